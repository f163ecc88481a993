"""Coalesced prefix reads: the pure-asyncio core of the PrefixReadBatcher.

:class:`PrefixReadCoalescer` merges the keys of concurrent ``read(keys)`` requests into
few deduplicated ``get_many`` calls, each at most ``batch_size`` keys and ``max_tokens``
tokens within one group (storage unit), at most ``max_concurrent`` at once, each bounded
by ``timeout_s`` seconds; a failure fails only the keys (and requests) it concerns. No
Dask here (knobs come from ``dask.config``): ``get_many`` is any async ``(keys) -> GetResult``-like callable.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Hashable, Sequence

import numpy as np

from tasks.errors import PrefixReadError
from tasks.packed import PackedBatch, align_fields, take_rows

from .. import config
from ..store.protocol import ABSENT_FIELD
from .answer import GetAnswer
from .pending import PendingKey, PendingQueue, ReadRequest, consume_exception, notify, token_hints

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

GetMany = Callable[[list[str]], Awaitable[Any]]
Timer = Callable[[float, Callable[[], None]], Any]  # (delay seconds, callback) -> handle with .cancel()

# Store reasons for which the row is still served (e.g. a row without routed_experts):
# the prefix verifier decides whether the missing field matters.
SERVED_REASONS = frozenset({ABSENT_FIELD})


class _KeyFailure(Exception):
    """Internal: one key's failure, carried on its shared future."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


@dataclass
class CoalescerStats:
    """Counters (counts; ``latencies_ms`` in milliseconds) since the coalescer started."""

    requests: int = 0
    keys_requested: int = 0  # sum over requests of their distinct keys
    keys_deduplicated: int = 0  # keys that joined an already pending or in-flight read
    gets: int = 0  # get_many calls, solo re-reads included
    keys_fetched: int = 0  # keys over all get_many calls
    immediate_gets: int = 0  # issued without a window wait (nothing else pending)
    window_waits: int = 0  # coalescing windows opened
    failed_gets: int = 0  # multi- or single-key gets that raised or timed out
    timeouts: int = 0
    solo_rereads: int = 0
    failed_keys: int = 0
    failed_requests: int = 0
    cancelled_requests: int = 0
    dropped_keys: int = 0  # queued keys dropped because every requester cancelled
    max_inflight: int = 0
    latencies_ms: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))

    def summary(self) -> dict[str, Any]:
        """Flat numbers for events and benchmarks (``*_ms`` in milliseconds)."""
        lat = np.fromiter(self.latencies_ms, dtype=np.float64)
        out = {k: v for k, v in self.__dict__.items() if k != "latencies_ms"}
        out["keys_per_get"] = self.keys_fetched / self.gets if self.gets else 0.0
        out["p50_ms"] = float(np.percentile(lat, 50)) if lat.size else 0.0
        out["p99_ms"] = float(np.percentile(lat, 99)) if lat.size else 0.0
        return out


