"""A move and the store's records of key NAMES (``store.replicas: 2``): lost keys and
witnessed names must follow their keys to the units the new table gives them, leave the
units it does not, and never outlive a delete made during the move.

The state a double loss leaves (both copies' units record the key lost, no row) is made
directly with the units' ``mark_lost``, as the repairer makes it; then a unit is added.
"""
from __future__ import annotations

import pytest

from pipeline.store.fence import Fence
from pipeline.store.moved_names import HandedNames, names_to_drop, names_to_hand, witness_ids
from pipeline.store.moves import copies_of
from pipeline.store.placement import Placement
from pipeline.store.protocol import LOST_KEY, pack_names
from pipeline.store.unit import StorageUnit
from tasks.keys import STAGING_PARTITION
from tasks.packed import PackedBatch
# test_elastic_edges's cluster (four nannies, the store host) for this module.
from test_elastic_edges import by_name, cluster, owned, put_all, rows_of  # noqa: F401


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_a_lost_key_stays_lost_and_witnessed_names_follow_their_keys_across_a_move(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"], w["c"]], replicas=2)
    try:
        rows = rows_of(11, groups=6)
        keys = [r.staging_key for r in rows]
        put_all(store, rows)
        # Keys the new unit will hold a copy of: the move takes them.
        after = store.placement.with_unit("3", w["d"])
        loc = after.locate(keys)
        taken = [k for k, p in zip(keys, loc.primary) if p == 3]  # the new unit becomes their primary
        assert taken
        gone = taken[0]
        before = store.placement.locate([gone])
        assert not store.delete([gone]).failed
        for u in (int(before.primary[0]), int(before.replica[0])):  # what a double loss's repair leaves
            store.units[u].mark_lost(STAGING_PARTITION, pack_names([gone]), "units lost together (test)").result(30)
        assert store.get_many([gone]).failed[gone][0] == LOST_KEY
        rb.add_unit(w["d"])
        assert store.moving is None
        # The lost key still reads lost, and refuses new content.
        assert store.get_many([gone]).failed[gone][0] == LOST_KEY, store.get_many([gone]).failed
        # Each unit witnesses the names the new table gives it.
        live = [k for k in keys if k != gone]
        for v, names in store.placement.witnesses_of(live).items():
            held = set(store.units[v].witnessed_keys(STAGING_PARTITION).result(30))
            missing = [k for k in names if k not in held]
            assert not missing, (v, len(missing), len(names))
        # ... and the units the new table does not give them hold neither.
        final, ids = store.placement, store.placement.unit_ids
        holders = copies_of(final, [gone])[0]
        for v, unit in enumerate(store.units):
            lost = unit.lost_keys(STAGING_PARTITION).result(30)
            assert (gone in lost) == (ids[v] in holders), (ids[v], holders)
            names = list(unit.witnessed_keys(STAGING_PARTITION).result(30))
            assert set(witness_ids(final, names)) <= {ids[v]}, ids[v]
    finally:
        store.close()


def test_a_moved_lost_key_deleted_during_the_move_is_not_recorded_and_a_drop_forgets_one(tmp_path):
    """The target's side: a lost-key record the move hands over after a delete of that
    key reached the target (a tombstone) is skipped, like a row; one not deleted is
    recorded; the drop step forgets a record the final table no longer gives the unit."""
    unit = StorageUnit(2, 1 << 26, 1 << 28, spill_directory=str(tmp_path))
    t0 = Placement(4, ("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002", "tcp://127.0.0.1:4003"), replicas=2)
    t1 = t0.with_unit("3", "tcp://127.0.0.1:4004")
    keys = [k for k in (f"r{i}/c0" for i in range(400)) if "2" in copies_of(t1, [k])[0]][:2]
    kept, deleted, part = keys[0], keys[1], STAGING_PARTITION
    empty = PackedBatch([], {})
    try:
        unit.set_fence(Fence.message(t1, "2", True, t0))
        unit.delete(part, [deleted], version=t1.version)  # reaches the new holder first
        assert unit.move_in(part, empty, {kept: "units 0 and 1 lost together", deleted: "same"}) == 0
        assert set(unit.lost_keys(part)) == {kept}
        assert unit.get_many(part, [deleted]).failed[deleted][0] == "missing_key"
        assert unit.get_many(part, [kept]).failed[kept][0] == LOST_KEY
        unit.drop(part, pack_names([kept]))
        assert not unit.lost_keys(part) and unit.get_many(part, [kept]).failed[kept][0] != LOST_KEY
    finally:
        unit.close()


def _table() -> tuple[Placement, Placement]:
    t0 = Placement(1, tuple(f"tcp://127.0.0.1:40{i:02d}" for i in range(4)), replicas=2)
    return t0, t0.with_unit("4", "tcp://127.0.0.1:4099")


def test_names_are_handed_to_their_new_witness_from_listings_and_old_witnesses():
    old, new = _table()
    keys = [f"r{i}/c0" for i in range(300)]
    w0, w1 = witness_ids(old, keys), witness_ids(new, keys)
    changed = [k for k, a, b in zip(keys, w0, w1) if a != b]
    assert changed
    listed = {"0": keys[:150]}  # rows some unit lists
    witnessed = {u: [k for k, w in zip(keys, w0) if w == u] for u in old.unit_ids}  # every name on its old witness
    hand = names_to_hand(new, listed, witnessed)
    got = {k for names in hand.values() for k in names}
    assert got == set(changed)  # every changed name, the unchanged ones not again
    assert all(w1[keys.index(k)] == u for u, names in hand.items() for k in names)


def test_names_dropped_are_those_the_final_table_moves_away_and_those_deleted_during_the_move():
    old, new = _table()
    final = Placement(new.version + 1, new.workers, new.unit_ids, new.replicas, new.homes)
    keys = [f"r{i}/c0" for i in range(300)]
    w1 = witness_ids(final, keys)
    mine = [k for k, w in zip(keys, w1) if w == "4"]
    elsewhere = [k for k, w in zip(keys, w1) if w != "4"][:3]
    deleted, live = mine[0], mine[1:]
    handed = HandedNames({"4": mine}, frozenset(keys))
    now = {"0": [k for k in keys if k != deleted]}  # the delete reached every holder
    drop = names_to_drop(final, {"4": mine + elsewhere}, handed, now)
    assert sorted(drop["4"]) == sorted([deleted] + elsewhere)
    assert not set(drop["4"]) & set(live)
