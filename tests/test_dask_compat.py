"""The distributed internals ``pipeline/dask_compat.py`` relies on, against the installed
distributed; and that no other module of ``pipeline/`` reaches them.

One test per internal: it exists, is callable where it is called, and has the shape the
adapter assumes (signature, what the code around it looks up), then the adapter's
behaviour on a real cluster. A failure here names what a new distributed release changed:
fix the adapter, then widen the bounds in ``pyproject.toml``. The source scan at the end
keeps every other module on the public API (or on the adapter).
"""
from __future__ import annotations

import concurrent.futures
import functools
import inspect
import pickle
import re
import socket
import textwrap
import threading
import types
import uuid
from pathlib import Path

import dask
import pytest
from distributed import Actor, Client, get_worker

from pipeline import dask_compat
from pipeline.actors import DirectActor, PinnedActor, start_pinned_actors, workers_now

ROOT = Path(__file__).resolve().parents[1]


def code_names(func) -> set[str]:
    """Every global and attribute name ``func``'s code looks up, nested functions included."""
    out: set[str] = set()
    stack = [getattr(func, "__code__", func)]
    while stack:
        code = stack.pop()
        out.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def code_consts(func) -> set:
    """Every constant of ``func``'s code (nested functions included), e.g. string keys."""
    out: set = set()
    stack = [func.__code__]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        out.update(c for c in code.co_consts if isinstance(c, str))
    return out


class Counter:
    """A tiny actor: state, a sync method, an async method."""

    def __init__(self):
        self.n = 0

    def increment(self) -> int:
        self.n += 1
        return self.n

    def on_actor_thread(self) -> bool:
        return dask_compat.in_actor_thread(get_worker())

    async def variable(self, name: str):
        from distributed import Variable

        return await Variable(name).get(timeout=10, asynchronous=True)


class Direct(dask_compat.FailFastActor):
    direct_to_worker = True


