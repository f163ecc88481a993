"""Listing while a store checkpoint defers deletes: a key deleted under an open checkpoint
is acknowledged and no longer listed (``StorageUnit.keys``, ``StagingStore.keys``), though
its row stays readable until the checkpoint ends, which removes it.
"""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.store import checkpoint as checkpoint_mod
from pipeline.store.unit import StorageUnit
from rollout_factory import make_rollout
from support import store_maker
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)


def test_a_unit_lists_no_key_whose_delete_a_checkpoint_defers(tmp_path):
    rng = np.random.default_rng(11)
    unit = StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging", "cut"])
    built = make_rollout(rng, "dl-r0", n_calls=3)
    keys = [r.staging_key for r in built.rows]
    assert len(keys) == 3 and not unit.put_many("staging", pack_rows(built.rows)).failed
    unit.begin_checkpoint("ck")
    res = unit.delete("staging", keys[1:2])
    assert res.ok == keys[1:2] and res.deferred == keys[1:2]
    assert unit.keys("staging") == [keys[0], keys[2]]  # insertion order, the deleted one left out
    assert unit.deferred_keys("staging") == keys[1:2]
    got = unit.get_many("staging", keys[1:2], ["token_ids"])  # the row stays: the checkpoint may write it
    assert not got.failed and list(got.batch.keys) == keys[1:2]
    np.testing.assert_array_equal(got.batch.fields["token_ids"].row(0), built.rows[1].token_ids)
    assert unit.stats()["rows"] == 3 and unit.stats()["pending_deletes"] == 1
    assert unit.end_checkpoint("ck")["applied"] == 1
    assert unit.keys("staging") == [keys[0], keys[2]] and unit.deferred_keys("staging") == []
    assert set(unit.get_many("staging", keys[1:2], ["token_ids"]).failed) == set(keys[1:2])
    s = unit.stats()
    assert s["rows"] == 2 and s["deleted_rows"] == 1 and s["deferred_rows"] == 1
    assert s["open_checkpoints"] == 0 and s["pending_deletes"] == 0
    unit.close()


def test_the_store_lists_no_key_deleted_during_a_checkpoint(inprocess_client, tmp_path, monkeypatch):
    rng = np.random.default_rng(12)
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        store = make(n_units=2)
        builts = [make_rollout(rng, f"dl-s{i}", n_calls=2) for i in range(6)]
        assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
        keys = [r.staging_key for b in builts for r in b.rows]
        doomed, kept = keys[::3], [k for i, k in enumerate(keys) if i % 3]
        seen = {}
        settle_all = checkpoint_mod.settle_all

        def settle_then_delete(futures, end=None):
            out = settle_all(futures, end)
            if not seen:  # right after the save opened on every unit, before any unit writes
                seen["res"] = store.delete(doomed)
                seen["listed"] = store.keys()
                seen["read"] = store.get_many(doomed, ["token_ids"])
            return out

        monkeypatch.setattr(checkpoint_mod, "settle_all", settle_then_delete)
        manifest = store.checkpoint(str(tmp_path / "ckpt"))
        assert sorted(seen["res"].ok) == sorted(doomed) and sorted(seen["res"].deferred) == sorted(doomed)
        assert sorted(seen["listed"]) == sorted(kept)  # deleted: not listed, though ...
        assert not seen["read"].failed and sorted(seen["read"].batch.keys) == sorted(doomed)  # ... still read
        assert manifest["rows"] == len(keys)  # and checkpointed
        assert sorted(store.keys()) == sorted(kept)
        assert set(store.get_many(doomed, ["token_ids"]).failed) == set(doomed)  # gone once it ended
        assert sum(s["rows"] for s in store.stats()) == len(kept)


def test_a_key_staged_again_during_its_deferred_delete_outlives_the_checkpoint(tmp_path):
    import dataclasses

    from pipeline.store.protocol import KEY_CONFLICT

    rng = np.random.default_rng(13)
    unit = StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging", "cut"])
    rows = make_rollout(rng, "dl-again", n_calls=2).rows
    keys = [r.staging_key for r in rows]
    assert not unit.put_many("staging", pack_rows(rows)).failed
    unit.begin_checkpoint("ck")
    assert unit.delete("staging", keys).deferred == keys
    # Other content under a deleted key: refused while the old row is kept for the checkpoint.
    other = dataclasses.replace(rows[1], token_ids=rows[1].token_ids[::-1].copy())
    refused = unit.put_many("staging", pack_rows([other]))
    assert refused.failed[keys[1]][0] == KEY_CONFLICT and "checkpoint" in refused.failed[keys[1]][1]
    # The same content again: acknowledged, so it is live again and its delete is cancelled.
    again = unit.put_many("staging", pack_rows(rows[:1]))
    assert again.ok == keys[:1] and not again.failed
    assert unit.keys("staging") == keys[:1] and unit.deferred_keys("staging") == keys[1:]
    assert unit.end_checkpoint("ck")["applied"] == 1  # only the key nobody staged again
    got = unit.get_many("staging", keys, ["token_ids"])
    assert list(got.batch.keys) == keys[:1] and set(got.failed) == set(keys[1:])
    np.testing.assert_array_equal(got.batch.fields["token_ids"].row(0), rows[0].token_ids)
    assert not unit.put_many("staging", pack_rows([other])).failed  # the key is free once it ended
    unit.close()


def test_a_checkpoint_begun_after_a_delete_does_not_write_the_deleted_row(tmp_path):
    from pipeline.store import batch_file

    unit = StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path / "spill"),
                       partitions=["staging", "cut"])
    rows = make_rollout(np.random.default_rng(3), "ov", n_calls=3).rows
    keys = [r.staging_key for r in rows]
    assert not unit.put_many("staging", pack_rows(rows)).failed

    def written(token: str) -> list[str]:
        out = tmp_path / token
        out.mkdir()
        entries = unit.checkpoint_write(str(out), 1 << 20, token=token)
        return [k for e in entries for k in batch_file.decode_batch((out / e["file"]).read_bytes()).keys]

    unit.begin_checkpoint("A")
    assert unit.delete("staging", keys[:1]).deferred == keys[:1]  # deleted while A is open
    unit.begin_checkpoint("B")
    assert unit.delete("staging", keys[1:2]).deferred == keys[1:2]  # deleted while A and B are open
    assert written("B") == keys[1:]  # B began after the first delete: it never saw that row
    assert written("A") == keys  # A began before both: it writes both
    unit.end_checkpoint("A")
    unit.end_checkpoint("B")
    assert unit.keys("staging") == keys[2:] and unit.stats()["rows"] == 1
    unit.close()
