"""Coalesced prefix reads: the pure-asyncio core of the PrefixReadBatcher.

:class:`PrefixReadCoalescer` merges the keys of concurrent ``read(keys)`` requests into
few deduplicated ``get_many`` calls, each at most ``batch_size`` keys and ``max_tokens``
tokens within one group (storage unit), at most ``max_concurrent`` at once, each bounded
by ``timeout_s`` seconds; a failure fails only the keys (and requests) it concerns. When
queued keys go (at once under light load, after a window or a free slot under load) is
:meth:`~pipeline.restore.dispatch.DispatchState.decide`'s call. No Dask here (knobs come
from ``dask.config``): ``get_many`` is any async ``(keys) -> GetResult``-like callable.
"""
from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Coroutine, Hashable, NamedTuple, Sequence

import numpy as np

from tasks.errors import PrefixReadError
from tasks.packed import PackedBatch, align_fields, take_rows

from .. import config
from ..store.protocol import ABSENT_FIELD
from .answer import GetAnswer
from .dispatch import Action, DispatchState
from .pending import PendingKey, PendingQueue, ReadRequest, notify, token_hints

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

GetMany = Callable[..., Awaitable[Any]]  # (keys) -> GetResult; bounded: (keys, timeout_s)
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


class Knobs(NamedTuple):
    """The coalescer's knobs at one moment (``window_s``/``timeout_s`` in seconds); a
    tuple: it is built on every request."""

    batch_size: int  # keys per get
    max_tokens: int  # tokens per get
    window_s: float
    max_concurrent: int  # gets in flight
    timeout_s: float
    eager_inflight: int  # below this many gets in flight a request is issued at once


