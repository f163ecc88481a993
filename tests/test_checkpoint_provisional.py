"""A store checkpoint holds only rows acknowledged when it is taken: rows still
provisional under a restore's claim are left out, so restoring the checkpoint never
brings back rows that restore's rollback took back (nor makes ordinary rows a restore
might still lose). A row a restore revived (deleted while a checkpoint was open, staged
again provisional) is still written by the checkpoints open at its delete: it was live
when they began."""
from __future__ import annotations

import os

import pytest

from pipeline.store.batch_file import decode_batch
from pipeline.store.unit import StorageUnit
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("claim_ends", ["released", "settled"])
def test_a_checkpoint_during_a_restore_leaves_its_provisional_rows_out(store_factory, tmp_path, claim_ends):
    rows = make_rows(6, calls=1, tokens=32, seed=21)
    keys = [r.staging_key for r in rows]
    store = store_factory(n_units=2)
    assert not store.put_many(pack_rows(rows[:2])).failed  # acknowledged before the checkpoint
    assert sorted(store.put_claimed(pack_rows(rows[2:]), "restore-t").ok) == sorted(keys[2:])
    assert sum(s["provisional_rows"] for s in store.stats()) == 4
    path = str(tmp_path / "ckpt")
    store.checkpoint(path)
    if claim_ends == "released":  # the restore failed: its rows are taken back
        removed, failed = store.release_claim(keys[2:], "restore-t")
        assert removed == 4 and not failed
        assert sorted(store.keys()) == sorted(keys[:2])
    else:
        assert store.settle_claim("restore-t") == 4
    again = store_factory(n_units=2)
    again.restore(path)
    assert sorted(again.keys()) == sorted(keys[:2]), "only rows acknowledged when the checkpoint was taken"
    assert not again.get_many(keys[:2]).failed


def _written_keys(entries: list[dict], directory) -> list[str]:
    out: list[str] = []
    for e in entries:
        if "file" in e:
            with open(os.path.join(directory, e["file"]), "rb") as fh:
                out.extend(decode_batch(bytearray(fh.read())).keys)
    return out


def test_a_revived_row_is_written_by_the_checkpoints_open_at_its_delete_only(tmp_path):
    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path / "spill"))
    try:
        rows = make_rows(3, calls=1, tokens=32, seed=22)
        keys = [r.staging_key for r in rows]
        assert unit.put_many("staging", pack_rows(rows[:2])).ok == keys[:2]
        unit.begin_checkpoint("old")
        assert unit.delete("staging", keys[:1]).deferred == keys[:1]  # deleted while "old" is open
        unit.begin_checkpoint("new")  # began after the delete
        assert sorted(unit.put_many("staging", pack_rows(rows), claim="t").ok) == sorted(keys)
        assert unit.stats()["provisional_rows"] == 2  # the revived key and the new one
        for token, want in (("old", keys[:2]), ("new", keys[1:2]), (None, keys[1:2])):
            d = tmp_path / f"w-{token}"
            d.mkdir()
            got = _written_keys(unit.checkpoint_write(str(d), 1 << 20, token=token), d)
            assert sorted(got) == sorted(want), token
        assert unit.release_claim("staging", keys, "t")["deferred"] == keys[:1]
        d = tmp_path / "after"
        d.mkdir()  # the release deferred the delete again for the checkpoints open at it
        assert sorted(_written_keys(unit.checkpoint_write(str(d), 1 << 20, token="old"), d)) == sorted(keys[:2])
        d = tmp_path / "after-new"
        d.mkdir()  # ... and for those only: "new" began after the delete
        assert _written_keys(unit.checkpoint_write(str(d), 1 << 20, token="new"), d) == keys[1:2]
    finally:
        unit.close()
