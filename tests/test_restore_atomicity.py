"""A failed restore takes back exactly what it created: every copy of each of its keys
(replicas=2 included), and never a row another writer had acknowledged meanwhile.

Rows a restore creates are provisional under its claim; a rollback releases the claim's
rows on every unit holding a copy. Counted on the units themselves (``rows``,
``released_rows``, ``provisional_rows``)."""
from __future__ import annotations

import dask
import pytest

from pipeline.store import checkpoint as ck
from pipeline.store.unit import StorageUnit
from pipeline.store.placement import Placement
from tasks.errors import RestoreIncomplete
from tasks.packed import pack_rows

from test_store import make_rows

pytestmark = pytest.mark.timeout(180)


def _saved(store_factory, tmp_path, rows) -> str:
    src = store_factory(n_units=1)
    assert not src.put_many(pack_rows(rows)).failed
    path = str(tmp_path / "ckpt")
    src.checkpoint(path)
    return path


def _row_bytes(store_factory, rows) -> int:
    """The largest weight (bytes) one of ``rows`` is charged on a unit."""
    one = store_factory(n_units=1)
    most = 0
    for r in rows:
        before = one.stats()[0]["used_bytes"]
        assert not one.put_many(pack_rows([r])).failed
        most = max(most, one.stats()[0]["used_bytes"] - before)
    return most


def test_replicated_restore_failing_on_one_copy_keeps_neither(store_factory, tmp_path):
    """Units 0, 1, 2 on two workers: unit 1, alone on its worker, holds a copy of every
    key (units 0's and 2's keys need their other copy on another worker), so it fills
    first and refuses some keys whose other copy was written."""
    rows = make_rows(8, calls=2, tokens=48, seed=11)
    path = _saved(store_factory, tmp_path, rows)
    keys = [r.staging_key for r in rows]
    # The store's placement as it will be: round-robin over two workers of one host.
    loc = Placement(0, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:1"), replicas=2).locate(keys)
    load = {u: int(((loc.primary == u) | (loc.replica == u)).sum()) for u in range(3)}
    assert load[1] == len(keys), f"unit 1 holds a copy of every key: {load}"
    room = max(load[0], load[2])  # rows every unit but unit 1 can hold
    assert load[1] > room, f"unit 1 must overflow alone: {load}"
    capacity = room * _row_bytes(store_factory, rows)
    with dask.config.set({"token-capture.store.replicas": 2}):
        store = store_factory(n_units=3, capacity=capacity)
    assert store.placement.locate(keys).replica.tolist() == loc.replica.tolist()

    with pytest.raises(RestoreIncomplete) as info:
        store.restore(path)
    err = info.value
    assert {reason for reason, _ in err.failed.values()} == {"store_full"}
    failed_loc = store.placement.locate(list(err.failed))
    half_written = [k for k, p, r in zip(err.failed, failed_loc.primary, failed_loc.replica) if 1 in (p, r)]
    assert half_written, "some failed key had its other copy written"
    stats = store.stats()
    assert [s["rows"] for s in stats] == [0, 0, 0], "no copy of any restored key stays"
    assert sum(s["released_rows"] for s in stats) == err.removed > 0
    assert store.keys() == []
    got = store.get_many([r.staging_key for r in rows])
    assert {reason for reason, _ in got.failed.values()} == {"missing_key"} and len(got.failed) == len(rows)
    # The rightful content can be put again: no key_conflict left behind by a stray copy.
    retry = [r for r in rows if r.staging_key in half_written][:2]
    assert not store.put_many(pack_rows(retry)).failed


def test_a_failed_restore_never_removes_a_row_another_writer_put_meanwhile(store_factory, tmp_path, monkeypatch):
    rows = make_rows(4, calls=2, tokens=48, seed=12)
    path = _saved(store_factory, tmp_path, rows)
    target = store_factory(n_units=2)
    # One checkpoint key already holds DIFFERENT content: the restore fails (key_conflict).
    clash = [r for r in make_rows(4, calls=2, tokens=48, seed=99) if r.staging_key == rows[0].staging_key]
    assert not target.put_many(pack_rows(clash)).failed
    writer_row = rows[3]

    real_rollback = ck._rollback

    def writer_puts_before_rollback(*args, **kwargs):
        # Another writer stages a row the restore has just created, with the same content:
        # the store acknowledges it (ok). From then on it is that writer's row.
        assert target.put_many(pack_rows([writer_row])).ok == [writer_row.staging_key]
        return real_rollback(*args, **kwargs)

    monkeypatch.setattr(ck, "_rollback", writer_puts_before_rollback)
    with pytest.raises(RestoreIncomplete) as info:
        target.restore(path)
    assert set(info.value.failed) == {rows[0].staging_key}
    assert sorted(target.keys()) == sorted([rows[0].staging_key, writer_row.staging_key])
    got = target.get_many([writer_row.staging_key])
    assert not got.failed, "the acknowledged row survived the rollback"
    assert sum(s["provisional_rows"] for s in target.stats()) == 0


def test_a_successful_restore_leaves_no_provisional_rows(store_factory, tmp_path):
    rows = make_rows(3, calls=2, tokens=48, seed=13)
    path = _saved(store_factory, tmp_path, rows)
    target = store_factory(n_units=2)
    assert target.restore(path)["rows"] == len(rows)
    assert sum(s["provisional_rows"] for s in target.stats()) == 0


def test_unit_claims_release_only_rows_nobody_else_put(tmp_path):
    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path))
    try:
        rows = make_rows(3, calls=1, tokens=32, seed=14)
        keys = [r.staging_key for r in rows]
        assert unit.put_many("staging", pack_rows(rows[:1])).ok == keys[:1]  # held before
        assert sorted(unit.put_many("staging", pack_rows(rows), claim="t").ok) == sorted(keys)
        assert unit.stats()["provisional_rows"] == 2  # the row held before is not the claim's
        assert unit.put_many("staging", pack_rows(rows[1:2])).ok == keys[1:2]  # another writer
        assert unit.stats()["provisional_rows"] == 1
        assert unit.put_many("staging", pack_rows(rows[2:]), claim="t").ok == keys[2:]  # its own retry
        out = unit.release_claim("staging", keys, "other-claim")
        assert out["removed"] == 0 and unit.stats()["rows"] == 3
        out = unit.release_claim("staging", keys, "t")
        assert out["removed"] == 1 and sorted(out["kept"]) == sorted(keys[:2])
        assert unit.keys("staging") == keys[:2]
        assert unit.counters["released_rows"] == 1
    finally:
        unit.close()


