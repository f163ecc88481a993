"""Tampering: every flipped byte is caught, with the right reason.

* Exhaustive, pure: every byte of every field of every chain row a finalizer fetches
  (and of a long rollout, sampled), flipped with three masks in turn, through
  ``verify_many``; every byte of every digest/chain/cumulative hash of the receipt. Each
  for every digest version: BLAKE3 over field digests (3, the default) and inline BLAKE3
  (2) with every mask, SHA-256 (1) with one mask per byte in turn (every byte still
  flipped, at a third of the cost).
* At rest, on a real cluster: bytes flipped inside the zict spill files of staged rows
  (bit rot on the storage unit's disk), one flip per rollout, all judged in ONE
  finalization step (rollouts of every digest version side by side); receipts with a
  flipped hash byte in the same step.
* Replay: a row staged under another rollout's (or another call's) key, and rows of an
  older checkpoint restored under the same keys, are rejected; that checkpoint's own
  rows (SHA-256, int16 routes) still finalize, beside uint8 ones of versions 2 and 3, to
  the same values; cut rows of every version restore and verify.

Expected reason of a flip in field ``f`` (first failing rule, see ``tasks.reasons``):
ids -> ``identity_mismatch`` / ``wrong_parent_call_id`` (``invalid_staging_row`` if the
bytes stop being UTF-8); a receipt-compared scalar or hash -> ``wrong_<f>``; versions ->
``invalid_staging_row`` (a digest version flipped to another supported one:
``wrong_digest_version``); token and routes buffers -> ``corrupt_digest``.
"""
from __future__ import annotations

import os
import struct
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import torch

from pipeline.finalize import Finalizer
from pipeline.generation.call_buffer import CallBuffer
from pipeline.store import StagingStore
from pipeline.store.spill import load_row
from rollout_factory import fetch, flip_byte, make_rollout, resign, set_tokens
from tasks import reasons as R
from tasks.digests import SUPPORTED_VERSIONS
from tasks.packed import PackedBatch, pack_rows
from tasks.finalize.plan import plan_step
from tasks.schema import HASH_FIELDS, ID_FIELDS, ROUTES_FIELDS, STAGING_FIELDS
from tasks.finalize.verify import verify_many
from tasks.cut.prefix import verify_prefix

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8
MASKS = (0x01, 0x80, 0xFF)
# Per-field verdict for a flip that leaves the field well-formed.
FLIP_REASON = {
    **{f: R.wrong(f) for f in R.RECEIPT_COMPARED_FIELDS},
    "rollout_id": R.IDENTITY_MISMATCH,
    "model_call_id": R.IDENTITY_MISMATCH,
    "schema_version": R.INVALID_STAGING_ROW,
    "digest_version": R.INVALID_STAGING_ROW,
    "token_ids": R.CORRUPT_DIGEST,
    "token_mask": R.CORRUPT_DIGEST,
    "logprobs": R.CORRUPT_DIGEST,
    **{f: R.CORRUPT_DIGEST for f in ROUTES_FIELDS},  # int16 and uint8 routes buffers alike
}
assert set(FLIP_REASON) == set(STAGING_FIELDS) | set(ROUTES_FIELDS)


def expected_reason(field: str, flipped: bytes) -> str:
    """The verdict for a row whose ``field`` now holds ``flipped`` (its raw bytes)."""
    if field in ID_FIELDS:
        try:
            flipped.decode("utf-8")
        except UnicodeDecodeError:
            return R.INVALID_STAGING_ROW
    if field == "digest_version" and int.from_bytes(flipped, "little", signed=True) in SUPPORTED_VERSIONS:
        return R.wrong(field)  # the other algorithm: the receipt's record says otherwise
    return FLIP_REASON[field]


def field_bytes(batch: PackedBatch, name: str, i: int) -> bytes:
    f = batch.fields[name]
    return f.values[f.offsets[i] : f.offsets[i + 1]].tobytes()


def verdict(plan, rows, routes) -> str:
    return verify_many([plan], rows, routes, vocab_size=VOCAB, num_experts=E)[0].status


