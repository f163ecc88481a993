"""StagingStore over real StorageUnit actors on a LocalCluster, spilling to tmp_path."""
from __future__ import annotations

import os

import numpy as np
import pytest

from pipeline.store import GetResult, StagingStore, StoreError, StoreResult
from tasks.digests import DEFAULT_VERSION
from tasks.gate import CaptureGate
from tasks.keys import unit_for_key
from tasks.packed import PackedBatch, PackedField, pack_rows, unpack_rows
from tasks.schema import StagedRow
from support import store_maker

pytestmark = pytest.mark.timeout(120)

VOCAB, EXPERTS, L, K = 512, 8, 4, 2
RF = "routed_experts_u8"  # the routes field of these rows: 8 experts, one-byte ids


def make_rows(n_rollouts: int, calls: int = 2, tokens: int = 64, routes: bool = True, seed: int = 0, prefix: str = "r",
              digest_version: int = DEFAULT_VERSION) -> list[StagedRow]:
    """Chains of ``calls`` model calls per rollout, built by the real capture gate
    (hashed with ``digest_version``: by default the writers' default, 3 BLAKE3 over field
    digests; 1 SHA-256)."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n_rollouts):
        gate = CaptureGate(f"{prefix}{r}", vocab_size=VOCAB, num_experts=EXPERTS, digest_version=digest_version)
        parent = None
        for c in range(calls):
            ctx = 4 if c else 0
            mask = np.concatenate([np.zeros(ctx, np.float32), np.ones(tokens - ctx, np.float32)])
            lp = np.where(mask > 0, -rng.random(tokens, dtype=np.float32) - 0.01, 0.0).astype(np.float32)
            ids = rng.integers(0, VOCAB, tokens)
            re = rng.integers(0, EXPERTS, (tokens, L, K)).astype(np.int16) if routes else None
            rows.append(gate.stage_call(f"c{c}", parent, ids, mask, lp, routed_experts=re))
            parent = f"c{c}"
    return rows


def assert_same_batch(got: PackedBatch, want: PackedBatch) -> None:
    assert got.keys == want.keys
    for name, f in want.fields.items():
        g = got.fields[name]
        assert g.values.dtype == f.values.dtype, name
        assert g.values.tobytes() == f.values.tobytes(), name
        assert np.array_equal(g.offsets, f.offsets), name


def spill_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]




def test_roundtrip_bit_exact_after_spill(store_factory, tmp_path):
    store = store_factory(n_units=2, memory_limit="24KiB")
    assert len(set(store.unit_workers)) == 2  # round-robin over both workers
    rows = make_rows(12, calls=3, tokens=96)
    batch = pack_rows(rows)
    res = store.put_many(batch)
    assert sorted(res.ok) == sorted(batch.keys) and not res.failed

    stats = store.stats()
    assert sum(s["rows"] for s in stats) == len(rows)
    assert sum(s["spilled_bytes"] for s in stats) > 0
    assert all(s["memory_bytes"] <= 24 * 1024 for s in stats)
    assert spill_files(tmp_path / "spill"), "spilled rows must be files on disk"

    # Reverse order, twice over some keys: one batch, in request order, bit-exact.
    order = list(range(len(batch)))[::-1] + [0, 5]
    got = store.get_many([batch.keys[i] for i in order])
    assert isinstance(got, GetResult) and not got.failed
    assert_same_batch(got.batch, batch.take(np.array(order)))
    for a, b in zip(unpack_rows(got.batch), [rows[i] for i in order]):
        assert a.same_content(b)

    dirs = [s["spill_directory"] for s in stats]
    store.close()
    assert not any(os.path.exists(d) for d in dirs), "closing a unit removes its spill directory"


def test_stored_rows_do_not_alias_batch(store_factory):
    store = store_factory(n_units=1)
    batch = pack_rows(make_rows(2))
    want = batch.fields["token_ids"].values.copy()
    store.put_many(batch)
    batch.fields["token_ids"].values[:] = 0  # caller reuses its buffer
    got = store.get_many(list(batch.keys), fields=["token_ids"])
    assert np.array_equal(got.batch.fields["token_ids"].values, want)


def test_per_key_results_missing_key_and_absent_field(store_factory):
    store = store_factory()
    with_routes = make_rows(3, routes=True, prefix="a")
    without = make_rows(3, routes=False, prefix="b", seed=1)
    b1, b2 = pack_rows(with_routes), pack_rows(without)
    assert not store.put_many(b1).failed and not store.put_many(b2).failed

    keys = [b2.keys[0], "ghost/c0", b1.keys[0], "no-slash-key", b2.keys[1]]
    got = store.get_many(keys, fields=["token_ids", RF])
    assert got.failed["ghost/c0"][0] == "missing_key"
    assert got.failed["no-slash-key"][0] == "invalid_key"
    for k in (b2.keys[0], b2.keys[1]):
        reason, detail = got.failed[k]
        assert reason == "absent_field" and RF in detail
    assert b1.keys[0] not in got.failed
    # Served: the three real keys, in request order, routes present only where stored.
    assert got.batch.keys == [b2.keys[0], b1.keys[0], b2.keys[1]]
    routes = got.batch.fields[RF]
    assert [routes.has(i) for i in range(3)] == [False, True, False]
    assert np.array_equal(routes.row(1), with_routes[0].routed_experts)
    assert np.array_equal(got.batch.fields["token_ids"].row(0), without[0].token_ids)
    assert set(got.batch.fields) == {"token_ids", RF}


def test_write_once_conflict_refused_identical_ok(store_factory):
    store = store_factory()
    rows = make_rows(4)
    batch = pack_rows(rows)
    assert not store.put_many(batch).failed
    again = store.put_many(pack_rows(rows))  # identical re-put: idempotent
    assert sorted(again.ok) == sorted(batch.keys) and not again.failed

    tampered = pack_rows(rows)
    victim = tampered.keys[2]
    o = tampered.fields["token_ids"].offsets
    tampered.fields["token_ids"].values[o[2]] ^= 1
    res = store.put_many(tampered)
    assert list(res.failed) == [victim] and res.failed[victim][0] == "key_conflict"
    assert len(res.ok) == len(batch) - 1
    got = store.get_many([victim])
    assert got.batch.fields["token_ids"].row(0).tobytes() == rows[2].token_ids.tobytes()

    # Deleting frees the key for a new write (cut retries delete then re-put).
    assert store.delete([victim]).ok == [victim]
    assert not store.put_many(tampered.take([2])).failed


def test_dtype_mismatch_refused_naming_field_nothing_lost(store_factory):
    store = store_factory(n_units=1)
    rows = make_rows(2)
    assert not store.put_many(pack_rows(rows)).failed

    new = make_rows(2, prefix="x", seed=3)
    bad = pack_rows(new)
    bad.fields["logprobs"] = PackedField(bad.fields["logprobs"].values.astype(np.float64), bad.fields["logprobs"].offsets)
    res = store.put_many(bad)
    assert not res.ok and set(res.failed) == set(bad.keys)
    reason, detail = res.failed[bad.keys[0]]
    assert reason == "dtype_mismatch"
    assert "logprobs" in detail and "<f4" in detail and "<f8" in detail
    assert store.get_many(list(bad.keys)).failed[bad.keys[0]][0] == "missing_key"

    # Trailing shape: only rows carrying the bad field fail; the rest of the batch is stored.
    mixed_rows = make_rows(1, prefix="m", routes=False, seed=4) + make_rows(1, prefix="n", seed=5)
    mixed = pack_rows(mixed_rows)
    f = mixed.fields[RF]
    mixed.fields[RF] = PackedField(np.ascontiguousarray(f.values[:, :2, :]), f.offsets, f.present)
    res = store.put_many(mixed)
    routed = [k for k, r in zip(mixed.keys, mixed_rows) if r.routed_experts is not None]
    assert sorted(res.failed) == sorted(routed)
    assert all(res.failed[k][0] == "dtype_mismatch" and "[4, 2]" in res.failed[k][1] for k in routed)
    assert sorted(res.ok) == sorted(k for k in mixed.keys if k not in routed)

    got = store.get_many([r.staging_key for r in rows])
    assert not got.failed and all(a.same_content(b) for a, b in zip(unpack_rows(got.batch), rows))


def test_store_full_refused_nothing_lost(store_factory):
    rows = make_rows(10, calls=1, tokens=128)
    one = pack_rows(rows[:1])
    probe = store_factory(n_units=1)
    probe.put_many(one)
    row_bytes = probe.stats()[0]["used_bytes"]
    store = store_factory(n_units=1, capacity=int(row_bytes * 4.5))
    res = store.put_many(pack_rows(rows))
    assert len(res.ok) == 4
    assert len(res.failed) == 6 and all(r == "store_full" for r, _ in res.failed.values())
    got = store.get_many(res.ok)
    assert not got.failed and len(got.batch) == 4
    by_key = {r.staging_key: r for r in rows}
    assert all(a.same_content(by_key[a.staging_key]) for a in unpack_rows(got.batch))
    # Space freed by a delete is usable again.
    store.delete(res.ok[:1])
    retry = store.put_many(pack_rows([by_key[next(iter(res.failed))]]))
    assert not retry.failed


def test_partitions_are_isolated(store_factory):
    store = store_factory()
    staged, cut = make_rows(2, seed=1), make_rows(2, seed=2)  # same keys, different content
    assert [r.staging_key for r in staged] == [r.staging_key for r in cut]
    assert not store.put_many(pack_rows(staged), partition="staging").failed
    assert store.get_many([staged[0].staging_key], partition="cut").failed[staged[0].staging_key][0] == "missing_key"
    assert not store.put_many(pack_rows(cut), partition="cut").failed  # no key_conflict across partitions
    a = unpack_rows(store.get_many([r.staging_key for r in staged], partition="staging").batch)
    b = unpack_rows(store.get_many([r.staging_key for r in cut], partition="cut").batch)
    assert all(x.same_content(y) for x, y in zip(a, staged)) and all(x.same_content(y) for x, y in zip(b, cut))
    assert store.delete([staged[0].staging_key], partition="cut").ok
    assert not store.get_many([staged[0].staging_key], partition="staging").failed
    counts = {}
    for s in store.stats():
        for p, n in s["partitions"].items():
            counts[p] = counts.get(p, 0) + n
    assert counts == {"staging": len(staged), "cut": len(cut) - 1}
    with pytest.raises(StoreError, match="unknown partition 'stagging'"):
        store.get_many([staged[0].staging_key], partition="stagging")


def test_bad_input_is_typed_and_contained(store_factory):
    store = store_factory()
    with pytest.raises(StoreError, match="PackedBatch"):
        store.put_many({"k": np.zeros(3)})
    batch = pack_rows(make_rows(2))
    batch.keys[1] = "not a key"
    res = store.put_many(batch)
    assert res.failed == {"not a key": ("invalid_key", res.failed["not a key"][1])}
    assert sorted(res.ok) == sorted(k for k in batch.keys if k != "not a key")
    broken = pack_rows(make_rows(2, prefix="z"))
    broken.fields["token_ids"].offsets[-1] += 3  # offsets overrun values
    res = store.put_many(broken)
    assert not res.ok and all(r == "invalid_batch" and "token_ids" in d for r, d in res.failed.values())


def test_delete_batched_and_stats(store_factory):
    store = store_factory()
    batch = pack_rows(make_rows(5))
    store.put_many(batch)
    res = store.delete(list(batch.keys[:4]) + ["ghost/c9"])
    assert isinstance(res, StoreResult)
    assert sorted(res.ok) == sorted(batch.keys[:4]) and res.failed["ghost/c9"][0] == "missing_key"
    stats = store.stats()
    assert sum(s["rows"] for s in stats) == len(batch) - 4
    assert sum(s["puts"] for s in stats) >= 1 and sum(s["deletes"] for s in stats) >= 1
    assert all({"memory_bytes", "spilled_bytes", "disk_bytes", "gets", "partitions"} <= set(s) for s in stats)


def _get_in_task(store: StagingStore, keys: list[str]) -> list[bytes]:
    got = store.get_many(keys, fields=["token_ids"])
    return [got.batch.fields["token_ids"].row(i).tobytes() for i in range(len(got.batch))]


class AsyncReader:
    """An async actor using the store's async twins on its worker's event loop."""

    def __init__(self, store: StagingStore):
        self.store = store

    async def roundtrip(self, batch: PackedBatch) -> tuple[int, list[str]]:
        put = await self.store.put_many_async(batch, partition="cut")
        got = await self.store.get_many_async(list(batch.keys), partition="cut")
        await self.store.delete_async(list(batch.keys[:1]), partition="cut")
        return len(put.ok), got.batch.keys


def test_store_usable_from_tasks_and_async_actors(cluster_client, store_factory):
    store = store_factory()
    rows = make_rows(3)
    batch = pack_rows(rows)
    store.put_many(batch)
    out = cluster_client.submit(_get_in_task, store, list(batch.keys), pure=False).result()
    assert out == [r.token_ids.tobytes() for r in rows]

    reader = cluster_client.submit(AsyncReader, store, actor=True, pure=False).result()
    n_ok, keys = reader.roundtrip(batch).result()
    assert n_ok == len(batch) and keys == batch.keys
    assert store.get_many([batch.keys[0]], partition="cut").failed[batch.keys[0]][0] == "missing_key"


def test_large_put_split_into_capped_calls(store_factory):
    import dask

    store = store_factory(n_units=1)
    rows = make_rows(6, calls=1, tokens=256)
    batch = pack_rows(rows)
    cap = int(2.5 * batch.nbytes / len(batch))  # ~2 rows per call, whatever the routes' width
    res = store.with_settings(max_call_bytes=cap).put_many(batch)
    assert sorted(res.ok) == sorted(batch.keys) and not res.failed
    assert store.stats()[0]["puts"] >= 3
    got = store.get_many(list(batch.keys))
    assert_same_batch(got.batch, batch)


# ---- adopted puts (put_many(..., adopt=True)) -------------------------------------------
#
# With adopt the caller hands the batch's buffers over; a unit keeps each row's token
# fields (token_ids, token_mask, logprobs, routed_experts) as views of the buffers it
# received, one shared group per put. Bytes of a group's buffers that no in-memory row
# covers any more are ``pinned_bytes``, counted against capacity; a group whose live rows
# cover less than half of its buffers is compacted (rows copied out, buffers freed).

# Per row: every token field is shared (>= 64 elements per row); in a put of 8 rows each
# token field is a buffer of its own on the wire (>= 64 KiB) and a plain frame (< 1 MiB,
# under the receive pool's smallest): the buffers hold exactly the rows' bytes.
TOKENS = 2048


def _token_bytes(tokens: int) -> int:
    """One row's bytes in the adopted buffers (its token-aligned fields, as packed)."""
    batch = pack_rows(make_rows(1, calls=1, tokens=tokens))
    return sum(f.values.nbytes for f in batch.fields.values() if len(f.values) == tokens)


