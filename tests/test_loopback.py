"""Every server the pipeline starts binds to loopback (127.0.0.1), never every interface."""
from __future__ import annotations

import os

import psutil
import pytest
from distributed import Client

from pipeline.cluster import local_cluster
from pipeline.store.client import StagingStore


def _listening(pids: set[int]) -> list[tuple[int, str]]:
    out = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
            out.append((conn.pid, conn.laddr.ip))
    return out


@pytest.mark.parametrize("processes", [False, True])
def test_embedded_cluster_listens_only_on_loopback(processes):
    with local_cluster(n_workers=2, threads_per_worker=1, processes=processes, dashboard_address=":0") as cluster, Client(cluster) as client:
        store = StagingStore.start(client)  # actors open no sockets of their own, but check
        me = psutil.Process(os.getpid())
        pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
        sockets = _listening(pids)
        store.close()
    assert sockets, "expected the scheduler, dashboard and workers to listen"
    assert all(ip == "127.0.0.1" for _, ip in sockets), sockets