def flip_all(built, sample: int | None = None, seed: int = 0, every_mask: bool = True) -> tuple[int, list]:
    """Flip every (or ``sample`` random) byte position of the fetched chain rows with each
    mask (or, ``every_mask`` False, one mask per position in turn); returns (cases run, misses)."""
    plan = plan_step([built.receipt]).rollouts[0]
    rows, routes = fetch([built], plan.keys, plan.routes_keys)
    assert verdict(plan, rows, routes) == R.OK
    positions = []
    for name in STAGING_FIELDS:
        for i in range(len(rows)):
            positions += [("rows", name, i, b) for b in range(len(field_bytes(rows, name, i)))]
    if routes is not None:
        for name in routes.fields:  # the rollout's routes encoding's field
            for i in range(len(routes)):
                positions += [("routes", name, i, b) for b in range(len(field_bytes(routes, name, i)))]
    if sample is not None and sample < len(positions):
        pick = np.random.default_rng(seed).choice(len(positions), size=sample, replace=False)
        positions = [positions[j] for j in sorted(pick)]
    misses, n = [], 0
    for k, (where, name, i, b) in enumerate(positions):
        for mask in MASKS if every_mask else (MASKS[k % len(MASKS)],):
            src = rows if where == "rows" else routes
            bad = flip_byte(src, name, i, b, mask)
            want = expected_reason(name, field_bytes(bad, name, i))
            got = verdict(plan, bad, routes) if where == "rows" else verdict(plan, rows, bad)
            n += 1
            if got != want:
                misses.append((name, i, b, mask, got, want))
    return n, misses


# ---- pure, exhaustive --------------------------------------------------------------------


# (digest version, every mask at every byte, routes encoding of the rows): BLAKE3 (field
# digests, as written now, and inline) every mask, SHA-256 one mask per byte in turn.
# Routes: uint8 ids (8 experts) as written now; int16 ids as SHA-256 rows were written
# before uint8 existed, and field-digest rows of int16 too: each routes buffer is flipped
# whole.
VERSION_CASES = pytest.mark.parametrize(
    "v, every_mask, encoding", [(3, True, 2), (3, True, 1), (2, True, 2), (1, False, 1)],
    ids=["blake3-fields-u8", "blake3-fields-i16", "blake3", "sha256"],
)
assert {3, 2, 1} == set(SUPPORTED_VERSIONS)


@VERSION_CASES
def test_every_byte_of_every_fetched_row_flipped_is_detected_with_its_reason(v, every_mask, encoding):
    rng = np.random.default_rng(11)
    built = make_rollout(rng, "tamper-all", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, digest_version=v,
                         routes_encoding=encoding)
    n, misses = flip_all(built, every_mask=every_mask)
    assert n > (2500 if every_mask else 1000)  # uint8 routes: half the routes bytes of int16
    assert misses == [], misses[:10]


@VERSION_CASES
def test_long_rollout_flips_sampled_are_detected(v, every_mask, encoding):
    rng = np.random.default_rng(12)
    built = make_rollout(rng, "tamper-long", n_calls=4, gen_len=(200, 400), routes=(L, K, E), vocab_size=VOCAB, digest_version=v,
                         routes_encoding=encoding)
    n, misses = flip_all(built, sample=800, seed=3, every_mask=every_mask)
    assert n == 800 * (len(MASKS) if every_mask else 1)
    assert misses == [], misses[:10]


@VERSION_CASES
def test_every_byte_of_every_receipt_hash_flipped_is_detected(v, every_mask, encoding):
    rng = np.random.default_rng(13)
    built = make_rollout(rng, "tamper-receipt", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, digest_version=v,
                         routes_encoding=encoding)
    plan = plan_step([built.receipt]).rollouts[0]
    rows, routes = fetch([built], plan.keys, plan.routes_keys)
    n, misses = 0, []
    for c, rec in enumerate(built.receipt.calls):
        for name in HASH_FIELDS:
            for b in range(32):
                for mask in MASKS if every_mask else (MASKS[b % len(MASKS)],):
                    h = bytearray(getattr(rec, name))
                    h[b] ^= mask
                    calls = list(built.receipt.calls)
                    calls[c] = replace(rec, **{name: bytes(h)})
                    p = plan_step([replace(built.receipt, calls=calls)]).rollouts[0]
                    got = verify_many([p], rows, routes, vocab_size=VOCAB, num_experts=E)[0].status
                    n += 1
                    if got != R.wrong(name):
                        misses.append((c, name, b, mask, got))
    assert n == 3 * 3 * 32 * (len(MASKS) if every_mask else 1)
    assert misses == [], misses[:10]


