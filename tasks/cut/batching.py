"""Batch planning for checkpoint-cut prefix puts, and the cut writer's import point. Pure.

A cut writes one prefix row per in-flight call, in batches of one ``put_many`` each,
bounded by rows, tokens and payload bytes (routes included) per put. :class:`BatchPlanner`
plans incrementally (a batch is put as soon as it is full), from each row's signature and
bytes (:mod:`~tasks.cut.row_cost`). The rows themselves are :class:`PrefixChunk`
(:mod:`~tasks.cut.chunk`), packed with their batch by :func:`pack_chunks`
(:mod:`~tasks.cut.packing`, with :class:`CallIdentity`); all importable from here too.
Per-row Python only, never per token. docs/design.md, "Checkpoint cuts".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from ..errors import BatchLimitError, InvalidChunk
from ..schema import StagedRow
from .chunk import PrefixChunk
from .packing import BufferSource, CallIdentity, Part, pack_chunks
from .row_cost import ROW_FIXED_BYTES, Signature, chunk_signature, put_nbytes, row_signature, token_nbytes

__all__ = [
    # planning (this module)
    "BatchLimits", "PlannedBatch", "BatchPlanner", "plan_batches", "plan_rows",
    # a row's signature and bytes (row_cost)
    "ROW_FIXED_BYTES", "Signature", "row_signature", "put_nbytes", "chunk_signature", "token_nbytes",
    # chunks (chunk) and their packing (packing)
    "PrefixChunk", "CallIdentity", "Part", "BufferSource", "pack_chunks",
    # errors
    "BatchLimitError", "InvalidChunk",
]


@dataclass(frozen=True)
class BatchLimits:
    """Per-put bounds: rows, tokens and bytes (all positive)."""

    max_rows: int  # rows per put
    max_tokens: int  # tokens per put
    max_bytes: int  # payload bytes per put (put_nbytes of its rows)

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
    tokens: int = 0  # tokens of its rows
    nbytes: int = 0  # payload bytes of its rows
    oversized: bool = False  # one row over max_tokens or max_bytes, put alone

    def __len__(self) -> int:
        return len(self.rows)


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
        """Row ``index`` (``tokens`` tokens, ``nbytes`` payload bytes) joins its
        signature's open batch; returns the batches that closed (put them now)."""
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
    signatures: Sequence[Signature] | None = None,
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
    """:func:`plan_batches` over staged (prefix) rows: delta_len tokens, :func:`put_nbytes` bytes."""
    rows = list(rows)
    return plan_batches(
        [r.delta_len for r in rows], [put_nbytes(r) for r in rows], [row_signature(r) for r in rows], limits=limits
    )
