"""Batch planning for checkpoint-cut prefix puts (SPEC section 7, step 2). Pure.

A cut freezes many in-flight calls and writes one prefix row per call. Rows travel in
batches, one ``put_many`` per batch, each bounded by three limits:

* ``max_rows``   rows per put (``cut.generation-prefix-batch-size``; 1 = one put per call),
* ``max_tokens`` tokens per put (``cut.generation-prefix-batch-max-tokens``),
* ``max_bytes``  payload bytes per put (``cut.generation-prefix-batch-max-bytes``), counting
  routed experts: with router replay each token also carries ``L * K`` int16 expert ids,
  which a token limit alone does not see (48 layers x top-8 is 768 bytes per token).

Rows are grouped by *signature* (each token field's dtype and trailing shape): the store
pins a field's dtype/shape per partition, and a batch must pack into one buffer per field.
A row above the token or byte limit on its own is *oversized*: it is written alone, never
split (a prefix chunk is the unit the restore side verifies).

Planning is incremental (:class:`BatchPlanner`) so a cut can freeze calls lazily, one
batch at a time, and put each batch as soon as it is full; :func:`plan_batches` plans a
whole list at once. Per-row Python only (one loop over rows), never per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Optional, Sequence

import numpy as np

from .errors import TokenCaptureError
from .schema import HASH_BYTES, HASH_FIELDS, ID_FIELDS, ROUTES_FIELD, SCALAR_FIELDS, TOKEN_FIELDS, StagedRow

# Bytes a packed row costs besides its token payload: scalars, hashes and one offset per
# field (ids are counted from their actual length).
ROW_FIXED_BYTES = len(SCALAR_FIELDS) * 8 + len(HASH_FIELDS) * HASH_BYTES + (len(ID_FIELDS) + len(SCALAR_FIELDS) + len(HASH_FIELDS) + len(TOKEN_FIELDS) + 1) * 8

Signature = Hashable


class BatchLimitError(TokenCaptureError):
    """A batch limit that is not a positive integer."""


@dataclass(frozen=True)
class BatchLimits:
    """Per-put bounds: rows, tokens and bytes (all positive)."""

    max_rows: int
    max_tokens: int
    max_bytes: int

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_tokens", "max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise BatchLimitError(f"{name} must be a positive int, got {v!r}")


@dataclass
class PlannedBatch:
    """One put: row indices (caller's numbering, in the order added), totals, signature."""

    signature: Signature
    rows: list[int] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    oversized: bool = False

    def __len__(self) -> int:
        return len(self.rows)


def row_signature(row: StagedRow) -> Signature:
    """(field, dtype, trailing shape) of every token field the row carries."""
    sig = tuple((name, np.asarray(getattr(row, name)).dtype.str, ()) for name in TOKEN_FIELDS)
    if row.routes_encoding and row.routed_experts is not None:
        r = row.routed_experts
        sig += ((ROUTES_FIELD, r.dtype.str, tuple(r.shape[1:])),)
    return sig


def row_nbytes(row: StagedRow) -> int:
    """Bytes the row adds to a packed put: token payload + routed experts + fixed fields."""
    ids = sum(len((getattr(row, n) or "").encode("utf-8")) for n in ID_FIELDS)
    routes = row.routed_experts.nbytes if (row.routes_encoding and row.routed_experts is not None) else 0
    return int(row.token_ids.nbytes + row.token_mask.nbytes + row.logprobs.nbytes + routes + ids + ROW_FIXED_BYTES)


class BatchPlanner:
    """Greedy, order-keeping batcher: one open batch per signature.

    :meth:`add` returns the batches the new row closed (ready to put now); :meth:`flush`
    closes the rest. A row that does not fit its signature's open batch closes it and
    opens the next one; an oversized row is returned as its own batch at once and leaves
    the open batch untouched.
    """

    def __init__(self, limits: BatchLimits):
        self.limits = limits
        self._open: dict[Signature, PlannedBatch] = {}

    @property
    def pending_rows(self) -> list[int]:
        """Rows added but not yet returned in a batch (they roll back if a cut stops)."""
        return [i for b in self._open.values() for i in b.rows]

    def add(self, index: int, tokens: int, nbytes: int, signature: Signature = None) -> list[PlannedBatch]:
        if tokens < 0 or nbytes < 0:
            raise ValueError(f"row {index}: tokens ({tokens}) and nbytes ({nbytes}) must be >= 0")
        lim = self.limits
        if tokens > lim.max_tokens or nbytes > lim.max_bytes:
            return [PlannedBatch(signature, [index], tokens, nbytes, oversized=True)]
        ready: list[PlannedBatch] = []
        b = self._open.get(signature)
        if b is not None and (
            len(b.rows) + 1 > lim.max_rows or b.tokens + tokens > lim.max_tokens or b.nbytes + nbytes > lim.max_bytes
        ):
            ready.append(b)
            b = None
        if b is None:
            b = self._open[signature] = PlannedBatch(signature)
        b.rows.append(index)
        b.tokens += tokens
        b.nbytes += nbytes
        if len(b.rows) == lim.max_rows:
            # Full: put it now rather than waiting for the next row to overflow it.
            ready.append(self._open.pop(signature))
        return ready

    def flush(self) -> list[PlannedBatch]:
        """Close every open batch, in order of each batch's first row."""
        out = sorted(self._open.values(), key=lambda b: b.rows[0])
        self._open.clear()
        return out

    def discard(self) -> list[int]:
        """Drop the open batches (a stopped cut); return their rows to roll back."""
        rows = self.pending_rows
        self._open.clear()
        return rows


def plan_batches(
    tokens: Sequence[int],
    nbytes: Sequence[int],
    signatures: Optional[Sequence[Signature]] = None,
    *,
    limits: BatchLimits,
) -> list[PlannedBatch]:
    """Plan every row at once; batches are ordered by their first row."""
    if len(tokens) != len(nbytes) or (signatures is not None and len(signatures) != len(tokens)):
        raise ValueError(f"{len(tokens)} token counts, {len(nbytes)} byte counts, "
                         f"{'no' if signatures is None else len(signatures)} signatures")
    planner = BatchPlanner(limits)
    out: list[PlannedBatch] = []
    for i in range(len(tokens)):
        out.extend(planner.add(i, int(tokens[i]), int(nbytes[i]), None if signatures is None else signatures[i]))
    out.extend(planner.flush())
    out.sort(key=lambda b: b.rows[0])
    return out


def plan_rows(rows: Iterable[StagedRow], *, limits: BatchLimits) -> list[PlannedBatch]:
    """:func:`plan_batches` over staged (prefix) rows: delta_len tokens, :func:`row_nbytes` bytes."""
    rows = list(rows)
    return plan_batches(
        [r.delta_len for r in rows], [row_nbytes(r) for r in rows], [row_signature(r) for r in rows], limits=limits
    )
