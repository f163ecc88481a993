"""A handle made before a move (a copy pickled into a task, a controller's handle nothing
refreshed) still sees every row: a store checkpoint saved through it holds them all, its
key listing names them all, its figures cover every unit and its close closes them all.
The units refuse a checkpoint, a listing or a figures call planned on an older table; the
handle takes the newest table and asks again, waiting for it when a unit holds a newer
table than the unit directory gives yet.

Owned stores on test_elastic_edges's cluster, a unit added through ``Rebalancer``.
"""
from __future__ import annotations

import contextlib
import pickle
import threading
from typing import Iterator

import pytest

from pipeline.store.client import StagingStore
from pipeline.store.fence import Fence
from pipeline.store.placement import Placement
from tasks.packed import pack_rows
from test_elastic_edges import by_name, cluster, counter, owned, put_all, rows_of  # noqa: F401

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@contextlib.contextmanager
def after_a_move(cluster, seed: int, replicas: int = 1, handles: int = 1) -> Iterator[tuple]:
    """A store of units on workers a and b holding ``rows_of(seed)``, ``handles`` copies
    of its handle made then, and a unit added on worker c since: (store, rows, old
    handles, the add's record). The store is closed after."""
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=replicas)
    try:
        rows = rows_of(seed, groups=6)
        put_all(store, rows)
        old = [pickle.loads(pickle.dumps(store)) for _ in range(handles)]
        record = rb.add_unit(w["c"])
        assert record["rows_moved"] > 0 and all(len(h.units) == 2 for h in old)
        yield store, rows, old, record
    finally:
        store.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_checkpoint_through_a_handle_from_before_a_move_holds_every_row(cluster, tmp_path, replicas):
    with after_a_move(cluster, 31, replicas) as (store, rows, (old,), _):
        manifest = old.checkpoint(str(tmp_path / "ck"))
        assert manifest["rows"] == len(rows)
        assert old.version == store.version
        w = by_name(cluster)
        fresh = StagingStore.start(cluster, n_units=2, memory_limit="64MiB", workers=[w["a"], w["d"]])
        try:
            fresh.restore(str(tmp_path / "ck"))
            got = fresh.get_many([r.staging_key for r in rows])
            assert not got.failed, list(got.failed.items())[:2]
        finally:
            fresh.close()


def test_a_listing_and_the_figures_through_a_handle_from_before_a_move_cover_every_unit(cluster):
    with after_a_move(cluster, 32, handles=2) as (store, rows, (listing, old), _):
        assert sorted(listing.keys()) == sorted(r.staging_key for r in rows)
        assert listing.version == store.version
        figures = old.stats()  # stats() takes no table another handle fetched: it is refused too
        assert len(figures) == 3 and sum(f["rows"] for f in figures) == len(rows)
        assert old.version == store.version


def test_a_close_through_a_handle_from_before_a_move_closes_the_added_unit_too(cluster):
    with after_a_move(cluster, 34) as (store, _, (old,), record):
        closed = old.close_units()
        assert len(closed) == 3 and all("error" not in c for c in closed)
        added = store.units[store.placement.index_of(record["unit"])]
        assert added.close().result(30)["closed"] is True  # closed already: the old handle reached it


class AsyncUser:
    """An actor reading and writing through a store handle's async twins (its worker's
    event loop: the async driver's refresh)."""

    def __init__(self, store: StagingStore):
        self.store = store

    async def get_then_put(self, keys: list[str], batch) -> tuple[dict, dict, int]:
        got = await self.store.get_many_async(keys)
        put = await self.store.put_many_async(batch)
        return dict(got.failed), dict(put.failed), self.store.version


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_handle_told_moved_waits_for_the_directory_to_show_the_newer_table(cluster, driver):
    # The units hold a table the directory does not give yet (the window between a unit's
    # fence and what a handle's fetch sees): the handle's get and put, refused ``moved``,
    # wait for the newer table and are answered instead of failing every key.
    w = by_name(cluster)
    store, _ = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        rows, more = rows_of(35, groups=2), rows_of(36, groups=2)
        put_all(store, rows)
        keys = [r.staging_key for r in rows]
        user = cluster.submit(AsyncUser, pickle.loads(pickle.dumps(store)), actor=True, workers=[w["c"]]).result()
        old = pickle.loads(pickle.dumps(store))
        p = store.placement
        newer = Placement(p.version + 1, p.workers, p.unit_ids, p.replicas, p.homes)
        refused = counter(store, "moved_refusals")
        for uid, unit in zip(p.unit_ids, store.units):
            unit.set_fence(Fence.message(newer, uid, False)).result(30)
        publish = threading.Timer(0.5, store.install_placement, (newer, store.units))
        publish.start()
        try:
            if driver == "sync":
                got, put = old.get_many(keys), old.put_many(pack_rows(more))
                assert len(got.batch) == len(rows)
                got_failed, put_failed, version = got.failed, put.failed, old.version
            else:
                got_failed, put_failed, version = user.get_then_put(keys, pack_rows(more)).result(60)
        finally:
            publish.join()
        assert not got_failed, list(got_failed.items())[:2]
        assert not put_failed, list(put_failed.items())[:2]
        assert version == newer.version
        assert counter(store, "moved_refusals") > refused  # refused before the table showed
        assert not store.get_many([r.staging_key for r in more]).failed
    finally:
        store.close()


def test_a_copy_of_a_closed_stores_handle_fails_its_keys_instead_of_waiting_forever(cluster):
    # Closing the store replaces its unit directory's table by a marker: a copy's refresh
    # after the closed units answered learns the store is closed (no wait for a table, no
    # error on the scheduler) and the keys fail unit_unavailable.
    w = by_name(cluster)
    store, _ = owned(cluster, [w["a"], w["b"], w["c"]], replicas=2)
    rows = rows_of(37, groups=1)
    put_all(store, rows)
    old = pickle.loads(pickle.dumps(store))
    store.close()
    answers: list = []
    reader = threading.Thread(target=lambda: answers.append(old.get_many([r.staging_key for r in rows])), daemon=True)
    reader.start()
    reader.join(60)
    assert answers, "the get through the closed store's handle did not return within 60 s"
    assert {reason for reason, _ in answers[0].failed.values()} == {"unit_unavailable"}
    assert len(answers[0].failed) == len(rows)
    assert old.directory.closed
    assert not [m for _, m in cluster.get_scheduler_logs(n=1000) if "variable_get" in m]
