"""Batched cut puts: one store round trip per planned batch, rows packed into
pooled slabs that are reused only once nothing refers to them, and ``bench cut``'s
``raw_put`` mode (the store's own put of the very batches the batched cut writes).

Behaviour only: the storage units' own ``counters["puts"]``, the pool's counters, the
bytes read back. Nothing here asserts on time.
"""
from __future__ import annotations

import argparse
import gc
import os

import numpy as np
import pytest

from pipeline.bench import cut as bench_cut
from pipeline.generation import CallBuffer, run_cut
from pipeline.generation.cut import pack_buffers
from pipeline.process_state import configured
from pipeline.store import StagingStore
from pipeline.store.slab_pool import SlabPool
from pipeline.store.protocol import StoreResult
from tasks import hashing
from tasks.cut.batching import BatchLimits, pack_chunks, plan_rows
from tasks.cut.prefix import verify_prefix
from tasks.cut.receipt import DURABLE_PREFIX, inventory_digest
from tasks.keys import unit_for_key
from tasks.packed import pack_rows, unpack_rows

from support import store_maker

pytestmark = pytest.mark.timeout(180)

L, K = 2, 2


@pytest.fixture
def make_store(inprocess_client, tmp_path):
    """``make(n_units=2)`` -> a StagingStore on the shared in-process cluster (closed after)."""
    with store_maker(inprocess_client, tmp_path) as make:
        yield make


