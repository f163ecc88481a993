"""Verify fetched rows against their receipt and linearize the root -> terminal chain.

The ledger's security property: every digest and hash is recomputed from the row's own
bytes, never trusted. The rules and their order are listed in :mod:`tasks.reasons`; the
per-token reference (``tests/reference_verifier.py``) implements the same order, and
property tests hold the two to identical verdicts and bitwise-identical rows.

Cost model: per-call Python only (dict look-ups, a handful of comparisons, three hashlib
calls over views of the packed buffers, no copies); validity scans are numpy over the
whole batch once (:class:`RowTable`), and ``tasks.validation``'s per-delta rules run only
for the rows the batch scan flags, to name the exact reason. Nothing here raises on bad
data: every failure is a :class:`RolloutResult` with a reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .. import hashing
from .. import reasons as R
from .linearize import Alloc, Linearized, OutputArena, linearize_ranges, row_bytes
from ..packed import PackedBatch, PackedField
from .plan import RolloutPlan, StepPlan
from ..schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_DTYPE,
    ROUTES_FIELD,
    ROUTES_INT16,
    ROUTES_NONE,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
)
from ..validation import check_lengths, check_logprobs, check_mask, check_routes, check_token_arrays, check_tokens

_U8 = np.dtype("u1")
# A batch whose needed rows hold under this share of its tokens is not pre-scanned whole:
# per-call checks on the needed rows are cheaper than a scan of everything.
_PRESCAN_MIN_SHARE = 0.25
# prev_len and delta_len below this keep the batch's cum_len == prev_len + delta_len check
# exact in int64; a row past it takes the per-call checks (Python ints).
_LEN_BOUND = 1 << 62


@dataclass
class RolloutResult:
    """Verdict for one rollout: ``status`` is ``"ok"`` or a :mod:`tasks.reasons` word."""

    rollout_id: str
    status: str
    detail: str = ""
    linearized: Optional[Linearized] = None
    n_calls: int = 0  # calls on the root -> terminal chain (0 if rejected before planning)

    @property
    def ok(self) -> bool:
        return self.status == R.OK


def rejected_result(rollout_id: str, reason: str, detail: str = "", n_calls: int = 0) -> RolloutResult:
    """A rejection (e.g. from :attr:`StepPlan.rejected`) as a result."""
    return RolloutResult(rollout_id, reason, detail, None, n_calls)


class _Reject(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def _byte_view(a: np.ndarray) -> memoryview:
    """Flat byte view of a contiguous array, without a copy (empty arrays too)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _field_problem(name: str, f: Optional[PackedField], n: int, dtype: np.dtype) -> Optional[str]:
    """Batch-level structure of one field: present, dtype, 1-D, sane offsets."""
    if f is None:
        return f"field {name} not in the batch"
    v, off = f.values, f.offsets
    if not isinstance(v, np.ndarray) or not isinstance(off, np.ndarray):
        return f"field {name} is not numpy"
    if v.dtype != dtype or v.ndim != 1:
        return f"field {name} dtype {v.dtype} ndim {v.ndim}, expected {dtype} 1-D"
    if off.ndim != 1 or off.shape[0] != n + 1 or off.dtype.kind not in "iu":
        return f"field {name} offsets malformed"
    if n and (off[0] < 0 or off[-1] > v.shape[0] or (np.diff(off) < 0).any()):
        return f"field {name} offsets out of range"
    if f.present is not None and (not isinstance(f.present, np.ndarray) or f.present.shape != (n,)):
        return f"field {name} presence mask malformed"
    return None


