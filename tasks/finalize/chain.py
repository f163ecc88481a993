"""The per-call rules of verification, walked along one rollout's root -> terminal chain.

:class:`CallRules` checks one call against a fetched batch (a lean path for rows the
batch pre-scans cleared, the named checks of :mod:`tasks.validation` for the rest);
:class:`ChainCheck` walks a rollout's calls in order, carrying what one call hands the
next (parent chain hash, parent length, routes shape). A failed rule raises
:class:`RuleFailed` with its reason; the caller turns it into a verdict.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from .. import hashing
from .. import reasons as R
from ..digests import SUPPORTED_VERSIONS, DigestScheme, described, scheme
from ..errors import RuleFailed
from ..receipts import CallRecord
from ..schema import (
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_NONE,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
)
from ..validation import (
    check_lengths,
    check_logprobs,
    check_mask,
    check_routes,
    check_token_arrays,
    check_tokens,
)
from .plan import RolloutPlan
from .tables import RoutesTable, RowTable

# ``lean(rec, i, state, rollout_id_utf8)``: the call's routes row (-1: none), or None to
# hand the call to the named checks (no state changed yet).
LeanCall = Callable[[CallRecord, int, "ChainCheck", "bytes | None"], "int | None"]


def _utf8(text: str) -> bytes | None:
    """UTF-8 of a receipt's id; None (equal to no row's bytes) if it has none (a lone
    surrogate): the named checks then decide."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


class ChainCheck:
    """One rollout's walk from the root call to the terminal, and the state it carries.

    ``root_enc``: the root's routes encoding (every call must share it); ``scheme``: the
    receipt's digest version, the algorithm every call is recomputed with (a receipt's
    calls share one, :func:`~tasks.finalize.plan.plan_step` checked it);
    ``parent_chain``: the previous call's recomputed chain hash (None before the root);
    ``prev_cum``: where the previous call's tokens end; ``routes_shape``: the ``(L, K)``
    of the first routed call. After :meth:`run`, ``rows_i`` / ``rows_j`` hold each
    call's row in the staging / routes table (-1: no routes).
    """

    __slots__ = ("plan", "root_enc", "scheme", "parent_chain", "prev_cum", "routes_shape", "rows_i", "rows_j")

    def __init__(self, plan: RolloutPlan) -> None:
        self.plan = plan
        self.root_enc: int = plan.chain[0].routes_encoding
        self.scheme: DigestScheme = scheme(plan.chain[0].digest_version)
        self.parent_chain: bytes | None = None
        self.prev_cum = 0
        self.routes_shape: tuple[int, ...] | None = None
        self.rows_i: list[int] = []
        self.rows_j: list[int] = []

    @property
    def routed(self) -> bool:
        """The chain carries routed experts."""
        return self.root_enc != ROUTES_NONE

    def run(self, rules: "CallRules") -> None:
        """Every call's rules, root first; raises :class:`RuleFailed` at the first failure."""
        index, good = rules.rows.index, rules.rows.good
        lean, checked = rules.lean_for(self.root_enc), rules.checked
        rid = self.plan.rollout_id
        rid_utf8 = _utf8(rid)
        rows_i, rows_j = self.rows_i, self.rows_j
        for rec in self.plan.chain:
            i = index.get(rec.staging_key, -1)
            if i < 0:
                raise RuleFailed(R.MISSING_STAGING_ROW, f"call {rec.model_call_id!r}: no staged row for {rec.staging_key!r}")
            j = lean(rec, i, self, rid_utf8) if good[i] and lean is not None else None
            if j is None:  # not cleared by the pre-checks: the named checks decide
                j = checked(rec, rid, i, self)
            rows_i.append(i)
            rows_j.append(j)


