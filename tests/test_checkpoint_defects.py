"""Checkpoint defects: manifest file names confined to the checkpoint directory,
an optional keyed (HMAC-SHA256) manifest, and all-or-nothing restores."""
from __future__ import annotations

import json
import os
import pickle
import shutil

import dask
import pytest

from pipeline.store import StagingStore
from pipeline.store import batch_file
from pipeline.store import checkpoint as ck
from tasks.errors import CheckpointCorrupt, CheckpointError, RestoreIncomplete
from tasks.packed import pack_rows, unpack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(180)

KEY_SETTING = "token-capture.store.checkpoint-key"


def total_rows(store) -> int:
    return sum(s["rows"] for s in store.stats())


def snapshot(store, partitions=("staging", "cut")) -> dict:
    """Every key of ``store`` with its row, per partition (what 'unchanged' compares)."""
    out = {}
    for p in partitions:
        keys = store.keys(p)
        got = store.get_many(keys, partition=p) if keys else None
        out[p] = {r.staging_key: r for r in unpack_rows(got.batch)} if got else {}
    return out


def assert_same(a: dict, b: dict) -> None:
    assert {p: sorted(v) for p, v in a.items()} == {p: sorted(v) for p, v in b.items()}
    for p in a:
        for k, row in a[p].items():
            assert row.same_content(b[p][k]), (p, k)


def resign(path, edit) -> None:
    """Edit the manifest with ``edit(manifest)`` and recompute its unkeyed digest: what
    anyone who can write the directory can do."""
    m = json.loads((path / ck.MANIFEST).read_text())
    edit(m)
    m["manifest_sha256"] = ck._manifest_digest(m)
    (path / ck.MANIFEST).write_text(json.dumps(m))


def saved(store_factory, tmp_path, n=4, chunk_bytes=None, name="ckpt"):
    src = store_factory(n_units=1)
    rows = make_rows(n, calls=2, tokens=48)
    assert not src.put_many(pack_rows(rows)).failed
    path = tmp_path / name
    manifest = src.checkpoint(str(path), chunk_bytes=chunk_bytes)
    return path, manifest, rows


def key_file(tmp_path, name="key.hex", key=bytes(range(32))) -> str:
    p = tmp_path / name
    p.write_text(key.hex() + "\n")
    return str(p)


# ---- 11.2a: manifest file names stay inside the checkpoint directory -----------------


@pytest.mark.parametrize(
    "name",
    ["../outside.tcb", "ABSOLUTE", "{gen}/../../outside.tcb", "{gen}/../{gen}/../../outside.tcb", "outside.tcb",
     "gen-other/u000-staging-00000.tcb", "{gen}/sub/u000-staging-00000.tcb", "{gen}/./u000-staging-00000.tcb"],
)
def test_manifest_file_outside_the_directory_is_refused(store_factory, tmp_path, name):
    path, manifest, rows = saved(store_factory, tmp_path)
    entry = manifest["files"][0]
    outside = tmp_path / "outside.tcb"
    shutil.copy(path / entry["file"], outside)  # same bytes: its SHA-256 matches the manifest
    name = str(outside) if name == "ABSOLUTE" else name.format(gen=manifest["generation"])
    resign(path, lambda m: m["files"][0].update(file=name))

    fresh = store_factory(n_units=1)
    with pytest.raises(CheckpointCorrupt, match="files\\[0\\]") as info:
        fresh.restore(str(path))
    assert name in str(info.value)
    assert total_rows(fresh) == 0, "no row is read from outside the checkpoint"


def test_symlink_escaping_the_directory_is_refused(store_factory, tmp_path):
    path, manifest, rows = saved(store_factory, tmp_path)
    entry = manifest["files"][0]
    outside = tmp_path / "elsewhere" / "rows.tcb"
    outside.parent.mkdir()
    shutil.move(path / entry["file"], outside)
    os.symlink(outside, path / entry["file"])  # the manifest is untouched and still valid

    fresh = store_factory(n_units=1)
    with pytest.raises(CheckpointCorrupt, match="outside the checkpoint directory"):
        fresh.restore(str(path))
    assert total_rows(fresh) == 0

    # A generation directory that is a symlink out of the checkpoint: refused the same way.
    os.unlink(path / entry["file"])
    shutil.move(outside, path / entry["file"])
    gen = path / manifest["generation"]
    shutil.move(gen, tmp_path / "moved-gen")
    os.symlink(tmp_path / "moved-gen", gen)
    with pytest.raises(CheckpointCorrupt, match="outside the checkpoint directory"):
        fresh.restore(str(path))
    assert total_rows(fresh) == 0

    # A symlink that stays inside the directory is followed: containment, not a ban.
    os.unlink(gen)
    shutil.move(tmp_path / "moved-gen", path / "real-gen")
    os.symlink("real-gen", gen)
    assert fresh.restore(str(path))["rows"] == len(rows)


