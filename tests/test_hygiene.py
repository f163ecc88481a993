"""Resource hygiene: after a store closes and its cluster shuts down,
no actor, task, thread, process, open file, temp file or spill directory is left.

Each test runs the pipeline's real work (stage with spilling, finalize one step,
checkpoint) on its own cluster. The in-process variant compares this process's threads
after a warm-up cycle (distributed creates a few process-wide pools once) with the
threads after a second cycle: a leak grows with every cluster.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import psutil
import pytest
from distributed import Client

from pipeline.cluster import local_cluster
from pipeline.finalize import Finalizer
from pipeline.store import StagingStore
from rollout_factory import make_group
from tasks.packed import pack_rows

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

VOCAB, L, K, E = 64, 2, 2, 8


def files_under(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def eventually(check, timeout: float = 10.0):
    """Poll ``check()`` until it returns a falsy leftover description; return the last one."""
    deadline = time.monotonic() + timeout
    while True:
        left = check()
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _actors(dask_worker=None):
    return sorted(dask_worker.state.actors)


def _tasks(dask_scheduler=None):
    return sorted(map(str, dask_scheduler.tasks))


def cycle(tmp_path, tag: str, processes: bool) -> dict:
    """One cluster's life with real work; returns what it left behind."""
    spill = tmp_path / f"spill-{tag}"
    with local_cluster(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=":0", protocol="tcp://") as cluster, Client(cluster) as client:
        local_dirs = list(client.run(lambda dask_worker: dask_worker.local_directory).values())
        store = StagingStore.start(client, n_units=2, memory_limit="8KiB", spill_directory=str(spill))
        rng = np.random.default_rng(0)
        builts = make_group(rng, "g", 6, rollout_prefix=f"hy{tag}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
        assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
        assert files_under(spill), "rows must really spill for this test to mean anything"
        step = Finalizer(client, store, vocab_size=VOCAB, num_experts=E).submit_step({"g": [b.receipt for b in builts]}).result(timeout=60)
        assert step.groups["g"].status == ["ok"] * len(builts)
        store.checkpoint(str(tmp_path / f"ckpt-{tag}"))
        unit_dirs = [s["spill_directory"] for s in store.stats()]
        assert client.run(_actors) and any(client.run(_actors).values())
        store.close()
        del store, step
        # Closing the store releases its actors on the workers and its tasks on the scheduler.
        actors_left = eventually(lambda: {w: a for w, a in client.run(_actors).items() if a})
        tasks_left = eventually(lambda: client.run_on_scheduler(_tasks))
    return {
        "actors": actors_left,
        "tasks": tasks_left,
        "spill_files": files_under(spill),
        "unit_dirs": [d for d in unit_dirs if os.path.exists(d)],
        "local_dirs": eventually(lambda: [d for d in local_dirs if os.path.exists(d)]),
        "open_files": [f.path for f in psutil.Process().open_files() if str(tmp_path) in f.path],
    }


def assert_clean(left: dict) -> None:
    assert left["actors"] == {}, left["actors"]
    assert left["tasks"] == [], left["tasks"]
    assert left["spill_files"] == [] and left["unit_dirs"] == []
    assert left["local_dirs"] == [], "worker scratch directories must be removed at close"
    assert left["open_files"] == []


def test_in_process_cluster_leaves_no_threads_actors_or_files(tmp_path):
    assert_clean(cycle(tmp_path, "warm", processes=False))
    before = {t.ident: t.name for t in threading.enumerate()}
    assert_clean(cycle(tmp_path, "measured", processes=False))
    grown = eventually(lambda: {t.name for t in threading.enumerate() if t.ident not in before})
    assert grown == set(), f"threads left by one cluster: {sorted(grown)}"


def test_process_cluster_leaves_no_processes_actors_or_files(tmp_path):
    me = psutil.Process()
    children_before = {p.pid for p in me.children(recursive=True)}
    assert_clean(cycle(tmp_path, "procs", processes=True))
    def leftovers():
        out = []
        for p in me.children(recursive=True):
            try:
                if p.pid in children_before or p.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = " ".join(p.cmdline())
            except psutil.NoSuchProcess:
                continue
            # multiprocessing's resource tracker is one per interpreter, started by the
            # first process cluster and shared by all later ones: not a per-cluster leak.
            if "resource_tracker" not in cmd:
                out.append((p.pid, cmd[:120]))
        return out

    left = eventually(leftovers)
    assert left == [], f"worker or nanny processes outlived the cluster: {left}"
