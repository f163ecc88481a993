"""The store host: a store started through the scheduler outlives the process that asked.

Real processes: nanny workers on 127.0.0.1 and a controller process (tests/store_host_controller.py)
that stages rows and exits without closing anything. A store the controller owned is gone
with it (the control case: the mechanism is what keeps rows); a hosted store keeps every
row bit for bit, is repaired by the scheduler after a unit's worker is killed, and closes
from any process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import dask
import numpy as np
import pytest
from rollout_factory import make_group
from store_host_controller import staged_rows
from support import preloaded_nanny_cluster, wait_until

from pipeline.client.discovery import lookup_store
from pipeline.store.host import StoreHost
from pipeline.store.host_messages import StartRequest
from pipeline.store.hosted import close_hosted, hosted_stores, start_hosted
from tasks.errors import InvalidStoreRequest, StoreUnavailable
from tasks.packed import pack_rows
from tasks.schema import STAGING_FIELDS

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = {
    "distributed.comm.timeouts.connect": "3s",
    "token-capture.store.replicas": 2,
    "token-capture.store.repair-interval-s": 0.2,
    "token-capture.store.report-interval-s": 0,
}


@pytest.fixture(scope="module")
def cluster():
    with preloaded_nanny_cluster("abc", SETTINGS) as client:
        yield client


def run_controller(client, name: str, seed: int, mode: str) -> None:
    """The controller process: stages rows, prints ``staged N``, exits without cleanup."""
    env = {**os.environ, "DASK_TOKEN_CAPTURE__STORE__REPLICAS": "2",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "store_host_controller.py"), client.scheduler.address, name, str(seed), mode],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert out.returncode == 0 and "staged" in out.stdout, (out.stdout, out.stderr[-2000:])


def same_rows(store, rows) -> None:
    """Every row reads back bit for bit."""
    keys = [r.staging_key for r in rows]
    got = store.get_many(keys, list(STAGING_FIELDS))
    assert not got.failed, list(got.failed.items())[:3]
    want = pack_rows(rows)
    for f in STAGING_FIELDS:
        assert np.array_equal(got.batch.fields[f].values, want.fields[f].values), f
        assert np.array_equal(got.batch.fields[f].offsets, want.fields[f].offsets), f


def test_an_owned_store_dies_with_its_controller(cluster):
    """Control case: without the host, the creator's exit takes the units with it."""
    run_controller(cluster, "owned-store", 1, "owned")
    store = lookup_store(cluster, "owned-store")
    rows = staged_rows(make_group, 1)

    def gone():
        got = store.get_many([r.staging_key for r in rows], timeout=5)
        return len(got.failed) == len(rows)

    wait_until(gone, 30, "the owned store's units released with its creator")
    cluster.unpublish_dataset("owned-store")


def test_a_hosted_store_outlives_its_controller_and_is_repaired_by_the_scheduler(cluster):
    run_controller(cluster, "hosted-store", 2, "hosted")
    rows = staged_rows(make_group, 2)
    store = lookup_store(cluster, "hosted-store")
    assert store.owner is None  # the handle owns nothing
    try:
        same_rows(store, rows)
        [info] = [s for s in hosted_stores(cluster) if s["name"] == "hosted-store"]
        assert info["units"] == 3 and info["replicas"] == 2 and not info["repaired"]

        # Kill one unit's worker: the host (not any controller) re-replicates it.
        victim = store.unit_workers[0]
        pid = cluster.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        repaired = wait_until(
            lambda: next((s["repaired"] for s in hosted_stores(cluster) if s["name"] == "hosted-store" and s["repaired"]), None),
            90, "the store host's re-replication")
        assert repaired[0]["unit"] == 0
        # Any process finds the current units: the host publishes the repaired table.
        fresh = wait_until(lambda: (h := lookup_store(cluster, "hosted-store")).version > store.version and h,
                           30, "the repaired table published")
        same_rows(fresh, rows)
        assert sum(s["rows"] for s in fresh.stats()) == 2 * len(rows)  # both copies again
    finally:
        records = close_hosted(cluster, "hosted-store")
    assert len(records) == 3
    assert "hosted-store" not in [s["name"] for s in hosted_stores(cluster)]
    with pytest.raises(StoreUnavailable, match="hosted-store"):
        lookup_store(cluster, "hosted-store")


def test_host_requests_are_checked(cluster):
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = start_hosted(cluster, "checked-store", n_units=1)
        try:
            with pytest.raises(InvalidStoreRequest, match="already hosted"):
                start_hosted(cluster, "checked-store", n_units=1)
            assert store.put_many(pack_rows(staged_rows(make_group, 3)[:2])).ok
        finally:
            close_hosted(cluster, "checked-store")
    with pytest.raises(StoreUnavailable, match="no store named 'nope'"):
        close_hosted(cluster, "nope")
    for bad, field in (({"name": ""}, "name"), ({"n_units": 0}, "n_units"), ({"capacity": "1GB"}, "capacity"),
                       ({"workers": "tcp://x"}, "workers")):
        msg = {"name": "x", "n_units": 1, "replicas": 1, "memory_limit": 1, "capacity": 1, **bad}
        with pytest.raises(InvalidStoreRequest, match=field):
            StartRequest.from_message(msg)


def test_a_scheduler_without_the_host_is_a_one_line_error():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as lc, Client(lc) as client:
        with pytest.raises(StoreUnavailable, match="no token-capture store host.*preload pipeline.dashboard.preload"):
            start_hosted(client, "x", n_units=1)
        assert StoreHost.name not in client.run_on_scheduler(lambda dask_scheduler: list(dask_scheduler.plugins))