SHARED_BYTES = _token_bytes(TOKENS)


def unit_stats(store: StagingStore, i: int = 0) -> dict:
    return store.stats()[i]


def assert_rows_exact(store: StagingStore, rows: list[StagedRow], partition: str = "staging") -> None:
    """Every row reads back bit-exact, in request order, recomputed digests included."""
    from tasks.hashing import row_digest

    got = store.get_many([r.staging_key for r in rows], partition=partition)
    assert not got.failed, got.failed
    assert_same_batch(got.batch, pack_rows(rows))
    assert all(row_digest(a) == b.digest for a, b in zip(unpack_rows(got.batch), rows))


def test_adopted_puts_read_back_bit_exact(store_factory):
    import dask

    rows = make_rows(12, calls=2, tokens=TOKENS, seed=21)
    batch = pack_rows(rows)
    store = store_factory(n_units=2)
    with dask.config.set({"token-capture.store.adopt-received": False}):  # read once, at start
        copy = store_factory(n_units=2)  # the copied reference
    # Rows interleaving the units (each unit's rows are gathered into a new batch), then rows
    # ordered by unit (each unit gets a slice of the batch buffers) in small capped calls.
    order = np.random.default_rng(0).permutation(len(batch))
    first, rest = order[:8], np.sort(order[8:])
    rest = rest[np.argsort([unit_for_key(batch.keys[i], 2) for i in rest], kind="stable")]
    res = store.put_many(batch.take(first), adopt=True)
    assert sorted(res.ok) == sorted(batch.keys[i] for i in first) and not res.failed
    res = store.with_settings(max_call_bytes=3 * SHARED_BYTES).put_many(batch.take(rest), adopt=True)
    assert sorted(res.ok) == sorted(batch.keys[i] for i in rest) and not res.failed
    assert not copy.put_many(pack_rows(rows)).failed
    assert_rows_exact(store, rows)
    stats, copy_stats = store.stats(), copy.stats()
    # Adopted rows weigh exactly what copied rows weigh; while every row lives nothing is
    # pinned but what the buffers hold beyond them (small calls share one wire buffer).
    assert [s["used_bytes"] for s in stats] == [s["used_bytes"] for s in copy_stats]
    assert all(s["dead_bytes"] == 0 for s in stats)
    assert all(s["shared_groups"] >= 2 for s in stats), "one group per adopted call"
    assert all(s["shared_groups"] == 0 for s in copy_stats)


