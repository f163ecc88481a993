"""StagingStore.checkpoint / restore: atomic saves, crash safety, digest-checked restores."""
from __future__ import annotations

import json
import os

import dask
import pytest

from pipeline.store import CheckpointCorrupt, CheckpointError, StagingStore
from pipeline.store import checkpoint as ck
from tasks.hashing import row_digest
from tasks.packed import pack_rows, unpack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(120)




def read_all(store, rows, partition="staging"):
    got = store.get_many([r.staging_key for r in rows], partition=partition)
    assert not got.failed, list(got.failed.items())[:3]
    return unpack_rows(got.batch)


def assert_rows(store, rows, partition="staging"):
    back = read_all(store, rows, partition)
    assert [b.staging_key for b in back] == [r.staging_key for r in rows]
    assert all(a.same_content(b) for a, b in zip(back, rows))


def total_rows(store):
    return sum(s["rows"] for s in store.stats())


def test_roundtrip_onto_a_different_unit_count(store_factory, tmp_path):
    src = store_factory(n_units=2, memory_limit="32KiB")  # some rows are spilled when saved
    staged = make_rows(6, calls=2, tokens=80)
    cut = make_rows(3, calls=1, tokens=40, routes=False, prefix="k", seed=9)
    assert not src.put_many(pack_rows(staged)).failed
    assert not src.put_many(pack_rows(cut), partition="cut").failed
    assert sum(s["spilled_bytes"] for s in src.stats()) > 0

    manifest = src.checkpoint(str(tmp_path / "ckpt"), chunk_bytes=20_000)
    assert manifest["rows"] == len(staged) + len(cut)
    assert len(manifest["files"]) > 2  # chunked: several files per unit
    assert os.path.exists(tmp_path / "ckpt" / ck.MANIFEST)

    dst = store_factory(n_units=3)
    out = dst.restore(str(tmp_path / "ckpt"))
    assert out["rows"] == len(staged) + len(cut) and not out["failed"]
    assert_rows(dst, staged)
    assert_rows(dst, cut, partition="cut")
    assert total_rows(dst) == len(staged) + len(cut)
    # Rows sit where unit_for_key puts them on the NEW store: one rollout, one unit.
    assert sum(1 for s in dst.stats() if s["rows"]) >= 2


def test_from_checkpoint_and_restore_is_idempotent(cluster_client, store_factory, tmp_path):
    src = store_factory()
    rows = make_rows(4)
    src.put_many(pack_rows(rows))
    src.checkpoint(str(tmp_path / "c"))
    dst = StagingStore.from_checkpoint(cluster_client, str(tmp_path / "c"), n_units=1, spill_directory=str(tmp_path / "s2"))
    try:
        assert_rows(dst, rows)
        again = dst.restore(str(tmp_path / "c"))  # identical re-put: write-once ok
        assert again["rows"] == len(rows) and not again["failed"]
    finally:
        dst.close()


def _fail_writes_after(n: int) -> None:
    """Runs in each worker: the unit's (n+1)-th data file write raises (a crash mid-save)."""
    import pipeline.store.batch_file as mod

    real = getattr(mod, "_real_write_atomic", mod.write_atomic)
    count = {"n": 0}

    def failing(path, buffers, *rest):
        count["n"] += 1
        if count["n"] > n:
            raise OSError(f"injected crash before writing {os.path.basename(path)}")
        return real(path, buffers, *rest)

    mod._real_write_atomic = real
    mod.write_atomic = failing


def _heal_writes() -> None:
    import pipeline.store.batch_file as mod

    mod.write_atomic = getattr(mod, "_real_write_atomic", mod.write_atomic)


