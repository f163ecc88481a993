"""Shared fixtures: small real Dask clusters on loopback (2 cores: keep them small)."""
from __future__ import annotations

import pytest
from distributed import Client

from pipeline.cluster import local_cluster


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
