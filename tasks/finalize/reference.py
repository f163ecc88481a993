"""A deliberately simple, per-token reference of the verification rules.

Written independently of ``tasks.finalize.verify`` / ``tasks.hashing`` /
``tasks.digests``: ids, mask and logprobs go through ``.tolist()`` and every rule is a
Python loop over them; each hash input is built by hand from the layout in
``tasks/hashing.py``'s docstring (parts joined once; float and routes buffers hashed as
one contiguous buffer each), with the hash function and tags of the row's digest version
(1: ``hashlib.sha256``, 2: ``blake3.blake3``, 3: ``blake3.blake3`` over keyed field
digests), spelled out here. It is the tests'
oracle and, as the per-token path the published system runs, the finalize benchmark's
baseline.

Rule order is the one documented in ``tasks/reasons.py``. The receipt reference
(:mod:`tasks.finalize.reference_receipts`) is re-exported here.
"""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import blake3
import numpy as np

from tasks.finalize.linearize import Linearized
from tasks.finalize.reference_receipts import reference_chain, reference_receipt_reason
from tasks.finalize.verify import RolloutResult

if TYPE_CHECKING:
    from tasks.finalize.plan import RolloutPlan
    from tasks.packed import PackedBatch
    from tasks.receipts import CallRecord

__all__ = [
    "RoutesView",
    "RowsView",
    "content_reason",
    "read_row",
    "reference_chain",
    "reference_receipt_reason",
    "reference_verify_rollout",
]

TAG_CHAIN = b"token-capture/chain/v1\x00"
TAG_PREFIX = b"token-capture/prefix/v1\x00"
TAG_CALL = b"token-capture/call/v1\x00"
# digest_version -> (hash function, chain tag, prefix tag, call tag).
ALGORITHMS = {
    1: (hashlib.sha256, TAG_CHAIN, TAG_PREFIX, TAG_CALL),
    2: (blake3.blake3, b"token-capture/chain/v2\x00", b"token-capture/prefix/v2\x00", b"token-capture/call/v2\x00"),
    3: (blake3.blake3, b"token-capture/chain/v3\x00", b"token-capture/prefix/v3\x00", b"token-capture/call/v3\x00"),
}
# Version 3 hashes each token field's keyed BLAKE3 digest in its place (key: BLAKE3's key
# derivation of this context and material).
FIELD_KEY_V3 = blake3.blake3(b"field digest v3", derive_key_context="token-capture 2026-12 field digest").digest()

ID_NAMES = ["rollout_id", "model_call_id", "parent_call_id"]
SCALAR_NAMES = {
    "prev_len": "<i8", "delta_len": "<i8", "cum_len": "<i8", "weight_version": "<i8",
    "routes_encoding": "i1", "schema_version": "<i8", "digest_version": "<i8",
}
HASH_NAMES = ["digest", "chain_hash", "cumulative_hash"]
TOKEN_NAMES = {"token_ids": "<i8", "token_mask": "<f4", "logprobs": "<f4"}
# routes_encoding -> (field, dtype) of the routes it stores (0: none).
ROUTES_NAMES = {1: ("routed_experts", "<i2"), 2: ("routed_experts_u8", "u1")}
COMPARED = ["parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
            "routes_encoding", "digest_version", "digest", "chain_hash", "cumulative_hash"]


