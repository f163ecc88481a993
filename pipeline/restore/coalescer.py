"""Coalesced prefix reads: the pure-asyncio core of the PrefixReadBatcher.

:class:`PrefixReadCoalescer` merges the keys of concurrent ``read(keys)`` requests into
few deduplicated ``get_many`` calls, each at most ``batch_size`` keys and ``max_tokens``
tokens within one group (storage unit), at most ``max_concurrent`` at once, each bounded
by ``timeout_s`` seconds; a failure fails only the keys (and requests) it concerns. When
queued keys go (at once under light load, after a window or a free slot under load) is
:meth:`~pipeline.restore.dispatch.DispatchState.decide`'s call; a turn's first request
may run its own get (:mod:`~pipeline.restore.own_get`). The gets and what they settle:
:mod:`~pipeline.restore.getter`; a request's answer: :mod:`~pipeline.restore.assembly`;
the knobs, read once when it is built: :mod:`~pipeline.restore.settings`. No Dask here:
``get_many`` is any async ``(keys) -> GetResult``-like callable.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable, Coroutine, Hashable, Protocol, Sequence

from tasks.errors import PrefixReadError
from tasks.packed import PackedBatch

from .assembly import assemble_answer
from .dispatch import Action, DispatchState
from .getter import GetMany, KeyBatch, KeyGetter
from .own_get import own_get_keys
from .pending import PendingKey, ReadRequest, token_hints
from .settings import CoalescerSettings
from .shared_keys import SharedKeys
from .stats import CoalescerStats

__all__ = ["PrefixReadCoalescer", "PrefixReadError", "CoalescerSettings", "CoalescerStats"]


class TimerHandle(Protocol):
    """What a :data:`Timer` returns (``asyncio.TimerHandle`` does): it can be cancelled."""

    def cancel(self) -> None: ...


# (delay seconds, callback) -> a handle with .cancel(): loop.call_later, or a test's.
Timer = Callable[[float, Callable[[], None]], TimerHandle]


class PrefixReadCoalescer:
    """Merge concurrent ``read(keys)`` requests into bounded, deduplicated ``get_many`` calls.

    Create it inside the event loop that will use it. Knobs left ``None`` are read from
    ``token-capture.restore.*`` once, here (:attr:`settings`; ``window_ms`` in ms,
    ``timeout_s`` in seconds, ``max_tokens`` in tokens, ``eager_inflight`` in gets: below
    it a request is issued at once, see :mod:`~pipeline.restore.dispatch`). ``bounded``:
    ``get_many(keys, timeout_s)`` enforces the timeout itself (the batcher's store call
    does), so the coalescer sets no timer of its own per get (on a busy worker loop one
    costs ~50 us, ~2% of a light-load read). ``timer`` replaces ``loop.call_later`` for
    the window (tests drive it by hand). ``group(key)`` (e.g. the key's storage unit)
    keeps each get within one group; groups take turns. ``latency_samples``: how many of
    the latest request latencies the stats keep.
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
        self.settings = CoalescerSettings.from_config(batch_size, max_tokens, window_ms, max_concurrent, timeout_s, eager_inflight)
        self._group = group
        self._grouping = None if group is None else self._group_of  # what own gets check
        self._loop = asyncio.get_running_loop()
        self._timer: Timer = timer or self._loop.call_later
        self.stats = CoalescerStats(latencies_ms=collections.deque(maxlen=latency_samples))
        self._getter = KeyGetter(get_many, bounded=bounded, stats=self.stats)
        self._keys = SharedKeys(self._loop, self._group_of, self.stats)
        self._queue = self._keys.queue  # keys not yet issued (its entries: every pending or in-flight key)
        self._inflight = 0
        self._window: TimerHandle | None = None  # while a window is open
        self._waited = False  # queued keys have waited (window over, or slots full): issue at the next free slot
        self._immediate_scheduled = False  # an arriving request takes the queue after one loop turn
        self._turn_busy = False  # a request arrived in this loop turn already (cleared by the next turn)
        self._owners: set[asyncio.Task] = set()  # requests' tasks running a get themselves
        self._closing: set[asyncio.Task] = set()  # owner tasks close() cancelled
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # ---- knobs (read once, when built) and load ------------------------------------------

    @property
    def batch_size(self) -> int:
        """Keys per get."""
        return self.settings.batch_size

    @property
    def max_tokens(self) -> int:
        """Tokens per get (by the callers' hints)."""
        return self.settings.max_tokens

    @property
    def window_s(self) -> float:
        """Longest coalescing window (seconds)."""
        return self.settings.window_s

    @property
    def max_concurrent(self) -> int:
        """Gets in flight at most."""
        return self.settings.max_concurrent

    @property
    def timeout_s(self) -> float:
        """Longest one get may take (seconds)."""
        return self.settings.timeout_s

    @property
    def eager_inflight(self) -> int:
        """Below this many gets in flight a request is issued at once."""
        return self.settings.eager_inflight

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
        alone = self._own_get_keys(keys, hints)
        if not self._turn_busy:
            self._turn_busy = True
            self._loop.call_soon(self._end_turn)
        if alone is not None:
            try:
                return await self._read_alone(keys, alone)
            finally:
                self.stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)
        mine = await self._read_shared(keys, hints)  # a cancelled request's latency is not counted
        try:
            return self._answer(keys, mine)
        finally:
            self.stats.latencies_ms.append((time.perf_counter() - t0) * 1000.0)

    def _own_get_keys(self, keys: list[str], hints: list[int]) -> list[str] | None:
        """The distinct keys when this request runs its own get now (the loop turn's first
        request, nothing queued, :func:`~pipeline.restore.own_get.own_get_keys` agrees);
        else None (the request goes through the queue)."""
        if self._turn_busy or self._queue or self._immediate_scheduled or self._closed:
            return None
        return own_get_keys(keys, hints, self.settings, self._inflight, self._keys.entries, self._grouping)

    async def _read_alone(self, keys: list[str], distinct: list[str]) -> PackedBatch:
        """A request's own get (see :meth:`_own_get_keys`), with none of the shared
        bookkeeping: its keys stay private (a request arriving meanwhile for one of them
        reads it again: restores rarely share keys), so cancelling it cancels only its own
        get. Failures are handled exactly as for a shared get (:class:`KeyGetter`)."""
        self.stats.keys_requested += len(distinct)
        self.stats.immediate_gets += 1
        self._inflight += 1
        self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
        task = asyncio.current_task()
        self._owners.add(task)
        timeout_s = self.settings.timeout_s
        mine: dict[str, PendingKey] = {}
        try:
            try:
                result = await self._getter.get(distinct, timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - per key, as for a shared get
                mine = self._private(distinct)
                await self._getter.settle_failed_get(list(mine.items()), exc, timeout_s)
            else:
                if not result.failed and result.batch.keys == keys:
                    return result.batch  # the usual case: exactly the rows asked for, in order
                mine = self._private(distinct)
                self._getter.deliver(list(mine.items()), result)
        except asyncio.CancelledError:
            if not self._stopped_by_close(task):
                self.stats.cancelled_requests += 1
                raise
            mine = self._private(distinct)  # close() stopped it: answer "closed", not cancelled
            self._getter.fail(list(mine.items()), "closed", "the prefix read coalescer was closed during the get")
        finally:
            self._owners.discard(task)
            self._inflight -= 1
            self._dispatch()
        return self._answer(keys, mine)

    async def _read_shared(self, keys: list[str], hints: list[int]) -> dict[str, PendingKey]:
        """The request's keys joined to the shared reads, settled (or ``CancelledError``,
        the request's hold on them released); returns its distinct keys' entries."""
        mine, req, n_added = self._keys.join(keys, hints)
        runs_get = self._dispatch(arrival=True) if n_added else False
        if req.pending or runs_get:
            await self._wait(req, mine, runs_get)
        self._release(mine)
        return mine

    async def _wait(self, req: ReadRequest, mine: dict[str, PendingKey], runs_get: bool) -> None:
        """Until the request's keys settle, running the next get itself if ``runs_get``.

        Only the request's own waiter is awaited (and cancelled with it): the shared
        futures and the gets behind them run on for the other requesters. Cancelled, it
        leaves its keys (their gets go on for others) and raises; stopped by close(), it
        waits for its keys' "closed" failures instead."""
        try:
            if runs_get:
                await self._run_owned(req)
            if req.pending:
                await req.waiter
        except asyncio.CancelledError:
            if not self._stopped_by_close(asyncio.current_task()):
                self.stats.cancelled_requests += 1
                for e in mine.values():
                    if req in e.waiting:
                        e.waiting.remove(req)
                self._release(mine)
                self._dispatch()  # keys this request's get carried for others go again
                raise
            if req.pending:
                await req.waiter

    def _answer(self, keys: list[str], mine: dict[str, PendingKey]) -> PackedBatch:
        """The request's rows from its settled keys (a failed request is counted)."""
        try:
            return assemble_answer(keys, mine)
        except PrefixReadError:
            self.stats.failed_requests += 1
            raise

    def _stopped_by_close(self, task: asyncio.Task | None) -> bool:
        """Whether close() cancelled ``task``'s get (then the cancellation is taken back:
        the caller sees its keys fail "closed", not a cancellation)."""
        if task not in self._closing:
            return False
        self._closing.discard(task)
        if hasattr(task, "uncancel"):  # Python >= 3.11
            task.uncancel()
        return True

    def _private(self, keys: list[str]) -> dict[str, PendingKey]:
        """Entries for keys nobody else shares (never registered, never queued)."""
        return {key: PendingKey(self._loop.create_future(), 0, None, refs=1, issued=True) for key in keys}

    def _end_turn(self) -> None:
        self._turn_busy = False

    def _group_of(self, key: str) -> Hashable:
        """The key's group, or None (no grouping, or a key the grouping cannot place)."""
        if self._group is None:
            return None
        try:
            return self._group(key)
        except Exception:  # noqa: BLE001 - a key the store cannot place fails in its get, not here
            return None

    def _release(self, mine: dict[str, PendingKey]) -> None:
        """The request lets go of its keys (:meth:`SharedKeys.release`)."""
        if self._keys.release(mine) and not self._queue:
            self._close_window()

    # ---- scheduling ---------------------------------------------------------------------

    def dispatch_state(self) -> DispatchState:
        """The load :meth:`DispatchState.decide` judges, now."""
        s = self.settings
        return DispatchState(
            queued=len(self._queue),
            inflight=self._inflight,
            max_concurrent=s.max_concurrent,
            eager_inflight=s.eager_inflight,
            queue_full=self._queue.full(s.batch_size, s.max_tokens),
            window_open=self._window is not None,
            waited=self._waited,
        )

    def _dispatch(self, *, arrival: bool = False) -> bool:
        """Act on the dispatch decision for the queue as it is now (after an arrival, a
        window's end or a finished get). True: the arriving request runs the next get
        itself (:meth:`_run_owned`; its slot is reserved now)."""
        if self._closed or self._immediate_scheduled or not self._queue:
            return False  # closed, or an arriving request takes the queue this turn, or idle
        action = self.dispatch_state().decide()
        if action is Action.ISSUE:
            if arrival:
                # The request's own task runs the get (no task to start, no wake-up turn
                # for its answer), one loop turn from now: same-turn arrivals share it.
                self._immediate_scheduled = True
                self._inflight += 1
                return True
            self._issue()
        elif action is Action.OPEN_WINDOW:
            self.stats.window_waits += 1
            self._window = self._timer(self.settings.window_s, self._on_window)
        elif action is Action.WAIT_SLOT and not self._waited:
            self.stats.slot_waits += 1
            self._waited = True  # it coalesces while it waits: no window once a slot frees
        return False

    async def _run_owned(self, req: ReadRequest) -> None:
        """An arriving request runs the queue's next get (its reserved slot) in its own
        task, one loop turn from now (same-turn arrivals join).

        Cancelled mid-get, it hands the get's keys back to the queue, so requests that
        joined them are re-read, never failed (:meth:`_run_get`)."""
        try:
            await asyncio.sleep(0)  # same-turn arrivals join the queue it is about to take
        except asyncio.CancelledError:
            self._immediate_scheduled = False
            self._inflight -= 1
            raise
        self._immediate_scheduled = False
        batch = self._next_batch() if self._queue and not self._closed else []
        if not batch:  # every requester cancelled already, or closed
            self._inflight -= 1
            self._dispatch()
            return
        self.stats.immediate_gets += 1
        self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
        self._issue(immediate=True)  # what the same turn queued beyond one get
        task = asyncio.current_task()
        self._owners.add(task)
        try:
            await self._run_get(batch, owner=req)
        finally:
            self._owners.discard(task)

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

    def _issue(self, *, immediate: bool = False) -> None:
        """Issue the queued keys as gets while slots are free (the decision was ISSUE)."""
        if self._closed:
            return
        while self._queue and self._inflight < self.settings.max_concurrent:
            batch = self._next_batch()
            if not batch:
                continue
            self._inflight += 1
            self.stats.max_inflight = max(self.stats.max_inflight, self._inflight)
            if immediate:
                self.stats.immediate_gets += 1
            self._spawn(self._run_get(batch))
        if self._queue:
            if not self._waited:
                self.stats.slot_waits += 1
            self._waited = True  # slots are full: the rest goes at the next free slot
        else:
            self._close_window()

    def _next_batch(self) -> KeyBatch:
        """Queued keys of one group in arrival order, up to batch_size keys and max_tokens."""
        return self._keys.next_batch(self.settings.batch_size, self.settings.max_tokens)

    # ---- gets ---------------------------------------------------------------------------

    async def _run_get(self, batch: KeyBatch, owner: ReadRequest | None = None) -> None:
        """One get for ``batch``, its answer delivered to every request waiting on its keys.
        ``owner``: the request whose own task runs it (see :meth:`_run_owned`)."""
        keys = [key for key, _ in batch]
        timeout_s = self.settings.timeout_s
        handed_over = False
        try:
            try:
                result = await self._getter.get(keys, timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a shared get is per key
                await self._getter.settle_failed_get(batch, exc, timeout_s)
            else:
                self._getter.deliver(batch, result)
        except asyncio.CancelledError:
            if owner is not None and not self._closed:
                # Its owner was cancelled, not the coalescer: the keys go back to the queue;
                # the owner's release drops those nobody else holds, then dispatches.
                handed_over = True
                self._keys.requeue(batch)
            else:
                self._getter.fail(batch, "closed", "the prefix read coalescer was closed during the get")
            raise
        finally:
            self._keys.forget_issued(batch)
            self._inflight -= 1
            if not handed_over:
                self._dispatch()

    # ---- lifecycle ----------------------------------------------------------------------

    async def close(self) -> None:
        """Fail every pending key with ``closed`` and stop the gets in flight."""
        self._closed = True
        self._close_window()
        self._getter.fail(self._keys.drain(), "closed", "the prefix read coalescer was closed")
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        # Requests running a get themselves: stop it; they answer "closed" (see read).
        for t in list(self._owners):
            self._closing.add(t)
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