class CallRules:
    """The rules of one call against one fetched batch (built once per verify task).

    :meth:`lean_for` gives the path of a row the batch pre-checks cleared
    (:attr:`RowTable.good`, :attr:`RoutesTable.sound`): ids compared as bytes, receipt
    fields compared, digest and chain hash recomputed over byte views of the batch
    buffers, content and expert ranges read off the pre-scans. :meth:`checked` runs every
    rule through its named check. Reasons and details are the same either way.
    ``routes``: one :class:`RoutesTable` per routes encoding (a chain reads its root's).
    """

    def __init__(self, rows: RowTable, routes: Mapping[int, RoutesTable], vocab_size: int, num_experts: int | None) -> None:
        self.rows = rows
        self.routes = routes
        self.vocab_size = vocab_size
        self.num_experts = num_experts
        self._lean: dict[int, LeanCall] = {enc: _lean_path(rows, t, vocab_size, num_experts) for enc, t in routes.items()}
        if self._lean:  # an unrouted chain reads no routes table: any encoding's path serves
            self._lean.setdefault(ROUTES_NONE, next(iter(self._lean.values())))
        self._no_routes = RoutesTable(None, None)

    def lean_for(self, encoding: int) -> LeanCall | None:
        """The lean path of chains of routes ``encoding`` (None: unknown, named checks only)."""
        return self._lean.get(encoding)

    def routes_for(self, encoding: int) -> RoutesTable:
        """The routes table of ``encoding`` (an empty one for no routes or an unknown one)."""
        return self.routes.get(encoding, self._no_routes)

    def checked(self, rec: CallRecord, rid: str, i: int, st: ChainCheck) -> int:
        """Every rule for one call, each through its named check (the path for a row the
        batch pre-checks did not clear). Returns the call's routes row (-1: none)."""
        rows, routes, num_experts = self.rows, self.routes_for(st.root_enc), self.num_experts
        where = f"call {rec.model_call_id!r}"
        row = _row_structure(rows, i)
        if row["rollout_id"] != rid or row["model_call_id"] != rec.model_call_id:
            raise RuleFailed(
                R.IDENTITY_MISMATCH,
                f"row under {rec.staging_key!r} is {row['rollout_id']!r}/{row['model_call_id']!r}",
            )
        for name in R.RECEIPT_COMPARED_FIELDS:
            if row[name] != getattr(rec, name):
                raise RuleFailed(R.wrong(name), f"{where}: row {name} differs from the receipt")
        # Lengths now equal the (validated) receipt's; the arrays must match them.
        problem = check_lengths(row["prev_len"], row["delta_len"], row["cum_len"]) or check_token_arrays(
            row["token_ids"], row["token_mask"], row["logprobs"], row["delta_len"]
        )
        if problem:
            raise RuleFailed(problem[0], f"{where}: {problem[1]}")
        enc = row["routes_encoding"]
        experts, j = None, -1
        if enc != st.root_enc:
            raise RuleFailed(R.INVALID_ROUTES, f"{where}: routes_encoding {enc} differs from the root's {st.root_enc}")
        if enc != ROUTES_NONE:
            experts, j = routes.get(rec.staging_key)
            problem = check_routes(enc, experts, row["delta_len"], None, st.routes_shape)
            if problem:
                raise RuleFailed(problem[0], f"{where}: {problem[1]}")
            st.routes_shape = st.routes_shape or tuple(experts.shape[1:])
        recomputed = hashing.digest(
            rollout_id=rid,
            model_call_id=rec.model_call_id,
            parent_call_id=row["parent_call_id"],
            prev_len=row["prev_len"],
            delta_len=row["delta_len"],
            cum_len=row["cum_len"],
            weight_version=row["weight_version"],
            token_ids=row["token_ids"],
            token_mask=row["token_mask"],
            logprobs=row["logprobs"],
            routes_encoding=enc,
            routed_experts=experts,
            chain_hash=row["chain_hash"],
            cumulative_hash=row["cumulative_hash"],
            schema_version=row["schema_version"],
            digest_version=row["digest_version"],
        )
        if recomputed != row["digest"]:
            raise RuleFailed(R.CORRUPT_DIGEST, f"{where}: recomputed digest differs from the stored one")
        if row["prev_len"] != st.prev_cum:
            raise RuleFailed(R.PARENT_LENGTH_MISMATCH, f"{where}: prev_len {row['prev_len']}, parent ends at {st.prev_cum}")
        st.parent_chain = hashing.chain_hash(st.parent_chain, row["token_ids"], row["digest_version"])
        if st.parent_chain != row["chain_hash"]:
            raise RuleFailed(R.CHAIN_HASH_MISMATCH, f"{where}: recomputed chain hash differs")
        check_content(rec, rows, i, row["token_ids"], row["token_mask"], row["logprobs"], self.vocab_size)
        if experts is not None and (routes.in_range is None or not routes.in_range[j]):
            problem = check_routes(enc, experts, row["delta_len"], num_experts, st.routes_shape)
            if problem:
                raise RuleFailed(problem[0], f"{where}: {problem[1]}")
        st.prev_cum = row["cum_len"]
        return j


