"""The elastic block's cluster (:mod:`.store_elastic`): a loopback LocalCluster whose
workers, added ones too, carry the ``storage`` resource, the scheduler preloaded with the
store host; storage workers added (``cluster.scale``) and retired (``client.retire_workers``,
the host draining first), the host's change records polled."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from ..store.protocol import PlacedStoreLike

RESOURCES = {"finalize": 1, "storage": 1}  # every worker of the block's cluster, added ones too
STORE_NAME = "bench-store-elastic"
CHANGE_TIMEOUT_S = 600.0  # a change not listed by then is a failure


class ElasticCluster:
    """The block's LocalCluster and a client of it: storage workers added and retired."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        self.cluster, self.client = cluster, client
        self.base = len(self.workers())

    def workers(self) -> set[str]:
        return set(self.client.scheduler_info(n_workers=-1)["workers"])

    def add_storage_worker(self, timeout_s: float = 120.0) -> tuple[str, float]:
        """Scale to one more worker (carrying the storage resource); its address and the
        moment it was seen joined (perf_counter s, polled every 10 ms)."""
        before = self.workers()
        self.cluster.scale(len(self.cluster.worker_spec) + 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = self.workers() - before
            if new:
                return new.pop(), time.perf_counter()
            time.sleep(0.01)
        raise TimeoutError(f"no worker joined within {timeout_s:.0f} s of cluster.scale")

    def retire(self, address: str, timeout_s: float = 120.0) -> None:
        """``client.retire_workers`` (the store host drains the worker's units first), then
        the cluster's spec shrinks to match; returns once the worker's process is gone.
        (``cluster.scale`` alone would not drain: SpecCluster asks the scheduler to retire
        the worker by its name, and the host drains by address.)"""
        self.client.retire_workers([address], close_workers=True)
        self.cluster.scale(len(self.cluster.worker_spec) - 1)
        deadline = time.monotonic() + timeout_s
        while address in self.workers() or len(self.cluster.workers) > len(self.cluster.worker_spec):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} still running {timeout_s:.0f} s after retire_workers")
            time.sleep(0.05)

    def changes(self) -> list[dict]:
        from ..store.hosted import hosted_stores

        return next((s["changes"] for s in hosted_stores(self.client) if s["name"] == STORE_NAME), [])

    def next_change(self, seen: int, timeout_s: float = CHANGE_TIMEOUT_S) -> tuple[dict, float]:
        """The change record after the first ``seen`` and when it was listed (perf_counter s;
        polled every 20 ms)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            changes = self.changes()
            if len(changes) > seen:
                return changes[seen], time.perf_counter()
            time.sleep(0.02)
        raise TimeoutError(f"the store host listed no new change within {timeout_s:.0f} s")


@contextlib.contextmanager
def elastic_cluster(n_workers: int = 2) -> Iterator[ElasticCluster]:
    """A loopback LocalCluster of ``n_workers`` single-threaded worker processes carrying
    ``RESOURCES``, the store host preloaded (:func:`pipeline.cluster.local_cluster`)."""
    from distributed import Client

    from ..cluster import local_cluster

    with local_cluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0",
                       resources=dict(RESOURCES)) as cluster, Client(cluster) as client:
        client.wait_for_workers(n_workers)
        yield ElasticCluster(cluster, client)


@contextlib.contextmanager
def hosted_store(ec: ElasticCluster, replicas: int) -> Iterator[PlacedStoreLike]:
    """A hosted store of 2 units with ``replicas`` copies per key (memory-resident: 4 GiB
    per unit before spilling), closed on exit."""
    import dask

    from ..store.hosted import close_hosted, start_hosted

    with dask.config.set({"token-capture.store.replicas": replicas}):
        store = start_hosted(ec.client, STORE_NAME, n_units=2, memory_limit="4GiB")
    try:
        yield store
    finally:
        close_hosted(ec.client, STORE_NAME)