def test_malformed_entries_are_refused_naming_the_entry(store_factory, tmp_path):
    path, manifest, _ = saved(store_factory, tmp_path)
    fresh = store_factory(n_units=1)
    for edit, words in [
        (lambda m: m["files"][0].update({m["file_digest"]: "../../x"}), "64 lowercase hex"),
        (lambda m: m["files"][0].pop(m["file_digest"]), "needs one file digest"),
        (lambda m: m["files"][0].update(sha256="0" * 64), "needs one file digest"),  # two digests
        (lambda m: m.update(file_digest="md5"), "file_digest"),
        (lambda m: m["files"][0].update(sha256=m["files"][0].pop("blake3")), "file_digest is blake3"),
        (lambda m: m["files"][0].update(rows=-1), "rows and bytes"),
        (lambda m: m["files"][0].update(partition="../p"), "partition"),
        (lambda m: m["files"].append(dict(m["files"][0])), "named twice"),
        (lambda m: m.update(generation="../gen-x"), "generation"),
    ]:
        original = (path / ck.MANIFEST).read_text()
        resign(path, edit)
        with pytest.raises(CheckpointCorrupt, match=words):
            fresh.restore(str(path))
        (path / ck.MANIFEST).write_text(original)
    assert total_rows(fresh) == 0


# ---- 11.2b: optional keyed manifest -------------------------------------------------------


def test_keyed_manifest_is_signed_and_checked(store_factory, tmp_path):
    assert dask.config.get(KEY_SETTING) is None  # default: unsigned, as before
    path, manifest, rows = saved(store_factory, tmp_path, name="plain")
    assert ck.HMAC_FIELD not in json.loads((path / ck.MANIFEST).read_text())

    key = key_file(tmp_path)
    with dask.config.set({KEY_SETTING: key}):
        signed_path, _, _ = saved(store_factory, tmp_path, name="signed")
        on_disk = json.loads((signed_path / ck.MANIFEST).read_text())
        assert len(on_disk[ck.HMAC_FIELD]) == 64
        fresh = store_factory(n_units=1)
        assert fresh.restore(str(signed_path))["rows"] == len(rows)

        # An unsigned manifest is refused while a key is configured...
        other = store_factory(n_units=1)
        with pytest.raises(CheckpointCorrupt, match="unsigned"):
            other.restore(str(path))
        # ...and so is a signed one edited and re-signed with the unkeyed digest only.
        resign(signed_path, lambda m: m.update(created_unix_s=0.0))
        with pytest.raises(CheckpointCorrupt, match="signature does not match"):
            other.restore(str(signed_path))
        # Stripping the signature is the unsigned case.
        resign(signed_path, lambda m: m.pop(ck.HMAC_FIELD))
        with pytest.raises(CheckpointCorrupt, match="unsigned"):
            other.restore(str(signed_path))
        assert total_rows(other) == 0

    # Another key refuses it; no key restores it (the unkeyed digest still checks it).
    with dask.config.set({KEY_SETTING: key}):
        again, _, _ = saved(store_factory, tmp_path, name="signed2")
    with dask.config.set({KEY_SETTING: key_file(tmp_path, "other.hex", bytes(range(1, 33)))}):
        with pytest.raises(CheckpointCorrupt, match="signature does not match"):
            store_factory(n_units=1).restore(str(again))
    assert store_factory(n_units=1).restore(str(again))["rows"] == len(rows)


def test_unusable_key_setting_is_a_checkpoint_error(store_factory, tmp_path):
    store = store_factory(n_units=1)
    short = tmp_path / "short.hex"
    short.write_text("00" * 16)
    junk = tmp_path / "junk.hex"
    junk.write_text("not hex at all")
    for value, words in [(str(tmp_path / "missing"), "cannot read key file"), (str(short), "at least 32 bytes"),
                         (str(junk), "as hex digits"), (7, "path of a key file")]:
        with dask.config.set({KEY_SETTING: value}):
            with pytest.raises(CheckpointError, match=words):
                store.checkpoint(str(tmp_path / "never"))
    assert not (tmp_path / "never").exists(), "a bad key setting fails before anything is written"


