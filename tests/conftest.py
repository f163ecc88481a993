"""Shared fixtures: small real Dask clusters on loopback (2 cores: keep them small)."""
from __future__ import annotations

import os

import dask
import pytest
from distributed import Client

from pipeline.cluster import local_cluster


def _own_host_addresses() -> None:
    """Under pytest-xdist (``-n 2``) each test process gets its own block of loopback host
    addresses: gw0 127.0.1.2, 127.0.1.3, ...; gw1 127.0.2.2, ... (a serial run keeps
    127.0.0.2, ...). Concurrent multi-host clusters, and a partition test's firewall rules,
    then never touch another test process's hosts. Set in this process's Dask config and
    in the environment (the cluster CLI runs in subprocesses)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        first = f"127.0.{int(worker[2:]) + 1}.2"
        os.environ["DASK_TOKEN_CAPTURE__HOSTS__FIRST_ADDRESS"] = first
        dask.config.set({"token-capture.hosts.first-address": first})


_own_host_addresses()


@pytest.fixture(scope="module")
def cluster_client():
    """A Client on a 2-worker, 1-thread-each process LocalCluster, shared by one test module."""
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client


@pytest.fixture
def store_factory(cluster_client, tmp_path):
    """``make(**StagingStore.start kwargs)`` on ``cluster_client``, spilling under tmp_path;
    every store made is closed after the test."""
    from support import store_maker

    with store_maker(cluster_client, tmp_path / "spill") as make:
        yield make


@pytest.fixture
def keep_staged_rows():
    """Keep staged rows after finalization (``finalize.clear-staged`` is on by default) for
    tests that read rows back afterwards; tests/test_store_lifecycle.py covers clearing.
    Use it per module: ``pytestmark = pytest.mark.usefixtures("keep_staged_rows")``."""
    import dask

    with dask.config.set({"token-capture.finalize.clear-staged": False}):
        yield


@pytest.fixture(scope="module")
def inprocess_client():
    """A Client on an in-process cluster (2 workers x 2 threads): a test can monkeypatch
    what tasks run, or hold a task until it releases it."""
    with local_cluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            yield client
