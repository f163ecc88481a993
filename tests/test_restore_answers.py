"""Restore-side copies: pooled get-answer buffers on the unit, sliced answers in the coalescer.

* ``SlabPool`` (pipeline/store/slab_pool.py): a slab is never handed out again while any
  view of an earlier answer lives (that would overwrite rows a caller still reads), is
  reused once released, and the pool keeps at most ``max_bytes`` of slabs.
* A real in-process cluster (answers reach the caller by reference, the case where reuse
  could alias): answers held across many later gets keep their bytes; released ones are
  reused (the unit's counters say so).
* The coalescer serves each request as views of its get's buffers, with read-only
  offsets shared by fields of equal layout, and identical rows to a direct slice.
"""
from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
from distributed import Client

from pipeline.cluster import local_cluster
from pipeline.restore.coalescer import PrefixReadCoalescer
from pipeline.store import StagingStore
from pipeline.store.slab_pool import SlabPool
from pipeline.store.protocol import GetResult
from pipeline.store.unit import pack_stored_rows
from tasks.keys import cut_key
from tasks.packed import PackedBatch, slice_rows

pytestmark = pytest.mark.timeout(60)

TOKENS = 8192  # per row: the token fields are 128 KiB + 2 x 32 KiB, so answers are pooled


def stored_rows(n: int, tokens: int = TOKENS, seed: int = 0) -> list[dict]:
    """Rows as a unit holds them: {field: array}, token fields big, the rest tiny."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        rows.append(
            {
                "token_ids": rng.integers(0, 1 << 40, tokens),
                "token_mask": rng.random(tokens, dtype=np.float32),
                "logprobs": -rng.random(tokens, dtype=np.float32),
                "prev_len": np.array([i], dtype=np.int64),
                "digest": rng.integers(0, 256, 32).astype(np.uint8),
            }
        )
    return rows


NAMES = ["token_ids", "token_mask", "logprobs", "prev_len", "digest"]


def slab_of(batch: PackedBatch) -> np.ndarray:
    base = batch.fields["token_ids"].values.base
    assert base is not None, "token field not carved from a pooled slab"
    return base


def test_slab_not_reused_while_any_view_lives_then_reused():
    pool = SlabPool(max_bytes=64 << 20)
    rows = stored_rows(8)
    keys = [f"k{i}" for i in range(4)]
    a = pack_stored_rows(keys, rows[:4], NAMES, None, pool)
    want_a = {n: a.fields[n].values.copy() for n in NAMES}
    slab_a = slab_of(a)
    # Every big field of one answer shares one slab; tiny fields are their own arrays.
    assert all(a.fields[n].values.base is slab_a for n in ("token_ids", "token_mask", "logprobs"))
    assert a.fields["digest"].values.base is not slab_a and a.fields["prev_len"].values.base is not slab_a

    held = a.fields["logprobs"].values[10:20]  # a caller keeps a small view of one field
    del a
    b = pack_stored_rows(keys, rows[4:], NAMES, None, pool)
    assert slab_of(b) is not slab_a and not np.shares_memory(slab_of(b), held)
    assert np.array_equal(held, want_a["logprobs"][10:20])
    assert (pool.allocated, pool.reused) == (2, 0)

    del held, slab_a
    c = pack_stored_rows(keys, rows[:4], NAMES, None, pool)
    assert (pool.allocated, pool.reused) == (2, 1)  # a's slab, now free, served c
    for n in NAMES:
        assert np.array_equal(c.fields[n].values, want_a[n]), n
    assert np.array_equal(c.fields["token_ids"].offsets, np.arange(5) * TOKENS)
    del b, c


def test_small_field_kept_does_not_pin_the_slab():
    pool = SlabPool(max_bytes=64 << 20)
    rows = stored_rows(2)
    a = pack_stored_rows(["a", "b"], rows, NAMES, None, pool)
    digest = a.fields["digest"].values  # e.g. a verifier keeping the hashes
    del a
    pack_stored_rows(["a", "b"], rows, NAMES, None, pool)
    assert pool.reused == 1 and digest.shape == (64,)


def test_pool_is_bounded_and_releases_idle_slabs_of_other_sizes():
    rows = stored_rows(4)
    one = SlabPool.size_class(2 * TOKENS * 16)  # the slab of a two-row answer
    pool = SlabPool(max_bytes=2 * one)
    held = [pack_stored_rows(["a", "b"], rows[:2], NAMES, None, pool) for _ in range(4)]
    # Two slabs pooled; the pool full, the other two answers are plain allocations.
    assert (pool.allocated, pool.unpooled, pool.held_bytes) == (2, 2, 2 * one)
    assert len({id(slab_of(b)) for b in held}) == 4
    del held
    pack_stored_rows(["a", "b"], rows[:2], NAMES, None, pool)
    assert pool.reused == 1
    # A four-row answer (twice the size): the idle two-row slabs make room for it.
    big = pack_stored_rows(["a", "b", "c", "d"], rows, NAMES, None, pool)
    assert (pool.allocated, pool.unpooled) == (3, 2)
    assert pool.held_bytes == SlabPool.size_class(4 * TOKENS * 16) <= pool.max_bytes
    del big


def test_zero_bytes_turns_pooling_off():
    pool = SlabPool(max_bytes=0)
    b = pack_stored_rows(["a", "b"], stored_rows(2), NAMES, None, pool)
    assert pool.allocated == 0 and b.fields["token_ids"].values.base is None


def test_small_answers_are_plain_allocations():
    pool = SlabPool(max_bytes=64 << 20)
    b = pack_stored_rows(["a"], stored_rows(1, tokens=16), NAMES, None, pool)
    assert pool.allocated == 0 and b.fields["token_ids"].values.base is None


# ---- a real cluster, in-process: answers reach the caller by reference ----------------


@pytest.fixture(scope="module")
def inproc_store(tmp_path_factory):
    with local_cluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster:
        with Client(cluster) as client:
            store = StagingStore.start(client, n_units=1, spill_directory=str(tmp_path_factory.mktemp("spill")))
            try:
                yield store
            finally:
                store.close()


def test_held_answers_survive_later_gets_on_a_real_unit(inproc_store):
    store = inproc_store
    rows = stored_rows(16, seed=1)
    keys = [cut_key("ck", f"r{i}", "c0", 0) for i in range(16)]
    batch = PackedBatch.from_rows(keys, rows)
    assert not store.put_many(batch, partition="cut").failed

    held = []
    for i in range(0, 16, 4):  # four answers, all held
        res = store.get_many(keys[i : i + 4], ["token_ids", "logprobs"], partition="cut")
        assert not res.failed
        held.append((i, res.batch))
    for _ in range(6):  # later gets while they are held, then released
        res = store.get_many(keys[:8], ["token_ids", "logprobs"], partition="cut")
        del res
    gc.collect()
    for i, b in held:
        for j in range(4):
            assert np.array_equal(b.fields["token_ids"].row(j), rows[i + j]["token_ids"])
            assert np.array_equal(b.fields["logprobs"].row(j), rows[i + j]["logprobs"])
    stats = store.stats()[0]
    assert stats["answer_buffers_reused"] >= 1  # released answers' slabs came back
    assert stats["answer_buffers_allocated"] >= 4  # held ones were never handed out again


# ---- the coalescer's answers: views, shared read-only offsets ---------------------------


class OneGetStore:
    def __init__(self, rows: dict[str, dict]):
        self.rows = rows
        self.answers: list[PackedBatch] = []

    async def get_many(self, keys: list[str]) -> GetResult:
        b = PackedBatch.from_rows(list(keys), [self.rows[k] for k in keys], NAMES)
        self.answers.append(b)
        await asyncio.sleep(0)  # a real get waits for its answer at least one loop turn
        return GetResult(b, {})


def test_coalesced_requests_are_views_with_read_only_offsets():
    rows = {f"__cut__/ck/r{i}/c0/{s}": r for i in range(6) for s, r in enumerate(stored_rows(2, tokens=64, seed=i))}
    store = OneGetStore(rows)
    requests = [[f"__cut__/ck/r{i}/c0/0", f"__cut__/ck/r{i}/c0/1"] for i in range(6)]

    async def main():
        co = PrefixReadCoalescer(store.get_many, window_ms=1000.0)
        # Same loop turn: the first request finds the coalescer idle and goes at once
        # (its answer is the get's batch itself); the other five join one get.
        return await asyncio.gather(*(co.read(ks, 128) for ks in requests))

    outs = asyncio.run(main())
    assert len(store.answers) == 2
    assert outs[0] is store.answers[0]
    answer = store.answers[1]
    for ks, got in zip(requests[1:], outs[1:]):
        lo = answer.keys.index(ks[0])
        want = slice_rows(answer, lo, lo + len(ks))
        assert got.keys == ks
        for n in NAMES:
            g = got.fields[n]
            assert np.array_equal(g.values, want.fields[n].values) and np.array_equal(g.offsets, want.fields[n].offsets), n
            assert np.shares_memory(g.values, answer.fields[n].values), n  # a view, not a copy
            assert not g.offsets.flags.writeable, n
        # Fields of one layout share their offsets; others have their own.
        f = got.fields
        assert f["token_ids"].offsets is f["token_mask"].offsets is f["logprobs"].offsets
        assert f["prev_len"].offsets is not f["token_ids"].offsets
        with pytest.raises(ValueError):
            f["token_ids"].offsets[0] = 5


def test_unit_reads_keys_and_fields_packed_or_as_lists(inproc_store):
    """The client sends keys/fields as one msgpack buffer each (a list argument costs Dask
    ~11 us per element per call); the unit answers the same either way and names a bad one."""
    from pipeline.store import StoreError
    from pipeline.store.protocol import pack_names

    store = inproc_store
    rows = stored_rows(3, seed=2)
    keys = [cut_key("pk", f"r{i}", "c0", 0) for i in range(3)]
    assert not store.put_many(PackedBatch.from_rows(keys, rows), partition="cut").failed
    unit = store.units[0]
    fields = ["token_ids", "digest"]
    packed = unit.get_many("cut", pack_names(keys + ["__cut__/pk/nope/c0/0"]), pack_names(fields)).result()
    plain = unit.get_many("cut", keys + ["__cut__/pk/nope/c0/0"], fields).result()
    for res in (packed, plain):
        assert res.batch.keys == keys and set(res.batch.fields) == set(fields)
        assert res.failed["__cut__/pk/nope/c0/0"][0] == "missing_key"
        assert np.array_equal(res.batch.fields["token_ids"].row(1), rows[1]["token_ids"])
    with pytest.raises(StoreError, match="keys: undecodable"):
        unit.get_many("cut", b"\xc1not msgpack", None).result()
    with pytest.raises(StoreError, match="fields must be a list"):
        unit.get_many("cut", keys, "token_ids").result()