def test_adopted_rows_survive_deletes_and_mostly_dead_groups_compact(store_factory):
    rows = make_rows(8, calls=1, tokens=TOKENS, seed=22)
    store = store_factory(n_units=1)
    assert not store.put_many(pack_rows(rows), adopt=True).failed
    s = unit_stats(store)
    assert (s["shared_groups"], s["pinned_bytes"]) == (1, 0)
    row_weight = s["used_bytes"] // 8
    for k in range(1, 6):
        assert store.delete([rows[k - 1].staging_key]).ok == [rows[k - 1].staging_key]
        s = unit_stats(store)
        assert s["used_bytes"] == (8 - k) * row_weight, "a deleted row's weight is freed at once"
        if k <= 4:
            # Live rows still cover at least half of the buffers: kept, the dead part pinned.
            assert (s["shared_groups"], s["pinned_bytes"]) == (1, k * SHARED_BYTES)
        else:
            # 3 of 8 live: compacted (survivors copied out, buffers freed, nothing pinned).
            assert (s["shared_groups"], s["pinned_bytes"]) == (0, 0)
        assert_rows_exact(store, rows[k:])
    # The rest leave without a group to update; the unit ends empty.
    store.delete([r.staging_key for r in rows[5:]])
    s = unit_stats(store)
    assert (s["rows"], s["used_bytes"], s["pinned_bytes"], s["shared_groups"]) == (0, 0, 0, 0)


