"""Test helper: valid rollouts built through the real capture gate, and ways to break them.

``make_rollout`` stages random calls through :class:`tasks.gate.CaptureGate` (so every
row and receipt is exactly what production writes): a main chain root -> terminal, plus
optional branch calls off the chain (abandoned retries). ``fetch`` emulates the store's
two finalizer fetches. Corruptions come in two kinds:

* byte-level (``flip_byte``, ``drop_key``, ``swap_keys``, ``replace_field``) on a fetched
  batch: what a bad disk or a buggy store produces;
* re-signed (``resign``): content changed and hashes recomputed by a forger, so the
  content and lineage rules (not the digest) must catch it.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import numpy as np

from tasks import hashing
from tasks.gate import CaptureGate, record_of
from tasks.packed import PackedBatch, PackedField, pack_rows
from tasks.receipts import Receipt
from tasks.schema import ROUTES_FIELDS, ROUTES_NONE, STAGING_FIELDS, StagedRow

VOCAB = 64


@dataclass
class Built:
    """One rollout: every staged row (staging order), its receipt and its main chain."""

    rollout_id: str
    rows: list[StagedRow]
    receipt: Receipt
    chain_ids: list[str]
    vocab_size: int
    num_experts: Optional[int]

    def row(self, call_id: str) -> StagedRow:
        return next(r for r in self.rows if r.model_call_id == call_id)


def _delta(rng: np.random.Generator, n_ctx: int, n_gen: int, vocab: int, routes):
    n = n_ctx + n_gen
    ids = rng.integers(0, vocab, size=n, dtype=np.int64)
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(n_gen, np.float32)])
    lps = np.zeros(n, np.float32)
    lps[n_ctx:] = -rng.exponential(1.0, size=n_gen).astype(np.float32)
    experts = None
    if routes is not None:
        L, K, E = routes
        experts = rng.integers(0, E, size=(n, L, K), dtype=np.int16)
    return ids, mask, lps, experts


def make_rollout(
    rng: np.random.Generator,
    rollout_id: str,
    *,
    n_calls: int = 3,
    gen_len: tuple[int, int] = (1, 12),
    ctx_len: tuple[int, int] = (0, 5),
    prompt_len: tuple[int, int] = (1, 8),
    routes: Optional[tuple[int, int, int]] = None,
    n_branches: int = 0,
    vocab_size: int = VOCAB,
    group_id: Optional[str] = None,
    reward: Optional[float] = None,
    weight_version: int | Sequence[int] = 0,
    routes_encoding: Optional[int] = None,
    digest_version: int = hashing.DIGEST_VERSION,
) -> Built:
    """A valid rollout of ``n_calls`` chain calls and ``n_branches`` off-chain calls.

    Lengths are inclusive ranges in tokens; ``routes=(L, K, E)`` adds routed experts,
    staged in ``routes_encoding`` (None: the gate's choice from ``E``, uint8 up to 256
    experts; 1: int16, as rows staged before uint8 existed), hashed with
    ``digest_version`` (1: SHA-256, 2: BLAKE3, 3: BLAKE3 over field digests, the default).
    ``weight_version``: one for every call, or one per chain call (off-chain calls take
    the first).
    """
    versions = [weight_version] * n_calls if isinstance(weight_version, (int, np.integer)) else list(weight_version)
    assert len(versions) == n_calls, "one weight_version per chain call"
    gate = CaptureGate(rollout_id, vocab_size=vocab_size, num_experts=None if routes is None else routes[2], group_id=group_id,
                       routes_encoding=routes_encoding, digest_version=digest_version)
    rows: list[StagedRow] = []
    chain: list[str] = []
    # Branches are staged at random points between chain calls, off a random staged call.
    branch_at = sorted(rng.integers(1, n_calls + 1, size=n_branches).tolist()) if n_branches else []
    b = 0
    for c in range(n_calls):
        while b < len(branch_at) and branch_at[b] == c and rows:
            parent = rows[int(rng.integers(0, len(rows)))]
            d = _delta(rng, int(rng.integers(ctx_len[0], ctx_len[1] + 1)), int(rng.integers(gen_len[0], gen_len[1] + 1)), vocab_size, routes)
            rows.append(gate.stage_call(f"b{b}", parent.model_call_id, *d[:3], routed_experts=d[3], weight_version=versions[0]))
            b += 1
        n_ctx = int(rng.integers(prompt_len[0], prompt_len[1] + 1)) if c == 0 else int(rng.integers(ctx_len[0], ctx_len[1] + 1))
        d = _delta(rng, n_ctx, int(rng.integers(gen_len[0], gen_len[1] + 1)), vocab_size, routes)
        cid = f"c{c}"
        rows.append(gate.stage_call(cid, chain[-1] if chain else None, *d[:3], routed_experts=d[3], weight_version=versions[c]))
        chain.append(cid)
    while b < len(branch_at):  # branches after the terminal call
        parent_id = rows[int(rng.integers(0, len(rows)))].model_call_id
        if parent_id == chain[-1]:  # the terminal stays a leaf: branch off its parent (or a new root)
            parent_id = chain[-2] if len(chain) > 1 else None
        d = _delta(rng, 1, 2, vocab_size, routes)
        rows.append(gate.stage_call(f"b{b}", parent_id, *d[:3], routed_experts=d[3], weight_version=versions[0]))
        b += 1
    r = float(rng.normal()) if reward is None else reward
    receipt = gate.receipt(r, chain[-1])
    return Built(rollout_id, rows, receipt, chain, vocab_size, None if routes is None else routes[2])


def make_group(rng: np.random.Generator, group_id: str, n: int, rollout_prefix: str | None = None, **kw) -> list[Built]:
    """``n`` rollouts of group ``group_id``, ids ``{rollout_prefix or group_id}-r{i}``."""
    prefix = group_id if rollout_prefix is None else rollout_prefix
    return [make_rollout(rng, f"{prefix}-r{i}", group_id=group_id, **kw) for i in range(n)]


# ---- the store's two fetches ------------------------------------------------------------


def fetch(builts: Sequence[Built], keys: Sequence[str], routes_keys: Sequence[str]):
    """(rows, routes) as the finalizer's union fetch and routes fetch return them.

    Missing keys are left out (the store reports them failed); routes is ``None`` when no
    key is routed.
    """
    store = {r.staging_key: r for b in builts for r in b.rows}
    found = [store[k] for k in keys if k in store]
    rows = pack_rows(found, with_routes=False).select(STAGING_FIELDS)
    routed = [store[k] for k in routes_keys if k in store and store[k].routed_experts is not None]
    routes = None
    if routes_keys:  # one field per routes encoding the rows use (as a store answers)
        routes = pack_rows(routed).select(ROUTES_FIELDS) if routed else PackedBatch([], {})
    return rows, routes


# ---- byte-level corruptions of a fetched batch ------------------------------------------


def _with_field(batch: PackedBatch, name: str, f: PackedField) -> PackedBatch:
    fields = dict(batch.fields)
    fields[name] = f
    return PackedBatch(list(batch.keys), fields)


def flip_byte(batch: PackedBatch, name: str, index: int, byte: int, mask: int = 0x01) -> Optional[PackedBatch]:
    """XOR one byte of row ``index``'s ``name`` field (``None`` if that row has no bytes)."""
    f = batch.fields[name]
    lo, hi = int(f.offsets[index]), int(f.offsets[index + 1])
    if hi <= lo:
        return None
    values = f.values.copy()
    raw = values.reshape(-1).view(np.uint8)
    per = values.itemsize * int(np.prod(values.shape[1:], dtype=np.int64))
    start, n = lo * per, (hi - lo) * per
    raw[start + byte % n] ^= mask
    return _with_field(batch, name, PackedField(values, f.offsets.copy(), None if f.present is None else f.present.copy()))


