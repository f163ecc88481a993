"""Dask's own ceiling for a store call: bare actors moving the same bytes.

A :class:`Sink` actor on each worker keeps what it is sent (as a storage unit keeps its
rows: new memory, never recycled) and hands it back. :func:`measure` moves a batch's
field buffers through them shaped like the store's calls: rows split evenly between the
workers, puts cut at ``store.max-call-bytes`` per call, one get per worker; every field a
contiguous view (no gather, no per-row work, no packing). What the store's batched calls
reach against these figures is the store's own overhead over Dask; what these reach
against raw loopback TCP is Dask's (its comm layer, frames received into fresh memory).
Figures in bytes/s; a sample read back is compared bit-exact with what was sent.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

import numpy as np

from tasks.packed import PackedBatch

from ..actors import workers_now
from ..store import receive_pool


class Sink:
    """A bare actor: keeps every call's frames and returns them by call number."""

    def __init__(self) -> None:
        self.kept: list[tuple[np.ndarray, ...]] = []

    def put(self, *frames: np.ndarray) -> int:
        """Keep ``frames``; their call number."""
        self.kept.append(frames)
        return len(self.kept) - 1

    def get(self, calls: Sequence[int]) -> list[tuple[np.ndarray, ...]]:
        """The frames of put calls ``calls``, in that order (views of what was kept)."""
        return [self.kept[i] for i in calls]


def row_chunks(batch: PackedBatch, parts: int, max_call_bytes: int) -> list[list[tuple[int, int]]]:
    """Rows ``[lo, hi)`` of each part's calls: rows split evenly into ``parts`` runs, each
    run cut where a call would pass ``max_call_bytes`` bytes (a row never split)."""
    sizes = np.zeros(len(batch), dtype=np.int64)
    for f in batch.fields.values():
        per = f.values.itemsize * int(np.prod(f.values.shape[1:], dtype=np.int64))
        sizes += np.diff(f.offsets) * per
    bounds = np.linspace(0, len(batch), parts + 1).astype(int)
    out: list[list[tuple[int, int]]] = []
    for p in range(parts):
        chunks, lo, acc = [], int(bounds[p]), 0
        for i in range(int(bounds[p]), int(bounds[p + 1])):
            if acc and acc + sizes[i] > max_call_bytes:
                chunks.append((lo, i))
                lo, acc = i, 0
            acc += int(sizes[i])
        if lo < bounds[p + 1]:
            chunks.append((lo, int(bounds[p + 1])))
        out.append(chunks)
    return out


def frames_of(batch: PackedBatch, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """Every field's values of rows ``[lo, hi)``: one contiguous view per field."""
    return tuple(f.values[int(f.offsets[lo]) : int(f.offsets[hi])] for f in batch.fields.values())


def measure(client: Any, batch: PackedBatch, calls: int, max_call_bytes: int, sink: type = Sink) -> dict[str, float]:
    """Bytes/s of ``calls`` puts of ``batch`` and of as many gets, through one bare
    ``sink`` actor (:class:`Sink`) per worker of ``client``, one warm-up call each way first.

    Returns ``put_bytes_per_s`` and ``get_bytes_per_s``; raises ``RuntimeError`` when an
    answer (the warm-up's, the last timed one's) differs from what was put."""
    workers = list(workers_now(client))
    futures = [client.submit(sink, actor=True, workers=[w], pure=False) for w in workers]
    sinks = [f.result() for f in futures]
    plan = row_chunks(batch, len(sinks), max_call_bytes)
    frames = [[frames_of(batch, lo, hi) for lo, hi in chunks] for chunks in plan]
    nbytes = sum(f.nbytes for part in frames for call in part for f in call)

    def put_all() -> list[list[int]]:
        futures = [[s.put(*call) for call in part] for s, part in zip(sinks, frames)]
        return [[f.result() for f in part] for part in futures]

    def get_all(numbers: list[list[int]]) -> list[list[tuple]]:
        futures = [s.get(ns) for s, ns in zip(sinks, numbers)]
        return [f.result() for f in futures]

    try:
        # Plain Dask: frames into fresh buffers, whatever the store client (and the units
        # hosted on the workers) installed.
        stack = contextlib.ExitStack()
        stack.enter_context(receive_pool.suspended())
        client.run(_suspend_receive_pool, 1, workers=workers)
        stack.callback(client.run, _suspend_receive_pool, -1, workers=workers)
        warm = put_all()
        _check(frames, get_all(warm))
        numbers = []
        t0 = time.perf_counter()
        for _ in range(calls):
            numbers.append(put_all())
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for n in numbers:
            got = get_all(n)
        get_s = time.perf_counter() - t0
        _check(frames, got)
    finally:
        stack.close()
        del sinks
        client.cancel(futures, force=True)  # the sinks and what they kept go now
    return {"put_bytes_per_s": nbytes * calls / put_s, "get_bytes_per_s": nbytes * calls / get_s}


def _suspend_receive_pool(by: int) -> None:
    """On a worker: open (``by=1``) or close (``by=-1``) a :func:`receive_pool.suspended` block."""
    from pipeline.process_state import process_state
    from pipeline.store.receive_pool import ReceivePool

    process_state().get(ReceivePool).suspend(by)


def _check(sent: list[list[tuple]], got: list[list[tuple]]) -> None:
    """Every frame read back equals the one put (bit-exact), else ``RuntimeError``."""
    for p, (want_part, got_part) in enumerate(zip(sent, got)):
        for want, have in zip(want_part, got_part):
            if len(want) != len(have) or not all(np.array_equal(a, b) for a, b in zip(want, have)):
                raise RuntimeError(f"bare actor ceiling: worker {p} answered frames that differ from what was put")
