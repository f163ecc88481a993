"""A handle made before a move (a copy pickled into a task, a controller's handle nothing
refreshed) still sees every row: a store checkpoint saved through it holds them all, its
key listing names them all and its figures cover every unit. The units refuse a
checkpoint, a listing or a figures call planned on an older table; the handle takes the
newest table and asks again.

Owned stores on test_elastic_edges's cluster, a unit added through ``Rebalancer``.
"""
from __future__ import annotations

import pickle

import pytest

from pipeline.store.client import StagingStore
from test_elastic_edges import by_name, cluster, owned, put_all, rows_of  # noqa: F401

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_checkpoint_through_a_handle_from_before_a_move_holds_every_row(cluster, tmp_path, replicas):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=replicas)
    fresh = None
    try:
        rows = rows_of(31, groups=6)
        put_all(store, rows)
        old = pickle.loads(pickle.dumps(store))
        record = rb.add_unit(w["c"])
        assert record["rows_moved"] > 0 and len(old.units) == 2
        manifest = old.checkpoint(str(tmp_path / "ck"))
        assert manifest["rows"] == len(rows)
        assert old.version == store.version
        fresh = StagingStore.start(cluster, n_units=2, memory_limit="64MiB", workers=[w["a"], w["d"]])
        fresh.restore(str(tmp_path / "ck"))
        keys = [r.staging_key for r in rows]
        got = fresh.get_many(keys)
        assert not got.failed, list(got.failed.items())[:2]
    finally:
        store.close()
        if fresh is not None:
            fresh.close()


def test_a_listing_and_the_figures_through_a_handle_from_before_a_move_cover_every_unit(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        rows = rows_of(32, groups=6)
        put_all(store, rows)
        listing, old = pickle.loads(pickle.dumps(store)), pickle.loads(pickle.dumps(store))
        assert rb.add_unit(w["c"])["rows_moved"] > 0
        assert sorted(listing.keys()) == sorted(r.staging_key for r in rows)
        assert listing.version == store.version
        figures = old.stats()  # stats() takes no table another handle fetched: it is refused too
        assert len(figures) == 3 and sum(f["rows"] for f in figures) == len(rows)
        assert old.version == store.version
    finally:
        store.close()
