"""Lost-key records in store checkpoints (``store.replicas: 2``): a key recorded lost
(both its copies died) is saved as lost with the checkpoint and restored as lost, so it
still reads ``lost_key`` and refuses new content after a restore; a checkpoint from
before lost keys were saved still restores (the key then reads ``missing_key``).

The state a double loss leaves (both copies' units record the key lost, no row) is made
directly with the units' ``mark_lost``, as the repairer makes it.
"""
from __future__ import annotations

import json

import dask
import pytest

from pipeline.store import checkpoint as ck
from pipeline.store.checkpoint_losses import LOST_FIELD
from pipeline.store.protocol import LOST_KEY, MISSING_KEY, pack_names
from tasks.errors import CheckpointCorrupt
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from test_store import make_rows

pytestmark = pytest.mark.timeout(180)

HOW = "units 0 and 1 lost together (test)"


@pytest.fixture
def replicated(store_factory):
    with dask.config.set({"token-capture.store.replicas": 2}):
        yield store_factory


def _with_a_lost_key(make):
    """A replicated store holding rows and one lost key (its row deleted, then recorded
    lost on both its copies' units); returns (store, rows, the lost row)."""
    store = make(n_units=2)
    rows = make_rows(5, calls=1, tokens=16, seed=11)
    assert not store.put_many(pack_rows(rows)).failed
    gone = rows[0]
    assert store.delete([gone.staging_key]).ok == [gone.staging_key]
    for unit in store.units:  # two units, two copies: each holds one
        unit.mark_lost(STAGING_PARTITION, pack_names([gone.staging_key]), HOW).result(30)
    assert store.get_many([gone.staging_key]).failed[gone.staging_key][0] == LOST_KEY
    return store, rows, gone


def _other_content(row):
    other = pack_rows(make_rows(1, calls=1, tokens=16, seed=99, prefix="x"))
    other.keys = [row.staging_key]
    return other


def _resign(path, edit) -> None:
    m = json.loads((path / ck.MANIFEST).read_text())
    edit(m)
    m["manifest_sha256"] = ck._manifest_digest(m)
    (path / ck.MANIFEST).write_text(json.dumps(m))


def test_a_lost_key_is_saved_with_the_checkpoint_and_restored_lost(replicated, tmp_path):
    src, rows, gone = _with_a_lost_key(replicated)
    key = gone.staging_key
    manifest = src.checkpoint(str(tmp_path / "ckpt"))
    assert manifest["rows"] == len(rows) - 1
    dst = replicated(n_units=2)
    out = dst.restore(str(tmp_path / "ckpt"))
    assert out["rows"] == len(rows) - 1
    got = dst.get_many([key])
    assert got.failed[key][0] == LOST_KEY, got.failed[key]
    assert HOW in got.failed[key][1]
    assert dst.put_many(_other_content(gone)).failed[key][0] == LOST_KEY  # write-once holds
    live = [r.staging_key for r in rows[1:]]
    assert not dst.get_many(live).failed
    assert key in dst.keys()  # listed, as a lost key is
    # Deleting it forgets the loss, as in the store it was saved from.
    assert dst.delete([key]).ok == [key]
    assert not dst.put_many(pack_rows([gone])).failed


def test_a_checkpoint_without_lost_key_records_still_restores(replicated, tmp_path):
    src, rows, gone = _with_a_lost_key(replicated)
    path = tmp_path / "ckpt"
    src.checkpoint(str(path))
    _resign(path, lambda m: m.pop(LOST_FIELD, None))  # as saved before lost keys were
    dst = replicated(n_units=2)
    assert dst.restore(str(path))["rows"] == len(rows) - 1
    assert dst.get_many([gone.staging_key]).failed[gone.staging_key][0] == MISSING_KEY


def test_a_malformed_lost_key_record_is_refused_before_anything_loads(replicated, tmp_path):
    src, rows, gone = _with_a_lost_key(replicated)
    path = tmp_path / "ckpt"
    src.checkpoint(str(path))
    _resign(path, lambda m: m.__setitem__(LOST_FIELD, {STAGING_PARTITION: {HOW: ["r1/c0", 17]}}))
    dst = replicated(n_units=2)
    with pytest.raises(CheckpointCorrupt, match=LOST_FIELD):
        dst.restore(str(path))
    assert sum(s["rows"] for s in dst.stats()) == 0