class _Reject(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---- by-hand encodings ---------------------------------------------------------------------


def u(n: int, width: int) -> bytes:
    return int(n).to_bytes(width, "little", signed=False)


def s(n: int, width: int) -> bytes:
    return int(n).to_bytes(width, "little", signed=True)


def framed(text: str) -> bytes:
    b = text.encode("utf-8")
    return u(len(b), 4) + b


def ids_bytes(ids: list[int]) -> bytes:
    """Token ids as ``<i8`` bytes, one Python int at a time, joined once (linear)."""
    return b"".join([t.to_bytes(8, "little", signed=True) for t in ids])


def field_ok(batch: PackedBatch, name: str, dtype: str, n: int) -> bool:
    f = batch.fields.get(name)
    if f is None or not isinstance(f.values, np.ndarray) or not isinstance(f.offsets, np.ndarray):
        return False
    if f.values.dtype != np.dtype(dtype) or f.values.ndim != 1:
        return False
    offs = f.offsets.tolist()
    if f.offsets.ndim != 1 or len(offs) != n + 1 or f.offsets.dtype.kind not in "iu":
        return False
    if n:
        if offs[0] < 0 or offs[-1] > f.values.shape[0]:
            return False
        for a, b in zip(offs, offs[1:]):
            if b < a:
                return False
    if f.present is not None and (not isinstance(f.present, np.ndarray) or f.present.shape != (n,)):
        return False
    return True


def cell(batch: PackedBatch, name: str, i: int) -> np.ndarray | None:
    f = batch.fields[name]
    if f.present is not None and not bool(f.present[i]):
        return None
    return f.values[int(f.offsets[i]) : int(f.offsets[i + 1])]


def content_reason(ids: list[int], mask: list[float], lps: list[float], vocab_size: int) -> str | None:
    for m in mask:
        if m != 0.0 and m != 1.0:
            return "invalid_mask_order"
    ones = 0
    for m in mask:
        if m == 1.0:
            ones += 1
    if ones == 0:
        return "empty_generation"
    seen_one = False
    for m in mask:
        if m == 1.0:
            seen_one = True
        elif seen_one:
            return "invalid_mask_order"
    for t in ids:
        if t < 0 or t >= vocab_size:
            return "invalid_token"
    for p in lps:
        if not math.isfinite(p):
            return "invalid_logprob"
    for p in lps:
        if p > 0.0:
            return "invalid_logprob"
    for p, m in zip(lps, mask):
        if m == 0.0 and p != 0.0:
            return "invalid_logprob"
    return None


_ROW_SPECS = {**{k: "u1" for k in ID_NAMES + HASH_NAMES}, **SCALAR_NAMES, **TOKEN_NAMES}


class RowsView:
    """A fetched staging batch, indexed by key once; its fields' structure checked once."""

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch
        self.index: dict[str, int] = {}
        for j, k in enumerate(batch.keys):
            self.index.setdefault(k, j)  # the first match, as the reference's scan
        n = len(batch.keys)
        self.fields_ok = all(field_ok(batch, name, dt, n) for name, dt in _ROW_SPECS.items())


class RoutesView:
    """A fetched routes batch (or ``None``), indexed once, each encoding's field's offsets
    checked once."""

    def __init__(self, routes: PackedBatch | None) -> None:
        self.index: dict[str, int] = {}
        self.fields: dict[int, tuple[Any, list[int]]] = {}  # encoding -> (field, offsets)
        if routes is None:
            return
        for j, k in enumerate(routes.keys):
            self.index.setdefault(k, j)
        n = len(routes.keys)
        for enc, (name, _) in ROUTES_NAMES.items():
            f = routes.fields.get(name)
            if f is None or not isinstance(f.values, np.ndarray) or f.offsets.shape != (n + 1,):
                continue
            offs = f.offsets.tolist()
            if n and (offs[0] < 0 or offs[-1] > f.values.shape[0] or any(b < a for a, b in zip(offs, offs[1:]))):
                continue
            self.fields[enc] = (f, offs)

    def cell(self, key: str, encoding: int = 1) -> np.ndarray | None:
        idx = self.index.get(key)
        if idx is None or encoding not in self.fields:
            return None
        f, offs = self.fields[encoding]
        if f.present is not None and not bool(f.present[idx]):
            return None
        return f.values[offs[idx] : offs[idx + 1]]


def read_row(rows: RowsView, i: int) -> dict[str, Any]:
    if not rows.fields_ok:
        raise _Reject("invalid_staging_row")
    cells = {}
    for name in _ROW_SPECS:
        c = cell(rows.batch, name, i)
        if c is None:
            raise _Reject("invalid_staging_row")
        cells[name] = c
    row: dict[str, Any] = {}
    for name in ID_NAMES:
        try:
            row[name] = bytes(cells[name].tolist()).decode("utf-8")
        except UnicodeDecodeError:
            raise _Reject("invalid_staging_row") from None
    for name in SCALAR_NAMES:
        vals = cells[name].tolist()
        if len(vals) != 1:
            raise _Reject("invalid_staging_row")
        row[name] = int(vals[0])
    for name in HASH_NAMES:
        b = bytes(cells[name].tolist())
        if len(b) != 32:
            raise _Reject("invalid_staging_row")
        row[name] = b
    if row["schema_version"] != 1 or row["digest_version"] not in ALGORITHMS:
        raise _Reject("invalid_staging_row")
    for name in TOKEN_NAMES:
        row[name] = cells[name]
    if row["parent_call_id"] == "":
        row["parent_call_id"] = None
    return row


def _raw(arr: np.ndarray) -> memoryview:
    """An array's bytes as ONE contiguous buffer (no per-value work)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def _matched_row(rows: RowsView, rec: CallRecord, rid: str) -> dict[str, Any]:
    """The call's row, read and held against its receipt record: missing_staging_row ->
    invalid_staging_row (structure) -> identity_mismatch -> wrong_<field> ->
    invalid_staging_row (lengths, token arrays not delta_len long)."""
    i = rows.index.get(rec.staging_key)
    if i is None:
        raise _Reject("missing_staging_row")
    row = read_row(rows, i)
    if row["rollout_id"] != rid or row["model_call_id"] != rec.model_call_id:
        raise _Reject("identity_mismatch")
    for name in COMPARED:
        if row[name] != getattr(rec, name):
            raise _Reject("wrong_" + name)
    if row["delta_len"] <= 0 or row["prev_len"] < 0 or row["cum_len"] != row["prev_len"] + row["delta_len"]:
        raise _Reject("invalid_staging_row")
    for name in TOKEN_NAMES:
        if row[name].shape[0] != row["delta_len"]:
            raise _Reject("invalid_staging_row")
    return row


def _routes_cell(
    routes: RoutesView, rec: CallRecord, row: dict[str, Any], root_enc: int, lk: tuple[int, int] | None
) -> np.ndarray | None:
    """The call's routes (None: unrouted), ready to hash: invalid_routes (encoding other
    than the root's) -> missing_routes -> invalid_routes (dtype, shape, ``[L, K]`` other
    than the chain's first routed call's ``lk``)."""
    if row["routes_encoding"] != root_enc:
        raise _Reject("invalid_routes")
    names = ROUTES_NAMES.get(row["routes_encoding"])
    if names is None:
        return None
    experts = routes.cell(rec.staging_key, row["routes_encoding"])
    if experts is None:
        raise _Reject("missing_routes")
    if experts.dtype != np.dtype(names[1]) or experts.ndim != 3 or experts.shape[0] != row["delta_len"]:
        raise _Reject("invalid_routes")
    if lk is not None and (experts.shape[1], experts.shape[2]) != lk:
        raise _Reject("invalid_routes")
    return experts


def _call_digest(rid: str, row: dict[str, Any], ids_b: bytes, experts: np.ndarray | None) -> bytes:
    """The row's digest recomputed by hand (``tasks/hashing.py``'s layout, parts joined once)."""
    parent_marker = b"\x00" if row["parent_call_id"] is None else b"\x01" + framed(row["parent_call_id"])
    new, _, _, tag_call = ALGORITHMS[row["digest_version"]]

    def field(b: Any) -> Any:  # version 3: the field's keyed digest stands for its bytes
        return blake3.blake3(b, key=FIELD_KEY_V3).digest() if row["digest_version"] == 3 else b

    parts = [
        tag_call, u(row["schema_version"] & 0xFFFF, 2), u(row["digest_version"], 2),
        framed(rid), framed(row["model_call_id"]), parent_marker,
        s(row["prev_len"], 8), s(row["delta_len"], 8), s(row["cum_len"], 8), s(row["weight_version"], 8),
        s(row["routes_encoding"], 1), u(len(ids_b), 8), field(ids_b),
    ]
    for name in ("token_mask", "logprobs"):
        b = _raw(row[name])
        parts += [u(b.nbytes, 8), field(b)]
    if experts is not None:
        b = _raw(experts)
        parts += [u(experts.shape[1], 4), u(experts.shape[2], 4), u(b.nbytes, 8), field(b)]
    parts += [row["chain_hash"], row["cumulative_hash"]]
    return new(b"".join(parts)).digest()


def _check_hashes(
    rid: str, row: dict[str, Any], ids_b: bytes, experts: np.ndarray | None, prev_end: int, parent_chain: bytes | None
) -> bytes:
    """corrupt_digest -> parent_length_mismatch -> chain_hash_mismatch; the call's chain hash."""
    if _call_digest(rid, row, ids_b, experts) != row["digest"]:
        raise _Reject("corrupt_digest")
    if row["prev_len"] != prev_end:
        raise _Reject("parent_length_mismatch")
    new, tag_chain, _, _ = ALGORITHMS[row["digest_version"]]
    h = new(tag_chain + (b"\x00" if parent_chain is None else b"\x01" + parent_chain))
    h.update(ids_b)
    chain = h.digest()
    if chain != row["chain_hash"]:
        raise _Reject("chain_hash_mismatch")
    return chain