class RowTable:
    """One fetched batch, indexed by key, with its whole-batch validity pre-scans.

    Built once per verify task and shared by every rollout of the task. Besides the
    content pre-scan (:attr:`content_ok`), :attr:`good` flags rows whose structure,
    versions, lengths and token-array lengths are all sound (one numpy pass over the
    batch's scalar columns), so a sound row skips those per-call checks; a row that is
    not runs the per-call checks, which name the exact reason.
    """

    def __init__(self, batch: PackedBatch, vocab_size: int, needed: Optional[Sequence[str]] = None):
        self.batch = batch
        n = len(batch.keys)
        self.index: dict[str, int] = {}
        for i, k in enumerate(batch.keys):
            self.index.setdefault(k, i)  # first occurrence wins (the reference agrees)
        specs = {**{k: _U8 for k in ID_FIELDS + HASH_FIELDS}, **SCALAR_FIELDS, **TOKEN_FIELDS}
        problems = (_field_problem(name, batch.fields.get(name), n, dt) for name, dt in specs.items())
        # A field unusable batch-wide (absent, wrong dtype) makes every row invalid.
        self.batch_problem: Optional[str] = next((p for p in problems if p), None)
        self._offs: dict[str, list[int]] = {}
        self._bytes: dict[str, bytes] = {}
        self._scalars: dict[str, list[int]] = {}
        self.struct_ok: list[bool] = []
        self.good: list[bool] = [False] * n
        # Token fields as contiguous arrays and byte views of them (hashed without copies).
        self.values: dict[str, np.ndarray] = {}
        self.mv: dict[str, memoryview] = {}
        if self.batch_problem is None:
            fields = {name: batch.fields[name] for name in specs}
            ok = np.ones(n, dtype=bool)
            for name, f in fields.items():
                if f.present is not None:
                    ok &= f.present
                lengths = np.diff(f.offsets)
                if name in SCALAR_FIELDS:
                    ok &= lengths == 1
                elif name in HASH_FIELDS:
                    ok &= lengths == HASH_BYTES
            self.struct_ok = ok.tolist()
            # Python lists and bytes once per batch: per-row access is then plain indexing.
            self._offs = {name: f.offsets.tolist() for name, f in fields.items()}
            self._bytes = {name: fields[name].values.tobytes() for name in ID_FIELDS + HASH_FIELDS}
            cols: dict[str, np.ndarray] = {}
            for name in SCALAR_FIELDS:
                f = fields[name]
                at = np.minimum(f.offsets[:-1], max(len(f.values) - 1, 0))
                cols[name] = f.values[at].astype(np.int64) if len(f.values) else np.zeros(n, np.int64)
                self._scalars[name] = cols[name].tolist()
            for name in TOKEN_FIELDS:
                v = np.ascontiguousarray(fields[name].values)
                self.values[name] = v
                self.mv[name] = _byte_view(v)
            prev, delta, cum = cols["prev_len"], cols["delta_len"], cols["cum_len"]
            good = ok & (cols["schema_version"] == SCHEMA_VERSION) & (cols["digest_version"] == hashing.DIGEST_VERSION)
            # The check_lengths rules; the bounds keep prev + delta clear of int64 overflow.
            good &= (delta > 0) & (delta < _LEN_BOUND) & (prev >= 0) & (prev < _LEN_BOUND) & (cum == prev + delta)
            for name in TOKEN_FIELDS:
                good &= np.diff(fields[name].offsets) == delta
            self.good = good.tolist()
        self.content_ok: Optional[list[bool]] = None
        scan = self._prescan(vocab_size, needed)
        if scan is not None:
            self.content_ok = scan.tolist()

    def _prescan(self, vocab_size: int, needed: Optional[Sequence[str]]) -> Optional[np.ndarray]:
        """bool[n]: True where mask, token and logprob rules surely hold (None: not scanned)."""
        if self.batch_problem is None:
            fs = [self.batch.fields[name] for name in TOKEN_FIELDS]
        if self.batch_problem is not None or len(fs[0].offsets) < 2:
            return None
        off = fs[0].offsets
        if any(f.present is not None for f in fs) or not all(np.array_equal(off, f.offsets) for f in fs[1:]):
            return None  # misaligned buffers (a malformed batch): per-call checks only
        total = int(off[-1] - off[0])
        if needed is not None and total:
            idx = [self.index[k] for k in needed if k in self.index]
            share = float(np.sum(off[np.add(idx, 1)] - off[idx])) / total if idx else 0.0
            if share < _PRESCAN_MIN_SHARE:
                return None
        ids, mask, lps = (self.values[name] for name in TOKEN_FIELDS)
        if not ids.size == mask.size == lps.size:
            return None  # buffers longer than their rows, unequally: per-call checks only
        drops = _scan_all_valid(ids, mask, lps, vocab_size)
        if drops is not None:
            return _zeros_then_ones(off, mask, drops)
        # Some element somewhere is bad: name the rows that hold one (cumulative counts).
        is_one = mask == 1.0
        is_zero = mask == 0.0
        bad = ~(is_one | is_zero)
        bad |= (ids < 0) | (ids >= vocab_size)
        bad |= ~np.isfinite(lps) | (lps > 0.0) | (is_zero & (lps != 0.0))
        cb = np.concatenate(([0], np.cumsum(bad)))
        c1 = np.concatenate(([0], np.cumsum(is_one)))
        start, end = off[:-1], off[1:]
        n_ones = c1[end] - c1[start]
        ones_suffix = c1[end] - c1[end - n_ones]
        return (cb[end] - cb[start] == 0) & (n_ones > 0) & (ones_suffix == n_ones)

    # -- per-row accessors (valid once ``batch_problem`` is None and ``struct_ok[i]``) --

    def view(self, name: str, i: int) -> np.ndarray:
        off = self._offs[name]
        return self.batch.fields[name].values[off[i] : off[i + 1]]

    def raw(self, name: str, i: int) -> bytes:
        off = self._offs[name]
        return self._bytes[name][off[i] : off[i + 1]]

    def row_problem(self, i: int) -> str:
        """Why ``struct_ok[i]`` is False (slow path, bad rows only)."""
        for name, f in self.batch.fields.items():
            if name in self._offs and not f.has(i):
                return f"field {name} absent"
        for name in SCALAR_FIELDS:
            if self._offs[name][i + 1] - self._offs[name][i] != 1:
                return f"{name} is not one value"
        for name in HASH_FIELDS:
            n = self._offs[name][i + 1] - self._offs[name][i]
            if n != HASH_BYTES:
                return f"{name} is {n} bytes, expected {HASH_BYTES}"
        return "malformed row"