def test_whole_adopted_group_deleted_unpins_everything(store_factory):
    tokens = 4 * TOKENS  # 3-row puts whose token fields are buffers of their own
    rows = make_rows(6, calls=1, tokens=tokens, seed=23)
    store = store_factory(n_units=1)
    store.put_many(pack_rows(rows[:3]), adopt=True)
    store.put_many(pack_rows(rows[3:]), adopt=True)
    assert unit_stats(store)["shared_groups"] == 2
    store.delete([rows[0].staging_key])  # group 1: 2 of 3 live
    s = unit_stats(store)
    assert (s["shared_groups"], s["pinned_bytes"]) == (2, _token_bytes(tokens))
    store.delete([r.staging_key for r in rows[1:3]])  # group 1 gone entirely: its pin goes too
    s = unit_stats(store)
    assert (s["shared_groups"], s["pinned_bytes"]) == (1, 0)
    assert_rows_exact(store, rows[3:])



def row_weight(store_factory, row) -> int:
    """Bytes a unit counts for ``row`` alone (put into a fresh one-unit store)."""
    probe = store_factory(n_units=1)
    probe.put_many(pack_rows([row]))
    return unit_stats(probe)["used_bytes"]

def test_adopted_rows_bit_exact_through_spill(store_factory, tmp_path):
    rows = make_rows(8, calls=1, tokens=TOKENS, seed=24)
    weight = row_weight(store_factory, rows[0])

    # Room for 5 rows in memory: the first 3 spill during the put. The 5 left would keep
    # the buffers, spilled rows' bytes included, past the memory limit: they are copied
    # out at the end of the put, and nothing is pinned.
    limit = int(5.5 * weight)
    store = store_factory(n_units=1, memory_limit=limit)
    assert not store.put_many(pack_rows(rows), adopt=True).failed
    s = unit_stats(store)
    in_memory = s["rows"] - s["spilled_rows"]
    assert s["spilled_rows"] > 0 and spill_files(tmp_path / "spill")
    assert in_memory >= 4, "the memory limit keeps what fits"
    assert (s["shared_groups"], s["pinned_bytes"], s["compacted_groups"]) == (0, 0, 1)
    assert s["resident_bytes"] == s["memory_bytes"] <= limit
    for _ in range(2):  # reads bring rows back and spill others: within the limit throughout
        assert_rows_exact(store, rows)
        assert_rows_exact(store, rows[::-1])
        s = unit_stats(store)
        assert s["resident_bytes"] <= limit
    assert s["spilled_rows"] > 0

    # Room for 1 row: everything but the last spills at once; a group of 1 live row in 8 is
    # compacted at the end of the put itself.
    tiny = store_factory(n_units=1, memory_limit=int(1.5 * weight))
    others = make_rows(8, calls=1, tokens=TOKENS, seed=25, prefix="t")
    assert not tiny.put_many(pack_rows(others), adopt=True).failed
    s = unit_stats(tiny)
    assert s["spilled_rows"] == 7 and (s["shared_groups"], s["pinned_bytes"]) == (0, 0)
    assert_rows_exact(tiny, others)
    # An identical re-put of spilled rows compares against the disk copy: idempotent.
    again = tiny.put_many(pack_rows(others), adopt=True)
    assert sorted(again.ok) == sorted(r.staging_key for r in others) and not again.failed
    assert unit_stats(tiny)["rows"] == 8