def _check_delta_content(
    ids: list[int], mask: list[float], lps: list[float], experts: np.ndarray | None, vocab_size: int, num_experts: int | None
) -> None:
    """The content rules (:func:`content_reason`), then invalid_routes: a token routed to
    an expert id below 0, or (``num_experts`` given) at or past ``num_experts``."""
    reason = content_reason(ids, mask, lps, vocab_size)
    if reason:
        raise _Reject(reason)
    # The whole buffer's least and greatest id (as before this rule covered None): the
    # baseline's cost stays what the per-token path it stands for pays.
    if experts is not None and experts.size:
        if int(experts.min()) < 0 or (num_experts is not None and int(experts.max()) >= num_experts):
            raise _Reject("invalid_routes")


class _TrainingRow:
    """The verified calls' tokens, joined call by call (Python lists, as published), and
    the running prefix hash over their ids (with the receipt's digest version's algorithm)."""

    def __init__(self, digest_version: int) -> None:
        new, _, tag_prefix, _ = ALGORITHMS[digest_version]
        self.prefix = new(tag_prefix)
        self.ids: list[int] = []
        self.mask: list[float] = []
        self.lps: list[float] = []
        self.route_parts: list[np.ndarray] = []
        self.spans: list[tuple[str, int, int]] = []
        self.prompt_length = 0

    def add(
        self, call_id: str, ids: list[int], ids_b: bytes, mask: list[float], lps: list[float], experts: np.ndarray | None
    ) -> None:
        """Append one verified call; the first call's leading zeros of the mask are the prompt."""
        if experts is not None:
            self.route_parts.append(experts)
        if not self.spans:
            prompt = 0
            for m in mask:
                if m != 0.0:
                    break
                prompt += 1
            self.prompt_length = prompt
        self.spans.append((call_id, len(self.ids), len(self.ids) + len(ids)))
        self.prefix.update(ids_b)
        self.ids.extend(ids)
        self.mask.extend(mask)
        self.lps.extend(lps)

    def finish(self, cumulative_hash: bytes, root_enc: int, lk: tuple[int, int] | None) -> Linearized:
        """The rules of the whole row (cumulative_hash_mismatch against the terminal's
        ``cumulative_hash`` -> empty_training_row), then the row as arrays."""
        if self.prefix.digest() != cumulative_hash:
            raise _Reject("cumulative_hash_mismatch")
        if not self.ids or all(m == 0.0 for m in self.mask):
            raise _Reject("empty_training_row")
        routed = None
        if root_enc in ROUTES_NAMES:
            dtype = ROUTES_NAMES[root_enc][1]
            routed = np.concatenate(self.route_parts).astype(dtype, copy=False).reshape(len(self.ids), lk[0], lk[1])
        return Linearized(
            np.array(self.ids, dtype=np.int64),
            np.array(self.mask, dtype=np.float32),
            np.array(self.lps, dtype=np.float32),
            routed,
            self.prompt_length,
            self.spans,
        )