def _lean_path(rows: RowTable, routes: RoutesTable, vocab_size: int, num_experts: int | None) -> LeanCall:
    """The lean path's function: its rule groups, each a closure over the batch's tables.

    The closures read every table through a local name bound once (no attribute look-ups
    per row): this is the verifier's hot loop. :func:`_lean_match` returns None, before
    changing any state, when a row differs from its receipt or its routes are not
    pre-cleared: the named checks then find the exact reason. From there on a failing rule
    rejects directly (:func:`_lean_hashes`, then :func:`_lean_content`): the named checks
    would find the same first failure, everything before it having passed.
    """
    match = _lean_match(rows, routes)
    hashes = _lean_hashes(rows, routes)
    content = _lean_content(rows, routes, vocab_size, num_experts)

    def lean(rec: CallRecord, i: int, st: ChainCheck, rids: bytes | None) -> int | None:
        row = match(rec, i, st, rids)
        if row is None:
            return None
        j = row[0]
        hashes(rec, i, st, row)
        content(rec, i, st, j, row[1], row[2])  # routes_encoding, delta_len
        st.prev_cum = row[3]  # cum_len
        return j

    return lean


# What :func:`_lean_match` hands the later rule groups for a row equal to its receipt:
# ``(j, routes_encoding, delta_len, cum_len, prev_len, weight_version, schema_version,
# rollout_id, model_call_id, parent_call_id, digest, chain_hash, cumulative_hash,
# routes_bytes)``: the routes row (-1: none), the row's scalars, its ids and hashes as
# ``bytes`` and its routes as a byte view of the batch buffer (None: unrouted). A plain
# tuple: built once per call, read by index.
LeanRow = tuple[int, int, int, int, int, int, int, bytes, bytes, bytes, bytes, bytes, bytes, memoryview | None]
LeanMatch = Callable[[CallRecord, int, "ChainCheck", "bytes | None"], "LeanRow | None"]


def _lean_match(rows: RowTable, routes: RoutesTable) -> LeanMatch:
    """Identity, the receipt-compared fields, the root's routes encoding and routes readiness.

    The row's ids equal to the UTF-8 of the receipt's strings decode to them (UTF-8 is
    canonical), so byte equality covers decoding, identity and wrong_parent_call_id. A
    difference, or routes the batch pre-scan did not clear, returns None (nothing changed).
    """
    offs, raw, scal = rows.offsets, rows.raw_bytes, rows.scalars
    o_rid, o_cid, o_par = offs.get("rollout_id"), offs.get("model_call_id"), offs.get("parent_call_id")
    o_dig, o_ch, o_cu = offs.get("digest"), offs.get("chain_hash"), offs.get("cumulative_hash")
    b_rid, b_cid, b_par = raw.get("rollout_id"), raw.get("model_call_id"), raw.get("parent_call_id")
    b_dig, b_ch, b_cu = raw.get("digest"), raw.get("chain_hash"), raw.get("cumulative_hash")
    s_prev, s_delta, s_cum = scal.get("prev_len"), scal.get("delta_len"), scal.get("cum_len")
    s_wv, s_enc, s_sv = scal.get("weight_version"), scal.get("routes_encoding"), scal.get("schema_version")
    s_dv = scal.get("digest_version")
    r_index, r_sound, r_present, r_offsets = routes.index, routes.sound, routes.present, routes.offsets
    r_mv, r_bpt, r_enc = routes.mv, routes.bytes_per_token, routes.encoding

    def match(rec: CallRecord, i: int, st: ChainCheck, rids: bytes | None) -> LeanRow | None:
        row_rid = b_rid[o_rid[i] : o_rid[i + 1]]
        row_cid = b_cid[o_cid[i] : o_cid[i + 1]]
        row_par = b_par[o_par[i] : o_par[i + 1]]
        rec_par = rec.parent_call_id
        prev, delta, cum, enc, wv = s_prev[i], s_delta[i], s_cum[i], s_enc[i], s_wv[i]
        dig, chh, cuh = b_dig[o_dig[i] : o_dig[i + 1]], b_ch[o_ch[i] : o_ch[i + 1]], b_cu[o_cu[i] : o_cu[i + 1]]
        if (
            row_rid != rids
            or row_cid != _utf8(rec.model_call_id)
            or row_par != (b"" if rec_par is None else _utf8(rec_par))
            or (rec_par is not None and not rec_par)  # a receipt's "" parent: the checks decide
            or prev != rec.prev_len
            or delta != rec.delta_len
            or cum != rec.cum_len
            or wv != rec.weight_version
            or enc != rec.routes_encoding
            or s_dv[i] != rec.digest_version
            or dig != rec.digest
            or chh != rec.chain_hash
            or cuh != rec.cumulative_hash
            or enc != st.root_enc
        ):
            return None
        j = -1
        route_buf = None
        if enc != ROUTES_NONE:
            j = r_index.get(rec.staging_key, -1)
            if not (enc == r_enc and r_sound and j >= 0 and r_present[j] and r_offsets[j + 1] - r_offsets[j] == delta):
                return None
            route_buf = r_mv[r_offsets[j] * r_bpt : r_offsets[j + 1] * r_bpt]
        return (j, enc, delta, cum, prev, wv, s_sv[i], row_rid, row_cid, row_par, dig, chh, cuh, route_buf)

    return match


