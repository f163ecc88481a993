"""The per-process owner (pipeline/process_state.py): one ProcessState per process holds
every pool, gate and cache; the modules that use them keep no module-level state of
their own; knobs are read when a component is made and re-read on reconfigure(); the
worker plugin holds a worker's owner from setup to teardown, on real workers."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from distributed import Client

from pipeline import dask_compat
from pipeline import process_state as ps
from pipeline.client.batcher import OpenBatchers
from pipeline.cluster import local_cluster
from pipeline.generation import cpu_gate
from pipeline.metrics import prometheus
from pipeline.process_state import (
    PLUGIN_NAME,
    ProcessStatePlugin,
    ProcessStateSlot,
    configured,
    process_state,
)
from pipeline.store import deadline, receive_pool, slab_pool

ROOT = Path(__file__).resolve().parents[1]

#: The modules whose state is per process: all of it lives in the owner.
PER_PROCESS = (
    "pipeline/store/receive_pool.py",
    "pipeline/store/slab_pool.py",
    "pipeline/store/deadline.py",
    "pipeline/generation/cpu_gate.py",
    "pipeline/client/batcher.py",
    "pipeline/metrics/prometheus.py",
    "pipeline/process_state.py",
)
#: Calls whose result never changes (a module or class may bind them).
IMMUTABLE_CALLS = {"TypeVar", "getLogger", "frozenset", "compile", "Struct"}


def _immutable(value: ast.expr | None) -> bool:
    if value is None or isinstance(value, (ast.Constant, ast.Name, ast.Attribute, ast.Subscript, ast.Lambda)):
        return True
    if isinstance(value, ast.Tuple):
        return all(_immutable(e) for e in value.elts)
    if isinstance(value, ast.UnaryOp):
        return _immutable(value.operand)
    if isinstance(value, ast.BinOp):
        return _immutable(value.left) and _immutable(value.right)
    if isinstance(value, ast.Call):
        func = value.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in IMMUTABLE_CALLS
    return False  # dict / list / set displays and comprehensions, other calls


def _assigned(body: list[ast.stmt]) -> list[tuple[str, ast.expr | None]]:
    out = []
    for node in body:
        if isinstance(node, ast.Assign):
            out += [(ast.unparse(t), node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            out.append((ast.unparse(node.target), node.value if isinstance(node, ast.AnnAssign) else ast.List()))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            out += _assigned(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
    return out


def mutable_state(path: Path) -> list[str]:
    """Names bound at module or class level to something mutable, and ``global`` statements."""
    tree = ast.parse(path.read_text(), str(path))
    found = [f"global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    scopes = [("", tree.body)] + [(f"{n.name}.", n.body) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for prefix, body in scopes:
        found += [prefix + name for name, value in _assigned(body) if name != "__all__" and not _immutable(value)]
    return found


@pytest.mark.parametrize("rel", PER_PROCESS)
def test_per_process_modules_keep_no_module_level_state_but_the_owner_slot(rel):
    found = mutable_state(ROOT / rel)
    if rel == "pipeline/process_state.py":
        assert found == ["_SLOT"], "the process's one slot is the only module-level state"
    else:
        assert not found, f"{rel}: per-process state belongs in a ProcessState component: {found}"


def test_the_scan_sees_globals_caches_and_class_level_containers(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import threading, logging\nX = 1\nT = (1, 'a')\nlogger = logging.getLogger(__name__)\n"
        "_CACHE: dict = {}\n_LOCK = threading.Lock()\nclass C:\n    N = 3\n    seen = set()\n"
        "def f():\n    global X\n"
    )
    assert sorted(mutable_state(src)) == ["C.seen", "_CACHE", "_LOCK", "global X"]


def test_every_accessor_answers_from_the_current_owner(monkeypatch):
    # A fresh slot for the process: every public accessor must answer from its owner,
    # so nothing of the old owner's survives anywhere else.
    old = (receive_pool.pool(), slab_pool.process_pool("store.client-buffer-bytes"), cpu_gate.cpu_gate(),
           prometheus.collector())
    slot = ProcessStateSlot()
    monkeypatch.setattr(ps, "_SLOT", slot)
    owner = process_state()
    try:
        new = (receive_pool.pool(), slab_pool.process_pool("store.client-buffer-bytes"), cpu_gate.cpu_gate(),
               prometheus.collector())
        assert not any(a is b for a, b in zip(old, new))
        assert new[0] is owner.get(receive_pool.ReceivePool).pool
        assert new[1] is owner.get(slab_pool.ConfiguredPool, "store.client-buffer-bytes")
        assert new[2] is owner.get(cpu_gate.CpuGates).gate()
        assert new[3] is owner.get(prometheus.CollectorRegistration).collector
        batchers = owner.get(OpenBatchers)
        assert batchers is owner.get(OpenBatchers)
        assert deadline.takes_timeout(batchers.discard) is False  # a bound method: cached for its class
        assert list(owner.get(deadline.TimeoutAnswers).answers) == [OpenBatchers.discard]
    finally:
        owner.close()


class Probe:
    """A component recording its reconfigure() and close() calls."""

    log: list  # set per test (class level: the owner makes it with no arguments)

    def __init__(self, name: str) -> None:
        self.name = name

    def reconfigure(self) -> None:
        self.log.append(("reconfigure", self.name))

    def close(self) -> None:
        self.log.append(("close", self.name))


def test_the_last_release_closes_the_owner_newest_component_first(monkeypatch):
    log: list = []
    monkeypatch.setattr(Probe, "log", log, raising=False)
    slot = ProcessStateSlot()
    assert slot.current() is None
    lazy = slot.get()  # made on first ask, held by nobody
    assert slot.get() is lazy and lazy.get(Probe, "a") is lazy.get(Probe, "a")
    lazy.get(Probe, "b")
    assert slot.acquire() is lazy and slot.acquire() is lazy and lazy.holders == 2
    lazy.reconfigure()
    assert log == [("reconfigure", "a"), ("reconfigure", "b")]
    slot.release(lazy)
    assert not lazy.closed and slot.current() is lazy
    slot.release(lazy)
    assert lazy.closed and slot.current() is None
    assert log[2:] == [("close", "b"), ("close", "a")]
    with pytest.raises(RuntimeError):
        slot.release(lazy)
    # Asked after its release, the old owner answers from the process's new one.
    fresh = slot.get()
    assert fresh is not lazy and lazy.get(Probe, "a") is fresh.get(Probe, "a")
    fresh.close()


def test_knobs_are_read_when_made_and_applied_on_reconfigure():
    import dask

    owner = process_state()
    pool = slab_pool.process_pool("store.client-buffer-bytes")
    cap = pool.max_bytes
    with dask.config.set({"token-capture.store.client-buffer-bytes": "3MiB"}):
        assert slab_pool.process_pool("store.client-buffer-bytes").max_bytes == cap  # not per call
        owner.reconfigure()
        assert pool.max_bytes == 3 << 20
    owner.reconfigure()
    assert pool.max_bytes == cap
    with configured({"token-capture.cut.cpu-slots": 3}):
        gate = cpu_gate.cpu_gate()
        assert [gate.acquire(blocking=False) for _ in range(4)] == [True, True, True, False]
        for _ in range(3):
            gate.release()
    assert cpu_gate.cpu_gate() is not gate and slab_pool.process_pool("store.client-buffer-bytes") is pool


def test_a_released_receive_pool_hands_dask_its_allocator_back():
    before = dask_compat.tcp_frame_allocator()
    slot = ProcessStateSlot()
    owner = slot.acquire()
    receiver = owner.get(receive_pool.ReceivePool)
    assert receiver.install() and dask_compat.tcp_frame_allocator() is not before
    slot.release(owner)
    assert dask_compat.tcp_frame_allocator() is before
    assert receiver.pool.max_bytes == 0 and not receiver.install()  # closed: never installs again


def test_in_process_workers_share_the_processs_owner_and_let_go_of_it():
    owner = ps.acquire()  # this test's own hold: the cluster closing must not close it
    try:
        held = owner.holders
        cluster = local_cluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0")
        with cluster, Client(cluster) as client:
            seen = client.run(lambda: id(process_state()))
            assert set(seen.values()) == {id(owner)}
            # Two workers' plugins and the scheduler's attached /metrics state.
            assert owner.holders == held + 3
        assert owner.holders == held and not owner.closed
    finally:
        ps.release(owner)


def test_the_worker_plugin_holds_a_real_workers_owner_until_teardown(cluster_client):
    def _worker_view(dask_worker) -> dict:
        from distributed.comm import tcp
        from distributed.protocol import utils

        from pipeline import process_state as ps

        owner = ps.current()
        return {
            "plugin": PLUGIN_NAME in dask_worker.plugins,
            "holders": None if owner is None else owner.holders,
            "pooled": tcp.host_array is not utils.host_array,
        }

    client = cluster_client
    assert client.run_on_scheduler(lambda dask_scheduler: PLUGIN_NAME in dask_scheduler.worker_plugins)
    # Registered by the scheduler's aggregator: each worker process holds its owner once.
    client.run(lambda: receive_pool.install())
    for view in client.run(_worker_view).values():
        assert view["plugin"] and view["holders"] == 1 and view["pooled"]
    # Teardown (here: the plugin removed) releases it: Dask's own allocator is back.
    client.unregister_worker_plugin(PLUGIN_NAME)
    for view in client.run(_worker_view).values():
        assert not view["plugin"] and view["holders"] is None and not view["pooled"]
    # Registered by hand (client.register_plugin), it holds a fresh owner again.
    client.register_plugin(ProcessStatePlugin())
    for view in client.run(_worker_view).values():
        assert view["plugin"] and view["holders"] == 1 and not view["pooled"]
    assert all(client.run(lambda: receive_pool.install()).values())