def test_pinned_bytes_count_against_the_memory_limit(store_factory):
    """Rows in memory and the bytes their buffers pin fit the memory limit together after
    every call: a group with deleted members is compacted before any row is spilled."""
    rows = make_rows(10, calls=1, tokens=TOKENS, seed=33)
    weight = row_weight(store_factory, rows[0])
    limit = int(8.5 * weight)
    store = store_factory(n_units=1, memory_limit=limit)
    assert not store.put_many(pack_rows(rows[:8]), adopt=True).failed
    store.delete([r.staging_key for r in rows[:3]])  # 5 of 8 live: kept, 3 rows pinned
    s = unit_stats(store)
    assert (s["shared_groups"], s["dead_bytes"], s["spilled_rows"]) == (1, 3 * SHARED_BYTES, 0)
    assert s["resident_bytes"] == s["memory_bytes"] + 3 * SHARED_BYTES <= limit
    # Two more rows fit by row weights (7 <= 8.5) but not with the pinned bytes (10 rows'
    # worth): the group is compacted (its dead bytes freed), no row spilled.
    assert not store.put_many(pack_rows(rows[8:]), adopt=True).failed
    s = unit_stats(store)
    assert (s["spilled_rows"], s["dead_bytes"], s["compacted_groups"]) == (0, 0, 1)
    assert s["resident_bytes"] <= limit
    assert_rows_exact(store, rows[3:])


