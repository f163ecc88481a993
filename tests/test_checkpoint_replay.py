"""Checkpoint sequences: every manifest names its store and a sequence one more than the
last; with a manifest key an older signed checkpoint put back in place of a newer one is
refused (CheckpointReplayed) unless ``allow_older=True``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import dask
import pytest

from pipeline import config
from pipeline.store import checkpoint as ck
from pipeline.store import sequence
from tasks.errors import CheckpointCorrupt, CheckpointReplayed
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(180)

KEY_SETTING = "token-capture.store.checkpoint-key"


@pytest.fixture
def key_path(tmp_path) -> str:
    p = tmp_path / "secrets" / "key.hex"
    p.parent.mkdir()
    p.write_text(bytes(range(32)).hex() + "\n")
    with dask.config.set({KEY_SETTING: str(p)}):
        yield str(p)


def filled(store_factory) -> tuple[Any, list]:
    store = store_factory(n_units=1)
    rows = make_rows(3, calls=1, tokens=24)
    assert not store.put_many(pack_rows(rows)).failed
    return store, rows


def put_back(old: Path, path: Path) -> None:
    """Replace the checkpoint at ``path`` by the copy ``old`` (what an attacker can do)."""
    shutil.rmtree(path)
    shutil.copytree(old, path)


def test_replayed_signed_checkpoint_is_refused(store_factory, tmp_path, key_path):
    store, rows = filled(store_factory)
    path, old, newest = tmp_path / "ckpt", tmp_path / "old-copy", tmp_path / "newest-copy"
    first = store.checkpoint(str(path))
    shutil.copytree(path, old)
    second, third = store.checkpoint(str(path)), store.checkpoint(str(path))
    name = config.get("capture-client.store-name")
    assert [m["sequence"] for m in (first, second, third)] == [1, 2, 3]
    assert {m["store"] for m in (first, second, third)} == {name}
    assert sequence.recorded(key_path + sequence.RECORD_SUFFIX, name) == 3
    shutil.copytree(path, newest)

    put_back(old, path)
    with pytest.raises(CheckpointReplayed, match="sequence 1 .* older than sequence 3") as info:
        store_factory(n_units=1).restore(str(path))
    assert isinstance(info.value, CheckpointCorrupt)
    assert (info.value.checkpoint, info.value.recorded) == (1, 3)
    assert "Restore the newest checkpoint" in str(info.value) and "allow_older=True" in str(info.value)

    out = store_factory(n_units=1).restore(str(newest))  # the newest restores fine
    assert out["rows"] == len(rows) and not out["failed"]

    assert ck.read_manifest(str(path), allow_older=True)["sequence"] == 1
    out = store_factory(n_units=1).restore(str(path), allow_older=True)  # on purpose: the old one
    assert out["rows"] == len(rows) and not out["failed"]


def test_restored_sequence_is_recorded_by_note_restored(store_factory, tmp_path, key_path):
    store, _ = filled(store_factory)
    path = tmp_path / "ckpt"
    old = store.checkpoint(str(path))
    newer = store.checkpoint(str(tmp_path / "elsewhere"))  # same store name, another location
    assert (old["sequence"], newer["sequence"]) == (1, 2)
    record = Path(key_path + sequence.RECORD_SUFFIX)
    record.unlink()  # a controller that has seen neither save yet
    assert ck.read_manifest(str(path))["sequence"] == 1
    store_factory(n_units=1).restore(str(tmp_path / "elsewhere"))  # restore records what it loaded
    assert json.loads(record.read_text())["stores"] == {newer["store"]: 2}
    with pytest.raises(CheckpointReplayed):
        ck.read_manifest(str(path))
    ck.note_restored(old)  # never lowers the record
    assert sequence.recorded(str(record), newer["store"]) == 2


def test_sequence_is_covered_by_the_signature(store_factory, tmp_path, key_path):
    store, _ = filled(store_factory)
    path = tmp_path / "ckpt"
    store.checkpoint(str(path))
    m = json.loads((path / ck.MANIFEST).read_text())
    m["sequence"] = 99
    m["manifest_sha256"] = ck._manifest_digest(m)  # anyone can recompute the unkeyed digest
    (path / ck.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointCorrupt, match="signature does not match"):
        ck.read_manifest(str(path))


def test_manifest_from_before_sequences_counts_as_zero(store_factory, tmp_path, key_path):
    store, _ = filled(store_factory)
    path = tmp_path / "ckpt"
    store.checkpoint(str(path))
    m = json.loads((path / ck.MANIFEST).read_text())
    for field in ("sequence", "store"):
        del m[field]
    ck.write_manifest(str(path), m)  # signed with the key, as an older release wrote it
    record = Path(key_path + sequence.RECORD_SUFFIX)
    with pytest.raises(CheckpointReplayed, match="sequence 0 .* older than sequence 1"):
        ck.read_manifest(str(path))
    record.unlink()  # nothing recorded: accepted
    assert "sequence" not in ck.read_manifest(str(path))
    assert store.checkpoint(str(path))["sequence"] == 1


def test_unsigned_checkpoints_carry_a_sequence_but_are_not_defended(store_factory, tmp_path):
    store, rows = filled(store_factory)
    path, old = tmp_path / "ckpt", tmp_path / "old-copy"
    first = store.checkpoint(str(path))
    shutil.copytree(path, old)
    later = [store.checkpoint(str(path)) for _ in range(2)]
    assert [m["sequence"] for m in (first, *later)] == [1, 2, 3]
    assert ck.HMAC_FIELD not in later[-1]
    put_back(old, path)  # no key, no record: anyone could rewrite it, so nothing to check
    out = store_factory(n_units=1).restore(str(path))
    assert out["rows"] == len(rows) and not out["failed"]
    assert not list(tmp_path.rglob("*" + sequence.RECORD_SUFFIX))