def _verify(plan: RolloutPlan, rows: RowsView, routes: RoutesView, vocab_size: int, num_experts: int | None) -> Linearized:
    """The rules of ``tasks/reasons.py`` in their order, call by call from the root to the
    terminal, then once for the rollout; raises :class:`_Reject` at the first failure."""
    rid = plan.rollout_id
    root_enc = plan.chain[0].routes_encoding
    out = _TrainingRow(plan.chain[0].digest_version)
    lk = None
    prev_end = 0
    parent_chain = None
    row: dict[str, Any] = {}
    for rec in plan.chain:
        row = _matched_row(rows, rec, rid)
        experts = _routes_cell(routes, rec, row, root_enc, lk)
        if experts is not None:
            lk = (experts.shape[1], experts.shape[2])
        ids = row["token_ids"].tolist()  # per token, as published
        ids_b = ids_bytes(ids)
        parent_chain = _check_hashes(rid, row, ids_b, experts, prev_end, parent_chain)
        mask = row["token_mask"].tolist()
        lps = row["logprobs"].tolist()
        _check_delta_content(ids, mask, lps, experts, vocab_size, num_experts)
        out.add(rec.model_call_id, ids, ids_b, mask, lps, experts)
        prev_end = row["cum_len"]
    return out.finish(row["cumulative_hash"], root_enc, lk)


def reference_verify_rollout(
    plan: RolloutPlan,
    rows: PackedBatch | RowsView,
    routes: PackedBatch | RoutesView | None,
    *,
    vocab_size: int,
    num_experts: int | None,
) -> RolloutResult:
    """Same signature and verdicts as :func:`tasks.finalize.verify.verify_rollout`, per token.

    ``rows``/``routes``: fetched batches, or their :class:`RowsView`/:class:`RoutesView`
    (build them once per fetch when many rollouts share one)."""
    rows = rows if isinstance(rows, RowsView) else RowsView(rows)
    routes = routes if isinstance(routes, RoutesView) else RoutesView(routes)
    try:
        lin = _verify(plan, rows, routes, vocab_size, num_experts)
    except _Reject as e:
        return RolloutResult(plan.rollout_id, e.reason, "", None, len(plan.chain))
    versions = [int(rec.weight_version) for rec in plan.chain]
    return RolloutResult(plan.rollout_id, "ok", "", lin, len(plan.chain), (min(versions), max(versions)))