def test_adopted_reput_is_idempotent_and_different_content_conflicts(store_factory):
    rows = make_rows(4, calls=2, tokens=TOKENS, seed=26)
    store = store_factory(n_units=1)
    assert not store.put_many(pack_rows(rows), adopt=True).failed
    before = unit_stats(store)
    again = store.put_many(pack_rows(rows), adopt=True)  # fresh buffers, same content
    assert sorted(again.ok) == sorted(r.staging_key for r in rows) and not again.failed
    s = unit_stats(store)
    assert s["rows"] == 8 and s["used_bytes"] == before["used_bytes"]
    assert (s["shared_groups"], s["pinned_bytes"]) == (1, 0), "an all-idempotent put keeps nothing of its buffers"

    tampered = pack_rows(rows)
    victim = tampered.keys[5]
    o = tampered.fields["logprobs"].offsets
    tampered.fields["logprobs"].values[o[5] + 3] -= 0.25
    res = store.put_many(tampered, adopt=True)
    assert list(res.failed) == [victim] and res.failed[victim][0] == "key_conflict"
    assert sorted(res.ok) == sorted(k for k in tampered.keys if k != victim)
    s = unit_stats(store)
    assert (s["rows"], s["shared_groups"], s["pinned_bytes"]) == (8, 1, 0)
    assert_rows_exact(store, rows)


def test_capacity_counts_pinned_bytes_nothing_lost(store_factory):
    rows = make_rows(8, calls=1, tokens=TOKENS, seed=27)
    fresh = make_rows(4, calls=1, tokens=TOKENS, seed=28, prefix="f")
    weight = row_weight(store_factory, rows[0])
    capacity = 8 * weight + weight // 4
    store = store_factory(n_units=1, capacity=capacity)
    assert not store.put_many(pack_rows(rows), adopt=True).failed
    store.delete([r.staging_key for r in rows[:4]])  # half live: kept, 4 rows' token bytes pinned
    s = unit_stats(store)
    assert s["pinned_bytes"] == 4 * SHARED_BYTES and s["used_bytes"] == 4 * weight
    # By row weights alone the 4 new rows fit (8 <= 8.25 rows); the pinned buffers are real
    # memory, so the unit refuses them.
    res = store.put_many(pack_rows(fresh), adopt=True)
    assert res.failed and all(r == "store_full" and "pinned" in d for r, d in res.failed.values())
    s = unit_stats(store)
    assert s["used_bytes"] + s["pinned_bytes"] <= capacity
    assert_rows_exact(store, rows[4:])
    refused = [r for r in fresh if r.staging_key in res.failed]
    missing = store.get_many([r.staging_key for r in refused]).failed
    assert all(missing[r.staging_key][0] == "missing_key" for r in refused), "refused rows are not half-stored"
    # One more delete leaves 3 of 8 live: compaction frees the pinned bytes, the rows fit.
    store.delete([rows[4].staging_key])
    assert unit_stats(store)["pinned_bytes"] == 0
    retry = store.put_many(pack_rows(refused), adopt=True)
    assert sorted(retry.ok) == sorted(r.staging_key for r in refused) and not retry.failed
    assert_rows_exact(store, rows[5:] + fresh)


def test_partly_refused_adopted_put_never_holds_the_unit_past_capacity(store_factory):
    """Rows refused from an adopted put (store_full, key_conflict, idempotent) still sit in
    its buffers; the unit must not keep those dead bytes beyond its capacity."""
    rows = make_rows(8, calls=1, tokens=TOKENS, seed=29)
    weight = row_weight(store_factory, rows[0])
    capacity = int(4.5 * weight)
    store = store_factory(n_units=1, capacity=capacity)
    res = store.put_many(pack_rows(rows), adopt=True)
    assert len(res.ok) == 4 and all(r == "store_full" for r, _ in res.failed.values())
    s = unit_stats(store)
    assert s["used_bytes"] == 4 * weight
    assert s["used_bytes"] + s["pinned_bytes"] <= capacity, s
    # The space the rows leave is usable: a row that fits by weight is taken.
    small = make_rows(1, calls=1, tokens=16, seed=30, prefix="s")
    assert not store.put_many(pack_rows(small), adopt=True).failed
    assert_rows_exact(store, [r for r in rows if r.staging_key in res.ok] + small)


# In-process (processes=False) the unit receives the caller's very arrays: no wire copy in
# between. What adopt promises there (StorageUnit.put_many / StagingStore.put_many): the
# caller hands the buffers over and never modifies them afterwards; in return the unit keeps
# token rows as views of them instead of copying each row. Without adopt the unit copies.


@pytest.fixture(scope="module")
def inproc_client():
    from distributed import Client, LocalCluster

    # inproc transport: nothing bound to a network interface.
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None,
                      worker_dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture
def inproc_store(inproc_client, tmp_path):
    with store_maker(inproc_client, tmp_path / "spill-inproc") as make:
        yield make


def _scribble(batch: PackedBatch, names) -> None:
    for name in names:
        v = batch.fields[name].values
        v.view(np.uint8)[...] ^= 0x5A  # every byte changes


TOKEN_NAMES = ("token_ids", "token_mask", "logprobs", RF)


