"""A move and a restore's provisional rows: a row moved while provisional under a claim
stays provisional under it on its new unit, so releasing the claim afterwards takes back
every copy and settling it makes every copy ordinary. A claim settled or released while
the move is in flight (it reached the source, not the row's new holder) is caught up
after the copy; a release during a move reaches both tables' copies.

Owned stores on test_elastic_edges's cluster, driven through ``Rebalancer`` directly.
"""
from __future__ import annotations

import pickle

import pytest

from pipeline.store.moves import copies_of
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from test_elastic_edges import by_name, cluster, owned, rows_of  # noqa: F401

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
PART = STAGING_PARTITION


def stage(store, rows) -> tuple[list[str], list[str]]:
    """Half the rows provisional under restore-x (to be released), half under restore-y
    (to be settled); their keys."""
    half = len(rows) // 2
    x, y = [r.staging_key for r in rows[:half]], [r.staging_key for r in rows[half:]]
    assert sorted(store.put_claimed(pack_rows(rows[:half]), "restore-x").ok) == sorted(x)
    assert sorted(store.put_claimed(pack_rows(rows[half:]), "restore-y").ok) == sorted(y)
    return x, y


def moved_keys(store, before, keys: list[str]) -> list[str]:
    """Keys with a copy on a unit that did not hold one before the change."""
    after = store.placement
    return [k for k, b, a in zip(keys, copies_of(before, keys), copies_of(after, keys)) if set(a) - set(b)]


def check_released_and_settled(store, x: list[str], y: list[str]) -> None:
    """restore-x released, restore-y settled: x on no unit, y on each of its holders,
    ordinary (a release of restore-y takes nothing), nothing provisional anywhere."""
    store.settle_claim("restore-y")
    removed, failed = store.release_claim(x, "restore-x")
    assert not failed
    final, ids = store.placement, store.placement.unit_ids
    for v, unit in enumerate(store.units):
        held = set(unit.keys(PART).result(30))
        assert not held & set(x), (ids[v], sorted(held & set(x))[:3])
        assert unit.stats().result(30)["provisional_rows"] == 0, ids[v]
    for k, holders in zip(y, copies_of(final, y)):
        for h in holders:
            assert k in set(store.units[final.index_of(h)].keys(PART).result(30)), (k, h)
    assert store.release_claim(y, "restore-y") == (0, {})
    got = store.get_many(x + y)
    assert set(got.failed) == set(x), list(got.failed.items())[:2]


@pytest.mark.parametrize("replicas", [1, 2])
def test_rows_moved_to_an_added_unit_stay_provisional_under_their_claim(cluster, replicas):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=replicas)
    try:
        x, y = stage(store, rows_of(21, groups=6))
        before = store.placement
        record = rb.add_unit(w["c"])
        assert record["rows_moved"] > 0
        assert moved_keys(store, before, x) and moved_keys(store, before, y)  # the move took some of each
        new = store.units[store.placement.index_of(record["unit"])]
        assert new.stats().result(30)["provisional_rows"] == new.stats().result(30)["rows"] > 0
        check_released_and_settled(store, x, y)
    finally:
        store.close()


def test_rows_moved_off_a_drained_unit_stay_provisional_under_their_claim(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"], w["c"]], replicas=1)
    try:
        x, y = stage(store, rows_of(22, groups=6))
        rb.drain_unit("2")
        assert store.placement.unit_ids == ("0", "1")
        check_released_and_settled(store, x, y)
    finally:
        store.close()


def test_a_claim_settled_or_released_while_its_rows_are_in_flight_is_caught_up(cluster):
    """The copy landed, the claim's settle and release reached the sources only (as when
    they ran between a source's read and the target's write): after the move, restore-x's
    rows are gone from every unit, restore-y's ordinary on every holder."""
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=2)
    try:
        x, y = stage(store, rows_of(23, groups=6))
        sources = list(store.units)
        copy = rb._copy

        def copy_then_claims_reach_the_sources(by_id, partition, transfers):
            out = copy(by_id, partition, transfers)
            for u in sources:
                u.settle_claim("restore-y").result(30)
                u.release_claim(partition, x, "restore-x").result(30)
            return out

        rb._copy = copy_then_claims_reach_the_sources
        record = rb.add_unit(w["c"])
        final = store.placement
        for v, unit in enumerate(store.units):
            assert not set(unit.keys(PART).result(30)) & set(x), final.unit_ids[v]
            assert unit.stats().result(30)["provisional_rows"] == 0, final.unit_ids[v]
        for k, holders in zip(y, copies_of(final, y)):
            for h in holders:
                assert k in set(store.units[final.index_of(h)].keys(PART).result(30)), (k, h)
        got = store.get_many(x + y)
        assert set(got.failed) == set(x)
        assert record["claims_caught_up"] > 0
        # The catch-up's rows were sent again: the move counts each moved row once.
        figures = store.stats()
        assert sum(f["sent_rows"] for f in figures) == sum(f["moved_in_rows"] for f in figures) == record["rows_moved"]
    finally:
        store.close()


def test_a_release_during_a_move_reaches_the_old_holders_too(cluster):
    """Released after the move is published, before its copy: the old holders' rows go
    too, so none is copied to the new unit and none stays there."""
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        x, y = stage(store, rows_of(24, groups=6))
        copy = rb._copy
        released: list[int] = []

        def release_then_copy(by_id, partition, transfers):
            assert store.moving is not None
            if partition == PART:
                released.append(store.release_claim(x, "restore-x", partition=partition)[0])
            return copy(by_id, partition, transfers)

        rb._copy = release_then_copy
        rb.add_unit(w["c"])
        assert released == [len(x)]
        for unit in store.units:
            assert not set(unit.keys(PART).result(30)) & set(x)
        store.settle_claim("restore-y")
        assert all(u.stats().result(30)["provisional_rows"] == 0 for u in store.units)
        assert not store.get_many(y).failed
    finally:
        store.close()


def test_a_handle_from_before_a_move_releases_and_settles_the_moved_copies(cluster):
    """A restore's handle pickled before a unit was added (as into a task) still names
    the old table: its claim calls are refused ``moved`` by the fenced units, so it takes
    the new table and asks again, reaching the copies on the added unit."""
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        x, y = stage(store, rows_of(25, groups=6))
        old = pickle.loads(pickle.dumps(store))
        before = store.placement
        rb.add_unit(w["c"])
        assert old.version < store.version and len(old.units) == 2
        assert moved_keys(store, before, x) and moved_keys(store, before, y)
        assert old.settle_claim("restore-y") == len(y)
        assert old.release_claim(x, "restore-x") == (len(x), {})
        assert old.version == store.version
        refused = sum(u.stats().result(30)["moved_refusals"] for u in store.units)
        assert refused > 0  # the old handle's first calls were refused, not served
        for v, unit in enumerate(store.units):
            assert not set(unit.keys(PART).result(30)) & set(x), store.placement.unit_ids[v]
            assert unit.stats().result(30)["provisional_rows"] == 0, store.placement.unit_ids[v]
        assert not store.get_many(y).failed
    finally:
        store.close()