@pytest.mark.parametrize("ends_first", [False, True], ids=["fails-during-checkpoint", "fails-after-it"])
def test_a_failed_restore_undoes_its_revival_of_a_key_deleted_during_a_checkpoint(tmp_path, ends_first):
    """A key deleted while a store checkpoint is open keeps its row until the checkpoint
    ends; a restore staging it again (same content) revives it. If the restore then
    fails, the acknowledged delete stands: deferred again while the checkpoint is open
    (it may still write the row), applied at once after it ended. The revived key used
    to be no row of the restore's, so its rollback kept it: a deleted key came back."""
    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path))
    try:
        rows = make_rows(2, calls=1, tokens=32, seed=15)
        keys = [r.staging_key for r in rows]
        assert unit.put_many("staging", pack_rows(rows)).ok == keys
        unit.begin_checkpoint("ck")
        assert unit.delete("staging", keys[:1]).deferred == keys[:1]  # acknowledged: deleted for every writer
        assert unit.put_many("staging", pack_rows(rows), claim="t").ok == keys  # the restore stages both again
        assert unit.stats()["provisional_rows"] == 1  # only the deleted one is the restore's
        if ends_first:
            assert unit.end_checkpoint("ck")["applied"] == 0  # revived: the restore's row now
        out = unit.release_claim("staging", keys, "t")  # the restore failed elsewhere
        assert out["kept"] == keys[1:] and unit.keys("staging") == keys[1:]
        if not ends_first:
            assert out["removed"] == 0 and out["deferred"] == keys[:1]
            assert not unit.get_many("staging", keys[:1]).failed  # the checkpoint may still write it
            assert unit.end_checkpoint("ck")["applied"] == 1
        else:
            assert out["removed"] == 1
        assert set(unit.get_many("staging", keys).failed) == set(keys[:1])
        assert unit.keys("staging") == keys[1:] and unit.stats()["provisional_rows"] == 0
    finally:
        unit.close()