# ---- at rest, on a real cluster ------------------------------------------------------------


@pytest.fixture
def disk_store(cluster_client, tmp_path):
    # memory_limit of 1 byte: every row goes straight to its zict spill file.
    s = StagingStore.start(cluster_client, n_units=2, memory_limit=1, spill_directory=str(tmp_path / "spill"))
    yield s
    s.close()


def _spill_paths(actor_keys, partition, keys, dask_worker=None):
    """On a worker: staging key -> spill file path, for the units it hosts."""
    out = {}
    for ak in actor_keys:
        unit = dask_worker.state.actors.get(ak)
        if unit is None:
            continue
        index = unit.held.index.get(partition, {})
        disk = unit.held.rows.disk.d
        for k in keys:
            slot = index.get(k)
            if slot is not None and slot in disk.filenames:
                out[k] = os.path.join(disk.directory, disk.filenames[slot])
    return out


def spill_paths(client, store, keys) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in client.run(_spill_paths, [u.key for u in store.units], "staging", list(keys)).values():
        out.update(part)
    return out


def spill_layout(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(header bytes, field -> (absolute offset, nbytes)) of a spill file (layout v1 of
    ``pipeline.store.spill.dump_row``)."""
    with open(path, "rb") as fh:
        buf = fh.read()
    (hlen,) = struct.unpack_from("<I", buf, 0)
    _, entries = msgpack.unpackb(buf[4 : 4 + hlen])
    start = 4 + hlen
    start += (-start) % 8
    return 4 + hlen, {name: (start + off, nbytes) for name, _, _, off, nbytes in entries}


def same_row_read(before: bytes, after: bytes) -> bool:
    """Whether a damaged spill file still loads as the very same row."""
    try:
        got = load_row(bytearray(after))
    except Exception:
        return False
    want = load_row(bytearray(before))
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and got[k].tobytes() == want[k].tobytes() for k in want
    )


def flip_file(path: str, pos: int, mask: int) -> bytes:
    with open(path, "r+b") as fh:
        fh.seek(pos)
        b = fh.read(1)[0] ^ mask
        fh.seek(pos)
        fh.write(bytes([b]))
    return bytes([b])


def test_bytes_flipped_in_spill_files_and_receipts_are_rejected_in_one_step(cluster_client, disk_store, tmp_path):
    rng = np.random.default_rng(21)
    fields = list(STAGING_FIELDS) + list(ROUTES_FIELDS)
    cases = [(c, f) for c in range(3) for f in fields]  # every (chain row, field) pair
    # Rollouts hashed with SHA-256 (1), BLAKE3 (2) and BLAKE3 over field digests (3) in
    # turn, routes staged as int16
    # (as before uint8 existed) and as uint8: one step judges them all. A routes field's
    # case is a rollout of that field's encoding.
    encoding = {name: enc for enc, name in ((1, ROUTES_FIELDS[0]), (2, ROUTES_FIELDS[1]))}
    builts = [make_rollout(rng, f"rest{i}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, digest_version=1 + i % 3,
                           routes_encoding=encoding.get(cases[i][1] if i < len(cases) else None, 1 + (i // 2) % 2))
              for i in range(len(cases) + 12)]
    assert {r.routes_encoding for b in builts for r in b.rows} == {1, 2}
    assert {r.digest_version for b in builts for r in b.rows} == {1, 2, 3}
    res = disk_store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed
    assert all(s["memory_bytes"] == 0 for s in disk_store.stats())  # everything is on disk
    paths = spill_paths(cluster_client, disk_store, [r.staging_key for b in builts for r in b.rows])
    assert len(paths) == sum(len(b.rows) for b in builts)

    expected: dict[str, str | None] = {}  # None: any rejection (header damage)
    receipts = [b.receipt for b in builts]
    pick = np.random.default_rng(5)
    j = 0
    for (c, name), b in zip(cases, builts):
        path = paths[f"{b.rollout_id}/c{c}"]
        _, layout = spill_layout(path)
        off, nbytes = layout[name]
        if nbytes == 0:  # the root's empty parent_call_id: flip the next call's instead
            path = paths[f"{b.rollout_id}/c{c + 1}"]
            _, layout = spill_layout(path)
            off, nbytes = layout[name]
        with open(path, "rb") as fh:
            fh.seek(off)
            original = bytearray(fh.read(nbytes))
        at = int(pick.integers(0, nbytes))
        mask = MASKS[j % len(MASKS)]
        j += 1
        flip_file(path, off + at, mask)
        original[at] ^= mask
        expected[b.rollout_id] = expected_reason(name, bytes(original))
    extra = builts[len(cases):]
    for b in extra[:4]:  # damage inside the spill file's header
        path = paths[f"{b.rollout_id}/c1"]
        hlen, _ = spill_layout(path)
        before = open(path, "rb").read()
        flip_file(path, int(pick.integers(4, hlen)), 0xFF)
        # Some header bytes are redundant (e.g. a shape numpy infers anyway): a flip
        # there leaves the row bit-identical, and then "ok" is the right verdict.
        expected[b.rollout_id] = R.OK if same_row_read(before, open(path, "rb").read()) else None
    for k, b in enumerate(extra[4:]):  # receipt hashes flipped, rows intact
        i = receipts.index(b.receipt)
        name = HASH_FIELDS[k % 3]
        rec = b.receipt.calls[k % 3]
        h = bytearray(getattr(rec, name))
        h[int(pick.integers(0, 32))] ^= MASKS[k % 3]
        calls = list(b.receipt.calls)
        calls[k % 3] = replace(rec, **{name: bytes(h)})
        receipts[i] = replace(b.receipt, calls=calls)
        expected[b.rollout_id] = R.wrong(name)

    fin = Finalizer(cluster_client, disk_store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g0": receipts}, step_id="tamper-at-rest").result(timeout=60)
    group = step.groups["g0"]
    got = dict(zip([b.rollout_id for b in builts], group.status))
    wrong = {rid: (got[rid], want) for rid, want in expected.items() if (want is None and got[rid] == R.OK) or (want is not None and got[rid] != want)}
    assert wrong == {}
    n_ok = sum(want == R.OK for want in expected.values())  # only bit-identical header damage
    assert group.sample_mask.sum().item() == n_ok == step.metrics["accepted"]
    assert sum(step.rejected.values()) == len(builts) - n_ok >= len(builts) - 4


# ---- replay ----------------------------------------------------------------------------------


@pytest.fixture
def store(cluster_client, tmp_path):
    s = StagingStore.start(cluster_client, n_units=2, memory_limit="16KiB", spill_directory=str(tmp_path / "spill"))
    yield s
    s.close()


def test_rows_replayed_from_another_rollout_or_call_are_rejected(cluster_client, store):
    rng = np.random.default_rng(31)
    a, b, c = (make_rollout(rng, rid, n_calls=3, routes=(L, K, E), vocab_size=VOCAB) for rid in ("replay-a", "replay-b", "replay-c"))
    # a: its c1 slot holds b's c1 row (another rollout); c: its c2 slot holds its own c1 row.
    rows_a = [r for r in a.rows if r.model_call_id != "c1"]
    put = store.put_many(pack_rows(rows_a + b.rows))
    assert not put.failed
    replay = pack_rows([b.row("c1")])
    assert not store.put_many(PackedBatch(["replay-a/c1"], replay.fields)).failed
    rows_c = [r for r in c.rows if r.model_call_id != "c2"]
    assert not store.put_many(pack_rows(rows_c)).failed
    own = pack_rows([c.row("c1")])
    assert not store.put_many(PackedBatch(["replay-c/c2"], own.fields)).failed

    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g": [a.receipt, b.receipt, c.receipt]}, step_id="replay").result(timeout=60)
    assert step.groups["g"].status == [R.IDENTITY_MISMATCH, R.OK, R.IDENTITY_MISMATCH]


def test_rows_of_an_older_checkpoint_are_rejected_for_the_newer_receipt(cluster_client, store, tmp_path):
    rng = np.random.default_rng(41)
    # The older checkpoint's rows were hashed with SHA-256 and routes staged as int16 (as
    # before uint8 existed); later ones with BLAKE3 (inline, version 2) and uint8 routes;
    # the newer captures hash with BLAKE3 over field digests (version 3, the default) and
    # stage uint8 routes. All three kinds, and cut rows of every version and both routes
    # dtypes, share the store and its checkpoint.
    old = [make_rollout(np.random.default_rng(100 + i), f"ck{i}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, digest_version=1,
                       routes_encoding=1) for i in range(3)]
    new = make_rollout(np.random.default_rng(100 + 2), "ck3", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
    mid = make_rollout(np.random.default_rng(100 + 2), "ck4", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, digest_version=2)
    assert {r.routes_encoding for r in old[2].rows} == {1} and {r.routes_encoding for r in new.rows + mid.rows} == {2}
    assert [{r.digest_version for r in b.rows} for b in (old[2], mid, new)] == [{1}, {2}, {3}]
    assert not store.put_many(pack_rows([r for b in old for r in b.rows])).failed
    assert not store.put_many(pack_rows(new.rows + mid.rows)).failed
    cuts = {(dt, v): cut_rows(f"cut-{np.dtype(dt).name}-v{v}", dt, v)
            for dt, v in ((np.int16, 3), (np.uint8, 3), (np.uint8, 2), (np.int16, 1))}
    for batch, _ in cuts.values():
        assert not store.put_many(batch, partition="cut").failed
    store.checkpoint(str(tmp_path / "old"))
    # Newer captures of the same rollouts: regenerated with a newer policy (same tokens,
    # weight_version 1), and regenerated with different tokens at c1.
    newer_version = make_rollout(np.random.default_rng(100), "ck0", n_calls=3, routes=(L, K, E), vocab_size=VOCAB, weight_version=1)
    newer_tokens = resign(old[1], set_tokens("c1", 0, (int(old[1].row("c1").token_ids[0]) + 1) % VOCAB))
    untouched = old[2]
    restored = StagingStore.from_checkpoint(cluster_client, str(tmp_path / "old"), n_units=1, spill_directory=str(tmp_path / "spill-r"))
    try:
        # The store refuses to let the newer rows overwrite the old ones (write-once)...
        clash = restored.put_many(pack_rows(newer_tokens.rows))
        assert {r for r, _ in clash.failed.values()} == {"key_conflict"}
        # ...and the finalizer rejects the newer receipts against the replayed old rows.
        fin = Finalizer(cluster_client, restored, vocab_size=VOCAB, num_experts=E)
        receipts = [newer_version.receipt, newer_tokens.receipt, untouched.receipt, new.receipt, mid.receipt]
        step = fin.submit_step({"g": receipts}, step_id="old-ckpt").result(timeout=60)
        g = step.groups["g"]
        assert g.status == [R.wrong("weight_version"), R.wrong("digest"), R.OK, R.OK, R.OK]
        # The old int16 rollout and the uint8 ones of versions 2 and 3 (same ids: same
        # seed) restore and finalize to the same values, in one group (int16: the widest stored).
        assert g.routed_experts.dtype == torch.int16
        for i, b in ((2, untouched), (3, new), (4, mid)):
            want = np.concatenate([b.row(c).routed_experts for c in b.chain_ids])
            np.testing.assert_array_equal(g.routed_experts[i, : len(want)].numpy(), want)
        assert torch.equal(g.routed_experts[2], g.routed_experts[3]) and torch.equal(g.routed_experts[2], g.routed_experts[4])
        # Cut rows of every version and both routes dtypes come back from the checkpoint and verify.
        for (dt, v), (batch, ack) in cuts.items():
            verdict = verify_prefix(restored.get_many(list(ack.staging_keys), partition="cut").batch, ack, num_experts=E)
            assert verdict.usable and verdict.prefix.routed_experts.dtype == dt, verdict
            assert ack.digest_version == verdict.prefix.digest_version == v
    finally:
        restored.close()
    del rng


def cut_rows(rollout: str, dtype, digest_version: int) -> tuple[PackedBatch, object]:
    """Two cut chunks of one call whose routes are kept as ``dtype``, hashed with
    ``digest_version`` (rows in chain order, last ack)."""
    rng = np.random.default_rng(7)
    buf = CallBuffer(rollout, "c0", rng.integers(0, VOCAB, 4), routes_shape=(L, K),
                     context_routes=rng.integers(0, E, (4, L, K)), routes_dtype=dtype, digest_version=digest_version)
    rows, ack = [], None
    for i in range(2):
        buf.append(rng.integers(0, VOCAB, 3), -rng.random(3).astype(np.float32), rng.integers(0, E, (3, L, K)))
        frozen = buf.freeze(f"ck-{i}")
        ack = buf.seal(frozen)
        rows.append(frozen.row)
    batch = pack_rows(rows)
    batch.keys = list(ack.staging_keys)
    return batch, ack
