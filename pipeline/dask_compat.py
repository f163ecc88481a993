"""The distributed internals this package relies on, in one place.

Everything else in ``pipeline/`` uses Dask's public API. The few things no public API
does go through this module, each with a comment naming the internal it touches and why
nothing public does the job:

- :class:`FailFastActor`: an ``Actor`` handle that fails fast when its worker is gone or
  no longer hosts the actor and, optionally, talks to that worker directly (``Actor``
  internals).
- :func:`hosted_actor`: the object behind an actor key on this worker
  (``WorkerState.actors``).
- :func:`actor_executor`, :func:`in_actor_thread`: the thread that runs a worker's actor
  methods (the ``"actor"`` entry of ``Worker.executors``, its ``_threads``).
- :func:`tcp_frame_allocator`, :func:`set_tcp_frame_allocator`: where Dask's TCP comm
  reads each frame into (``distributed.comm.tcp.host_array``).

``tests/test_dask_compat.py`` checks every one of them against the installed
distributed, and a source scan there keeps other modules from reaching past this one;
``pyproject.toml`` bounds dask and distributed to the release line those tests pass on.
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

import dask.config
from dask.utils import parse_timedelta
from distributed import Actor

if TYPE_CHECKING:
    from distributed import Worker

__all__ = [
    "FailFastActor",
    "actor_executor",
    "hosted_actor",
    "in_actor_thread",
    "set_tcp_frame_allocator",
    "tcp_frame_allocator",
]

_A = TypeVar("_A", bound="FailFastActor")

#: ``n bytes -> writable memoryview of n bytes``: what Dask's TCP comm reads a frame into.
FrameAllocator = Callable[[int], memoryview]


# ---- actor handles ---------------------------------------------------------------


class FailFastActor(Actor):
    """An ``Actor`` handle whose calls fail with ``OSError`` once its worker is gone.

    A plain handle holding its task's future answers a connection error by awaiting that
    future, then retrying: forever, for a task pinned to a worker that died. This handle
    keeps the future only to keep the actor alive, out of the retry path, so a call fails
    after the connect timeout (``distributed.comm.timeouts.connect``).

    With :attr:`direct_to_worker` set (a subclass), calls from a client go straight to
    the hosting worker instead of through the scheduler, whatever the client's
    ``direct_to_workers``; calls from a worker are direct anyway.

    Pickles to its class, actor class, address and key, like a plain handle.
    """

    #: Calls from a client connect to the hosting worker, not through the scheduler.
    direct_to_worker: ClassVar[bool] = False

    # distributed internal: Actor._try_bind_worker_client() is where a handle finds its
    # worker/client and creates ``self._future`` (a Future of the actor's key), which
    # Actor.__getattr__ awaits on OSError before retrying the call. No public option
    # turns that retry off; moving the future to ``_keepalive`` right after binding keeps
    # the actor referenced but leaves ``_future`` None, so the call returns the error.
    def _try_bind_worker_client(self) -> None:
        super()._try_bind_worker_client()
        if self._future is not None:
            self._keepalive, self._future = self._future, None

    # distributed internal: Actor._worker_rpc is the rpc every method call goes through;
    # from a client it is a ProxyRPC via the scheduler unless Client.direct_to_workers.
    # That is a per-client setting only (``distributed.client.direct-to-workers`` read
    # when the client starts); no public API makes one handle direct.
    #
    # Also: Actor.__getattr__ catches only OSError around ``actor_execute``. When the
    # worker no longer hosts the actor (released, or the worker restarted), the worker's
    # lookup raises KeyError outside the handler's own try, the rpc re-raises it here, and
    # the call's ActorFuture is never resolved: the caller waits out its whole deadline.
    # :class:`_AnsweredRpc` turns such a failure into an ``OSError`` answer at once.
    @property
    def _worker_rpc(self) -> Any:
        if not self.direct_to_worker:
            return _AnsweredRpc(super()._worker_rpc, self._address, self.key)
        if self._worker is None and self._client is None:
            self._try_bind_worker_client()
        if self._worker is None and self._client is not None:
            return _AnsweredRpc(_ConnectBounded(self._client.rpc(self._address)), self._address, self.key)
        return _AnsweredRpc(super()._worker_rpc, self._address, self.key)

    # distributed internal: ``Actor(cls, address, key)`` is the form Actor.__reduce__
    # rebuilds a handle from; ``_cls`` and ``_address`` have no public accessor.
    def __reduce__(self) -> tuple[type, tuple[type, str, Any]]:
        return (type(self), (self._cls, self._address, self.key))

    @classmethod
    def from_actor(cls: type[_A], actor: Actor) -> _A:
        """A handle of this class to the same actor as ``actor`` (any ``Actor`` handle,
        e.g. what ``client.submit(..., actor=True).result()`` gave)."""
        # distributed internal: Actor._cls (the actor's class) and Actor._address (its
        # worker), the constructor's own arguments; no public accessor exists. The
        # address could be asked of the scheduler (who_has), at a round trip per handle.
        return cls(actor._cls, actor._address, actor.key)


class _ConnectBounded:
    """A client's pooled rpc to one worker whose connects wait at most
    ``distributed.comm.timeouts.connect`` (read per handle call), like a worker's.

    A client's connection pool connects with the CLIENT's ``timeout`` (``Client(...,
    timeout=60)`` is a patient wait for the scheduler), so a direct call to a dead worker
    (connection refused, retried until the pool's timeout) waited that long: a whole
    store call's deadline, where a worker's call to it fails after the connect timeout."""

    def __init__(self, pooled: Any) -> None:
        self._pooled = pooled

    def __getattr__(self, name: str) -> Any:
        # distributed internal: PooledRPCCall (``client.rpc(address)``) has ``pool`` and
        # ``addr`` and connects with ``pool.connect(addr)``, i.e. the pool's timeout;
        # ConnectionPool.connect takes a ``timeout=`` that no public call passes ("for
        # internal use"). The call below is a copy of PooledRPCCall.__getattr__'s, with
        # that timeout; tests/test_dask_compat.py holds the source it was copied from and
        # fails when the installed distributed's differs. The public route, a
        # ``distributed.core.rpc(address, timeout=...)``, does not share the client's pool:
        # one per call opens a connection per call (7.3 ms a call against 0.9 ms pooled,
        # loopback, in-process cluster), one kept per worker has no close with the client.
        from distributed.core import send_recv

        pooled = self._pooled
        connect_s = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")

        async def call(**kwargs: Any) -> Any:
            if pooled.serializers is not None and kwargs.get("serializers") is None:
                kwargs["serializers"] = pooled.serializers
            if pooled.deserializers is not None and kwargs.get("deserializers") is None:
                kwargs["deserializers"] = pooled.deserializers
            timeout = connect_s if not pooled.pool.timeout else min(connect_s, pooled.pool.timeout)
            comm = await pooled.pool.connect(pooled.addr, timeout=timeout)
            prev_name, comm.name = comm.name, f"ConnectionPool.{name}"
            try:
                return await send_recv(comm=comm, op=name, **kwargs)
            finally:
                pooled.pool.reuse(pooled.addr, comm)
                comm.name = prev_name

        return call


class _AnsweredRpc:
    """An rpc whose ``actor_execute`` always answers: a failure of the call itself (not of
    the actor's method, which the worker answers as ``status: error``) comes back as an
    ``OSError`` answer naming the actor and its worker, so the handle fails at once."""

    def __init__(self, rpc: Any, address: str, key: Any) -> None:
        self._rpc, self._address, self._key = rpc, address, key

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._rpc, name)
        if name != "actor_execute":
            return call

        async def actor_execute(**kwargs: Any) -> dict:
            try:
                return await call(**kwargs)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - the worker could not run the call at all
                gone = OSError(f"actor {self._key} is not on worker {self._address} any more "
                               f"({type(e).__name__}: {e}): it was released or its worker restarted")
                return {"status": "error", "exception": gone}

        return actor_execute


# ---- the worker hosting an actor -------------------------------------------------


def hosted_actor(worker: "Worker", key: Any) -> Any | None:
    """The object behind actor ``key`` when ``worker`` hosts it, else ``None``."""
    # distributed internal: WorkerState.actors (``Worker.state.actors``, key -> the
    # instance) is where a worker keeps its actors. Public APIs reach an actor only
    # through a handle, i.e. a comm round trip and serialization of arguments and
    # results, even when caller and actor share the process.
    return worker.state.actors.get(key)


def actor_executor(worker: "Worker") -> concurrent.futures.Executor:
    """The executor whose one thread runs ``worker``'s (non-async) actor methods.

    Raises ``RuntimeError`` when the worker has none (as ``run_in_executor`` does once
    the executor shut down with the worker): callers treat both as "no actor thread".
    """
    # distributed internal: Worker.__init__ creates ``executors["actor"]``, a
    # one-thread ThreadPoolExecutor on which Worker.actor_execute runs actor methods (one
    # at a time: the actor model's guarantee). ``Worker.executors`` is public (the
    # ``executor=`` argument, the ``executor`` task annotation); its ``"actor"`` entry is
    # not. Publicly, only an actor call runs code on that thread: through a comm.
    executor = getattr(worker, "executors", {}).get("actor")
    if executor is None:
        raise RuntimeError(f"worker {getattr(worker, 'address', '?')} has no actor executor")
    return executor


def in_actor_thread(worker: "Worker") -> bool:
    """Whether the calling thread is ``worker``'s actor thread, where waiting on work
    submitted to :func:`actor_executor` would wait forever. True as well when that
    cannot be told (no actor executor, or one that does not list its threads): callers
    then take the path that is safe on the actor thread."""
    try:
        executor = actor_executor(worker)
    except RuntimeError:
        return True
    # distributed internal: distributed.threadpoolexecutor.ThreadPoolExecutor._threads,
    # the set of the executor's threads (distributed's secede()/rejoin() edit it; the
    # executor derives from distributed's vendored copy of concurrent.futures'). Nothing
    # public says whether the current thread belongs to an executor; distributed's
    # ``thread_state.actor`` flag is as private, and set only while actor_execute runs.
    threads = getattr(executor, "_threads", None)
    if threads is None:
        return True
    return threading.current_thread() in threads


# ---- the TCP comm's receive buffers ----------------------------------------------


def tcp_frame_allocator() -> FrameAllocator | None:
    """The function Dask's TCP comm allocates each frame it reads with (``n`` bytes -> a
    writable ``memoryview`` of ``n`` bytes); ``None`` when this distributed reads frames
    some other way (then there is nothing to replace)."""
    # distributed internal: distributed.comm.tcp.read_bytes_rw() calls the module global
    # ``host_array`` (imported from distributed.protocol.utils) for every frame, looked
    # up at call time. No public hook chooses the memory received frames land in.
    import distributed.comm.tcp as tcp

    allocate = getattr(tcp, "host_array", None)
    return allocate if callable(allocate) else None


def set_tcp_frame_allocator(allocate: FrameAllocator) -> None:
    """Have Dask's TCP comm read every frame of this process into ``allocate(n)``
    (which must return a writable, contiguous ``memoryview`` of exactly ``n`` bytes)."""
    # distributed internal: distributed.comm.tcp.host_array, see tcp_frame_allocator().
    import distributed.comm.tcp as tcp

    tcp.host_array = allocate
