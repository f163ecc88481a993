"""Running a store operation's actor calls: one sync driver, one async driver.

A store operation (:mod:`~pipeline.store.operations`) is a generator: it yields a list
of :class:`Call` (sent together, answered in order) or a :class:`Refresh` (were units
replaced since the placement version it planned with?) and returns its answer. The
operation holds every decision; a driver only sends, waits and settles. So there is ONE
path per operation, driven by :func:`run_sync` (a client, a task, an actor thread) or
:func:`run_async` (a coroutine on a worker's event loop).

Settling (:func:`settle`): a unit that failed as a whole (its worker lost, the call past
the deadline, the unit closed: :func:`~.call_outcome.classify`) fails only the keys of
ITS call, as ``unit_unavailable``; every other call's answer stands. Anything else (a
bug) raises. A read whose keys have another copy may carry its own, shorter bound
(:attr:`Call.bound_s`): past it the call fails as a :class:`~tasks.errors.SlowRead` and
the operation reads the other copy.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Generator, Protocol, Sequence, TypeVar, Union

from tasks.errors import SlowRead, UnitSkipped

from ..actors import local_call
from .call_outcome import Outcome, classify
from .deadline import bounded, waiter
from .moving import MovingTable
from .placement import Placement
from .protocol import UNIT_UNAVAILABLE, GetResult, StoreResult
from .settings import StoreSettings
from .slab_pool import SlabPool
from .unit_health import UnitHealth, unit_health, unit_id

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor

    from .directory import UnitDirectory

T = TypeVar("T")
Answer = Union[StoreResult, GetResult, object]  # a unit method's answer (object: stats, counts)


@dataclass
class Call:
    """One actor call: unit ``unit``'s ``method`` with the arguments ``args()`` gives.

    ``args`` is built only as the call is sent, so a sync driver cuts the next call's
    rows while the event loop writes the previous one. ``keys`` are the keys this call
    answers for (they fail ``unit_unavailable`` if the unit does), ``empty`` makes the
    answer of a unit that failed. ``local``: a read that may run on the unit's own actor
    thread when this code runs on the unit's worker (``store.local-reads``), with
    ``local_args()`` when given (the arguments of a call that crosses no wire)."""

    unit: int
    method: str
    args: Callable[[], tuple]
    keys: Sequence[str] = ()
    empty: Callable[[], Answer] = StoreResult
    local: bool = False
    local_args: Callable[[], tuple] | None = None
    bound_s: float | None = None  # a read with another copy: given up this long after it left (SlowRead)


class Window(list):
    """Calls (a ``list[Call]`` request) sent at most ``per_unit`` at a time to each unit:
    the next call to a unit leaves as one of its unit's is answered. Answers in call order.
    The drivers take the units' calls round-robin (:meth:`order`), each unit's in order."""

    def __init__(self, calls: Sequence[Call], per_unit: int):
        super().__init__(calls)
        self.per_unit = max(1, int(per_unit))

    def order(self) -> list[int]:
        """Indices of the calls round-robin over their units (each unit's in order)."""
        by_unit: dict[int, list[int]] = {}
        for i, c in enumerate(self):
            by_unit.setdefault(c.unit, []).append(i)
        lanes = list(by_unit.values())
        return [lane[k] for k in range(max(map(len, lanes), default=0)) for lane in lanes if k < len(lane)]


@dataclass(frozen=True)
class Refresh:
    """Ask whether the units changed since placement version ``seen`` (True: plan again).

    ``learn_only``: asked only so that later calls find a replaced unit (a get that read
    keys from their replicas): the drivers ask the unit directory for it at most once per
    ``store.skip-unreachable-s`` per directory (:meth:`~.unit_health.UnitHealth.refresh_due`),
    so a unit staying down does not cost every get a round trip; else the answer is False."""

    seen: int
    learn_only: bool = False
    moved: bool = False  # a unit answered ``moved``: a newer table exists, wait for it (``MOVED_WAIT_S``)


class Pending(Protocol):
    """A sync actor call in flight (an ``ActorFuture`` or a ``concurrent.futures.Future``)."""

    def result(self, timeout: float | None = None) -> object: ...

    def done(self) -> bool: ...


Request = Union[list[Call], Refresh]
Operation = Generator[Request, object, T]


class Driven(Protocol):
    """What operations and drivers use of a store handle."""

    units: list["Actor"]  # the storage units' handles
    placement: Placement
    moving: MovingTable | None  # a move in progress: its two tables (units: the union)
    settings: StoreSettings
    directory: "UnitDirectory | None"  # the shared unit table (replicas=2), None: never replaced
    answer_row_bytes: dict[tuple, float]  # (partition, fields) -> bytes per row of the last get's answers

    def refresh(self, seen: int, moved: bool = False) -> bool: ...

    async def refresh_async(self, seen: int, moved: bool = False) -> bool: ...

    def buffers(self) -> SlabPool: ...


def settle(call: Call, outcome: Answer | BaseException, workers: Sequence[str]) -> Answer:
    """``call``'s answer: ``outcome`` itself, or for a unit that failed as a whole
    (:func:`~.call_outcome.classify`: skipped, past the deadline, unreachable, closed) its
    ``empty`` answer with every key ``unit_unavailable``. Any other exception (a bug, a
    refused request) raises: it must not pass for a lost unit."""
    kind = classify(outcome)
    if kind is Outcome.ANSWERED:
        return outcome
    if not kind.unit_unavailable:
        raise outcome  # type: ignore[misc]
    worker = workers[call.unit] if call.unit < len(workers) else "?"
    if isinstance(outcome, SlowRead):  # read from the other copy next
        detail = f"storage unit {call.unit} on {worker} is unavailable: {outcome}"
    elif kind is Outcome.DEADLINE:  # a hung (alive) unit: its keys fail like a lost one's
        detail = f"storage unit {call.unit} on {worker} is unavailable: timeout: no answer by the call's deadline"
    else:
        detail = f"storage unit {call.unit} on {worker} is unavailable: {kind.value}: {type(outcome).__name__}: {outcome}"
    out = call.empty()
    out.failed.update({k: (UNIT_UNAVAILABLE, detail) for k in call.keys})
    return out


# ---- sync -------------------------------------------------------------------------------


def _advance(op: Operation[T], reply: object) -> tuple[bool, object]:
    """(True, the answer) once ``op`` returned, else (False, its next request)."""
    try:
        return False, op.send(reply)
    except StopIteration as done:
        return True, done.value


def run_sync(op: Operation[T], store: Driven, end: float | None) -> T:
    """Drive ``op`` to its answer, blocking on actor futures (each bounded by ``end``)."""
    finished, step = _advance(op, None)
    while not finished:
        if isinstance(step, Refresh):
            reply: object = _refresh_due(store, step) and store.refresh(step.seen, step.moved)
        else:
            reply = _send_sync(step, store, end)
        finished, step = _advance(op, reply)
    return step  # type: ignore[return-value]


def _refresh_due(store: Driven, step: Refresh) -> bool:
    """Whether to ask ``store`` for ``step`` (a ``learn_only`` one: once per unreachable
    window per unit directory, :meth:`~.unit_health.UnitHealth.refresh_due`)."""
    if not step.learn_only or store.directory is None:
        return True
    return unit_health().refresh_due(store.directory.name, store.settings.skip_unreachable_s)


def _send_sync(calls: list[Call], store: Driven, end: float | None) -> list[Answer]:
    per_unit = calls.per_unit if isinstance(calls, Window) else None
    order = calls.order() if isinstance(calls, Window) else range(len(calls))
    queued: dict[int, deque[int]] = {}
    for i in order:
        queued.setdefault(calls[i].unit if per_unit else -1, deque()).append(i)
    futures: list[Pending | None] = [None] * len(calls)
    ends: list[float | None] = [end] * len(calls)
    health, ids = unit_health(), _unit_ids(store, calls)

    def launch(u: int, n: int) -> None:
        for _ in range(n):
            if queued[u]:
                i = queued[u].popleft()
                skipped = health.skip(ids[i], store.settings.skip_unreachable_s)
                ends[i] = call_end(calls[i], end)
                futures[i] = _Skipped(ids[i]) if skipped else _invoke_sync(store, calls[i])  # sent as soon as its args exist

    for u in queued:
        launch(u, per_unit or len(calls))
    out: list[Answer] = [None] * len(calls)
    for i in order:  # waited in the order sent: each unit's next call leaves as one returns
        c = calls[i]
        try:
            outcome: object = waiter(futures[i], ends[i])()
        except Exception as e:  # noqa: BLE001 - settle keeps unit failures, re-raises bugs
            outcome = slow_read(c, e) if ends[i] != end else e
        health.outcome(ids[i], outcome)
        out[i] = settle(c, outcome, store.placement.workers)
        if per_unit:
            launch(c.unit, 1)  # its unit has one call fewer in flight
    return out


def call_end(call: Call, end: float | None) -> float | None:
    """When ``call``, leaving now, stops being waited for (monotonic s; None: never): the
    operation's ``end``, or sooner a read's own bound (:attr:`Call.bound_s`)."""
    if call.bound_s is None:
        return end
    own = time.monotonic() + call.bound_s
    return own if end is None else min(own, end)


def slow_read(call: Call, error: BaseException) -> BaseException:
    """``error`` of a call waited for only until its own bound: a ``TimeoutError`` there
    is a :class:`SlowRead` (its other copy is read next)."""
    if isinstance(error, TimeoutError) and not isinstance(error, SlowRead):
        return SlowRead(f"no answer to a read within store.read-failover-s ({call.bound_s:g} s); its keys' other copy is read")
    return error


def _unit_ids(store: Driven, calls: Sequence[Call]) -> list[tuple[str, str]]:
    """Each call's unit identity for :class:`~.unit_health.UnitHealth` (read before any
    call is sent: a table taken meanwhile must not mix handles and workers)."""
    workers = store.placement.workers
    return [unit_id(store.units[c.unit], workers[c.unit] if c.unit < len(workers) else "?") for c in calls]


class _Skipped:
    """The :class:`Pending` of a call not sent (its unit was found unreachable moments ago)."""

    def __init__(self, unit: tuple[str, str]):
        self.unit = unit

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> object:
        raise UnitSkipped(f"not called: unit {self.unit[0]} on {self.unit[1]} was unreachable or closed moments ago")


def _invoke_sync(store: Driven, call: Call) -> "Pending":
    unit = store.units[call.unit]
    fn = local_call(unit, call.method) if call.local and store.settings.local_reads else None
    if fn is not None:
        return fn(*(call.local_args or call.args)())
    return getattr(unit, call.method)(*call.args())


# ---- async ------------------------------------------------------------------------------


async def run_async(op: Operation[T], store: Driven, end: float | None) -> T:
    """Drive ``op`` to its answer from a coroutine (each call bounded by ``end``)."""
    finished, step = _advance(op, None)
    while not finished:
        if isinstance(step, Refresh):
            reply: object = _refresh_due(store, step) and await store.refresh_async(step.seen, step.moved)
        else:
            reply = await _send_async(step, store, end)  # type: ignore[arg-type]
        finished, step = _advance(op, reply)
    return step  # type: ignore[return-value]


async def _send_async(calls: list[Call], store: Driven, end: float | None) -> list[Answer]:
    workers = store.placement.workers
    health, ids = unit_health(), _unit_ids(store, calls)

    def send(c: Call, unit: tuple[str, str]) -> Awaitable[object]:
        """The unit's call, bounded by the deadline (not awaited yet), its outcome recorded."""
        if health.skip(unit, store.settings.skip_unreachable_s):
            return _skipped(unit)
        own = call_end(c, end)
        return _recorded(health, unit, bounded(getattr(store.units[c.unit], c.method)(*c.args()), own),
                         c if own != end else None)

    if len(calls) == 1:
        # One unit (a restore's keys, a coalesced get): await its call directly, no gather
        # task per call. Failures settle exactly as gather's would.
        (c,) = calls
        try:
            outcome: object = await send(c, ids[0])
        except Exception as e:  # noqa: BLE001 - settle keeps unit failures, re-raises bugs
            outcome = e
        return [settle(c, outcome, workers)]
    if isinstance(calls, Window):
        gates = {c.unit: asyncio.Semaphore(calls.per_unit) for c in calls}

        async def gated(c: Call, unit: tuple[str, str]) -> object:
            async with gates[c.unit]:  # FIFO: a unit's calls leave in order
                return await send(c, unit)

        outs = await asyncio.gather(*(gated(c, u) for c, u in zip(calls, ids)), return_exceptions=True)
    else:
        outs = await asyncio.gather(*(send(c, u) for c, u in zip(calls, ids)), return_exceptions=True)
    return [settle(c, o, workers) for c, o in zip(calls, outs)]


async def _skipped(unit: tuple[str, str]) -> object:
    return _Skipped(unit).result()


async def _recorded(health: UnitHealth, unit: tuple[str, str], call: Awaitable[object],
                    bounded_read: Call | None = None) -> object:
    """``call``'s answer, its outcome (answer or failure) recorded in ``health``;
    ``bounded_read``: the call, when waited for only until its own bound (a timeout is
    then a :class:`SlowRead`)."""
    try:
        answer = await call
    except Exception as e:
        if bounded_read is not None:
            e = slow_read(bounded_read, e)
        health.outcome(unit, e)
        raise e
    health.outcome(unit, answer)
    return answer
