"""Deletes with two copies per key (``store.replicas: 2``) while one copy's unit hangs.

In-process cluster (``processes=False``) so a unit can be made to hang by patching
``StorageUnit`` in this process: the patched ``delete`` blocks unit 0's actor thread on a
``threading.Event`` that only the test's teardown sets, exactly as a live unit that
stopped answering.
"""
from __future__ import annotations

import threading

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.store import StagingStore
from pipeline.store.protocol import MISSING_KEY, UNIT_UNAVAILABLE
from pipeline.store.unit import StorageUnit
from tasks.errors import StoreUnavailable
from rollout_factory import make_group
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8
HUNG = 0  # the unit made to hang


@pytest.fixture(scope="module")
def client():
    with dask.config.set({"token-capture.store.replicas": 2}), LocalCluster(
        n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None,
        worker_dashboard_address="127.0.0.1:0",
    ) as cluster, Client(cluster) as c:
        yield c


def staged_rows(store: StagingStore):
    rng = np.random.default_rng(3)
    groups = [make_group(rng, f"g{g}", 4, rollout_prefix=f"del{g}", n_calls=2, routes=(L, K, E), vocab_size=VOCAB)
              for g in range(3)]
    rows = [r for bs in groups for b in bs for r in b.rows]
    assert not store.put_many(pack_rows(rows)).failed
    return rows


def test_a_retried_delete_is_not_missing_while_a_copy_stays_on_a_hung_unit(client, tmp_path, monkeypatch):
    """A delete removes the live copy and times out on the hung one: ``unit_unavailable``.
    Asked again while the unit still hangs, the key is NOT ``missing_key`` (one copy
    missing, the other unanswered): a caller taking missing for gone (the cut does) would
    stop retrying while a copy stays, readable again once its unit answers (or, for a call
    that never reached it, for good)."""
    with dask.config.set({"token-capture.store.replicas": 2}):
        store = StagingStore.start(client, n_units=2, spill_directory=str(tmp_path / "spill"))
    release = threading.Event()
    orig = StorageUnit.delete

    def hung(self, *a, **kw):
        if self.unit_index == HUNG and not release.is_set():
            release.wait(100)
        return orig(self, *a, **kw)

    try:
        assert store.replicas == 2
        rows = staged_rows(store)
        keys = [r.staging_key for r in rows]
        primary, _ = store.placement.route(keys)
        on_hung = [k for k, p in zip(keys, primary) if p == HUNG]  # the hung unit is their primary
        assert on_hung
        monkeypatch.setattr(StorageUnit, "delete", hung)
        first = store.delete(on_hung, timeout=2.0)
        assert {r for r, _ in first.failed.values()} == {UNIT_UNAVAILABLE} and not first.ok
        again = store.delete(on_hung, timeout=2.0)
        assert not again.ok
        reasons = {k: r for k, (r, _) in again.failed.items()}
        assert set(reasons) == set(on_hung)
        assert MISSING_KEY not in reasons.values(), reasons
        assert set(reasons.values()) == {UNIT_UNAVAILABLE}
    finally:
        release.set()
        store.close()


class _Answers:
    """A unit handle whose ``keys`` call answers ``keys`` or raises ``error`` (an unreachable unit)."""

    def __init__(self, keys: list[str] | None = None, error: Exception | None = None):
        self._keys, self._error = keys or [], error

    def keys(self, partition: str, version: int | None = None):
        from concurrent.futures import Future

        f: Future = Future()
        f.set_exception(self._error) if self._error else f.set_result(list(self._keys))
        return f


def test_listing_during_a_drain_survives_the_leaving_unit_being_unreachable():
    """Mid-move, the unit being drained (the last of the handle's units, outside the new
    table) cannot be reached: every key it holds has another copy on a reachable unit of
    the old table, so the listing is complete and returned (no IndexError from ranking a
    unit the new table does not have)."""
    from pipeline.store.moving import MovingTable
    from pipeline.store.placement import Placement

    workers = ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3")
    old = Placement(1, workers, ("0", "1", "2"), 2)
    new = old.without_unit("2")
    keys = [f"r{i}/c0" for i in range(30)]
    loc = old.locate(keys)
    held = {u: [k for k, p, r in zip(keys, loc.primary, loc.replica) if u in (p, r)] for u in range(3)}
    units = [_Answers(held[0]), _Answers(held[1]), _Answers(error=OSError("connection refused"))]
    store = StagingStore(units[:2], new.workers, placement=new)
    store.units, store.moving = units, MovingTable(new, old)  # as install_moving leaves a handle
    assert sorted(store.keys()) == sorted(keys)
    # Both copies' units unreachable: never a partial listing.
    units[0] = _Answers(error=OSError("connection refused"))
    with pytest.raises(StoreUnavailable):
        store.keys()