def _lean_hashes(rows: RowTable, routes: RoutesTable) -> Callable[[CallRecord, int, ChainCheck, LeanRow], None]:
    """corrupt_digest -> parent_length_mismatch -> chain_hash_mismatch for a matched row.

    The digest (the layout of :func:`tasks.hashing.digest_raw`, field digests for version 3; its header built
    inline, as :func:`tasks.hashing.digest_header` would, whose checks a cleared row
    already passed) and the chain hash are fed byte views of the batch buffers, in as
    few updates as it takes. Sets ``st.parent_chain``.
    """
    offs, mv = rows.offsets, rows.mv
    o_ids, o_mask, o_lps = offs.get("token_ids"), offs.get("token_mask"), offs.get("logprobs")
    mv_ids, mv_mask, mv_lps = mv.get("token_ids"), mv.get("token_mask"), mv.get("logprobs")
    r_shape = routes.route_shape
    head, u32, lengths, nbytes, routes_head = (
        hashing.call_head, hashing.U32.pack, hashing.LENGTHS.pack, hashing.NBYTES.pack, hashing.ROUTES_HEAD.pack,
    )
    root, linked = hashing.ROOT_MARKER, b"\x01"

    def hashes(rec: CallRecord, i: int, st: ChainCheck, row: LeanRow) -> None:
        _, enc, delta, cum, prev, wv, sv, row_rid, row_cid, row_par, dig, chh, cuh, route_buf = row
        a_ids = o_ids[i]
        ids_b = mv_ids[a_ids * 8 : (a_ids + delta) * 8]
        a_mask, a_lps = o_mask[i], o_lps[i]
        mask_b = mv_mask[a_mask * 4 : (a_mask + delta) * 4]
        lps_b = mv_lps[a_lps * 4 : (a_lps + delta) * 4]
        sc = st.scheme  # the receipt's algorithm (the row's: its digest_version matched)
        h = sc.new(b"".join((
            head(sv, row_rid, sc.version), u32(len(row_cid)), row_cid,
            linked + u32(len(row_par)) + row_par if row_par else root,
            lengths(prev, delta, cum, wv, enc), nbytes(len(ids_b)),
        )))
        f = sc.field_new  # field-digest layout: each field's digest stands for its bytes
        h.update(ids_b if f is None else f(ids_b).digest())
        h.update(nbytes(len(mask_b)))
        h.update(mask_b if f is None else f(mask_b).digest())
        h.update(nbytes(len(lps_b)))
        h.update(lps_b if f is None else f(lps_b).digest())
        if route_buf is not None:
            h.update(routes_head(r_shape[0], r_shape[1], len(route_buf)))
            h.update(route_buf if f is None else f(route_buf).digest())
        h.update(chh + cuh)
        if h.digest() != dig:
            raise RuleFailed(R.CORRUPT_DIGEST, f"call {rec.model_call_id!r}: recomputed digest differs from the stored one")
        if prev != st.prev_cum:
            raise RuleFailed(
                R.PARENT_LENGTH_MISMATCH, f"call {rec.model_call_id!r}: prev_len {prev}, parent ends at {st.prev_cum}"
            )
        parent = st.parent_chain
        c = sc.new(sc.chain_root if parent is None else sc.chain_link + parent)
        c.update(ids_b)
        st.parent_chain = c.digest()
        if st.parent_chain != chh:
            raise RuleFailed(R.CHAIN_HASH_MISMATCH, f"call {rec.model_call_id!r}: recomputed chain hash differs")

    return hashes


