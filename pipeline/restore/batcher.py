"""PrefixReadBatcher: the Dask actor that serves restore reads on one generation worker.

Its methods are ``async`` (the worker's event loop, not the actor thread the generation
worker's decoding uses); concurrent reads merge in one PrefixReadCoalescer over the
store's ``cut`` partition, and verification runs in a thread off the loop.

    batchers = start_batchers(client, store)        # {worker address: actor}
    verdict = batchers[addr].restore(ack).result()   # PrefixVerdict: usable, or a reason
    verdict = await local_batcher(handle).restore(ack)  # on the batcher's own worker: in-process

Usage and statistics: docs/design.md, "Restore".
"""
from __future__ import annotations

import asyncio
import bisect
import functools
import time
import uuid
from typing import Any, Callable, Sequence

from tasks import reasons
from tasks.keys import CUT_PARTITION, primary_unit, rollout_of_key
from tasks.placement_hash import default_unit_ids
from tasks.packed import PackedBatch
from tasks.cut.prefix import Continuation, PrefixVerdict, verify_prefix

from .. import config, events
from ..actors import current_workers, local_instance, start_pinned_actors
from ..store.placement import Placement
from ..store.protocol import AsyncStoreLike
from .coalescer import PrefixReadCoalescer, PrefixReadError



class PrefixReadBatcher:
    """Dask actor: coalesced prefix reads and prefix verification for one worker.

    ``store`` is a :class:`~pipeline.store.client.StagingStore` (anything with
    ``get_many_async(keys, fields, partition=, timeout=)``). Coalescer knobs left ``None`` are read
    from ``token-capture.restore.*`` when used. ``vocab_size``/``num_experts``/
    ``routes_shape`` are the defaults for verification (``None``: not checked).
    """

    def __init__(
        self,
        store: AsyncStoreLike,
        partition: str = CUT_PARTITION,
        fields: Sequence[str] | None = None,
        *,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        window_ms: float | None = None,
        max_concurrent: int | None = None,
        timeout_s: float | None = None,
        eager_inflight: int | None = None,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        routes_shape: tuple[int, int] | None = None,
        name: str | None = None,
    ):
        self.store = store
        self.partition = partition
        self.fields = None if fields is None else list(fields)
        self._knobs = dict(
            batch_size=batch_size, max_tokens=max_tokens, window_ms=window_ms,
            max_concurrent=max_concurrent, timeout_s=timeout_s, eager_inflight=eager_inflight,
        )
        self._verify_kw = dict(vocab_size=vocab_size, num_experts=num_experts, routes_shape=routes_shape)
        self._name = name
        self._coalescer: PrefixReadCoalescer | None = None
        self._verdicts: dict[str, int] = {}  # "ok" or reason -> count
        self._next_publish = 0.0  # time.monotonic() after which the next read publishes
        self._publish_interval_s = float(config.get("restore.publish-interval-s"))  # read once
        # Request latency histogram since start (published in RESTORE events): upper bounds
        # in seconds (metrics.buckets-seconds), one count per bucket plus +Inf, sum in s.
        self._lat_bounds = [float(b) for b in config.get("metrics.buckets-seconds")]
        self._lat_counts = [0] * (len(self._lat_bounds) + 1)
        self._lat_sum_s = 0.0

    @property
    def name(self) -> str:
        if self._name is None:
            self._name = events.host_name("local")
        return self._name

    def _co(self) -> PrefixReadCoalescer:
        # Built on first use, inside the event loop that serves the actor's async methods.
        if self._coalescer is None:
            # The store call is bounded by get-timeout-s (a hung unit fails its keys
            # unit_unavailable, after trying a replica): no second timer around it.
            self._coalescer = PrefixReadCoalescer(self._get_many, **self._knobs, bounded=True, group=unit_grouping(self.store))
        return self._coalescer

    async def _get_many(self, keys: list[str], timeout_s: float) -> Any:
        return await self.store.get_many_async(keys, self.fields, partition=self.partition, timeout=timeout_s)

    # ---- reads ----------------------------------------------------------------------

    async def read(self, keys: Sequence[str], tokens: Any = None) -> PackedBatch:
        """Rows of ``keys`` in that order (see :meth:`PrefixReadCoalescer.read`).

        Raises :class:`~pipeline.restore.coalescer.PrefixReadError` naming unreadable keys.
        """
        try:
            return await self._timed_read(keys, tokens)
        finally:
            self._maybe_publish()

    async def _timed_read(self, keys: Sequence[str], tokens: Any) -> PackedBatch:
        """The coalescer's read, its latency counted in the histogram (as the coalescer
        counts it: answered or failed requests for keys, not cancelled ones)."""
        t0 = time.perf_counter()
        try:
            out = await self._co().read(keys, tokens)
        except PrefixReadError:
            self._observe_latency(time.perf_counter() - t0)
            raise
        if len(keys):
            self._observe_latency(time.perf_counter() - t0)
        return out

    def _observe_latency(self, seconds: float) -> None:
        self._lat_counts[bisect.bisect_left(self._lat_bounds, seconds)] += 1
        self._lat_sum_s += seconds

    async def restore(self, continuation: Any, **verify_kw: Any) -> PrefixVerdict:
        """Read and verify one call's prefix; a :class:`~tasks.cut.prefix.PrefixVerdict`.

        ``continuation`` is the cut receipt's ``CallAck`` (or a dict with ``staging_keys``,
        ``prefix_tokens``, ``prefix_digest``). Never raises for bad data: an unreadable or
        unusable prefix is a verdict with a reason, and the call regenerates.
        ``verify_kw`` overrides ``vocab_size``/``num_experts``/``routes_shape``.
        """
        try:
            verdict = await self._restore(continuation, {**self._verify_kw, **verify_kw})
            key = "ok" if verdict.usable else str(verdict.reason)
            self._verdicts[key] = self._verdicts.get(key, 0) + 1  # counted before it is published
        finally:
            self._maybe_publish()
        return verdict

    async def restore_many(self, continuations: Sequence[Any], **verify_kw: Any) -> list[PrefixVerdict]:
        """:meth:`restore` of each continuation, concurrently (their reads coalesce)."""
        return list(await asyncio.gather(*(self.restore(c, **verify_kw) for c in continuations)))

    async def _restore(self, continuation: Any, verify_kw: dict) -> PrefixVerdict:
        try:
            cont = Continuation.of(continuation)
        except ValueError:
            return verify_prefix(PackedBatch([], {}), continuation)  # the verifier names it
        if not cont.keys:
            return verify_prefix(PackedBatch([], {}), cont)
        try:
            rows = await self._timed_read(list(cont.keys), cont.prefix_tokens)
        except PrefixReadError as e:
            key, (why, detail) = next(iter(e.failed.items()))
            more = f" (+{len(e.failed) - 1} more keys)" if len(e.failed) > 1 else ""
            return PrefixVerdict.unusable(reasons.MISSING_STAGING_ROW, f"{key!r}: {why}: {detail}{more}")
        except (TypeError, ValueError) as e:
            return PrefixVerdict.unusable("invalid_continuation", str(e))
        # Hashing a long prefix takes milliseconds: keep it off the worker's event loop
        # (hashlib releases the GIL on large buffers).
        return await asyncio.to_thread(verify_prefix, rows, cont, **verify_kw)

    # ---- introspection --------------------------------------------------------------

    async def stats(self) -> dict:
        """Coalescer counters (``p50_ms``/``p99_ms`` request latency in ms) and verdicts."""
        out = self._co().stats.summary()
        out.update(worker=self.name, verdicts=dict(self._verdicts), inflight=self._co().inflight, queued=self._co().queued,
                   decision=self._co().dispatch_state().decide().value)
        return out

    async def close(self) -> None:
        """Fail pending reads (``closed``) and stop gets in flight."""
        if self._coalescer is not None:
            await self._coalescer.close()

    def _maybe_publish(self) -> None:
        now = time.monotonic()
        if now < self._next_publish:
            return
        self._next_publish = now + self._publish_interval_s
        s = self._co().stats.summary()
        failures = {k: v for k, v in self._verdicts.items() if k != "ok"}
        events.publish(
            events.RESTORE,
            {
                "worker": self.name,
                "requests": s["requests"],
                "gets": s["gets"],
                "keys": s["keys_fetched"],
                "keys_per_get": s["keys_per_get"],
                "p50_ms": s["p50_ms"],
                "p99_ms": s["p99_ms"],
                "failures": failures,
                "latency_bounds_s": list(self._lat_bounds),
                "latency_counts": list(self._lat_counts),
                "latency_sum_s": self._lat_sum_s,
            },
        )