def drop_key(batch: PackedBatch, key: str) -> PackedBatch:
    return batch.take([i for i, k in enumerate(batch.keys) if k != key])


def swap_keys(batch: PackedBatch, a: int, b: int) -> PackedBatch:
    keys = list(batch.keys)
    keys[a], keys[b] = keys[b], keys[a]
    return PackedBatch(keys, dict(batch.fields))


def replace_field(batch: PackedBatch, name: str, index: int, value: Optional[np.ndarray]) -> PackedBatch:
    """Row ``index`` of field ``name`` replaced by ``value`` (``None``: absent)."""
    f = batch.fields[name]
    arrays = [f.row(i) for i in range(len(f))]
    arrays[index] = value
    proto = next((a for a in arrays if a is not None), f.values)
    return _with_field(batch, name, PackedField.from_arrays(arrays, dtype=proto.dtype, trailing=proto.shape[1:]))


# ---- re-signed corruptions (a forger recomputes the hashes) ------------------------------


def resign(
    built: Built,
    mutate: Callable[[dict[str, StagedRow]], None],
    *,
    chain: bool = True,
    cumulative: bool = True,
    digest: bool = True,
) -> Built:
    """Copy the rows, ``mutate`` them (by call id), recompute the chosen hashes along the
    lineage (staging order) and rebuild the receipt from the rows."""
    rows = [copy.deepcopy(r) for r in built.rows]
    by_id = {r.model_call_id: r for r in rows}
    mutate(by_id)
    states: dict[str, object] = {}
    for r in rows:
        parent = by_id.get(r.parent_call_id) if r.parent_call_id else None
        if chain:
            r.chain_hash = hashing.chain_hash(None if parent is None else parent.chain_hash, r.token_ids, r.digest_version)
        if cumulative:
            st = hashing.prefix_state(None if parent is None else states.get(parent.model_call_id), r.digest_version)
            r.cumulative_hash = hashing.extend_prefix(st, r.token_ids)
            states[r.model_call_id] = st
        if digest:
            r.digest = hashing.row_digest(r)
    receipt = replace(built.receipt, calls=[record_of(r) for r in rows])
    return replace(built, rows=rows, receipt=receipt)


