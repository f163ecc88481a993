"""Failure injection for the cut and generation paths: a clock and a store that break on cue.

:class:`ManualClock` moves only when told; :class:`FaultyStore` wraps a real store and
refuses, raises, drops acks, pauses or interrupts chosen puts per its :class:`FaultRules`.
Tests and benchmarks use these instead of mocking Dask; both pickle, so actors can be
built on them. Times in seconds; puts are counted from 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tasks.keys import STAGING_PARTITION
from tasks.packed import PackedBatch

if TYPE_CHECKING:
    from ..generation.cut import CutStore
    from ..store.protocol import StoreResult


class ManualClock:
    """A clock (seconds) that moves only when told: ``clock.advance(dt)``. Picklable."""

    def __init__(self, start: float = 1_000.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += float(seconds)
        return self.t


class InjectedStoreError(RuntimeError):
    """Raised by :class:`FaultyStore` where its rules say a put fails outright."""


@dataclass
class FaultRules:
    """What a :class:`FaultyStore` breaks. Keys match by substring; puts count from 1.

    fail_keys: put_many refuses these keys (reason ``injected_fault``) and writes the rest,
        like a store that rejects single rows.
    raise_on_puts: these puts raise :class:`InjectedStoreError` before writing anything.
    drop_ack_keys: written, but missing from the put's acknowledgement (a lost ack).
    interrupt_after_put: after this put is applied, raise ``asyncio.CancelledError``
        (an interruption: rows written that no call has received).
    advance_after_put: {put number: seconds}: advance ``clock`` once that put is applied.
    pause_put / event_prefix: before applying that put, set the ``distributed.Event``
        ``{prefix}-started`` and wait (up to ``pause_timeout_s``) for ``{prefix}-release``.
    """

    fail_keys: tuple[str, ...] = ()
    raise_on_puts: tuple[int, ...] = ()
    drop_ack_keys: tuple[str, ...] = ()
    interrupt_after_put: int | None = None
    advance_after_put: dict[int, float] = field(default_factory=dict)
    pause_put: int | None = None
    event_prefix: str = "faulty-store"
    pause_timeout_s: float = 30.0


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(p in key for p in patterns)


class FaultyStore:
    """A store wrapper that breaks chosen puts (see :class:`FaultRules`); picklable.

    Everything else is passed through to the wrapped store. ``clock`` is the clock the
    rules advance; a :class:`~pipeline.generation.worker.GenerationWorker` built on this
    store uses it when given no clock of its own. ``puts`` / ``deletes`` record each
    call's keys (in this process's copy).
    """

    def __init__(self, store: CutStore, rules: FaultRules | None = None, clock: ManualClock | None = None):
        self.store = store
        self.rules = rules or FaultRules()
        self.clock = clock
        self.puts: list[list[str]] = []
        self.deletes: list[list[str]] = []

    def put_many(self, batch: PackedBatch, partition: str = STAGING_PARTITION, adopt: bool = False) -> StoreResult:
        r = self.rules
        self.puts.append(list(batch.keys))
        n = len(self.puts)
        if r.pause_put == n:
            from distributed import Event

            Event(f"{r.event_prefix}-started").set()
            if not Event(f"{r.event_prefix}-release").wait(timeout=r.pause_timeout_s):
                raise InjectedStoreError(f"put {n}: pause was never released")
        if n in r.raise_on_puts:
            raise InjectedStoreError(f"put {n} failed (injected)")
        refused = [i for i, k in enumerate(batch.keys) if _matches(k, r.fail_keys)]
        if refused:
            keep = np.setdiff1d(np.arange(len(batch)), refused)
            if len(keep):
                result = self.store.put_many(batch.take(keep), partition=partition, adopt=True)
            else:
                from ..store.protocol import StoreResult

                result = StoreResult()
            for i in refused:
                result.failed[batch.keys[i]] = ("injected_fault", f"put {n} refuses {batch.keys[i]!r}")
        else:
            result = self.store.put_many(batch, partition=partition, adopt=adopt)
        if r.drop_ack_keys:
            result.ok = [k for k in result.ok if not _matches(k, r.drop_ack_keys)]
        if n in r.advance_after_put and self.clock is not None:
            self.clock.advance(r.advance_after_put[n])
        if r.interrupt_after_put == n:
            import asyncio

            raise asyncio.CancelledError(f"cut interrupted after put {n}")
        return result

    def delete(self, keys: Sequence[str], partition: str = STAGING_PARTITION) -> object:
        self.deletes.append(list(keys))
        return self.store.delete(keys, partition=partition)

    def __getattr__(self, name: str) -> object:
        if name in ("store", "rules", "clock", "puts", "deletes"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.store, name)