def test_in_process_adopt_keeps_views_and_a_kept_promise_keeps_rows_exact(inproc_store):
    import gc

    store = inproc_store(n_units=1)
    rows = make_rows(8, calls=1, tokens=TOKENS, seed=31)

    # Without adopt the unit copies: the caller may reuse every buffer at once.
    copied = pack_rows(rows[:4])
    assert not store.put_many(copied).failed
    _scribble(copied, copied.fields)
    assert_rows_exact(store, rows[:4])

    # Adopt, promise kept: the caller never touches the buffers again (here: drops them).
    adopted = pack_rows(rows[4:])
    assert not store.put_many(adopted, adopt=True).failed
    del adopted
    gc.collect()
    assert_rows_exact(store, rows[4:])  # the unit's views keep the buffers alive
    assert unit_stats(store)["shared_groups"] == 1

    # Why the promise matters: token fields ARE the handed-over buffers (no per-row copy),
    # while ids, scalars and hashes are copied once per batch.
    others = make_rows(8, calls=1, tokens=TOKENS, seed=32, prefix="v")
    handed = pack_rows(others)
    assert not store.put_many(handed, adopt=True).failed
    keys = list(handed.keys)
    want_small = {n: f.values.copy() for n, f in handed.fields.items() if n not in TOKEN_NAMES}
    _scribble(handed, handed.fields)  # a broken promise
    got = store.get_many(keys).batch
    for name in TOKEN_NAMES:
        assert got.fields[name].values.tobytes() == handed.fields[name].values.tobytes(), name
    for name, want in want_small.items():
        assert got.fields[name].values.tobytes() == want.tobytes(), f"{name} is copied on put"

    # Compaction copies the survivors out: from then on they no longer follow the buffers.
    store.delete(keys[:5])
    assert unit_stats(store)["shared_groups"] == 1  # only the first adopted group is left
    before = store.get_many(keys[5:]).batch
    _scribble(handed, TOKEN_NAMES)
    after = store.get_many(keys[5:]).batch
    for name in TOKEN_NAMES:
        assert after.fields[name].values.tobytes() == before.fields[name].values.tobytes(), name


def test_in_process_adopt_across_units_reads_back_exact(inproc_store):
    store = inproc_store(n_units=2, memory_limit="48KiB")  # spills too
    rows = make_rows(16, calls=2, tokens=TOKENS, seed=33)
    batch = pack_rows(rows)
    by_unit = np.argsort([unit_for_key(k, 2) for k in batch.keys], kind="stable")
    assert not store.put_many(batch.take(by_unit), adopt=True).failed  # each unit: a slice of the buffers
    assert sum(s["spilled_rows"] for s in store.stats()) > 0
    assert_rows_exact(store, rows)
    store.delete([r.staging_key for r in rows[::2]])
    assert_rows_exact(store, rows[1::2])
    stats = store.stats()
    assert all(s["pinned_bytes"] <= s["memory_bytes"] for s in stats), "pins never exceed live bytes"


def test_units_adopt_batches_received_over_the_wire(store_factory):
    """A put that crossed a TCP connection arrives in buffers only the unit holds: the unit
    keeps its rows as views of them (one shared group per call, no copy per row) even
    without ``adopt=True``; ``store.adopt-received: false`` makes it copy every row."""
    import dask

    rows = make_rows(6, calls=2, tokens=TOKENS, seed=5)
    batch = pack_rows(rows)
    store = store_factory(n_units=1)
    assert store.unit_workers[0].startswith("tcp://")
    assert not store.put_many(batch).failed
    assert store.stats()[0]["shared_groups"] == 1
    with dask.config.set({"token-capture.store.adopt-received": False}):  # read once, at start
        copied = store_factory(n_units=1)
    assert not copied.put_many(batch).failed
    assert copied.stats()[0]["shared_groups"] == 0
    assert_rows_exact(store, rows)
    assert_rows_exact(copied, rows)


def test_in_process_units_copy_what_they_are_given(inprocess_client, tmp_path):
    """In-process (``inproc://``) calls hand the caller's own arrays to the unit: it must
    copy them, or a caller reusing its buffers would change staged rows."""
    from pipeline.store import StagingStore

    rows = make_rows(4, calls=1, tokens=TOKENS, seed=6)
    batch = pack_rows(rows)
    store = StagingStore.start(inprocess_client, n_units=1, spill_directory=str(tmp_path))
    try:
        assert store.unit_workers[0].startswith("inproc://")
        assert not store.put_many(batch).failed
        assert store.stats()[0]["shared_groups"] == 0
        batch.fields["token_ids"].values[:] = -1  # the caller reuses its buffer
        assert_rows_exact(store, rows)
    finally:
        store.close()


