"""The workers connected now are asked of the scheduler, not read from the client's cache.

``Client.scheduler_info(n_workers=-1)`` refreshes the client's cached identity and answers
it, but the client's periodic refresh (which asks for no workers) can replace the cache in
between: under load a store then started on "no workers" with two connected.
"""
from __future__ import annotations

import pytest

from pipeline.actors import current_workers, workers_now

pytestmark = pytest.mark.timeout(60)


def test_workers_are_asked_of_the_scheduler_even_when_the_clients_cache_has_none(cluster_client, monkeypatch):
    expected = sorted(cluster_client.scheduler_info(n_workers=-1)["workers"])
    assert len(expected) == 2
    stale = dict(cluster_client.scheduler_info(n_workers=-1), workers={})  # what the race leaves behind
    monkeypatch.setattr(cluster_client, "scheduler_info", lambda *a, **k: stale)
    assert current_workers(cluster_client) == expected
    info = workers_now(cluster_client)
    assert sorted(info) == expected and all("resources" in w for w in info.values())


def test_the_pool_sees_its_workers_in_the_cluster_whatever_the_cache_says(cluster_client, monkeypatch):
    from pipeline.driver.pool import ActorPool

    workers = sorted(cluster_client.scheduler_info(n_workers=-1)["workers"])
    pool = object.__new__(ActorPool)  # only what slots_in_cluster reads
    pool.client, pool.workers = cluster_client, workers + ["tcp://127.0.0.1:1"]
    monkeypatch.setattr(cluster_client, "scheduler_info", lambda *a, **k: {"workers": {}})
    assert pool.slots_in_cluster([0, 1, 2]) == {0: True, 1: True, 2: False}