@dataclass
class CoalescerStats:
    """Counters (counts; ``latencies_ms`` in milliseconds) since the coalescer started."""

    requests: int = 0
    keys_requested: int = 0  # sum over requests of their distinct keys
    keys_deduplicated: int = 0  # keys that joined an already pending or in-flight read
    gets: int = 0  # get_many calls, solo re-reads included
    keys_fetched: int = 0  # keys over all get_many calls
    immediate_gets: int = 0  # issued as their request arrived (light load: no window, no slot wait)
    window_waits: int = 0  # coalescing windows opened (loaded: eager-inflight gets or more in flight)
    slot_waits: int = 0  # times the queue waited for a free slot (saturated: max-concurrent-gets in flight)
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
    ``timeout_s`` in seconds, ``max_tokens`` in tokens, ``eager_inflight`` in gets: below
    it a request is issued at once, see :mod:`~pipeline.restore.dispatch`). ``bounded``:
    ``get_many(keys, timeout_s)`` enforces the timeout itself (the batcher's store call
    does), so the coalescer sets no timer of its own per get (on a busy worker loop one
    costs ~50 us, ~2% of a light-load read). ``timer`` replaces ``loop.call_later`` for
    the window (tests drive it by hand). ``group(key)`` (e.g. the key's storage unit)
    keeps each get within one group; groups take turns.
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
        eager_inflight: int | None = None,
        bounded: bool = False,
        timer: Timer | None = None,
        group: Callable[[str], Hashable] | None = None,
        latency_samples: int = 4096,
    ) -> None:
        self._get_many = get_many
        self._bounded = bounded
        self._group = group
        self._overrides = {
            "batch-size": batch_size,
            "max-tokens": max_tokens,
            "window-ms": window_ms,
            "max-concurrent-gets": max_concurrent,
            "get-timeout-s": timeout_s,
            "eager-inflight": eager_inflight,
        }
        for name, value in self._overrides.items():
            # eager-inflight 0 is meaningful: never issue at once, always coalesce.
            if value is not None and not (value >= 0 if name == "eager-inflight" else value > 0):
                raise ValueError(f"restore {name} must be {'>= 0' if name == 'eager-inflight' else '> 0'}, got {value!r}")
        self._loop = asyncio.get_running_loop()
        self._timer: Timer = timer or self._loop.call_later
        self._entries: dict[str, PendingKey] = {}  # every pending or in-flight key
        self._queue = PendingQueue()  # keys not yet issued
        self._inflight = 0
        self._window: Any = None  # timer handle while a window is open
        self._waited = False  # queued keys have waited (window over, or slots full): issue at the next free slot
        self._immediate_scheduled = False  # an arriving request takes the queue after one loop turn
        self._turn_busy = False  # a request arrived in this loop turn already (cleared by the next turn)
        self._owners: dict[asyncio.Task, ReadRequest | None] = {}  # requests' tasks running a get themselves
        self._closing: set[asyncio.Task] = set()  # owner tasks close() cancelled
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.stats = CoalescerStats(latencies_ms=collections.deque(maxlen=latency_samples))

    # ---- knobs (read at call time) ------------------------------------------------------

    def knobs(self) -> Knobs:
        """Every knob as it stands now: overrides, else ``token-capture.restore.*`` (one
        config read for all of them: a request's path reads them a few times)."""
        c = config.get("restore")
        v = {name: c[name] if over is None else over for name, over in self._overrides.items()}
        return Knobs(
            int(v["batch-size"]), int(v["max-tokens"]), float(v["window-ms"]) / 1000.0,
            int(v["max-concurrent-gets"]), float(v["get-timeout-s"]), int(v["eager-inflight"]),
        )

    @property
    def batch_size(self) -> int:
        return self.knobs().batch_size

    @property
    def max_tokens(self) -> int:
        return self.knobs().max_tokens

    @property
    def window_s(self) -> float:
        return self.knobs().window_s

    @property
    def max_concurrent(self) -> int:
        return self.knobs().max_concurrent

    @property
    def timeout_s(self) -> float:
        return self.knobs().timeout_s

    @property
    def eager_inflight(self) -> int:
        return self.knobs().eager_inflight

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
        # The first request of this loop turn, nothing queued, and it fits one get that
        # decide() issues now: it issues the get itself, as a per-request get would.
        # Later arrivals of the same turn share the next get.
        alone = self._alone(keys, hints)
        if not self._turn_busy:
            self._turn_busy = True
            self._loop.call_soon(self._end_turn)
        if alone is not None:
            try:
                return await self._read_alone(keys, *alone)
            finally:
                self.stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)
        mine: dict[str, PendingKey] = {}
        req = ReadRequest(self._loop)
        n_added = 0
        for k, t in zip(keys, hints):
            if k in mine:
                continue
            e = self._entries.get(k)
            if e is None:
                e = PendingKey(self._loop.create_future(), t, self._group_of(k))
                self._entries[k] = e
                self._queue.add(k, e)
                n_added += 1
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
        owner = self._dispatch(arrival=True) if n_added else None
        if req.pending or owner is not None:
            try:
                if owner is not None:
                    await self._run_owned(req, owner)
                if req.pending:
                    # Only this request's own waiter is awaited (and cancelled with it): the
                    # shared futures and the gets behind them run on for the other requesters.
                    await req.waiter
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task not in self._closing:
                    self.stats.cancelled_requests += 1
                    for e in mine.values():
                        if req in e.waiting:
                            e.waiting.remove(req)
                    self._release(mine)
                    self._dispatch()  # keys this request's get carried for others go again
                    raise
                # close() stopped the get this request ran: its keys failed "closed" (below).
                self._closing.discard(task)
                if hasattr(task, "uncancel"):  # Python >= 3.11: the caller sees no cancellation
                    task.uncancel()
                if req.pending:
                    await req.waiter
        self._release(mine)
        try:
            return self._assemble(keys, mine)
        except PrefixReadError:
            self.stats.failed_requests += 1
            raise
        finally:
            self.stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)

    def _alone(self, keys: list[str], hints: list[int]) -> tuple[list[str], Knobs] | None:
        """(distinct keys, knobs) when this is the loop turn's first request, nothing is
        queued and :meth:`DispatchState.decide` issues ``keys`` now, in one get (one group,
        within the limits); else None (the request goes through the queue)."""
        if self._turn_busy or self._queue or self._immediate_scheduled or self._closed:
            return None
        k = self.knobs()
        distinct = keys if len(keys) == 1 else list(dict.fromkeys(keys))
        n = len(distinct)
        tokens = sum(hints) if n == len(keys) else sum(dict(zip(keys, hints)).values())
        state = DispatchState(queued=n, inflight=self._inflight, max_concurrent=k.max_concurrent,
                              eager_inflight=k.eager_inflight, queue_full=n >= k.batch_size or tokens >= k.max_tokens)
        if state.decide() is not Action.ISSUE or n > k.batch_size or (n > 1 and tokens > k.max_tokens):
            return None
        if self._entries and any(x in self._entries for x in distinct):
            return None  # it joins a read in flight instead
        if n > 1 and self._group is not None and len({self._group_of(x) for x in distinct}) > 1:
            return None
        return distinct, k

    async def _read_alone(self, keys: list[str], distinct: list[str], k: Knobs) -> PackedBatch:
        """A request's own get (see :meth:`_alone`), with none of the shared bookkeeping:
        its keys stay private (a request arriving meanwhile for one of them reads it
        again: restores rarely share keys), so cancelling it cancels only its own get.
        Failures are handled exactly as for a shared get (:meth:`_deliver`,
        :meth:`_reread_alone`)."""
        self.stats.keys_requested += len(distinct)
        self.stats.immediate_gets += 1
        self._inflight += 1
        self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
        task = asyncio.current_task()
        self._owners[task] = None
        mine: dict[str, PendingKey] = {}
        try:
            try:
                result = await self._get(distinct, k.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - per key below, as for a shared get
                self.stats.failed_gets += 1
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                mine = self._private(distinct)
                if len(distinct) == 1:
                    self._fail(list(mine.items()), *_failure_of(exc, k.timeout_s))
                else:
                    await self._reread_alone(list(mine.items()), k.timeout_s)
            else:
                if not result.failed and result.batch.keys == keys:
                    return result.batch  # the usual case: exactly the rows asked for, in order
                mine = self._private(distinct)
                self._deliver(list(mine.items()), result)
        except asyncio.CancelledError:
            if task not in self._closing:
                self.stats.cancelled_requests += 1
                raise
            self._closing.discard(task)  # close() stopped it: answer "closed", not cancelled
            if hasattr(task, "uncancel"):
                task.uncancel()
            mine = self._private(distinct)
            self._fail(list(mine.items()), "closed", "the prefix read coalescer was closed during the get")
        finally:
            self._owners.pop(task, None)
            self._inflight -= 1
            self._dispatch()
        try:
            return self._assemble(keys, mine)
        except PrefixReadError:
            self.stats.failed_requests += 1
            raise

    def _private(self, keys: list[str]) -> dict[str, PendingKey]:
        """Entries for keys nobody else shares (never registered, never queued)."""
        return {key: PendingKey(self._loop.create_future(), 0, None, refs=1, issued=True) for key in keys}

    def _end_turn(self) -> None:
        self._turn_busy = False

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

    def dispatch_state(self, k: Knobs | None = None) -> DispatchState:
        """The load :meth:`DispatchState.decide` judges (knobs ``k``, default: read now)."""
        k = k or self.knobs()
        return DispatchState(
            queued=len(self._queue),
            inflight=self._inflight,
            max_concurrent=k.max_concurrent,
            eager_inflight=k.eager_inflight,
            queue_full=self._queue.full(k.batch_size, k.max_tokens),
            window_open=self._window is not None,
            waited=self._waited,
        )

    def _dispatch(self, *, arrival: bool = False) -> Knobs | None:
        """Act on the dispatch decision for the queue as it is now (after an arrival, a
        window's end or a finished get). Knobs (not None): the arriving request runs the
        next get itself with them (:meth:`_run_owned`; its slot is reserved now)."""
        if self._closed or self._immediate_scheduled or not self._queue:
            return None  # closed, or an arriving request takes the queue this turn, or idle
        k = self.knobs()
        action = self.dispatch_state(k).decide()
        if action is Action.ISSUE:
            if arrival:
                # The request's own task runs the get (no task to start, no wake-up turn
                # for its answer), one loop turn from now: same-turn arrivals share it.
                self._immediate_scheduled = True
                self._inflight += 1
                return k
            self._issue(k)
        elif action is Action.OPEN_WINDOW:
            self.stats.window_waits += 1
            self._window = self._timer(k.window_s, self._on_window)
        elif action is Action.WAIT_SLOT and not self._waited:
            self.stats.slot_waits += 1
            self._waited = True  # it coalesces while it waits: no window once a slot frees
        return None

    async def _run_owned(self, req: ReadRequest, k: Knobs) -> None:
        """An arriving request runs the queue's next get (its reserved slot) in its own
        task, one loop turn from now (same-turn arrivals join), with knobs ``k``.

        Cancelled mid-get, it hands the get's keys back to the queue, so requests that
        joined them are re-read, never failed (:meth:`_run_get`)."""
        try:
            await asyncio.sleep(0)  # same-turn arrivals join the queue it is about to take
        except asyncio.CancelledError:
            self._immediate_scheduled = False
            self._inflight -= 1
            raise
        self._immediate_scheduled = False
        batch = self._next_batch(k) if self._queue and not self._closed else []
        if not batch:  # every requester cancelled already, or closed
            self._inflight -= 1
            self._dispatch()
            return
        self.stats.immediate_gets += 1
        self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
        self._issue(k, immediate=True)  # what the same turn queued beyond one get
        task = asyncio.current_task()
        self._owners[task] = req
        try:
            await self._run_get(batch, k, owner=req)
        finally:
            self._owners.pop(task, None)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_window(self) -> None:
        self._window = None
        self._waited = True
        self._dispatch()

    def _close_window(self) -> None:
        if self._window is not None:
            self._window.cancel()
            self._window = None
        self._waited = False

    def _issue(self, k: Knobs, *, immediate: bool = False) -> None:
        """Issue the queued keys as gets while slots are free (the decision was ISSUE)."""
        if self._closed:
            return
        while self._queue and self._inflight < k.max_concurrent:
            batch = self._next_batch(k)
            if not batch:
                continue
            self._inflight += 1
            self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
            if immediate:
                self.stats.immediate_gets += 1
            self._spawn(self._run_get(batch, k))
        if self._queue:
            if not self._waited:
                self.stats.slot_waits += 1
            self._waited = True  # slots are full: the rest goes at the next free slot
        else:
            self._close_window()

    def _next_batch(self, k: Knobs) -> list[tuple[str, PendingKey]]:
        """Queued keys of one group in arrival order, up to batch_size keys and max_tokens."""
        batch = self._queue.pop_batch(k.batch_size, k.max_tokens)
        for _, e in batch:
            e.issued = True
        return batch

    # ---- gets ---------------------------------------------------------------------------

    async def _get(self, keys: list[str], timeout_s: float) -> Any:
        self.stats.gets += 1
        self.stats.keys_fetched += len(keys)
        if self._bounded:
            result = await self._get_many(list(keys), timeout_s)
        elif _timeout is not None:  # no extra task around the get (wait_for makes one)
            async with _timeout(timeout_s):
                result = await self._get_many(list(keys))
        else:
            result = await asyncio.wait_for(self._get_many(list(keys)), timeout_s)
        return _checked(result)

    async def _run_get(self, batch: list[tuple[str, PendingKey]], k: Knobs, owner: ReadRequest | None = None) -> None:
        """One get for ``batch``, its answer delivered to every request waiting on its keys.
        ``owner``: the request whose own task runs it (see :meth:`_run_owned`)."""
        keys = [key for key, _ in batch]
        handed_over = False
        try:
            try:
                result = await self._get(keys, k.timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a shared get is per key below
                self.stats.failed_gets += 1
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                if len(keys) == 1:
                    self._fail(batch, *_failure_of(exc, k.timeout_s))
                else:
                    await self._reread_alone(batch, k.timeout_s)
            else:
                self._deliver(batch, result)
        except asyncio.CancelledError:
            if owner is not None and not self._closed:
                # Its owner was cancelled, not the coalescer: the keys go back to the queue;
                # the owner's release drops those nobody else holds, then dispatches.
                handed_over = True
                for key, e in batch:
                    if not e.future.done():
                        e.issued = False
                        self._queue.add(key, e)
            else:
                self._fail(batch, "closed", "the prefix read coalescer was closed during the get")
            raise
        finally:
            for key, e in batch:
                if e.issued and self._entries.get(key) is e:
                    del self._entries[key]
            self._inflight -= 1
            if not handed_over:
                self._dispatch()

    async def _reread_alone(self, batch: list[tuple[str, PendingKey]], timeout_s: float) -> None:
        """Each key of a failed batch once, on its own, so a bad row fails only its requesters.

        The solo gets run concurrently (each under ``get-timeout-s``) inside the failed
        batch's slot: an outage costs N + 1 gets and at most twice the timeout.
        """
        self.stats.solo_rereads += len(batch)

        async def one(k: str, e: PendingKey) -> None:
            try:
                result = await self._get([k], timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                self.stats.failed_gets += 1
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                self._fail([(k, e)], *_failure_of(exc, timeout_s))
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
                e.future.exception()  # seen: every requester may be gone (cancelled) already
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
        # Requests running a get themselves: stop it; they answer "closed" (see read).
        for t in list(self._owners):
            self._closing.add(t)
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _checked(result: Any) -> Any:
    """``result`` if it is a GetResult (``batch``, ``failed``), else ``TypeError``."""
    if not isinstance(getattr(result, "batch", None), PackedBatch) or not isinstance(getattr(result, "failed", None), dict):
        raise TypeError(f"get_many returned {type(result).__name__}, expected a GetResult (batch, failed)")
    return result


def _failure_of(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    if isinstance(exc, asyncio.TimeoutError):
        return "read_timeout", f"get ran past get-timeout-s ({timeout_s} s)"
    return "read_failed", f"{type(exc).__name__}: {exc}"