def test_merged_gets_reuse_pooled_buffers_but_never_one_a_caller_holds(store_factory):
    """A get over several units merges their answers into a pooled slab: the next get
    reuses it once the caller dropped the previous answer (no fresh memory per get), and
    never while the caller still holds it (its rows stay what they were)."""
    from pipeline.store import client as store_client

    rows = make_rows(16, calls=1, tokens=4096, seed=9)  # big enough to pool
    store = store_factory(n_units=2)
    assert not store.put_many(pack_rows(rows)).failed
    keys = [r.staging_key for r in rows]
    assert len({unit_for_key(k, 2) for k in keys}) == 2, "the get must merge two units"
    pool = store_client.client_buffers()
    first = store.get_many(keys)
    held = first.batch.fields["token_ids"].values.copy()
    reused, allocated = pool.reused, pool.allocated
    second = store.get_many(keys)  # `first` still held: a new slab
    assert pool.allocated == allocated + 1 and pool.reused == reused
    assert np.array_equal(first.batch.fields["token_ids"].values, held)
    del first, second
    store.get_many(keys)  # both dropped: a slab is reused
    assert pool.reused == reused + 1
    assert_rows_exact(store, rows)


def test_batch_computed_row_weights_equal_each_rows_own_weight(tmp_path):
    """The unit weighs a put's rows for the whole batch at once; every weight must be what
    row_nbytes says of the row itself (rows with and without routes), so capacity and
    spilling count exactly."""
    from pipeline.store.spill import row_nbytes
    from pipeline.store.unit import ROW_OVERHEAD_BYTES, StorageUnit, key_nbytes

    with_routes = make_rows(3, calls=1, tokens=32, routes=True, seed=1, prefix="a")
    without = make_rows(2, calls=1, tokens=32, routes=False, seed=2, prefix="b")
    batch = pack_rows(with_routes + without)
    f = batch.fields[RF]
    assert f.present is not None and not f.present.all()
    unit = StorageUnit(0, 1 << 30, 1 << 31, spill_directory=str(tmp_path))
    try:
        assert not unit.put_many("staging", batch).failed
        expected = sum(
            row_nbytes(unit.held.rows[unit.held.index["staging"][k]]) + key_nbytes(k) + ROW_OVERHEAD_BYTES for k in batch.keys
        )
        assert unit.held.used_bytes == expected
        assert unit.held.rows.fast.total_weight == sum(row_nbytes(unit.held.rows[s]) for s in unit.held.index["staging"].values())
    finally:
        unit.close()


def test_a_put_gathers_each_units_rows_into_pooled_buffers(store_factory):
    """Rows interleaving the units are gathered per unit into the client's pooled buffers
    (memory the process already touched), reused across puts once a call is done; the
    rows stored are what was put."""
    import gc

    from pipeline.store import client as store_client

    made = make_rows(16, calls=1, tokens=4096, seed=13)
    by_unit = [[r for r in made if unit_for_key(r.staging_key, 2) == u] for u in (0, 1)]
    rows = [r for pair in zip(*by_unit) for r in pair]  # units alternate: every put gathers
    assert len(rows) >= 8
    store = store_factory(n_units=2)
    pool = store_client.client_buffers()
    before = pool.allocated + pool.reused
    first = pack_rows(rows[:4])
    assert not store.put_many(first).failed
    taken = pool.allocated + pool.reused
    assert taken > before, "the per-unit gathers came from the pool"
    gc.collect()  # an actor call's arguments may sit in a reference cycle until collected
    reused = pool.reused
    assert not store.put_many(pack_rows(rows[4:8])).failed  # the same sizes: the same slabs
    assert pool.reused > reused
    assert_rows_exact(store, rows[:8])


def _read_on_unit_worker(store, keys: list[str], local_reads: bool) -> tuple[bool, bool]:
    """Runs as a task on the unit's worker: (rows read back right, served from the unit's
    own pooled answer buffer, i.e. in-process)."""
    from distributed import get_worker

    got = store.with_settings(local_reads=local_reads).get_many(keys)
    unit = get_worker().state.actors[store.units[0].key]
    slabs = [s for slabs in unit.answers._classes.values() for s in slabs]
    values = got.batch.fields["token_ids"].values
    return (not got.failed and got.batch.keys == keys), any(np.shares_memory(values, s) for s in slabs)


def test_reads_on_the_units_own_worker_skip_the_socket(store_factory, cluster_client):
    """A get from a task on the worker hosting the unit is served in-process, on the unit's
    actor thread: the answer IS the unit's pooled buffer (no copy over a socket); with
    ``store.local-reads: false`` it comes over TCP into fresh buffers. Same rows."""
    rows = make_rows(8, calls=1, tokens=4096, seed=14)
    store = store_factory(n_units=1)
    assert not store.put_many(pack_rows(rows)).failed
    keys = [r.staging_key for r in rows]
    where = [store.unit_workers[0]]
    ok, local = cluster_client.submit(_read_on_unit_worker, store, keys, True, workers=where, pure=False).result()
    assert ok and local
    ok, local = cluster_client.submit(_read_on_unit_worker, store, keys, False, workers=where, pure=False).result()
    assert ok and not local
    assert store.stats()[0]["gets"] == 2
    assert_rows_exact(store, rows)