def calls(n: int, *, prefix: str, gen: int = 24, routes_every: int = 0, seed: int = 0) -> list[CallBuffer]:
    """``n`` calls of 8 context + ``gen`` generated tokens (ragged); every ``routes_every``-th
    one carries routed experts (another planner signature)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        routed = bool(routes_every) and i % routes_every == 0
        k = gen + i % 5
        b = CallBuffer(f"{prefix}{i}", "call-0", rng.integers(0, 500, 8), routes_shape=(L, K) if routed else None,
                       context_routes=rng.integers(0, 8, (8, L, K)).astype(np.int16) if routed else None,
                       max_new_tokens=100_000)
        b.append(rng.integers(0, 500, k), -rng.random(k, dtype=np.float32),
                 rng.integers(0, 8, (k, L, K)).astype(np.int16) if routed else None)
        out.append(b)
    return out


def cut(bufs, store, limits: BatchLimits, checkpoint_id: str = "ck"):
    pairs = [(b.call, b) for b in bufs]
    return run_cut(pairs, store, checkpoint_id=checkpoint_id, inventory_digest=inventory_digest([c for c, _ in pairs]),
                   limits=limits)


def unit_puts(store: StagingStore) -> int:
    return sum(s["puts"] for s in store.stats())


@pytest.mark.parametrize(
    "limits, routes_every",
    [
        (BatchLimits(8, 1 << 22, 1 << 28), 0),  # by rows
        (BatchLimits(64, 100, 1 << 28), 0),  # by tokens: 3 rows of 32-36 tokens per put
        (BatchLimits(8, 1 << 22, 1 << 28), 3),  # two signatures: each its own batches
    ],
    ids=["rows", "tokens", "signatures"],
)
def test_a_cut_makes_one_put_per_planned_batch(make_store, limits, routes_every):
    store = make_store(n_units=1)  # one unit: a batch is exactly one unit-level put
    bufs = calls(37, prefix=f"p{limits.max_rows}-{routes_every}-", routes_every=routes_every)
    # The plan, made independently from the rows the same calls freeze to.
    again = calls(37, prefix=f"p{limits.max_rows}-{routes_every}-", routes_every=routes_every)
    planned = plan_rows([b.freeze("ck").row for b in again], limits=limits)
    before = unit_puts(store)
    receipt, stats = cut(bufs, store, limits)
    assert receipt.counts() == {DURABLE_PREFIX: 37}
    assert unit_puts(store) - before == len(planned) == receipt.put_calls == stats.put_calls
    assert receipt.delete_calls == 0, "a clean cut makes no other round trip"
    for ack in receipt.acks:
        rows = store.get_many(list(ack.staging_keys), partition="cut").batch
        assert verify_prefix(rows, ack).usable


def test_batches_reach_the_store_as_one_buffer_per_field(make_store):
    """What the store is handed: every planned batch as ONE PackedBatch, its rows ordered
    by storage unit, each token field one contiguous buffer (no per-row arrays)."""
    store = make_store(n_units=2)
    seen = []

    class Spy:
        units = store.units

        def put_many(self, batch, partition="cut", adopt=False, timeout=None):
            seen.append((len(batch), [unit_for_key(k, len(store.units)) for k in batch.keys],
                         {n: (f.values.flags.c_contiguous, len(f)) for n, f in batch.fields.items()}))
            return store.put_many(batch, partition=partition, adopt=adopt, timeout=timeout)

        def delete(self, keys, partition="cut", timeout=None):
            return store.delete(keys, partition=partition, timeout=timeout)

    receipt, _ = cut(calls(20, prefix="spy"), Spy(), BatchLimits(8, 1 << 22, 1 << 28))
    assert receipt.counts() == {DURABLE_PREFIX: 20}
    assert [n for n, _, _ in seen] == [8, 8, 4]
    for n, units, fields in seen:
        assert all(contiguous and rows == n for contiguous, rows in fields.values())
        assert units == sorted(units)


def test_pack_chunks_into_pooled_slabs_is_byte_identical():
    bufs = calls(12, prefix="pool", gen=3000, routes_every=1)
    chunks = [b.freeze("ck").chunk for b in bufs]
    pool = SlabPool(1 << 26)
    got = pack_chunks(chunks, pool.allocator)
    want = pack_chunks(chunks)
    assert pool.allocated == 1, "the token fields came from one pooled slab"
    for name, w in want.fields.items():
        g = got.fields[name]
        assert g.values.dtype == w.values.dtype and g.values.tobytes() == w.values.tobytes(), name
        assert np.array_equal(g.offsets, w.offsets), name
    ref = pack_rows([c.to_row() for c in chunks])
    for back, row in zip(unpack_rows(got), unpack_rows(ref)):
        assert back.digest == row.digest == hashing.row_digest(back)


class Keeper:
    """A cut store that keeps every batch it is handed (so their slabs stay referenced)."""

    def __init__(self):
        self.batches = []

    def put_many(self, batch, partition="cut", adopt=False, timeout=None):
        self.batches.append(batch)
        return StoreResult(ok=list(batch.keys))

    def delete(self, keys, partition="cut", timeout=None):
        return StoreResult(ok=list(keys))


def test_a_slab_is_reused_only_once_nothing_refers_to_it(make_store):
    limits = BatchLimits(16, 1 << 22, 1 << 28)
    with configured({"token-capture.cut.pack-buffer-bytes": "64MiB"}):
        pool = pack_buffers()
        # Batches a store still holds pin their slabs: the next cut packs elsewhere and
        # the held batches keep their bytes.
        keeper = Keeper()
        cut(calls(16, prefix="held-a", gen=2000), keeper, limits)
        reused = pool.reused
        cut(calls(16, prefix="held-b", gen=2000), keeper, limits)
        assert pool.reused == reused, "a slab a batch still refers to was handed out again"
        for b in keeper.batches:
            assert [r.digest for r in unpack_rows(b)] == [hashing.row_digest(r) for r in unpack_rows(b)]
        del keeper, b
        gc.collect()
        # Against the real store the batch is dropped once its put is done: the next cut
        # packs into the same memory, and what it wrote reads back intact.
        store = make_store()
        first, _ = cut(calls(16, prefix="free-a", gen=2000), store, limits, "ck-a")
        gc.collect()  # a Dask actor call keeps its arguments in a reference cycle until the collector runs
        reused = pool.reused
        receipt, _ = cut(calls(16, prefix="free-b", gen=2000), store, limits, "ck-b")
        assert pool.reused > reused
        # The units got the slabs in-process (never received off a wire): they copied
        # them, so the first cut's rows are intact after the second cut reused the memory.
        assert sum(s["adopted_rows"] for s in store.stats()) == 0
        for ack in [*first.acks, *receipt.acks]:
            rows = store.get_many(list(ack.staging_keys), partition="cut").batch
            assert verify_prefix(rows, ack).usable


def test_pooling_off_packs_fresh_memory(make_store):
    with configured({"token-capture.cut.pack-buffer-bytes": 0}):
        pool = pack_buffers()
        held, allocated = pool.held_bytes, pool.allocated
        receipt, _ = cut(calls(16, prefix="fresh", gen=2000), make_store(), BatchLimits(16, 1 << 22, 1 << 28))
        assert receipt.counts() == {DURABLE_PREFIX: 16}
        assert pool.allocated == allocated and pool.held_bytes <= held


# ---- bench cut: the raw put of the batched cut's own batches ----------------------------


@pytest.fixture(scope="module")
def address(cluster_client):
    return cluster_client.scheduler.address


def parse(address: str, *flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_cut.add_arguments(p)
    return p.parse_args(["--scheduler", address, "--quiet", *flags])


FLAGS = ("--rows", "12", "--clients", "3", "--batch-size", "3", "--tokens", "1024", "--repeats", "3")


def test_raw_put_replays_the_batched_cut_exactly(address):
    result = bench_cut.run(parse(address, *FLAGS))
    assert result["ok"] is True and result["failures"] == []
    cut_rows = {r["mode"]: r for r in result["table"]}
    assert sorted(cut_rows) == ["batched", "batched_serial", "one_row"]
    assert cut_rows["batched_serial"]["put_calls"] == cut_rows["batched"]["put_calls"] == 6
    assert result["pipelined_vs_serial_1024"] == round(cut_rows["batched"]["rows_per_s"] / cut_rows["batched_serial"]["rows_per_s"], 3)
    raw, copy = result["raw_put"]
    batched = cut_rows["batched"]
    assert raw["mode"] == "raw_put" and raw["runs"] == 3 and len(raw["wall_s_runs"]) == 3
    # copy_put: the same batches after the one copy of their token fields (same rows, bytes, puts).
    assert copy["mode"] == "copy_put" and copy["written"] == 12 and copy["put_calls"] == 6
    assert copy["bytes_written"] == raw["bytes_written"] and "cut_own_cpu_s" not in copy
    assert result["cut_vs_raw_put_copy_bound_1024"] == round(copy["rows_per_s"] / raw["rows_per_s"], 3)
    missed = result["cut_vs_raw_put_1024"] < 0.8 and result["cut_vs_raw_put_copy_bound_1024"] < 0.8
    assert result["targets_out_of_reach"] == (["cut_vs_raw_put_1024"] if missed else [])
    # The same rows, bytes and batches: 12 rows over 3 clients (4 each), 3 rows per put: 3 + 1 each.
    assert raw["rows"] == batched["rows"] == 12 and raw["written"] == 12 and raw["failed"] == 0
    assert raw["put_calls"] == batched["put_calls"] == 6
    assert raw["bytes_written"] == batched["bytes_written"]
    assert result["cut_vs_raw_put_1024"] > 0 and result["speedup_1024"] > 0
    assert set(result["targets"]) == {"speedup_1024", "cut_vs_raw_put_1024"}
    # The cut's own CPU (the same calls cut against a recorder) bounds the ratio in the same run.
    assert raw["cut_own_cpu_s"] > 0 and result["cut_vs_raw_put_cpu_bound_1024"] == bench_cut.cpu_bound_ratio(raw)
    assert 0 < result["cut_vs_raw_put_cpu_bound_1024"] <= 1.0
    assert result["raw_put_core_use_1024"] == bench_cut.core_use(raw, len(os.sched_getaffinity(0))) > 0
    assert bench_cut.exit_status(result) == 0


def test_the_copy_put_copies_every_token_field_into_the_pool_and_shares_the_rest():
    pool = SlabPool(1 << 26)
    rows = [b.freeze("ck").row for b in bench_cut.client_calls(0, 4, 8192, "cp", None)]
    batch = pack_rows(rows)
    got = bench_cut.copied(batch, pool)
    assert list(got.keys) == list(batch.keys)
    for name, field in batch.fields.items():
        assert np.array_equal(got.fields[name].values, field.values) and np.array_equal(got.fields[name].offsets, field.offsets)
        copied = name in ("token_ids", "token_mask", "logprobs")
        if field.values.size:
            assert (not np.shares_memory(got.fields[name].values, field.values)) == copied, name
    assert pool.allocated == 1, "the token fields went into one pooled slab"


def test_core_use_is_every_process_cpu_over_the_cores_and_the_wall():
    row = {"wall_s": 0.5, "cpu_s": {"controller": 0.3, "tcp://a": 0.25, "tcp://b": 0.2}}
    assert bench_cut.core_use(row, 2) == 0.75 and bench_cut.core_use(row, 1) == 1.5


def test_the_cpu_bound_ratio_is_the_raw_wall_over_both_cpus_at_most_one():
    row = {"wall_s": 0.3, "cut_own_cpu_s": 0.47, "cpu_s": {"controller": 0.23, "tcp://w": 0.1}}
    assert bench_cut.cpu_bound_ratio(row) == round(0.3 / 0.70, 3)
    assert bench_cut.cpu_bound_ratio({**row, "wall_s": 2.0}) == 1.0  # the put itself is slower than both CPUs


def test_a_refused_raw_put_row_fails_the_bench_without_ratios(address, monkeypatch):
    real = StagingStore.put_many

    def put_many(self, batch, *a, **kw):
        res = real(self, batch, *a, **kw)
        if kw.get("timeout") is None:  # the raw put (a cut bounds its puts by its deadline)
            for k in batch.keys:
                if "c1r1/" in k:
                    res.ok.remove(k)
                    res.failed[k] = ("refused", "made to fail by the test")
        return res

    monkeypatch.setattr(StagingStore, "put_many", put_many)
    result = bench_cut.run(parse(address, *FLAGS[:-1], "1"))
    assert result["ok"] is False and bench_cut.exit_status(result) == 1
    assert any("raw_put" in f and "refused" in f and "c1r1" in f for f in result["failures"]), result["failures"]
    assert not [k for k in result if "speedup" in k or "cut_vs_raw_put" in k or "target" in k]


def test_the_cut_own_cpu_is_measured_against_a_store_that_keeps_no_batch(monkeypatch):
    # Kept batches pin their pooled slabs: the next batches would pack into fresh memory
    # (page faults a real cut does not pay), so the cut's own CPU is measured dropping them.
    made = []

    class Counting(bench_cut._Recorder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(bench_cut, "_Recorder", Counting)
    args = argparse.Namespace(clients=2, profile="toy", no_routes=False, layers=None, top_k=None, experts=None)
    cpu = bench_cut._cut_own_cpu_s(6, 64, args, "own", bench_cut._limits(3), ["u0", "u1"])
    assert cpu > 0 and len(made) == 2
    assert all(r.batches == [] for r in made)
