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

from . import hashing
from . import reasons as R
from .linearize import Linearized, linearize
from .packed import PackedBatch, PackedField
from .plan import RolloutPlan, StepPlan
from .schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_FIELD,
    ROUTES_NONE,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
)
from .validation import check_lengths, check_logprobs, check_mask, check_routes, check_token_arrays, check_tokens

_U8 = np.dtype("u1")
# A batch whose needed rows hold under this share of its tokens is not pre-scanned whole:
# per-call checks on the needed rows are cheaper than a scan of everything.
_PRESCAN_MIN_SHARE = 0.25


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
    """One fetched batch, indexed by key, with its whole-batch validity pre-scan.

    Built once per verify task and shared by every rollout of the task.
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
            for name in SCALAR_FIELDS:
                f = fields[name]
                at = np.minimum(f.offsets[:-1], max(len(f.values) - 1, 0))
                self._scalars[name] = f.values[at].tolist() if len(f.values) else [0] * n
        self.content_ok = self._prescan(vocab_size, needed)

    def _prescan(self, vocab_size: int, needed: Optional[Sequence[str]]) -> Optional[np.ndarray]:
        """bool[n]: True where mask, token and logprob rules surely hold (None: not scanned)."""
        if self.batch_problem is not None:
            return None
        fs = [self.batch.fields[name] for name in TOKEN_FIELDS]
        off = fs[0].offsets
        if any(f.present is not None for f in fs) or not all(np.array_equal(off, f.offsets) for f in fs[1:]):
            return None  # misaligned buffers (a malformed batch): per-call checks only
        total = int(off[-1] - off[0]) if len(off) > 1 else 0
        if needed is not None and total:
            idx = [self.index[k] for k in needed if k in self.index]
            share = float(np.sum(off[np.add(idx, 1)] - off[idx])) / total if idx else 0.0
            if share < _PRESCAN_MIN_SHARE:
                return None
        ids, mask, lps = (f.values for f in fs)
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


class RoutesTable:
    """The ``routed_experts`` batch (or ``None``), indexed by key, range pre-scanned."""

    def __init__(self, batch: Optional[PackedBatch], num_experts: Optional[int]):
        self.index: dict[str, int] = {}
        self.field: Optional[PackedField] = None
        self.in_range: Optional[np.ndarray] = None
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
        if num_experts is not None and v.ndim == 3 and v.dtype.kind in "iu":
            bad = ((v < 0) | (v >= num_experts)).any(axis=(1, 2))  # per token
            cb = np.concatenate(([0], np.cumsum(bad)))
            self.in_range = cb[f.offsets[1:]] - cb[f.offsets[:-1]] == 0

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


def _verify(
    plan: RolloutPlan,
    rows: RowTable,
    routes: RoutesTable,
    vocab_size: int,
    num_experts: Optional[int],
) -> RolloutResult:
    chain = plan.chain
    rid = plan.rollout_id
    parent_chain: Optional[bytes] = None
    prev_cum = 0
    root_enc = chain[0].routes_encoding
    routes_shape = None
    views: list[dict] = []
    route_views: list[np.ndarray] = []
    for pos, rec in enumerate(chain):
        where = f"call {rec.model_call_id!r}"
        i = rows.index.get(rec.staging_key, -1)
        if i < 0:
            raise _Reject(R.MISSING_STAGING_ROW, f"{where}: no staged row for {rec.staging_key!r}")
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
        experts = None
        if enc != root_enc:
            raise _Reject(R.INVALID_ROUTES, f"{where}: routes_encoding {enc} differs from the root's {root_enc}")
        if enc != ROUTES_NONE:
            experts, j = routes.get(rec.staging_key)
            problem = check_routes(enc, experts, row["delta_len"], None, routes_shape)
            if problem:
                raise _Reject(problem[0], f"{where}: {problem[1]}")
            routes_shape = routes_shape or tuple(experts.shape[1:])
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
        if row["prev_len"] != prev_cum:
            raise _Reject(R.PARENT_LENGTH_MISMATCH, f"{where}: prev_len {row['prev_len']}, parent ends at {prev_cum}")
        parent_chain = hashing.chain_hash(parent_chain, row["token_ids"])
        if parent_chain != row["chain_hash"]:
            raise _Reject(R.CHAIN_HASH_MISMATCH, f"{where}: recomputed chain hash differs")
        if rows.content_ok is None or not rows.content_ok[i]:
            problem = (
                check_mask(row["token_mask"])
                or check_tokens(row["token_ids"], vocab_size)
                or check_logprobs(row["logprobs"], row["token_mask"])
            )
            if problem:
                raise _Reject(problem[0], f"{where}: {problem[1]}")
        if experts is not None and num_experts is not None and (routes.in_range is None or not routes.in_range[j]):
            problem = check_routes(enc, experts, row["delta_len"], num_experts, routes_shape)
            if problem:
                raise _Reject(problem[0], f"{where}: {problem[1]}")
        prev_cum = row["cum_len"]
        views.append(row)
        if experts is not None:
            route_views.append(experts)
    lin = linearize(
        [c.model_call_id for c in chain],
        [v["token_ids"] for v in views],
        [v["token_mask"] for v in views],
        [v["logprobs"] for v in views],
        route_views if root_enc != ROUTES_NONE else None,
    )
    # Recomputed once over the linearized ids: covers every token from the root on.
    if hashing.cumulative_hash(lin.input_ids) != views[-1]["cumulative_hash"]:
        raise _Reject(R.CUMULATIVE_HASH_MISMATCH, "cumulative hash of the linearized ids differs from the terminal's")
    if lin.length == 0 or not np.any(lin.token_mask):
        raise _Reject(R.EMPTY_TRAINING_ROW, "no generated token in the training row")
    return RolloutResult(rid, R.OK, "", lin, len(chain))


def _safe_verify(plan, rows, routes, vocab_size, num_experts) -> RolloutResult:
    try:
        return _verify(plan, rows, routes, vocab_size, num_experts)
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
    return [_safe_verify(p, table, rtable, vocab_size, num_experts) for p in plans]


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
