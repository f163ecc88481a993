"""A deliberately simple, per-token reference of the verification rules.

Written independently of ``tasks.finalize.verify`` / ``tasks.hashing``: ids, mask and
logprobs go through ``.tolist()`` and every rule is a Python loop over them; each hash
input is built by hand from the layout in ``tasks/hashing.py``'s docstring (parts joined
once; float and routes buffers hashed as one contiguous buffer each). It is the tests'
oracle and, as the per-token path the published system runs, the finalize benchmark's
baseline.

Rule order is the one documented in ``tasks/reasons.py``.
"""
from __future__ import annotations

import hashlib
import math
import struct
from typing import Any

import numpy as np

from tasks.finalize.linearize import Linearized
from tasks.finalize.verify import RolloutResult

TAG_CHAIN = b"token-capture/chain/v1\x00"
TAG_PREFIX = b"token-capture/prefix/v1\x00"
TAG_CALL = b"token-capture/call/v1\x00"

ID_NAMES = ["rollout_id", "model_call_id", "parent_call_id"]
SCALAR_NAMES = {
    "prev_len": "<i8", "delta_len": "<i8", "cum_len": "<i8", "weight_version": "<i8",
    "routes_encoding": "i1", "schema_version": "<i8", "digest_version": "<i8",
}
HASH_NAMES = ["digest", "chain_hash", "cumulative_hash"]
TOKEN_NAMES = {"token_ids": "<i8", "token_mask": "<f4", "logprobs": "<f4"}
COMPARED = ["parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
            "routes_encoding", "digest", "chain_hash", "cumulative_hash"]


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


def field_ok(batch, name: str, dtype: str, n: int) -> bool:
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


def cell(batch, name: str, i: int) -> np.ndarray | None:
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

    def __init__(self, batch) -> None:
        self.batch = batch
        self.index: dict[str, int] = {}
        for j, k in enumerate(batch.keys):
            self.index.setdefault(k, j)  # the first match, as the reference's scan
        n = len(batch.keys)
        self.fields_ok = all(field_ok(batch, name, dt, n) for name, dt in _ROW_SPECS.items())


class RoutesView:
    """A fetched ``routed_experts`` batch (or ``None``), indexed once, offsets checked once."""

    def __init__(self, routes) -> None:
        self.index: dict[str, int] = {}
        self.field = None
        self.offs: list[int] = []
        if routes is None:
            return
        for j, k in enumerate(routes.keys):
            self.index.setdefault(k, j)
        f = routes.fields.get("routed_experts")
        n = len(routes.keys)
        if f is None or not isinstance(f.values, np.ndarray) or f.offsets.shape != (n + 1,):
            return
        offs = f.offsets.tolist()
        if n and (offs[0] < 0 or offs[-1] > f.values.shape[0] or any(b < a for a, b in zip(offs, offs[1:]))):
            return
        self.field, self.offs = f, offs

    def cell(self, key: str) -> np.ndarray | None:
        idx = self.index.get(key)
        if idx is None or self.field is None:
            return None
        if self.field.present is not None and not bool(self.field.present[idx]):
            return None
        return self.field.values[self.offs[idx] : self.offs[idx + 1]]


def read_row(rows: RowsView, i: int) -> dict:
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
    if row["schema_version"] != 1 or row["digest_version"] != 1:
        raise _Reject("invalid_staging_row")
    for name in TOKEN_NAMES:
        row[name] = cells[name]
    if row["parent_call_id"] == "":
        row["parent_call_id"] = None
    return row