# ---- 11.3a: every file decoded and validated before any row is loaded --------------------


def _replace_file(path, entry_index: int, data: bytes) -> None:
    """Put ``data`` in a data file and record its true SHA-256/size in the manifest, so
    the file passes its digest check and fails only when decoded."""
    m = json.loads((path / ck.MANIFEST).read_text())
    entry = m["files"][entry_index]
    (path / entry["file"]).write_bytes(data)
    algorithm = m["file_digest"]
    hexdigest, size = batch_file.file_digest(str(path / entry["file"]), algorithm)
    resign(path, lambda m: m["files"][entry_index].update({algorithm: hexdigest, "bytes": size}))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad-offsets", "rows"])
def test_file_that_does_not_decode_loads_nothing(cluster_client, store_factory, tmp_path, damage):
    path, manifest, rows = saved(store_factory, tmp_path, n=6, chunk_bytes=1)  # one file per row
    assert len(manifest["files"]) == len(rows)
    last = len(manifest["files"]) - 1
    good = (path / manifest["files"][last]["file"]).read_bytes()
    if damage == "garbage":
        _replace_file(path, last, b"TCPB" + b"\x01\x00" + b"\xff" * 200)
    elif damage == "truncated":
        _replace_file(path, last, good[: len(good) // 2])
    elif damage == "bad-offsets":
        batch = batch_file.decode_batch(bytearray(good))
        name = next(iter(batch.fields))
        batch.fields[name].offsets[-1] += 1  # no longer ends at len(values)
        _replace_file(path, last, b"".join(bytes(b) for b in batch_file.encode_batch(batch)))
    else:  # decodes, but holds a different number of rows than the manifest says
        resign(path, lambda m: m["files"][last].update(rows=2))

    fresh = store_factory(n_units=2)
    with pytest.raises(CheckpointCorrupt, match=os.path.basename(manifest["files"][last]["file"])):
        fresh.restore(str(path))
    assert total_rows(fresh) == 0, "no file's rows are loaded when any file fails to decode"
    # Refused BEFORE the first row entered any unit, not loaded and removed again.
    assert sum(s["puts"] for s in fresh.stats()) == 0
    with pytest.raises(CheckpointCorrupt):
        StagingStore.from_checkpoint(cluster_client, str(path), n_units=1, spill_directory=str(tmp_path / "s2"))


def _fail_third_load() -> None:
    """Runs in each worker: the load pass's 3rd file read there fails (after the
    validate pass passed), as a file changed between the two reads would."""
    import pipeline.store.checkpoint_files as mod  # where restore_file reads its files

    real = getattr(mod, "_real_load_file", mod.load_file)
    count = {"n": 0}

    def failing(root, entry, generation):
        count["n"] += 1
        if count["n"] == 3:
            raise CheckpointCorrupt(f"{entry['file']}: sha256 changed since verification (injected)")
        return real(root, entry, generation)

    mod._real_load_file = real
    mod.load_file = failing


def _heal_load() -> None:
    import pipeline.store.checkpoint_files as mod

    mod.load_file = getattr(mod, "_real_load_file", mod.load_file)


def test_failure_in_the_load_pass_removes_what_was_loaded(cluster_client, store_factory, tmp_path):
    path, manifest, rows = saved(store_factory, tmp_path, n=6, chunk_bytes=1)
    target = store_factory(n_units=2)
    keep = make_rows(2, prefix="keep", seed=5)
    assert not target.put_many(pack_rows(keep)).failed
    before = snapshot(target)
    cluster_client.run(_fail_third_load)
    try:
        with pytest.raises(CheckpointCorrupt, match="injected") as info:
            target.restore(str(path))
    finally:
        cluster_client.run(_heal_load)
    assert "were removed" in str(info.value)
    assert_same(snapshot(target), before)
    assert target.restore(str(path))["rows"] == len(rows)  # healed: the same checkpoint loads


# ---- 11.3b: per-key failures raise; the store is left as it was ------------------------


def test_restore_into_too_small_a_store_raises_and_keeps_nothing(cluster_client, store_factory, tmp_path):
    src = store_factory(n_units=1)
    rows = make_rows(4, calls=2, tokens=48)  # 8 rows
    assert not src.put_many(pack_rows(rows)).failed
    row_bytes = max(s["used_bytes"] for s in src.stats()) // len(rows)
    path = tmp_path / "ckpt"
    src.checkpoint(str(path))

    small = store_factory(n_units=1, capacity=int(row_bytes * 1.5))  # room for one row
    with pytest.raises(RestoreIncomplete) as info:
        small.restore(str(path))
    err = info.value
    assert isinstance(err, CheckpointError)
    assert {r for r, _ in err.failed.values()} == {"store_full"} and len(err.failed) == len(rows) - 1
    assert set(err.failed) < {r.staging_key for r in rows}
    assert "store_full" in str(err) and next(iter(err.failed)) in str(err)
    assert err.removed == 1 and not err.rollback_failed
    assert total_rows(small) == 0, "the one row that fitted was removed again"
    again = pickle.loads(pickle.dumps(err))
    assert (again.failed, again.removed, str(again)) == (err.failed, err.removed, str(err))

    with pytest.raises(RestoreIncomplete, match="store_full"):
        StagingStore.from_checkpoint(cluster_client, str(path), n_units=1, capacity=int(row_bytes * 1.5),
                                     spill_directory=str(tmp_path / "s2"))


def test_conflicting_restore_never_changes_existing_rows(store_factory, tmp_path):
    src = store_factory(n_units=1)
    rows = make_rows(4, calls=2, tokens=48)
    cut = make_rows(2, calls=1, tokens=16, routes=False, prefix="k", seed=3)
    assert not src.put_many(pack_rows(rows)).failed
    assert not src.put_many(pack_rows(cut), partition="cut").failed
    path = tmp_path / "ckpt"
    src.checkpoint(str(path))

    # The target already holds: one identical row, one DIFFERENT row under a checkpoint
    # key (rollout r1 regenerated with other tokens), and an unrelated row.
    target = store_factory(n_units=2)
    other = [r for r in make_rows(4, calls=2, tokens=48, seed=99) if r.rollout_id == "r1"][:1]
    unrelated = make_rows(1, prefix="z", seed=4)
    assert not target.put_many(pack_rows([rows[0], *other, *unrelated])).failed
    before = snapshot(target)
    with pytest.raises(RestoreIncomplete) as info:
        target.restore(str(path))
    assert info.value.failed == {other[0].staging_key: info.value.failed[other[0].staging_key]}
    assert info.value.failed[other[0].staging_key][0] == "key_conflict"
    assert_same(snapshot(target), before)  # the identical row was kept, nothing else added


def test_decode_refuses_trailing_bytes_and_negative_lengths():
    import msgpack

    batch = pack_rows(make_rows(2, calls=1, tokens=8))
    good = bytearray(b"".join(bytes(b) for b in batch_file.encode_batch(batch)))
    assert batch_file.decode_batch(good).keys == batch.keys
    with pytest.raises(CheckpointCorrupt, match="past its last field"):
        batch_file.decode_batch(good + b"\x00" * 8)
    # A header claiming a negative value count: refused, not read as "the rest of the file".
    header = {"keys": ["r0/c0"], "fields": [["token_ids", "<i8", [], -1, False]]}
    h = msgpack.packb(header)
    head = batch_file._PRELUDE.pack(batch_file.MAGIC, batch_file.FORMAT_VERSION, len(h)) + h
    head += batch_file._pad(len(head))
    body = (b"\x00" * 8) + (1).to_bytes(8, "little") + (5).to_bytes(8, "little")
    with pytest.raises(CheckpointCorrupt, match="negative"):
        batch_file.decode_batch(head + body)


def test_partition_the_store_lacks_is_refused_before_loading(store_factory, tmp_path):
    src = store_factory(n_units=1)
    assert not src.put_many(pack_rows(make_rows(2))).failed
    assert not src.put_many(pack_rows(make_rows(1, calls=1, prefix="k", routes=False)), partition="cut").failed
    src.checkpoint(str(tmp_path / "ckpt"))
    with dask.config.set({"token-capture.store.partitions": ["staging"]}):
        narrow = store_factory(n_units=1)
    with pytest.raises(CheckpointError, match="partition.*'cut'"):
        narrow.restore(str(tmp_path / "ckpt"))
    assert sum(s["puts"] for s in narrow.stats()) == 0
