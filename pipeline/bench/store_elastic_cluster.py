"""The elastic block's cluster (:mod:`.store_elastic`), of one of two kinds:

- ``hosts`` (default): as deployed, a ``dask scheduler`` process of its own (the store host
  runs there, not in the process running the loop) and ``dask worker`` processes started
  from Dask's CLI, one host per storage worker on its own loopback address
  (:class:`~pipeline.deploy.hosts.LocalHosts`); a storage worker is added by starting a host;
- ``local``: a loopback LocalCluster, whose scheduler (and so the store host moving the
  keys) shares the loop's process; a storage worker is added by ``cluster.scale``.

Every worker carries the ``storage`` resource; storage workers are retired through
``client.retire_workers`` (the host draining first); the host's change records polled."""
from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from ..deploy.hosts import LocalHosts

    from ..store.protocol import PlacedStoreLike

RESOURCES = {"finalize": 1, "storage": 1}  # every worker of the block's cluster, added ones too
ROLES = ("storage", "finalize")  # the same, as the roles of a CLI host
KINDS = ("hosts", "local")
STORE_NAME = "bench-store-elastic"
CHANGE_TIMEOUT_S = 600.0  # a change not listed by then is a failure


class ElasticCluster(abc.ABC):
    """A cluster of the block and a client of it: storage workers added and retired."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.base = len(self.workers())

    def workers(self) -> set[str]:
        from ..actors import workers_now

        return set(workers_now(self.client))

    @abc.abstractmethod
    def add_storage_worker(self, timeout_s: float = 120.0) -> tuple[str, float]:
        """Start one more storage worker; its address and the moment it was seen joined
        (perf_counter s)."""

    def retire(self, address: str, timeout_s: float = 120.0) -> None:
        """``client.retire_workers`` (the store host drains the worker's units first);
        returns once the worker is gone."""
        self.client.retire_workers([address], close_workers=True)
        self._wait_gone(address, timeout_s)

    def _wait_gone(self, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while address in self.workers() or self._lingering():
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} still running {timeout_s:.0f} s after retire_workers")
            time.sleep(0.05)

    def _lingering(self) -> bool:
        """A retired worker's process is still running (the kind's own bookkeeping)."""
        return False

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


class LocalElastic(ElasticCluster):
    """The ``local`` kind: a LocalCluster scaled by its spec."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        self.cluster = cluster
        super().__init__(client)

    def add_storage_worker(self, timeout_s: float = 120.0) -> tuple[str, float]:
        """Scale to one more worker (polled every 10 ms)."""
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
        """Retire, then shrink the spec to match (``cluster.scale`` alone would not drain:
        SpecCluster asks the scheduler to retire the worker by its name)."""
        self.client.retire_workers([address], close_workers=True)
        self.cluster.scale(len(self.cluster.worker_spec) - 1)
        self._wait_gone(address, timeout_s)

    def _lingering(self) -> bool:
        return len(self.cluster.workers) > len(self.cluster.worker_spec)


class HostsElastic(ElasticCluster):
    """The ``hosts`` kind: one CLI host (one worker) per storage worker."""

    def __init__(self, hosts: LocalHosts, client: Client) -> None:
        self.hosts = hosts
        super().__init__(client)

    def add_storage_worker(self, timeout_s: float = 120.0) -> tuple[str, float]:
        """Start a host of one storage worker; returns once it is registered."""
        host = self.hosts.add_host(ROLES, workers=1)
        return self.hosts.workers(host.name)[0], time.perf_counter()


@contextlib.contextmanager
def elastic_cluster(n_workers: int = 2, kind: str = "hosts") -> Iterator[ElasticCluster]:
    """``n_workers`` single-threaded storage workers of ``kind`` (module docstring), the
    store host preloaded in the scheduler."""
    from distributed import Client

    if kind == "hosts":
        from ..deploy.hosts import LocalHosts

        with LocalHosts() as hosts:
            address = hosts.start(port=0, dashboard_address="127.0.0.1:0")
            for _ in range(n_workers):
                hosts.add_host(ROLES, workers=1)
            with Client(address) as client:  # the default client: the store's handles bind to it
                yield HostsElastic(hosts, client)
        return

    from ..cluster import local_cluster

    with local_cluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0",
                       resources=dict(RESOURCES)) as cluster, Client(cluster) as client:
        client.wait_for_workers(n_workers)
        yield LocalElastic(cluster, client)


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