def _raw(arr: np.ndarray) -> memoryview:
    """An array's bytes as ONE contiguous buffer (no per-value work)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1)).cast("B")


def _verify(plan, rows: RowsView, routes: RoutesView, vocab_size: int, num_experts: int | None) -> Linearized:
    rid = plan.rollout_id
    chain = plan.chain
    root_enc = chain[0].routes_encoding
    lk = None
    prev_end = 0
    parent_chain = None
    prefix = hashlib.sha256(TAG_PREFIX)
    all_ids: list[int] = []
    all_mask: list[float] = []
    all_lps: list[float] = []
    route_parts: list[np.ndarray] = []
    spans = []
    prompt_length = 0
    row: dict = {}
    for pos, rec in enumerate(chain):
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
        experts = None
        if row["routes_encoding"] != root_enc:
            raise _Reject("invalid_routes")
        if row["routes_encoding"] == 1:
            experts = routes.cell(rec.staging_key)
            if experts is None:
                raise _Reject("missing_routes")
            if experts.dtype != np.dtype("<i2") or experts.ndim != 3 or experts.shape[0] != row["delta_len"]:
                raise _Reject("invalid_routes")
            if lk is not None and (experts.shape[1], experts.shape[2]) != lk:
                raise _Reject("invalid_routes")
            lk = (experts.shape[1], experts.shape[2])
        ids = row["token_ids"].tolist()  # per token, as published
        ids_b = ids_bytes(ids)
        parent_marker = b"\x00" if row["parent_call_id"] is None else b"\x01" + framed(row["parent_call_id"])
        parts = [
            TAG_CALL, u(row["schema_version"] & 0xFFFF, 2), u(row["digest_version"], 2),
            framed(rid), framed(row["model_call_id"]), parent_marker,
            s(row["prev_len"], 8), s(row["delta_len"], 8), s(row["cum_len"], 8), s(row["weight_version"], 8),
            s(row["routes_encoding"], 1), u(len(ids_b), 8), ids_b,
        ]
        for name in ("token_mask", "logprobs"):
            b = _raw(row[name])
            parts += [u(b.nbytes, 8), b]
        if row["routes_encoding"] == 1:
            b = _raw(experts)
            parts += [u(experts.shape[1], 4), u(experts.shape[2], 4), u(b.nbytes, 8), b]
        parts += [row["chain_hash"], row["cumulative_hash"]]
        if hashlib.sha256(b"".join(parts)).digest() != row["digest"]:
            raise _Reject("corrupt_digest")
        if row["prev_len"] != prev_end:
            raise _Reject("parent_length_mismatch")
        h = hashlib.sha256(TAG_CHAIN + (b"\x00" if parent_chain is None else b"\x01" + parent_chain))
        h.update(ids_b)
        parent_chain = h.digest()
        if parent_chain != row["chain_hash"]:
            raise _Reject("chain_hash_mismatch")
        mask = row["token_mask"].tolist()
        lps = row["logprobs"].tolist()
        reason = content_reason(ids, mask, lps, vocab_size)
        if reason:
            raise _Reject(reason)
        if experts is not None:
            if num_experts is not None and experts.size and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
                raise _Reject("invalid_routes")
            route_parts.append(experts)
        if pos == 0:
            for m in mask:
                if m != 0.0:
                    break
                prompt_length += 1
        spans.append((rec.model_call_id, len(all_ids), len(all_ids) + len(ids)))
        prefix.update(ids_b)
        all_ids.extend(ids)
        all_mask.extend(mask)
        all_lps.extend(lps)
        prev_end = row["cum_len"]
    if prefix.digest() != row["cumulative_hash"]:
        raise _Reject("cumulative_hash_mismatch")
    if not all_ids or all(m == 0.0 for m in all_mask):
        raise _Reject("empty_training_row")
    routed = None
    if root_enc == 1:
        routed = np.concatenate(route_parts).astype(np.int16, copy=False).reshape(len(all_ids), lk[0], lk[1])
    return Linearized(
        np.array(all_ids, dtype=np.int64),
        np.array(all_mask, dtype=np.float32),
        np.array(all_lps, dtype=np.float32),
        routed,
        prompt_length,
        spans,
    )


def reference_verify_rollout(plan, rows, routes, *, vocab_size: int, num_experts: int | None) -> RolloutResult:
    """Same signature and verdicts as :func:`tasks.finalize.verify.verify_rollout`, per token.

    ``rows``/``routes``: fetched batches, or their :class:`RowsView`/:class:`RoutesView`
    (build them once per fetch when many rollouts share one)."""
    rows = rows if isinstance(rows, RowsView) else RowsView(rows)
    routes = routes if isinstance(routes, RoutesView) else RoutesView(routes)
    try:
        lin = _verify(plan, rows, routes, vocab_size, num_experts)
    except _Reject as e:
        return RolloutResult(plan.rollout_id, e.reason, "", None, len(plan.chain))
    return RolloutResult(plan.rollout_id, "ok", "", lin, len(plan.chain))


# ---- receipts ------------------------------------------------------------------------------

RECORD_KEYS = ["model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
               "digest", "chain_hash", "cumulative_hash", "routes_encoding", "staging_key"]


def _good_id(v) -> bool:
    return (isinstance(v, str) and v != "" and "/" not in v and v != "__cut__"
            and len(v.encode("utf-8", "surrogatepass")) <= 512 and _utf8(v))


def _utf8(v: str) -> bool:
    try:
        v.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _f32_reward(v: Any) -> bool:
    """A number that stays finite as a float32 (``struct`` refuses to pack a float that
    rounds past float32's range; NaN and inf pack, so they are tested apart)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        x = float(v)
        struct.pack("<f", x)
    except OverflowError:
        return False
    return not math.isnan(x) and not math.isinf(x)


def reference_receipt_reason(raw: Any, submitted_group: str | None = None) -> str | None:
    """The rejection reason of one receipt dict by itself (``None``: usable), submitted
    in the group ``submitted_group`` (``None``: submitted in no named group)."""
    if not isinstance(raw, dict):
        return "invalid_receipt"
    allowed = {"rollout_id", "reward", "terminal_model_call_id", "calls", "poisoned", "failure_reason", "group_id", "version"}
    for k in raw:
        if k not in allowed:
            return "invalid_receipt"
    for k in ("rollout_id", "reward", "terminal_model_call_id", "calls"):
        if k not in raw:
            return "invalid_receipt"
    rid = raw["rollout_id"]
    reward = raw["reward"]
    if not _good_id(rid):
        return "invalid_receipt"
    if not _f32_reward(reward):
        return "invalid_receipt"
    term = raw["terminal_model_call_id"]
    if term is not None and not isinstance(term, str):
        return "invalid_receipt"
    calls = raw["calls"]
    if not isinstance(calls, (list, tuple)):
        return "invalid_receipt"
    if not isinstance(raw.get("poisoned", False), bool):
        return "invalid_receipt"
    for k in ("failure_reason", "group_id"):
        if raw.get(k) is not None and not isinstance(raw.get(k), str):
            return "invalid_receipt"
    if not _int(raw.get("version", 1)) or raw.get("version", 1) != 1:
        return "invalid_receipt"
    claimed = raw.get("group_id")
    if submitted_group is not None and claimed is not None and claimed != "" and claimed != submitted_group:
        return "wrong_group"
    if raw.get("poisoned", False):
        return "capture_poisoned"
    if len(calls) == 0:
        return "empty_manifest"
    for c in calls:
        if not isinstance(c, dict) or sorted(c) != sorted(RECORD_KEYS):
            return "invalid_receipt"
        if not _good_id(c["model_call_id"]):
            return "invalid_receipt"
        if c["parent_call_id"] is not None and not _good_id(c["parent_call_id"]):
            return "invalid_receipt"
        for k in ("prev_len", "delta_len", "cum_len", "weight_version"):
            if not _int(c[k]):
                return "invalid_receipt"
        if c["delta_len"] <= 0 or c["prev_len"] < 0 or c["cum_len"] != c["prev_len"] + c["delta_len"]:
            return "invalid_receipt"
        if not _int(c["routes_encoding"]) or c["routes_encoding"] not in (0, 1):
            return "invalid_receipt"
        if not isinstance(c["staging_key"], str):
            return "invalid_receipt"
        for k in ("digest", "chain_hash", "cumulative_hash"):
            if not isinstance(c[k], (bytes, bytearray)) or len(c[k]) != 32:
                return "invalid_receipt"
    ids = [c["model_call_id"] for c in calls]
    if len(set(ids)) != len(ids):
        return "duplicate_call_id"
    keys = [c["staging_key"] for c in calls]
    if len(set(keys)) != len(keys):
        return "duplicate_staging_key"
    for c in calls:
        if c["staging_key"] != rid + "/" + c["model_call_id"]:
            return "invalid_receipt"
    if term is None or term not in ids:
        return "missing_terminal"
    parent = {c["model_call_id"]: c["parent_call_id"] for c in calls}
    for c in calls:
        if c["parent_call_id"] is not None and c["parent_call_id"] not in parent:
            return "missing_parent"
    for start in ids:
        steps, cur = 0, start
        while cur is not None:
            cur = parent[cur]
            steps += 1
            if steps > len(ids):
                return "lineage_cycle"
    for c in calls:
        if c["parent_call_id"] == term:
            return "terminal_not_leaf"
    return None


def reference_chain(raw: dict) -> list[str]:
    """Root -> terminal call ids of a usable receipt dict."""
    parent = {c["model_call_id"]: c["parent_call_id"] for c in raw["calls"]}
    out = [raw["terminal_model_call_id"]]
    while parent[out[-1]] is not None:
        out.append(parent[out[-1]])
    return out[::-1]