class PrefixReadCoalescer:
    """Merge concurrent ``read(keys)`` requests into bounded, deduplicated ``get_many`` calls.

    Create it inside the event loop that will use it. Knobs left ``None`` are read from
    ``token-capture.restore.*`` each time they are used (``window_ms`` in ms,
    ``timeout_s`` in seconds, ``max_tokens`` in tokens). ``timer`` replaces
    ``loop.call_later`` for the window (tests drive it by hand). ``group(key)`` (e.g. the
    key's storage unit) keeps each get within one group; groups take turns.
    """

    def __init__(
        self,
        get_many: GetMany,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        window_ms: float | None = None,
        max_concurrent: int | None = None,
        timeout_s: float | None = None,
        *,
        timer: Timer | None = None,
        group: Callable[[str], Hashable] | None = None,
        latency_samples: int = 4096,
    ) -> None:
        self._get_many = get_many
        self._group = group
        self._overrides = {
            "batch-size": batch_size,
            "max-tokens": max_tokens,
            "window-ms": window_ms,
            "max-concurrent-gets": max_concurrent,
            "get-timeout-s": timeout_s,
        }
        for name, value in self._overrides.items():
            if value is not None and not value > 0:
                raise ValueError(f"restore {name} must be > 0, got {value!r}")
        self._loop = asyncio.get_running_loop()
        self._timer: Timer = timer or self._loop.call_later
        self._entries: dict[str, PendingKey] = {}  # every pending or in-flight key
        self._queue = PendingQueue()  # keys not yet issued
        self._inflight = 0
        self._window: Any = None  # timer handle while a window is open
        self._window_expired = False  # queued keys have waited their window: issue at the next free slot
        self._immediate_scheduled = False
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.stats = CoalescerStats(latencies_ms=collections.deque(maxlen=latency_samples))

    # ---- knobs (read at call time) ------------------------------------------------------

    def _knob(self, name: str) -> Any:
        v = self._overrides[name]
        return config.get(f"restore.{name}") if v is None else v

    @property
    def batch_size(self) -> int:
        return int(self._knob("batch-size"))

    @property
    def max_tokens(self) -> int:
        return int(self._knob("max-tokens"))

    @property
    def window_s(self) -> float:
        return float(self._knob("window-ms")) / 1000.0

    @property
    def max_concurrent(self) -> int:
        return int(self._knob("max-concurrent-gets"))

    @property
    def timeout_s(self) -> float:
        return float(self._knob("get-timeout-s"))

    @property
    def inflight(self) -> int:
        """Gets running now."""
        return self._inflight

    @property
    def queued(self) -> int:
        """Distinct keys waiting for a get."""
        return len(self._queue)

    # ---- requests -----------------------------------------------------------------------

    async def read(self, keys: Sequence[str], tokens: None | int | Sequence[int] = None) -> PackedBatch:
        """Rows for ``keys``, in that order (duplicates repeated), as one packed batch.

        ``tokens`` is a token-count hint for the ``max_tokens`` limit: one int per key, or
        the request's total (spread evenly over its keys), or ``None`` (keys count 0).
        Raises :class:`PrefixReadError` naming every key that could not be read, and
        ``TypeError``/``ValueError`` for malformed arguments.
        """
        keys = list(keys)
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(f"prefix keys must be str, got {type(k).__name__}: {k!r}")
        if self._closed:
            raise PrefixReadError({k: ("closed", "the prefix read coalescer is closed") for k in keys})
        hints = token_hints(keys, tokens)
        self.stats.requests += 1
        if not keys:
            return PackedBatch([], {})
        t0 = time.perf_counter()
        mine: dict[str, PendingKey] = {}
        req = ReadRequest(self._loop)
        added = False
        for k, t in zip(keys, hints):
            if k in mine:
                continue
            e = self._entries.get(k)
            if e is None:
                e = PendingKey(self._loop.create_future(), t, self._group_of(k))
                # Nobody may be left to look at a failure (all requesters cancelled).
                e.future.add_done_callback(consume_exception)
                self._entries[k] = e
                self._queue.add(k, e)
                added = True
            else:
                self.stats.keys_deduplicated += 1
                if not e.issued and t > e.tokens:
                    self._queue.grow(e, t)
            e.refs += 1
            mine[k] = e
            if not e.future.done():
                e.waiting.append(req)
                req.pending += 1
        self.stats.keys_requested += len(mine)
        if added:
            self._on_arrival()
        if req.pending:
            try:
                # Only this request's own waiter is awaited (and cancelled with it): the
                # shared futures and the gets behind them run on for the other requesters.
                await req.waiter
            except asyncio.CancelledError:
                self.stats.cancelled_requests += 1
                for e in mine.values():
                    if req in e.waiting:
                        e.waiting.remove(req)
                self._release(mine)
                raise
        self._release(mine)
        try:
            return self._assemble(keys, mine)
        except PrefixReadError:
            self.stats.failed_requests += 1
            raise
        finally:
            self.stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)

    def _group_of(self, key: str) -> Hashable:
        if self._group is None:
            return None
        try:
            return self._group(key)
        except Exception:  # noqa: BLE001 - a key the store cannot place fails in its get, not here
            return None

    def _release(self, mine: dict[str, PendingKey]) -> None:
        dropped = False
        for k, e in mine.items():
            e.refs -= 1
            if e.refs <= 0 and not e.issued and not e.future.done():
                # Nobody wants it any more and no get carries it yet: do not read it.
                self._queue.remove(k, e)
                self._entries.pop(k, None)
                e.future.cancel()
                self.stats.dropped_keys += 1
                dropped = True
        if dropped and not self._queue:
            self._close_window()

    # ---- scheduling ---------------------------------------------------------------------

    def _on_arrival(self) -> None:
        if self._immediate_scheduled:
            return  # joins the flush already due this loop turn
        if self._inflight == 0 and self._window is None and not self._window_expired:
            # Nothing to coalesce with: issue on the next loop turn (requests arriving in
            # this same turn still join), never after the window. The get's own task takes
            # its batch on its first step: no extra loop turn in the light-load path.
            self._immediate_scheduled = True
            self._inflight += 1  # the slot is reserved for that task
            self._spawn(self._immediate_get())
            return
        if self._window is None and not self._window_expired:
            self.stats.window_waits += 1
            self._window = self._timer(self.window_s, self._on_window)
        if self._queue_full():
            self._pump(force=True)  # a full batch gains nothing by waiting

    async def _immediate_get(self) -> None:
        self._immediate_scheduled = False
        batch = self._next_batch() if self._queue and not self._closed else []
        if not batch:  # every requester cancelled already, or closed
            self._inflight -= 1
            self._pump()
            return
        self.stats.immediate_gets += 1
        self._pump(force=True, immediate=True)  # what the same turn queued beyond one get
        if self._queue and self._window is None:
            self._window_expired = True  # slots are full: the rest goes at the next free slot
        await self._run_get(batch)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_window(self) -> None:
        self._window = None
        self._window_expired = True
        self._pump()

    def _close_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None
        self._window_expired = False

    def _queue_full(self) -> bool:
        return self._queue.full(self.batch_size, self.max_tokens)

    def _pump(self, *, force: bool = False, immediate: bool = False) -> None:
        """Issue gets while slots are free and the queue may go (window over, or full)."""
        if self._closed:
            return
        max_concurrent = self.max_concurrent
        while self._queue and self._inflight < max_concurrent:
            if not (force or self._window_expired or self._queue_full()):
                break
            batch = self._next_batch()
            if not batch:
                continue
            self._inflight += 1
            self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
            if immediate:
                self.stats.immediate_gets += 1
            self._spawn(self._run_get(batch))
        if not self._queue:
            self._close_window()

    def _next_batch(self) -> list[tuple[str, PendingKey]]:
        """Queued keys of one group in arrival order, up to batch_size keys and max_tokens."""
        batch = self._queue.pop_batch(self.batch_size, self.max_tokens)
        for _, e in batch:
            e.issued = True
        return batch

    # ---- gets ---------------------------------------------------------------------------

    async def _get(self, keys: list[str]) -> Any:
        self.stats.gets += 1
        self.stats.keys_fetched += len(keys)
        if _timeout is not None:  # no extra task around the get (wait_for makes one)
            async with _timeout(self.timeout_s):
                result = await self._get_many(list(keys))
        else:
            result = await asyncio.wait_for(self._get_many(list(keys)), self.timeout_s)
        if not isinstance(getattr(result, "batch", None), PackedBatch) or not isinstance(getattr(result, "failed", None), dict):
            raise TypeError(f"get_many returned {type(result).__name__}, expected a GetResult (batch, failed)")
        return result

    async def _run_get(self, batch: list[tuple[str, PendingKey]]) -> None:
        keys = [k for k, _ in batch]
        try:
            try:
                result = await self._get(keys)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a shared get is per key below
                self.stats.failed_gets += 1
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                if len(keys) == 1:
                    self._fail(batch, *_failure_of(exc, self.timeout_s))
                else:
                    await self._reread_alone(batch)
            else:
                self._deliver(batch, result)
        except asyncio.CancelledError:
            self._fail(batch, "closed", "the prefix read coalescer was closed during the get")
            raise
        finally:
            for k, _ in batch:
                self._entries.pop(k, None)
            self._inflight -= 1
            self._pump()

    async def _reread_alone(self, batch: list[tuple[str, PendingKey]]) -> None:
        """Each key of a failed batch once, on its own, so a bad row fails only its requesters.

        The solo gets run concurrently (each under ``get-timeout-s``) inside the failed
        batch's slot: an outage costs N + 1 gets and at most twice the timeout.
        """
        self.stats.solo_rereads += len(batch)

        async def one(k: str, e: PendingKey) -> None:
            try:
                result = await self._get([k])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.stats.failed_gets += 1
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                self._fail([(k, e)], *_failure_of(exc, self.timeout_s))
            else:
                self._deliver([(k, e)], result)

        await asyncio.gather(*(one(k, e) for k, e in batch))

    def _deliver(self, batch: list[tuple[str, PendingKey]], result: Any) -> None:
        rows = GetAnswer(result.batch)  # sliced by every request it serves: prepared once
        failed: dict = result.failed
        index = {k: i for i, k in enumerate(rows.batch.keys)}
        for k, e in batch:
            if e.future.done():
                continue
            i = index.get(k)
            problem = failed.get(k)
            if problem is not None and not (i is not None and problem[0] in SERVED_REASONS):
                self._fail([(k, e)], str(problem[0]), str(problem[1]))
            elif i is None:
                self._fail([(k, e)], "incomplete_get", "the store returned neither the row nor a failure for it")
            else:
                e.future.set_result((rows, i))
                notify(e)

    def _fail(self, batch: list[tuple[str, PendingKey]], reason: str, detail: str) -> None:
        for _, e in batch:
            if not e.future.done():
                self.stats.failed_keys += 1
                e.future.set_exception(_KeyFailure(reason, detail))
                notify(e)

    # ---- answers ------------------------------------------------------------------------

    def _assemble(self, keys: list[str], mine: dict[str, PendingKey]) -> PackedBatch:
        failed: dict[str, tuple[str, str]] = {}
        for k, e in mine.items():
            exc = e.future.exception()
            if exc is not None:
                failed[k] = (exc.reason, exc.detail) if isinstance(exc, _KeyFailure) else ("read_failed", repr(exc))
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
            # The request's rows sit together in its get's answer (the usual case: a
            # request's keys are queued together): views, no copy.
            return first.slice(lo, lo + len(keys))
        # Rows from several gets (or out of order): one gather copy per field.
        batches: dict[int, int] = {}
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

    # ---- lifecycle ----------------------------------------------------------------------

    async def close(self) -> None:
        """Fail every pending key with ``closed`` and stop the gets in flight."""
        self._closed = True
        self._close_window()
        queued = self._queue.drain()
        self._fail(queued, "closed", "the prefix read coalescer was closed")
        for k, _ in queued:
            self._entries.pop(k, None)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _failure_of(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    if isinstance(exc, asyncio.TimeoutError):
        return "read_timeout", f"get ran past get-timeout-s ({timeout_s} s)"
    return "read_failed", f"{type(exc).__name__}: {exc}"