# Elements per step of the whole-buffer scan: its boolean temporaries stay small enough
# to be reused from the heap (a fresh large temporary costs a page fault per 4 KiB).
_SCAN_CHUNK = 1 << 15


def _scan_all_valid(ids: np.ndarray, mask: np.ndarray, lps: np.ndarray, vocab_size: int) -> Optional[np.ndarray]:
    """If EVERY element of the (equally long) buffers passes the per-element content rules
    (ids in ``[0, vocab_size)``, mask 0.0 or 1.0, logprobs finite and <= 0, and 0 where the
    mask is 0), the positions ``p`` where ``mask[p] == 1`` and ``mask[p + 1] == 0``;
    otherwise None.

    Reductions and chunked comparisons only: the common, all-valid case.
    """
    n = mask.size
    if not n:
        return np.zeros(0, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        return None
    # NaN fails both comparisons (min/max propagate it); -inf fails the first.
    if not (lps.min() > -np.inf and lps.max() <= 0.0):
        return None
    drops = []
    for a in range(0, n, _SCAN_CHUNK):
        b = min(a + _SCAN_CHUNK + 1, n)  # one element of overlap: steps across chunks
        one = mask[a:b] == 1.0
        zero = mask[a:b] == 0.0
        if np.count_nonzero(one) + np.count_nonzero(zero) != b - a:
            return None
        # Every logprob is <= 0 now, so "!= 0" is "< 0".
        if np.any(zero & (lps[a:b] < 0.0)):
            return None
        d = np.flatnonzero(one[:-1] & zero[1:])
        if d.size:
            drops.append(d + a)
    return np.concatenate(drops) if drops else np.zeros(0, dtype=np.int64)


def _zeros_then_ones(off: np.ndarray, mask: np.ndarray, drops: np.ndarray) -> np.ndarray:
    """bool[n]: row is zeros then ones with at least one 1, given every mask value is 0 or 1
    and ``drops`` (every ``p`` with ``mask[p] == 1`` and ``mask[p + 1] == 0``).

    Such a row ends with a 1 and has no 1 -> 0 step inside it; steps at row boundaries
    are allowed. Vectorized over rows, no cumulative sums.
    """
    start, end = off[:-1], off[1:]
    ok = end > start
    if mask.size:
        ok &= mask[np.clip(end - 1, 0, mask.size - 1)] == 1.0
        if drops.size:
            r = np.searchsorted(off, drops, side="right") - 1  # the row holding p
            inside = (r >= 0) & (r < len(start))
            r, p = r[inside], drops[inside]
            ok[r[p + 1 < end[r]]] = False
    return ok


class RoutesTable:
    """The ``routed_experts`` batch (or ``None``), indexed by key, range pre-scanned.

    :attr:`sound` is set when the field is one int16 ``[total, L, K]`` buffer: a row
    present with ``delta_len`` tokens then passes :func:`check_routes`' presence, dtype
    and shape rules without calling it.
    """

    def __init__(self, batch: Optional[PackedBatch], num_experts: Optional[int]):
        self.index: dict[str, int] = {}
        self.field: Optional[PackedField] = None
        self.in_range: Optional[list[bool]] = None
        self.sound = False
        if batch is None:
            return
        for i, k in enumerate(batch.keys):
            self.index.setdefault(k, i)
        f = batch.fields.get(ROUTES_FIELD)
        if f is None or not isinstance(f.values, np.ndarray) or f.offsets.shape != (len(batch.keys) + 1,):
            return
        n = len(batch.keys)
        if n and (f.offsets[0] < 0 or f.offsets[-1] > f.values.shape[0] or (np.diff(f.offsets) < 0).any()):
            return
        self.field = f
        v = f.values
        present_ok = f.present is None or (
            isinstance(f.present, np.ndarray) and f.present.dtype == bool and f.present.shape == (n,)
        )
        if v.dtype == ROUTES_DTYPE and v.ndim == 3 and present_ok:
            self.sound = True
            self.values = np.ascontiguousarray(v)
            self.mv = _byte_view(self.values)
            self.lk = (int(v.shape[1]), int(v.shape[2]))
            self.row_bytes = int(v.shape[1] * v.shape[2] * v.itemsize)
            self.offs = f.offsets.tolist()
            self.present = [True] * n if f.present is None else f.present.tolist()
        if num_experts is not None and v.ndim == 3 and v.dtype.kind in "iu":
            if not v.size or (v.min() >= 0 and v.max() < num_experts):
                self.in_range = [True] * n  # one pass over the whole buffer: the common case
            else:
                bad = ((v < 0) | (v >= num_experts)).any(axis=(1, 2))  # per token
                cb = np.concatenate(([0], np.cumsum(bad)))
                self.in_range = (cb[f.offsets[1:]] - cb[f.offsets[:-1]] == 0).tolist()

    def get(self, key: str) -> tuple[Optional[np.ndarray], int]:
        i = self.index.get(key, -1)
        if i < 0 or self.field is None:
            return None, -1
        return self.field.row(i), i


def _row_structure(t: RowTable, i: int) -> dict:
    """Decode row ``i`` into python scalars/bytes and array views (lengths not yet checked),
    or raise invalid_staging_row."""
    if t.batch_problem is not None:
        raise _Reject(R.INVALID_STAGING_ROW, t.batch_problem)
    if not t.struct_ok[i]:
        raise _Reject(R.INVALID_STAGING_ROW, t.row_problem(i))
    row: dict = {}
    for name in ID_FIELDS:
        try:
            row[name] = t.raw(name, i).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Reject(R.INVALID_STAGING_ROW, f"{name} is not UTF-8: {e}") from None
    for name in SCALAR_FIELDS:
        row[name] = t._scalars[name][i]
    for name in HASH_FIELDS:
        row[name] = t.raw(name, i)
    if row["schema_version"] != SCHEMA_VERSION or row["digest_version"] != hashing.DIGEST_VERSION:
        raise _Reject(
            R.INVALID_STAGING_ROW,
            f"schema/digest version {row['schema_version']}/{row['digest_version']} unsupported",
        )
    for name in TOKEN_FIELDS:
        row[name] = t.view(name, i)
    row["parent_call_id"] = row["parent_call_id"] or None
    return row


def _utf8(text: str) -> Optional[bytes]:
    """UTF-8 of a receipt's id; None (equal to no row's bytes) if it has none (a lone
    surrogate): the named checks then decide."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return None


@dataclass
class _Chain:
    """What the walk along a rollout's chain carries from one call to the next."""

    root_enc: int
    parent_chain: Optional[bytes] = None
    prev_cum: int = 0
    routes_shape: Optional[tuple] = None


def _verify_call_checked(
    rec, rid: str, i: int, rows: RowTable, routes: RoutesTable, st: _Chain, vocab_size: int, num_experts: Optional[int]
) -> int:
    """Every rule for one call, each through its named check (the path for a row the
    batch pre-checks did not clear). Returns the call's routes row (-1: none)."""
    where = f"call {rec.model_call_id!r}"
    row = _row_structure(rows, i)
    if row["rollout_id"] != rid or row["model_call_id"] != rec.model_call_id:
        raise _Reject(
            R.IDENTITY_MISMATCH,
            f"row under {rec.staging_key!r} is {row['rollout_id']!r}/{row['model_call_id']!r}",
        )
    for name in R.RECEIPT_COMPARED_FIELDS:
        if row[name] != getattr(rec, name):
            raise _Reject(R.wrong(name), f"{where}: row {name} differs from the receipt")
    # Lengths now equal the (validated) receipt's; the arrays must match them.
    problem = check_lengths(row["prev_len"], row["delta_len"], row["cum_len"]) or check_token_arrays(
        row["token_ids"], row["token_mask"], row["logprobs"], row["delta_len"]
    )
    if problem:
        raise _Reject(problem[0], f"{where}: {problem[1]}")
    enc = row["routes_encoding"]
    experts, j = None, -1
    if enc != st.root_enc:
        raise _Reject(R.INVALID_ROUTES, f"{where}: routes_encoding {enc} differs from the root's {st.root_enc}")
    if enc != ROUTES_NONE:
        experts, j = routes.get(rec.staging_key)
        problem = check_routes(enc, experts, row["delta_len"], None, st.routes_shape)
        if problem:
            raise _Reject(problem[0], f"{where}: {problem[1]}")
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
        raise _Reject(R.CORRUPT_DIGEST, f"{where}: recomputed digest differs from the stored one")
    if row["prev_len"] != st.prev_cum:
        raise _Reject(R.PARENT_LENGTH_MISMATCH, f"{where}: prev_len {row['prev_len']}, parent ends at {st.prev_cum}")
    st.parent_chain = hashing.chain_hash(st.parent_chain, row["token_ids"])
    if st.parent_chain != row["chain_hash"]:
        raise _Reject(R.CHAIN_HASH_MISMATCH, f"{where}: recomputed chain hash differs")
    _check_content(rec, rows, i, row["token_ids"], row["token_mask"], row["logprobs"], vocab_size)
    if experts is not None and num_experts is not None and (routes.in_range is None or not routes.in_range[j]):
        problem = check_routes(enc, experts, row["delta_len"], num_experts, st.routes_shape)
        if problem:
            raise _Reject(problem[0], f"{where}: {problem[1]}")
    st.prev_cum = row["cum_len"]
    return j


def _check_content(rec, rows: RowTable, i: int, ids, mask, lps, vocab_size: int) -> None:
    if rows.content_ok is not None and rows.content_ok[i]:
        return
    problem = check_mask(mask) or check_tokens(ids, vocab_size) or check_logprobs(lps, mask)
    if problem:
        raise _Reject(problem[0], f"call {rec.model_call_id!r}: {problem[1]}")


def _verify(
    plan: RolloutPlan,
    rows: RowTable,
    routes: RoutesTable,
    vocab_size: int,
    num_experts: Optional[int],
    alloc: Optional[Alloc] = None,
) -> RolloutResult:
    """The rules of :mod:`tasks.reasons`, call by call, in their order.

    A row the batch pre-checks cleared (:attr:`RowTable.good`, :attr:`RoutesTable.sound`)
    takes the lean path: ids decoded and compared, receipt fields compared, digest and
    chain hash recomputed over byte views of the batch buffers, content and expert
    ranges read off the pre-scans. Any other row, and any rule a pre-scan did not clear,
    goes through the named check functions, so reasons and details are the same either
    way.
    """
    chain = plan.chain
    rid = plan.rollout_id
    st = _Chain(chain[0].routes_encoding)
    index, good = rows.index, rows.good
    offs, raw, scal = rows._offs, rows._bytes, rows._scalars
    o_rid, o_cid, o_par = offs.get("rollout_id"), offs.get("model_call_id"), offs.get("parent_call_id")
    o_ids, o_mask, o_lps = offs.get("token_ids"), offs.get("token_mask"), offs.get("logprobs")
    o_dig, o_ch, o_cu = offs.get("digest"), offs.get("chain_hash"), offs.get("cumulative_hash")
    b_rid, b_cid, b_par = raw.get("rollout_id"), raw.get("model_call_id"), raw.get("parent_call_id")
    b_dig, b_ch, b_cu = raw.get("digest"), raw.get("chain_hash"), raw.get("cumulative_hash")
    mv_ids, mv_mask, mv_lps = rows.mv.get("token_ids"), rows.mv.get("token_mask"), rows.mv.get("logprobs")
    s_prev, s_delta, s_cum = scal.get("prev_len"), scal.get("delta_len"), scal.get("cum_len")
    s_wv, s_enc, s_sv = scal.get("weight_version"), scal.get("routes_encoding"), scal.get("schema_version")
    content_ok = rows.content_ok
    ids_v = rows.values.get("token_ids")
    mask_v = rows.values.get("token_mask")
    lps_v = rows.values.get("logprobs")
    rids = _utf8(rid)
    rows_i: list[int] = []
    rows_j: list[int] = []

    def _lean_call(rec, i: int) -> Optional[int]:
        """The call's rules for a pre-checked row; None hands the call to the named checks
        (before any state changed). Returns the routes row (-1: none)."""
        row_rid = b_rid[o_rid[i] : o_rid[i + 1]]
        row_cid = b_cid[o_cid[i] : o_cid[i + 1]]
        row_par = b_par[o_par[i] : o_par[i + 1]]
        # Ids equal to the UTF-8 of the receipt's strings decode to them (UTF-8 is
        # canonical), so byte equality covers decoding, identity and wrong_parent_call_id.
        rec_par = rec.parent_call_id
        prev, delta, cum, enc = s_prev[i], s_delta[i], s_cum[i], s_enc[i]
        dig, chh, cuh = b_dig[o_dig[i] : o_dig[i + 1]], b_ch[o_ch[i] : o_ch[i + 1]], b_cu[o_cu[i] : o_cu[i + 1]]
        if (
            row_rid != rids
            or row_cid != _utf8(rec.model_call_id)
            or row_par != (b"" if rec_par is None else _utf8(rec_par))
            or (rec_par is not None and not rec_par)  # a receipt's "" parent: the checks decide
            or prev != rec.prev_len
            or delta != rec.delta_len
            or cum != rec.cum_len
            or s_wv[i] != rec.weight_version
            or enc != rec.routes_encoding
            or dig != rec.digest
            or chh != rec.chain_hash
            or cuh != rec.cumulative_hash
            or enc != st.root_enc
        ):
            return None
        j = -1
        route_buf = None
        if enc != ROUTES_NONE:
            j = routes.index.get(rec.staging_key, -1)
            if not (
                enc == ROUTES_INT16
                and routes.sound
                and j >= 0
                and routes.present[j]
                and routes.offs[j + 1] - routes.offs[j] == delta
            ):
                return None
            rb = routes.row_bytes
            route_buf = (routes.lk[0], routes.lk[1], routes.mv[routes.offs[j] * rb : routes.offs[j + 1] * rb])
        # From here on a failing rule rejects directly: the named checks would find the
        # same first failure, everything before it having passed.
        a_ids, a_mask, a_lps = o_ids[i], o_mask[i], o_lps[i]
        ids_b = mv_ids[a_ids * 8 : (a_ids + delta) * 8]
        header = hashing.digest_header(
            s_sv[i], hashing.DIGEST_VERSION, row_rid, row_cid, row_par or None, prev, delta, cum, s_wv[i], enc
        )
        mask_b = mv_mask[a_mask * 4 : (a_mask + delta) * 4]
        lps_b = mv_lps[a_lps * 4 : (a_lps + delta) * 4]
        if hashing.digest_raw(header, ids_b, mask_b, lps_b, route_buf, chh, cuh) != dig:
            raise _Reject(R.CORRUPT_DIGEST, f"call {rec.model_call_id!r}: recomputed digest differs from the stored one")
        if prev != st.prev_cum:
            raise _Reject(
                R.PARENT_LENGTH_MISMATCH, f"call {rec.model_call_id!r}: prev_len {prev}, parent ends at {st.prev_cum}"
            )
        st.parent_chain = hashing.chain_hash_raw(st.parent_chain, ids_b)
        if st.parent_chain != chh:
            raise _Reject(R.CHAIN_HASH_MISMATCH, f"call {rec.model_call_id!r}: recomputed chain hash differs")
        if content_ok is None or not content_ok[i]:
            ids_a, mask_a = ids_v[a_ids : a_ids + delta], mask_v[a_mask : a_mask + delta]
            _check_content(rec, rows, i, ids_a, mask_a, lps_v[a_lps : a_lps + delta], vocab_size)
        if j >= 0:
            st.routes_shape = st.routes_shape or routes.lk
            if num_experts is not None and (routes.in_range is None or not routes.in_range[j]):
                problem = check_routes(enc, routes.field.row(j), delta, num_experts, st.routes_shape)
                if problem:
                    raise _Reject(problem[0], f"call {rec.model_call_id!r}: {problem[1]}")
        st.prev_cum = cum
        return j

    for rec in chain:
        i = index.get(rec.staging_key, -1)
        if i < 0:
            raise _Reject(R.MISSING_STAGING_ROW, f"call {rec.model_call_id!r}: no staged row for {rec.staging_key!r}")
        j = _lean_call(rec, i) if good[i] else None
        if j is None:  # not cleared by the pre-checks: the named checks decide
            j = _verify_call_checked(rec, rid, i, rows, routes, st, vocab_size, num_experts)
        rows_i.append(i)
        rows_j.append(j)
    lin = _linearize(chain, rows, routes, rows_i, rows_j, st.root_enc != ROUTES_NONE, alloc)
    # Recomputed once over the linearized ids: covers every token from the root on.
    if hashing.cumulative_hash(lin.input_ids) != rows._bytes["cumulative_hash"][
        rows._offs["cumulative_hash"][rows_i[-1]] : rows._offs["cumulative_hash"][rows_i[-1] + 1]
    ]:
        raise _Reject(R.CUMULATIVE_HASH_MISMATCH, "cumulative hash of the linearized ids differs from the terminal's")
    if lin.length == 0 or not lin.token_mask.any():
        raise _Reject(R.EMPTY_TRAINING_ROW, "no generated token in the training row")
    return RolloutResult(rid, R.OK, "", lin, len(chain))


def _linearize(
    chain, rows: RowTable, routes: RoutesTable, rows_i: list[int], rows_j: list[int], routed: bool, alloc: Optional[Alloc]
) -> Linearized:
    """The verified chain's training row: ranges of the batch buffers, one copy per field."""
    delta = rows._scalars["delta_len"]
    lengths = [delta[i] for i in rows_i]

    def ranges(name: str) -> tuple:
        off = rows._offs[name]
        starts = [off[i] for i in rows_i]
        return rows.values[name], starts, [s + n for s, n in zip(starts, lengths)]

    route_ranges = None
    if routed:
        f = routes.field
        off = routes.offs if routes.sound else f.offsets.tolist()
        starts = [off[j] for j in rows_j]
        values = routes.values if routes.sound else f.values
        route_ranges = (values, starts, [s + n for s, n in zip(starts, lengths)])
    names = [c.model_call_id for c in chain]
    parts = (ranges("token_ids"), ranges("token_mask"), ranges("logprobs"), route_ranges)
    return linearize_ranges(names, *parts) if alloc is None else linearize_ranges(names, *parts, alloc)


def _safe_verify(plan, rows, routes, vocab_size, num_experts, alloc=None) -> RolloutResult:
    try:
        return _verify(plan, rows, routes, vocab_size, num_experts, alloc)
    except _Reject as e:
        return RolloutResult(plan.rollout_id, e.reason, e.detail, None, len(plan.chain))
    except Exception as e:  # never take down the task; a bug shows in the detail
        return RolloutResult(
            plan.rollout_id, R.INVALID_STAGING_ROW, f"internal error: {type(e).__name__}: {e}", None, len(plan.chain)
        )


def verify_rollout(
    plan: RolloutPlan,
    rows: PackedBatch,
    routes: Optional[PackedBatch],
    *,
    vocab_size: int,
    num_experts: Optional[int],
) -> RolloutResult:
    """Verify one rollout's chain and linearize it.

    ``rows``: a batch holding (at least) ``plan.keys`` with the STAGING_FIELDS;
    ``routes``: a batch of ``routed_experts`` for ``plan.routes_keys`` (or ``None``).
    ``num_experts=None`` skips the expert-id range check.
    """
    return verify_many([plan], rows, routes, vocab_size=vocab_size, num_experts=num_experts)[0]


def verify_many(
    plans: Sequence[RolloutPlan],
    rows: PackedBatch,
    routes: Optional[PackedBatch],
    *,
    vocab_size: int,
    num_experts: Optional[int],
) -> list[RolloutResult]:
    """:func:`verify_rollout` for a packed verify task: the batch is indexed and scanned once."""
    needed = [k for p in plans for k in p.keys]
    try:
        table = RowTable(rows, vocab_size, needed)
        rtable = RoutesTable(routes, num_experts)
    except Exception as e:  # an unusable batch rejects its rollouts, not the task
        return [
            RolloutResult(p.rollout_id, R.INVALID_STAGING_ROW, f"unreadable batch: {type(e).__name__}: {e}", None, len(p.chain))
            for p in plans
        ]
    arena = _arena(plans, table, rtable)
    if arena is None:
        return [_safe_verify(p, table, rtable, vocab_size, num_experts) for p in plans]
    return [_safe_verify(p, table, rtable, vocab_size, num_experts, arena.alloc(k)) for k, p in enumerate(plans)]


def _arena(plans: Sequence[RolloutPlan], table: RowTable, rtable: RoutesTable) -> Optional[OutputArena]:
    """One output buffer for every rollout's training row, sized from the receipts.

    A verified chain's tokens are exactly its receipts' delta lengths, and rollouts of
    one step never share rows, so all verifiable rows together fit in the batch's tokens:
    slots are handed out only up to that many tokens (forged receipts cannot make the
    arena bigger than the batch); a rollout past it gets its own allocation. None for an
    unusable batch.
    """
    if table.batch_problem is not None:
        return None
    left = int(table.values["token_ids"].shape[0])
    per_token_routes = rtable.row_bytes if rtable.sound else 0
    sizes = []
    for p in plans:
        n = sum(rec.delta_len for rec in p.chain)
        routed = p.chain[0].routes_encoding != ROUTES_NONE
        fits = 0 < n <= left
        left -= n if fits else 0
        sizes.append(row_bytes(n, per_token_routes if routed else 0) if fits else 0)
    return OutputArena(sizes) if any(sizes) else None


def merge_results(step: StepPlan, results: Sequence[RolloutResult]) -> list[RolloutResult]:
    """Every submitted receipt's result in submission order: early rejections included.

    ``results`` are verify results of ``step.rollouts`` (any order); a rollout with no
    result is reported ``missing_staging_row`` (its verify never delivered).
    """
    by_id = {r.rollout_id: r for r in results}
    out = []
    for rid in step.order:
        if rid in step.rejected:
            out.append(rejected_result(rid, *step.rejected[rid]))
        else:
            out.append(by_id.get(rid) or rejected_result(rid, R.MISSING_STAGING_ROW, "no verify result"))
    return out