def free_address() -> str:
    """A loopback address nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---- Actor internals (FailFastActor) ----------------------------------------------


def test_actor_is_built_from_cls_address_key():
    # FailFastActor.from_actor / __reduce__ call Actor(cls, address, key).
    params = list(inspect.signature(Actor.__init__).parameters.values())
    assert [p.name for p in params[:4]] == ["self", "cls", "address", "key"]
    assert all(p.default is not p.empty for p in params[4:])  # anything after: optional
    a = Actor(Counter, "tcp://127.0.0.1:1", "compat-ctor")
    assert a._cls is Counter and a._address == "tcp://127.0.0.1:1" and a.key == "compat-ctor"
    rebuild, args = a.__reduce__()
    assert rebuild is Actor and args == (Counter, "tcp://127.0.0.1:1", "compat-ctor")


def test_try_bind_worker_client_is_where_the_retry_future_is_made():
    f = Actor._try_bind_worker_client
    assert callable(f) and list(inspect.signature(f).parameters) == ["self"]
    assert "_try_bind_worker_client" in code_names(Actor.__init__)  # called on construction
    assert {"_future", "_worker", "_client"} <= code_names(f)  # binds both, makes the future
    a = Actor(Counter, "tcp://127.0.0.1:1", "compat-bind")
    assert hasattr(a, "_future") and hasattr(a, "_worker") and hasattr(a, "_client")


def test_a_call_awaits_the_future_on_oserror():
    # What FailFastActor turns off: the method call's OSError path awaits self._future.
    names = code_names(Actor.__getattr__)
    assert {"_future", "_worker_rpc", "_try_bind_worker_client", "OSError"} <= names


def test_worker_rpc_is_a_property_choosing_proxy_or_direct():
    prop = inspect.getattr_static(Actor, "_worker_rpc")
    assert isinstance(prop, property)
    assert {"direct_to_workers", "rpc", "_address", "_worker", "_client"} <= code_names(prop.fget)


def test_fail_fast_handles_pickle_and_convert():
    a = Actor(Counter, "tcp://127.0.0.1:1", "compat-pickle")
    for cls in (dask_compat.FailFastActor, PinnedActor, DirectActor):
        h = cls.from_actor(a)
        assert type(h) is cls and h.key == a.key and h._address == a._address and h._cls is Counter
        back = pickle.loads(pickle.dumps(h))
        assert type(back) is cls and back.key == a.key
    assert DirectActor.direct_to_worker and not PinnedActor.direct_to_worker


def test_fail_fast_handle_keeps_the_future_out_of_the_retry_path(cluster_client):
    plain = cluster_client.submit(Counter, actor=True, pure=False).result()
    assert plain._future is not None  # a plain handle holds it where calls retry on it
    h = PinnedActor.from_actor(plain)
    assert h._future is None and h._keepalive.key == plain.key
    assert h.increment().result() == 1
    from distributed.actor import ProxyRPC

    assert isinstance(h._worker_rpc._rpc, ProxyRPC)  # through the scheduler (the client's default)
    d = DirectActor.from_actor(plain)
    assert not isinstance(d._worker_rpc._rpc, ProxyRPC)  # straight to the worker
    assert d.increment().result() == 2


def test_fail_fast_handle_raises_oserror_for_a_gone_worker(cluster_client):
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        with Client(cluster_client.scheduler.address, set_as_default=False) as c, c.as_current():
            h = Direct(Counter, free_address(), f"compat-gone-{uuid.uuid4().hex[:8]}")
            assert h._client is c and h._future is None
            with pytest.raises(OSError):
                h.increment().result(timeout=60)


# The installed distributed's PooledRPCCall.__getattr__, which _ConnectBounded.__getattr__
# copies (with ``timeout=`` on the connect): the copy is kept in step by hand.
POOLED_RPC_CALL = '''\
def __getattr__(self, key):
    async def send_recv_from_rpc(**kwargs):
        if self.serializers is not None and kwargs.get("serializers") is None:
            kwargs["serializers"] = self.serializers
        if self.deserializers is not None and kwargs.get("deserializers") is None:
            kwargs["deserializers"] = self.deserializers
        comm = await self.pool.connect(self.addr)
        prev_name, comm.name = comm.name, f"ConnectionPool.{key}"
        try:
            return await send_recv(comm=comm, op=key, **kwargs)
        finally:
            self.pool.reuse(self.addr, comm)
            comm.name = prev_name

    return send_recv_from_rpc
'''


def test_connect_bounded_is_a_copy_of_the_installed_pooled_rpc_call():
    # _ConnectBounded copies PooledRPCCall.__getattr__ (no public call connects a pooled
    # rpc within a timeout of its own): a change there must be carried into the copy.
    from distributed.core import ConnectionPool, PooledRPCCall

    installed = textwrap.dedent(inspect.getsource(PooledRPCCall.__getattr__))
    assert installed == POOLED_RPC_CALL, (
        "distributed changed PooledRPCCall.__getattr__: carry the change into "
        "dask_compat._ConnectBounded.__getattr__, then update POOLED_RPC_CALL")
    # The copy looks up everything the original does; beyond it, only the timeout's parts.
    ours, theirs = code_names(dask_compat._ConnectBounded.__getattr__), code_names(PooledRPCCall.__getattr__)
    assert theirs <= ours, f"the copy misses {sorted(theirs - ours)}"
    assert ours - theirs == {"_pooled", "dask", "config", "parse_timedelta", "distributed.core", "min", "timeout"}
    assert list(inspect.signature(ConnectionPool.connect).parameters) == ["self", "addr", "timeout"]
    assert list(inspect.signature(ConnectionPool.reuse).parameters) == ["self", "addr", "comm"]


def test_a_direct_call_from_a_patient_client_waits_the_connect_timeout_not_the_clients(cluster_client):
    # _ConnectBounded: PooledRPCCall's pool/addr/(de)serializers, ConnectionPool.connect(timeout=).
    from distributed.core import ConnectionPool

    assert {"pool", "addr", "serializers", "deserializers"} <= set(vars(cluster_client.rpc("tcp://127.0.0.1:1")))
    assert "timeout" in inspect.signature(ConnectionPool.connect).parameters
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        # The client's own timeout (its pool's connect wait) is far above the call's wait.
        with Client(cluster_client.scheduler.address, timeout=60, set_as_default=False) as c, c.as_current():
            h = Direct(Counter, free_address(), f"compat-patient-{uuid.uuid4().hex[:8]}")
            with pytest.raises(OSError) as failed:
                h.increment().result(timeout=15)
            assert not isinstance(failed.value, TimeoutError), "the call waited out its deadline"


# ---- WorkerState.actors, Worker.executors["actor"] and its _threads --------------


def test_worker_state_actors_and_actor_executor_exist(cluster_client):
    from distributed import Worker

    # Worker.actor_execute runs sync methods on executors["actor"], looking actors up in
    # state.actors: the two things hosted_actor and actor_executor stand for.
    names, consts = code_names(Worker.actor_execute), code_consts(Worker.actor_execute)
    assert {"state", "actors", "executors"} <= names and "actor" in consts

    def probe(dask_worker):
        from distributed.threadpoolexecutor import ThreadPoolExecutor

        ex = dask_worker.executors["actor"]
        return (
            isinstance(dask_worker.state.actors, dict),
            isinstance(ex, ThreadPoolExecutor) and isinstance(ex, concurrent.futures.Executor),
            ex._max_workers,
            isinstance(ex._threads, set),
        )

    for got in cluster_client.run(probe).values():
        assert got == (True, True, 1, True)


def test_distributed_thread_pool_lists_its_threads():
    from distributed.threadpoolexecutor import ThreadPoolExecutor

    ex = ThreadPoolExecutor(1, thread_name_prefix="compat")
    try:
        thread = ex.submit(threading.current_thread).result()
        assert thread in ex._threads and threading.current_thread() not in ex._threads
    finally:
        ex.shutdown()


def _on_worker(handle):
    w = get_worker()
    inst = dask_compat.hosted_actor(w, handle.key)
    ex = dask_compat.actor_executor(w)
    return (
        None if inst is None else inst.n,
        dask_compat.in_actor_thread(w),
        None if inst is None else ex.submit(inst.increment).result(),
    )


def test_hosted_actor_and_actor_thread_on_a_real_worker(cluster_client):
    workers = sorted(workers_now(cluster_client))
    [h], _futures = start_pinned_actors(cluster_client, Counter, workers[:1])
    assert h.increment().result() == 1
    home = cluster_client.submit(_on_worker, h, workers=workers[:1], pure=False).result()
    assert home == (1, False, 2)  # the instance itself; a task thread; the actor thread ran it
    assert h.on_actor_thread().result() is True
    away = cluster_client.submit(_on_worker, h, workers=workers[1:], pure=False).result()
    assert away[0] is None


def test_no_actor_executor_means_no_actor_thread():
    bare = types.SimpleNamespace(executors={}, address="tcp://fake:1")
    with pytest.raises(RuntimeError):
        dask_compat.actor_executor(bare)
    assert dask_compat.in_actor_thread(bare) is True
    ex = concurrent.futures.ThreadPoolExecutor(1)
    try:
        assert dask_compat.in_actor_thread(types.SimpleNamespace(executors={"actor": ex})) is False
    finally:
        ex.shutdown()


# ---- distributed.comm.tcp.host_array ---------------------------------------------


def test_tcp_reads_frames_through_its_host_array_global():
    import distributed.comm.tcp as tcp

    assert callable(tcp.host_array)
    assert len(inspect.signature(tcp.host_array).parameters) == 1
    # Looked up as a module global at call time: replacing the attribute takes effect.
    assert "host_array" in tcp.read_bytes_rw.__code__.co_names
    assert "read_bytes_rw" in code_names(tcp.TCP.read)
    buf = dask_compat.tcp_frame_allocator()(16)
    assert isinstance(buf, memoryview) and buf.nbytes == 16 and not buf.readonly


def test_set_tcp_frame_allocator_serves_received_frames(cluster_client):
    original = dask_compat.tcp_frame_allocator()
    seen: list[int] = []

    def counting(n: int) -> memoryview:
        seen.append(n)
        return original(n)

    dask_compat.set_tcp_frame_allocator(counting)
    try:
        assert dask_compat.tcp_frame_allocator() is counting
        assert cluster_client.submit(bytes, 1 << 20, pure=False).result() == bytes(1 << 20)
    finally:
        dask_compat.set_tcp_frame_allocator(original)
    assert seen and max(seen) >= 1 << 20


# ---- public replacements other modules use instead of internals -------------------


def test_variable_get_is_awaitable_from_an_async_actor_method(cluster_client):
    # pipeline/store/directory.py: Variable.get(..., asynchronous=True), not Variable._get.
    from distributed import Variable

    name = f"compat-var-{uuid.uuid4().hex[:8]}"
    Variable(name, cluster_client).set(b"table")
    a = cluster_client.submit(Counter, actor=True, pure=False).result()
    assert a.variable(name).result() == b"table"
    Variable(name, cluster_client).delete()


def test_scheduler_get_events_lists_every_topic(cluster_client):
    # pipeline/bench/soak.py: Scheduler.get_events(), not Scheduler._broker._topics.
    from support import wait_until

    cluster_client.log_event("compat-topic", {"x": 1})

    def count(dask_scheduler):
        events = dask_scheduler.get_events()
        return isinstance(events, dict) and all(isinstance(e, tuple) for e in events.values()), len(events.get("compat-topic", ()))

    assert wait_until(lambda: (lambda r: r if r[1] else None)(cluster_client.run_on_scheduler(count)), what="the event") == (True, 1)


# ---- nothing else in pipeline/ reaches these internals ----------------------------

#: The internals the adapter relies on: description -> pattern in source text.
ADAPTER_ONLY = {
    "Actor._try_bind_worker_client": r"\b_try_bind_worker_client\b",
    "Actor._worker_rpc": r"\b_worker_rpc\b",
    "Actor._future": r"\b_future\b",
    "Actor._cls": r"\b_cls\b",
    "Actor._address": r"\b_address\b",
    "WorkerState.actors": r"\bstate\.actors\b",
    "Worker.executors": r"\bexecutors\b",
    "distributed ThreadPoolExecutor._threads": r"\b_threads\b",
    "distributed.comm.tcp.host_array": r"\bhost_array\b",
}
#: Internals with a public replacement: used nowhere, the adapter included.
NOWHERE = {
    "Variable._get (Variable.get(..., asynchronous=True))": r"(?:Variable\([^)]*\)|_variable\(\))\._get\b",
    "Scheduler._broker (Scheduler.get_events())": r"\b_broker\b",
    "Broker._topics (Scheduler.get_events())": r"\b_topics\b",
}
#: Known uses in modules still to be moved over (the replacement is named with each
#: internal above: the adapter, or the public API); drop an entry once its module is.
PENDING: set[tuple[str, str]] = set()  # uses still outside the adapter (none)
ADAPTER = "pipeline/dask_compat.py"


@functools.cache
def offences() -> frozenset[tuple[str, str]]:
    """``(module path, internal)`` for every mention outside the adapter (NOWHERE: anywhere)."""
    found = set()
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        rules = dict(NOWHERE) if rel == ADAPTER else {**ADAPTER_ONLY, **NOWHERE}
        found |= {(rel, what) for what, pattern in rules.items() if re.search(pattern, text)}
    return frozenset(found)


def test_no_module_but_the_adapter_mentions_distributed_internals():
    unexpected = sorted(offences() - PENDING)
    assert not unexpected, "use pipeline.dask_compat (or the public API) instead: " + repr(unexpected)


def test_only_the_adapter_subclasses_actor_or_reaches_its_private_attributes():
    # A subclass of the adapter's handle inherits Actor's attributes: none of its code may
    # touch the private ones (what the text patterns above cannot tell from the project's
    # own ``self._worker`` and such).
    import ast

    private = {n for n in code_names(Actor.__init__) | code_names(Actor._try_bind_worker_client) | set(vars(Actor))
               if n.startswith("_") and not n.startswith("__")}
    handles = {"Actor", "FailFastActor"}
    classes: list[tuple[str, ast.ClassDef]] = []
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel != ADAPTER:
            classes += [(rel, n) for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]

    def base_names(node: ast.ClassDef) -> set[str]:
        return {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}

    grew = True
    while grew:  # subclasses of subclasses, by name across the package
        before = len(handles)
        handles |= {n.name for _, n in classes if base_names(n) & (handles - {"Actor"})}
        grew = len(handles) > before
    bad = []
    for rel, node in classes:
        if "Actor" in base_names(node):
            bad.append(f"{rel}: {node.name} subclasses distributed.Actor")
        if node.name in handles:
            bad += [f"{rel}: {node.name} uses self.{a.attr}" for a in ast.walk(node)
                    if isinstance(a, ast.Attribute) and a.attr in private]
    assert not bad, bad


def test_a_list_subclass_answer_crosses_in_one_frame_a_plain_list_in_one_per_item():
    # What WireList / WireDict rely on: an actor answer goes out as to_serialize(result);
    # distributed serializes a plain list or dict item by item (a frame each) and pickles
    # a subclass whole. Should distributed change this, the key listings of a move and a
    # repair get slow again (or stay fast): this test says which.
    from distributed.protocol import dumps, loads, to_serialize

    from pipeline.answers import WireDict, WireList

    keys = [f"r{i}/c0" for i in range(500)]
    plain = dumps({"status": "OK", "result": to_serialize(keys)})
    assert len(plain) > len(keys)  # one frame per item
    for wire in (WireList(keys), WireDict.fromkeys(keys, "x")):
        frames = dumps({"status": "OK", "result": to_serialize(wire)})
        assert len(frames) < 5, len(frames)
        assert loads(frames)["result"] == wire


def test_storage_unit_listings_answer_in_wire_types(tmp_path):
    from pipeline.answers import WireDict, WireList
    from pipeline.store.unit import StorageUnit

    unit = StorageUnit(0, 1 << 20, 1 << 22, spill_directory=str(tmp_path))
    assert type(unit.keys("staging")) is WireList
    assert type(unit.witnessed_keys("staging")) is WireList
    assert type(unit.lost_keys("staging")) is WireDict
    unit.close()


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self) -> int:
        self.n += 1
        return self.n


@pytest.mark.parametrize("direct", [False, True])
def test_a_call_to_a_released_actor_fails_at_once_instead_of_waiting_its_deadline(direct):
    # A plain Actor handle's call to an actor its worker no longer hosts never resolves
    # (the worker's KeyError escapes Actor.__getattr__'s OSError-only handler); a
    # fail-fast handle answers OSError naming the actor. Without _AnsweredRpc the
    # result(timeout=...) below raises TimeoutError instead.
    from distributed import Client, LocalCluster

    from pipeline.actors import DirectActor, PinnedActor

    cls = DirectActor if direct else PinnedActor
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        future = client.submit(_Counter, actor=True)
        handle = cls.from_actor(future.result())
        assert handle.add().result(timeout=10) == 1
        key = future.key
        client.cancel([future], force=True)
        del future
        import time

        from pipeline.dask_compat import hosted_actor

        deadline = time.monotonic() + 10
        while any(client.run(lambda dask_worker: hosted_actor(dask_worker, key) is not None).values()):
            assert time.monotonic() < deadline, "the actor was not released"
            time.sleep(0.05)
        with pytest.raises(OSError, match="is not on worker"):
            handle.add().result(timeout=20)


def test_generation_worker_answers_grow_with_calls_and_cross_in_one_frame():
    import numpy as np

    from pipeline.answers import WireList
    from pipeline.generation.worker import GenerationWorker

    worker = GenerationWorker(store=None, name="g", with_routes=False)
    opened = worker.start_calls([{"rollout_id": f"r{i}", "model_call_id": "c0", "context": np.arange(4),
                                  "max_new_tokens": 2} for i in range(3)])
    assert type(opened) is WireList and len(opened) == 3
    assert type(worker.list_calls()) is WireList and type(worker.take_completed()) is WireList