def test_crash_mid_save_keeps_previous_checkpoint(cluster_client, store_factory, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    store = store_factory()
    first = make_rows(4, seed=1)
    store.put_many(pack_rows(first))
    m1 = store.checkpoint(path, chunk_bytes=10_000)

    later = make_rows(4, seed=2, prefix="late")
    store.put_many(pack_rows(later))
    cluster_client.run(_fail_writes_after, 1)  # each unit writes one file, then "crashes"
    try:
        with pytest.raises(CheckpointError, match="previous checkpoint kept"):
            store.checkpoint(path, chunk_bytes=10_000)
    finally:
        cluster_client.run(_heal_writes)
    assert ck.read_manifest(path)["generation"] == m1["generation"]

    # A crash after every data file but before the manifest's rename: same guarantee.
    def no_manifest(*a, **k):
        raise OSError("injected crash before the manifest")

    monkeypatch.setattr(ck, "write_manifest", no_manifest)
    with pytest.raises(OSError, match="before the manifest"):
        store.checkpoint(path, chunk_bytes=10_000)
    monkeypatch.undo()
    assert ck.read_manifest(path)["generation"] == m1["generation"]

    fresh = store_factory(n_units=2)
    out = fresh.restore(path)
    assert out["rows"] == len(first) and total_rows(fresh) == len(first)
    assert_rows(fresh, first)
    assert fresh.get_many([later[0].staging_key]).failed[later[0].staging_key][0] == "missing_key"

    # The next good save becomes current and clears the half-written generations.
    m3 = store.checkpoint(path)
    assert [d for d in os.listdir(path) if d.startswith("gen-")] == [m3["generation"]]
    newest = store_factory(n_units=1)
    newest.restore(path)
    assert_rows(newest, first + later)


def test_corrupt_checkpoint_refused(store_factory, tmp_path):
    path = tmp_path / "ckpt"
    store = store_factory()
    rows = make_rows(4)
    store.put_many(pack_rows(rows))
    manifest = store.checkpoint(str(path))
    victim = manifest["files"][0]["file"]
    with open(path / victim, "r+b") as fh:  # flip one byte deep in the payload
        fh.seek(os.path.getsize(path / victim) - 7)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))

    fresh = store_factory()
    with pytest.raises(CheckpointCorrupt, match=os.path.basename(victim)):
        fresh.restore(str(path))
    assert total_rows(fresh) == 0, "nothing is loaded from a refused checkpoint"

    # An edited manifest is refused too, and a missing checkpoint says so.
    m = json.loads((path / ck.MANIFEST).read_text())
    m["files"][0][m["file_digest"]] = "0" * 64
    (path / ck.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointCorrupt, match="manifest digest"):
        fresh.restore(str(path))
    with pytest.raises(CheckpointError, match="MANIFEST.json is missing"):
        fresh.restore(str(tmp_path / "nowhere"))


def test_a_sha256_checkpoint_in_the_old_format_restores_under_the_blake3_default(store_factory, tmp_path):
    """A checkpoint as the code before BLAKE3 wrote it: SHA-256 rows (digest version 1),
    SHA-256 file digests under ``sha256``, no ``file_digest`` field. It restores, its rows
    keep verifying, and a damaged file of it is still refused, under ``capture.digest:
    blake3``; a save follows the setting (``sha256`` above, ``blake3`` below)."""
    path = tmp_path / "old"
    rows = make_rows(3, digest_version=1)
    src = store_factory(n_units=1)
    assert not src.put_many(pack_rows(rows)).failed
    with dask.config.set({"token-capture.capture.digest": "sha256"}):
        saved = src.checkpoint(str(path), chunk_bytes=4_000)
    assert saved["file_digest"] == "sha256" and all(set(f) & {"sha256", "blake3"} == {"sha256"} for f in saved["files"])
    m = json.loads((path / ck.MANIFEST).read_text())
    del m["file_digest"]  # the old writer had no such field
    m["manifest_sha256"] = ck._manifest_digest(m)
    (path / ck.MANIFEST).write_text(json.dumps(m))

    assert dask.config.get("token-capture.capture.digest") == "blake3"
    dst = store_factory(n_units=2)
    out = dst.restore(str(path))
    assert out["rows"] == len(rows) and not out["failed"]
    back = read_all(dst, rows)
    assert all(b.digest_version == 1 and row_digest(b) == b.digest == a.digest for a, b in zip(rows, back))
    again = dst.checkpoint(str(tmp_path / "new"))
    assert again["file_digest"] == "blake3" and all("blake3" in f and "sha256" not in f for f in again["files"])

    victim = path / m["files"][-1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="sha256"):
        store_factory(n_units=1).restore(str(path))