def _lean_content(
    rows: RowTable, routes: RoutesTable, vocab_size: int, num_experts: int | None
) -> Callable[[CallRecord, int, ChainCheck, int, int, int], None]:
    """The content rules (unless the pre-scan cleared the row), then the expert-id range
    (unless the routes pre-scan cleared it), for a row whose hashes held. Fixes
    ``st.routes_shape`` at the chain's first routed call."""
    offs, values = rows.offsets, rows.values
    o_ids, o_mask, o_lps = offs.get("token_ids"), offs.get("token_mask"), offs.get("logprobs")
    ids_v, mask_v, lps_v = values.get("token_ids"), values.get("token_mask"), values.get("logprobs")
    content_ok = rows.content_ok
    r_shape, r_in_range = routes.route_shape, routes.in_range

    def content(rec: CallRecord, i: int, st: ChainCheck, j: int, enc: int, delta: int) -> None:
        if content_ok is None or not content_ok[i]:
            a_ids, a_mask, a_lps = o_ids[i], o_mask[i], o_lps[i]
            ids_a, mask_a = ids_v[a_ids : a_ids + delta], mask_v[a_mask : a_mask + delta]
            check_content(rec, rows, i, ids_a, mask_a, lps_v[a_lps : a_lps + delta], vocab_size)
        if j >= 0:
            st.routes_shape = st.routes_shape or r_shape
            if r_in_range is None or not r_in_range[j]:
                problem = check_routes(enc, routes.field.row(j), delta, num_experts, st.routes_shape)
                if problem:
                    raise RuleFailed(problem[0], f"call {rec.model_call_id!r}: {problem[1]}")

    return content


def check_content(
    rec: CallRecord, rows: RowTable, i: int, ids: np.ndarray, mask: np.ndarray, lps: np.ndarray, vocab_size: int
) -> None:
    """The mask, token and logprob rules of one delta, unless the pre-scan cleared row ``i``."""
    if rows.content_ok is not None and rows.content_ok[i]:
        return
    problem = check_mask(mask) or check_tokens(ids, vocab_size) or check_logprobs(lps, mask)
    if problem:
        raise RuleFailed(problem[0], f"call {rec.model_call_id!r}: {problem[1]}")


def _row_structure(t: RowTable, i: int) -> dict[str, Any]:
    """Decode row ``i`` into python scalars/bytes and array views (lengths not yet checked),
    or raise invalid_staging_row."""
    if t.batch_problem is not None:
        raise RuleFailed(R.INVALID_STAGING_ROW, t.batch_problem)
    if not t.struct_ok[i]:
        raise RuleFailed(R.INVALID_STAGING_ROW, t.row_problem(i))
    row: dict[str, Any] = {}
    for name in ID_FIELDS:
        try:
            row[name] = t.raw(name, i).decode("utf-8")
        except UnicodeDecodeError as e:
            raise RuleFailed(R.INVALID_STAGING_ROW, f"{name} is not UTF-8: {e}") from None
    for name in SCALAR_FIELDS:
        row[name] = t.scalars[name][i]
    for name in HASH_FIELDS:
        row[name] = t.raw(name, i)
    if row["schema_version"] != SCHEMA_VERSION or row["digest_version"] not in SUPPORTED_VERSIONS:
        raise RuleFailed(
            R.INVALID_STAGING_ROW,
            f"schema/digest version {row['schema_version']}/{row['digest_version']} unsupported "
            f"(this build: schema {SCHEMA_VERSION}, digest {described()})",
        )
    for name in TOKEN_FIELDS:
        row[name] = t.view(name, i)
    row["parent_call_id"] = row["parent_call_id"] or None
    return row
