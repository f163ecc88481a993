"""A lost storage unit costs a process ONE call that cannot reach it, not one per call.

Store handles are pickled into every task with the table they were made with; these tests
unpickle a handle made before a unit's worker was SIGKILLed, afresh for every call (as
each task does), and count through the process's :class:`~pipeline.store.unit_health.UnitHealth`:
calls that could not reach their unit, calls skipped, calls that ran out of their
deadline, tables taken from the process's memory. Real process cluster (named nannies:
the killed worker restarts at a new address; the unit it hosted is gone).
"""
from __future__ import annotations

import os
import pickle
import signal
import time

import dask
import numpy as np
import pytest

from pipeline.actors import workers_now
from pipeline.store import StagingStore
from pipeline.store.unit_health import unit_health
from rollout_factory import make_group
from support import named_nanny_cluster, wait_for_names, wait_until
from tasks.packed import pack_rows
from tasks.schema import STAGING_FIELDS

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def cluster():
    # No repair thread at work (the tests run the repair themselves, when they want it).
    settings = {"token-capture.store.replicas": 2, "token-capture.store.repair-interval-s": 600.0}
    with dask.config.set(settings), named_nanny_cluster({n: {} for n in "abcd"}) as client:
        yield client


def staged(client, tmp_path, tag: str, skip_s: float = 10.0):
    """A replicas=2 store of 3 units on a, b, c holding 8 rollouts' rows, and their keys
    (``skip_s``: its ``store.skip-unreachable-s``, which its pickled copies keep)."""
    names = wait_for_names(client, ["a", "b", "c"])
    settings = {"token-capture.store.replicas": 2, "token-capture.store.repair-interval-s": 600.0,
                "token-capture.store.skip-unreachable-s": skip_s}
    with dask.config.set(settings):
        store = StagingStore.start(client, n_units=3, workers=[names[n] for n in "abc"], spill_directory=str(tmp_path / tag))
    rng = np.random.default_rng(0)
    rows = [r for b in make_group(rng, "g0", 8, rollout_prefix=tag, n_calls=2, routes=(2, 2, 8), vocab_size=64) for r in b.rows]
    res = store.put_many(pack_rows(rows))
    assert not res.failed
    return store, [r.staging_key for r in rows]


def kill_unit_worker(client, store, u: int) -> None:
    pid = client.run(os.getpid, workers=[store.unit_workers[u]])[store.unit_workers[u]]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: store.unit_workers[u] not in workers_now(client), 30, "the worker gone")


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def test_a_lost_unit_is_called_once_then_skipped_until_replaced(cluster, tmp_path):
    """Five gets while a unit is down: one call to it, one directory fetch (the get that
    found it down), not five. A replacement is learned by the first get that fails over
    after ``store.skip-unreachable-s``, and taken by the process's later handles."""
    skip_s = 2.0  # long enough for five small gets (tens of ms each), short for the test
    store, keys = staged(cluster, tmp_path, "skip", skip_s)
    try:
        old = pickle.dumps(store)  # the table a task gets before the loss
        kill_unit_worker(cluster, store, 0)
        health = unit_health()
        start = health.figures()
        for i in range(5):  # five tasks, each with its own copy of the old handle
            got = pickle.loads(old).get_many(keys, list(STAGING_FIELDS), timeout=30)
            assert not got.failed and got.batch.keys == keys  # read from the replicas
            if i == 0:
                first_done = time.monotonic()  # its unit mark and directory ask are before this
        d = delta(start, health.figures())
        assert d["unreachable"] == 1  # the first copy found unit 0 gone; the others did not call it
        assert d["skipped"] >= 4 and d["timeouts"] == 0
        assert d["tables_fetched"] == 1 and d["refreshes_spared"] == 4  # one round trip, not five

        # Replaced: the first get that fails over once the window is over asks the
        # directory, and leaves the new table to the process's later copies.
        with cluster.as_current():
            assert store.owner.repairer.check() == [0]
        time.sleep(max(0.0, first_done + skip_s - time.monotonic()))
        pickle.loads(old).get_many(keys, list(STAGING_FIELDS), timeout=30)
        mid = health.figures()
        assert mid["tables_fetched"] - start["tables_fetched"] == 2
        for _ in range(2):
            got = pickle.loads(old).get_many(keys, list(STAGING_FIELDS), timeout=30)
            assert not got.failed and got.batch.keys == keys
        d = delta(mid, health.figures())
        assert d["tables_taken"] == 2 and d["skipped"] == 0 and d["unreachable"] == 0 and d["tables_fetched"] == 0
    finally:
        store.close()


def test_a_delete_fails_fast_on_a_lost_unit_and_clears_the_live_copies(cluster, tmp_path):
    """From a client whose own ``timeout`` (its connection pool's connect wait) is longer
    than the delete's deadline: the dead unit's call fails on the connect timeout, not on
    the deadline, and the live copies are deleted."""
    from distributed import Client

    store, keys = staged(cluster, tmp_path, "del")
    try:
        old = pickle.dumps(store)
        kill_unit_worker(cluster, store, 1)
        loc = store.placement.locate(keys)
        on_dead = {k for k, p, r in zip(keys, loc.primary, loc.replica) if 1 in (p, r)}
        with Client(cluster.scheduler.address, timeout=60) as patient, patient.as_current():
            health = unit_health()
            start = health.figures()
            res = pickle.loads(old).delete(keys, timeout=20)  # handles bind to ``patient``
            d = delta(start, health.figures())
        assert d["timeouts"] == 0 and d["unreachable"] + d["skipped"] >= 1
        assert sorted(res.ok) == sorted(set(keys) - on_dead)
        assert {k for k, (reason, _) in res.failed.items() if reason == "unit_unavailable"} == on_dead
        assert sum(store.units[u].stats().result()["rows"] for u in (0, 2)) == 0  # every live copy gone
    finally:
        store.close()


def test_a_closed_unit_fails_over_and_is_not_called_again(cluster, tmp_path):
    """A unit that answers it is closed (it stays closed) fails its keys over to their
    replicas like a lost one, and is remembered the same way: counted as closed, not as
    unreachable, and not called again by the process's later handles."""
    store, keys = staged(cluster, tmp_path, "closed")
    try:
        old = pickle.dumps(store)
        store.units[0].close().result()
        health = unit_health()
        start = health.figures()
        for _ in range(3):
            got = pickle.loads(old).get_many(keys, list(STAGING_FIELDS), timeout=30)
            assert not got.failed and got.batch.keys == keys  # read from the replicas
        d = delta(start, health.figures())
        assert d["closed"] == 1 and d["unreachable"] == 0 and d["timeouts"] == 0
        assert d["skipped"] >= 2
    finally:
        store.close()