def unit_grouping(store: AsyncStoreLike) -> Callable[[str], int] | None:
    """``key -> storage unit`` (its primary) for a store with ``units``, by its
    current placement's unit ids (default ids without one), else None. Cached per
    rollout id and ids: a rollout's keys share their unit.

    Coalesced gets then stay within one unit: the store answers such a get with the
    unit's own batch, no cross-unit merge copy, and units serve their gets in parallel.
    """
    units = getattr(store, "units", None)
    if not units:
        return None
    default = default_unit_ids(len(units))
    of_rollout = functools.lru_cache(maxsize=1 << 14)(primary_unit)

    def group(key: str) -> int:
        placement = getattr(store, "placement", None)  # the handle's current table
        return of_rollout(rollout_of_key(key), placement.unit_ids if isinstance(placement, Placement) else default)

    return group


def local_batcher(handle: Any) -> Any:
    """The :class:`PrefixReadBatcher` itself when ``handle``'s actor lives in this worker
    process, else ``handle``: a generation worker then calls its own worker's batcher
    in-process (no loopback round trip, no serialization of the rows), as distributed does
    for actor-to-actor calls on one worker. Await its async methods either way, from a
    coroutine on the worker's event loop (an async actor method)."""
    instance = local_instance(handle)  # None off its worker (the driver, a test)
    return handle if instance is None else instance


def start_batchers(client: Any, store: AsyncStoreLike, workers: Sequence[str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """One :class:`PrefixReadBatcher` actor on each worker (default: every worker now).

    Returns ``{worker address: actor handle}``; ``kwargs`` go to the constructor.
    """
    workers = current_workers(client) if workers is None else list(workers)
    # A fresh tag per call: a key reused (e.g. a later store at the same id()) could hand
    # back a batcher closed earlier whose release has not reached the scheduler yet.
    tag = uuid.uuid4().hex[:12]
    keys = [f"PrefixReadBatcher-{addr}-{tag}" for addr in workers]
    # Verdicts carry prefix arrays: the handles talk to their worker directly.
    actors, _ = start_pinned_actors(client, PrefixReadBatcher, workers, args=[(store,)] * len(workers), keys=keys, **kwargs)
    return dict(zip(workers, actors))