def set_tokens(call: str, pos: int, value: int):
    def m(rows):
        rows[call].token_ids = rows[call].token_ids.copy()
        rows[call].token_ids[pos % rows[call].delta_len] = value
    return m


def set_logprob(call: str, pos: int, value: float):
    def m(rows):
        rows[call].logprobs = rows[call].logprobs.copy()
        rows[call].logprobs[pos % rows[call].delta_len] = value
    return m


def set_mask(call: str, mask: Sequence[float], logprobs: Optional[Sequence[float]] = None):
    """Replace a call's mask (and logprobs), keeping its delta length."""
    def m(rows):
        r = rows[call]
        r.token_mask = np.asarray(mask, np.float32)
        if logprobs is not None:
            r.logprobs = np.asarray(logprobs, np.float32)
    return m


def set_expert(call: str, value: int):
    """The call's first expert id set to ``value`` (its routes widened to int16, encoding
    1, when ``value`` does not fit their dtype, e.g. -1 in uint8 routes)."""
    def m(rows):
        r = rows[call]
        info = np.iinfo(r.routed_experts.dtype)
        if not info.min <= value <= info.max:
            r.routed_experts, r.routes_encoding = r.routed_experts.astype(np.int16), 1
        r.routed_experts = r.routed_experts.copy()
        r.routed_experts.reshape(-1)[0] = value
    return m


def shift_lengths(call: str, by: int):
    """prev_len and cum_len moved together: lengths stay self-consistent, lineage breaks."""
    def m(rows):
        rows[call].prev_len += by
        rows[call].cum_len += by
    return m


def drop_routes(call: str):
    def m(rows):
        rows[call].routes_encoding = ROUTES_NONE
        rows[call].routed_experts = None
    return m


def receipt_dict(built: Built) -> dict:
    """The receipt as a plain dict (what a msgpack round trip gives), deep-copied."""
    return copy.deepcopy(built.receipt.to_dict())
