"""A read request's answer, assembled from its keys' settled futures.

Each future holds ``(get answer, row index)`` or a key failure. Rows that sit together,
in order, in one get's answer (the usual case: a request's keys are queued together)
are answered as views of that get's buffers; rows from several gets (or out of order)
with one gather copy per field.
"""
from __future__ import annotations

import numpy as np

from tasks.errors import KeyReadFailure, PrefixReadError
from tasks.packed import PackedBatch, align_fields, take_rows

from .pending import PendingKey


def assemble_answer(keys: list[str], mine: dict[str, PendingKey]) -> PackedBatch:
    """Rows for ``keys`` in that order (duplicates repeated), from ``mine`` (each distinct
    key's settled entry); :class:`PrefixReadError` naming every key that failed."""
    failed: dict[str, tuple[str, str]] = {}
    for k, e in mine.items():
        exc = e.future.exception()
        if exc is not None:
            failed[k] = (exc.reason, exc.detail) if isinstance(exc, KeyReadFailure) else ("read_failed", repr(exc))
    if failed:
        raise PrefixReadError(failed)
    # Where each of the request's rows sits: (get answer, row).
    first, lo = mine[keys[0]].future.result()
    together = True
    for pos in range(1, len(keys)):
        answer, i = mine[keys[pos]].future.result()
        if answer is not first or i != lo + pos:
            together = False
            break
    if together:
        # The request's rows sit together in its get's answer: views, no copy.
        return first.slice(lo, lo + len(keys))
    return _gathered(keys, mine)


def _gathered(keys: list[str], mine: dict[str, PendingKey]) -> PackedBatch:
    """Rows from several gets (or out of order): one gather copy per field."""
    batches: dict[int, int] = {}  # id(get answer) -> its index in sources
    sources: list[PackedBatch] = []
    src = np.empty(len(keys), dtype=np.int64)
    rows_idx = np.empty(len(keys), dtype=np.int64)
    for pos, k in enumerate(keys):
        answer, i = mine[k].future.result()
        b = batches.get(id(answer))
        if b is None:
            b = batches[id(answer)] = len(sources)
            sources.append(answer.batch)
        src[pos], rows_idx[pos] = b, i
    return take_rows(align_fields(sources), src, rows_idx)
