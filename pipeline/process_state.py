"""The one owner of a process's pools, gates and caches: :class:`ProcessState`.

Some state belongs to a whole process, not to a call or an object: the slab pools
(:func:`pipeline.store.slab_pool.process_pool`), the receive pool Dask's TCP comm reads
large frames into (:mod:`pipeline.store.receive_pool`), the cuts' CPU gate
(:mod:`pipeline.generation.cpu_gate`), the cache of which store methods take ``timeout=``
(:func:`pipeline.store.deadline.takes_timeout`), the capture clients' open batchers
(:mod:`pipeline.client.batcher`) and the ``/metrics`` collector
(:mod:`pipeline.metrics.prometheus`). None of those modules keeps it in a global: each
defines a component class and asks the process's owner for its instance,
``process_state().get(ComponentClass, *args)``; their public functions are thin
accessors over that. On workers :class:`ProcessStatePlugin` (a Dask ``WorkerPlugin``)
holds the owner from setup to teardown; elsewhere :func:`process_state` makes it lazily.
What it owns, its lifetime and its thread safety: :class:`ProcessState`.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import dask.config
from distributed.diagnostics.plugin import WorkerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler, Worker

__all__ = [
    "PLUGIN_NAME",
    "ProcessState",
    "ProcessStatePlugin",
    "ProcessStateSlot",
    "acquire",
    "configured",
    "current",
    "process_state",
    "register_on_workers",
    "release",
]

PLUGIN_NAME = "token-capture-process-state"

_C = TypeVar("_C")


class ProcessState:
    """A process's components (pools, gates, caches), one per class and arguments.

    What it owns: one instance of each component class per constructor arguments
    (``get(ConfiguredPool, "cut.pack-buffer-bytes")`` is one pool, another key another),
    made on first ask as ``ComponentClass(*args)``. A component may define
    ``reconfigure()`` (re-read its knobs) and ``close()`` (release what it holds: memory,
    Dask's frame allocator, a Prometheus registration); both are optional.

    Knobs: a component reads its knobs when it is made, not per call. After changing one
    (``dask.config.set``), :meth:`reconfigure` applies it to every component;
    :func:`configured` does both for a ``with`` block (set, apply; on exit undo, apply).

    Lifetime: made by a :class:`ProcessStateSlot` (the process's: :func:`process_state`),
    lazily on first ask or by the first :func:`acquire`. Holders (:func:`acquire` /
    :func:`release`) keep it: on a worker :class:`ProcessStatePlugin`, from ``setup`` to
    ``teardown`` (the scheduler's token-capture aggregator registers the plugin for every
    current and future worker, :func:`register_on_workers`, as distributed's shuffle
    registers its own; ``client.register_plugin(ProcessStatePlugin())`` does it by hand);
    on a scheduler, its attached ``/metrics`` state. When the last holder releases it, it
    is closed (every component's ``close()``, newest first) and the process's next
    :func:`process_state` makes a fresh one. Several workers in one process (an
    in-process cluster) share the one owner, as does the controller in that process;
    without any holder (the controller, a test) it lives as long as the process.

    Thread safety: :meth:`get` makes each component at most once (under the owner's lock)
    and then answers without locking; each component guards its own state. A closed owner
    asked for a component forwards to the process's current owner, so a caller that
    raced a worker's teardown still gets a live one. Component constructors and
    ``close()`` run under a lock: they must not call :func:`process_state`.
    """

    def __init__(self, slot: ProcessStateSlot) -> None:
        self._slot = slot  # where a closed owner forwards to (the process's: the module's slot)
        self._lock = threading.Lock()
        self._components: dict[tuple[Any, ...], Any] = {}  # (class, *args) -> instance, in creation order
        self.holders = 0  # acquire() calls not yet released (the slot's lock guards it)
        self.closed = False

    def get(self, kind: type[_C], *args: Any) -> _C:
        """This process's ``kind(*args)``, made on first ask (``args`` must be hashable)."""
        key = (kind, *args)
        got = self._components.get(key)
        if got is not None:
            return got
        with self._lock:
            if not self.closed:
                got = self._components.get(key)
                if got is None:
                    got = self._components[key] = kind(*args)
                return got
        return self._slot.get().get(kind, *args)  # released meanwhile: the current owner's

    def components(self) -> list[Any]:
        """Every component made so far, oldest first."""
        with self._lock:
            return list(self._components.values())

    def reconfigure(self) -> None:
        """Re-read every component's knobs now (each one's ``reconfigure()``, if any).

        Components read their knobs when they are made; call this after changing one
        (e.g. ``dask.config.set``), or use :func:`configured`."""
        for component in self.components():
            hook = getattr(component, "reconfigure", None)
            if hook is not None:
                hook()

    def close(self) -> None:
        """Release every component (each one's ``close()``, newest first) and forget them.
        Idempotent; asked for a component afterwards, the owner forwards to the current one."""
        with self._lock:
            self.closed = True
            gone, self._components = list(self._components.values()), {}
        for component in reversed(gone):
            hook = getattr(component, "close", None)
            if hook is not None:
                hook()


class ProcessStateSlot:
    """Where a process keeps its owner: lazily made, held, closed at the last release.

    The module keeps the process's one slot (:func:`process_state` and friends); a test
    may make its own to exercise the lifetime rules in isolation.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: ProcessState | None = None

    def current(self) -> ProcessState | None:
        """The owner, if one was made and not released since (never makes one)."""
        return self._owner

    def get(self) -> ProcessState:
        """The owner, made now if there is none (not held: see :meth:`acquire`)."""
        owner = self._owner
        if owner is not None:
            return owner
        with self._lock:
            if self._owner is None:
                self._owner = ProcessState(self)
            return self._owner

    def acquire(self) -> ProcessState:
        """The owner (made now if there is none), kept until a matching :meth:`release`."""
        with self._lock:
            if self._owner is None:
                self._owner = ProcessState(self)
            self._owner.holders += 1
            return self._owner

    def release(self, owner: ProcessState) -> None:
        """Let go of ``owner`` (from :meth:`acquire`); the last holder's release closes it
        and the next :meth:`get` makes a fresh one."""
        with self._lock:
            if owner.holders <= 0:
                raise RuntimeError("ProcessState released more often than acquired")
            owner.holders -= 1
            if owner.holders:
                return
            if self._owner is owner:
                self._owner = None
            # Under the lock: no new owner installs Dask's frame allocator while this one
            # still hands its own back.
            owner.close()


# The process's one slot: the only module-level state of the per-process components.
_SLOT = ProcessStateSlot()


def process_state() -> ProcessState:
    """This process's :class:`ProcessState` (made now if there is none)."""
    return _SLOT.get()


def current() -> ProcessState | None:
    """This process's owner if there is one, without making it."""
    return _SLOT.current()


def acquire() -> ProcessState:
    """Hold this process's owner (made now if there is none) until :func:`release`."""
    return _SLOT.acquire()


def release(owner: ProcessState) -> None:
    """Let go of ``owner``; the last holder's release closes it (see the module docstring)."""
    _SLOT.release(owner)


@contextlib.contextmanager
def configured(settings: Mapping[str, Any]) -> Iterator[ProcessState]:
    """``dask.config.set(settings)`` applied to this process's components at once
    (:meth:`ProcessState.reconfigure`), and on exit undone and applied again."""
    try:
        with dask.config.set(dict(settings)):
            process_state().reconfigure()
            yield process_state()
    finally:
        process_state().reconfigure()


class ProcessStatePlugin(WorkerPlugin):
    """Holds the worker process's :class:`ProcessState` from ``setup`` to ``teardown``.

    Registered for every worker by the scheduler's token-capture aggregator
    (:func:`register_on_workers`), or by hand: ``client.register_plugin(ProcessStatePlugin())``.
    Its ``teardown`` (the worker closing, or the plugin unregistered) releases the owner:
    with no other holder in the process, its pools are emptied, Dask's own frame
    allocator is back and its caches are gone.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self._held: list[ProcessState] = []  # one per worker set up (in-process workers may share a plugin)

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (type(self), ())  # what it holds stays in this process

    def setup(self, worker: Worker) -> None:
        self._held.append(acquire())

    def teardown(self, worker: Worker) -> None:
        if self._held:
            release(self._held.pop())


async def register_on_workers(scheduler: Scheduler) -> None:
    """Have every worker of ``scheduler``, current and future, run :class:`ProcessStatePlugin`
    (idempotent), the way distributed's shuffle extension registers its worker plugin."""
    from distributed.protocol.pickle import dumps

    await scheduler.register_worker_plugin(None, dumps(ProcessStatePlugin()), name=PLUGIN_NAME, idempotent=True)
