"""The store client's receive pool (pipeline/store/receive_pool.py): a get's large frames
land in reused memory, never in memory an answer still holds; config and ``suspended()``
turn it off. No timing is asserted."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench.store import template_batch, with_keys
from pipeline.process_state import configured
from pipeline.store import receive_pool

TOKENS = 8192  # 64 rows of ~180 KB: each unit's answer has frames of a few MB


@pytest.fixture(scope="module")
def template():
    return template_batch(64, TOKENS, layers=2, top_k=2, routes=True)


@pytest.fixture
def store(store_factory, template):
    s = store_factory(n_units=2)
    assert not s.put_many(with_keys(template, "rp", 0, len(template))).failed
    return s


def keys(template) -> list[str]:
    return list(with_keys(template, "rp", 0, len(template)).keys)


def in_pool(a: np.ndarray) -> bool:
    slabs = [s for group in receive_pool.pool()._classes.values() for s in group]
    return any(np.shares_memory(a, s) for s in slabs)


def counters() -> tuple[int, int, int]:
    p = receive_pool.pool()
    return p.reused, p.allocated, p.unpooled


def test_answers_are_read_into_pooled_memory_and_reused_once_dropped(store, template):
    got = store.get_many(keys(template))
    assert receive_pool.install()
    first = store.get_many(keys(template))
    assert not first.failed
    # One unit's answer comes back as the batch itself when it alone serves the keys; here
    # two units answer and the client merges, so look at what the wire delivered: the
    # counters moved, and a slab is handed out again only after its answer is gone.
    before = counters()
    del got, first
    again = store.get_many(keys(template))
    after = counters()
    assert after[0] > before[0]  # reused slabs, not new ones
    assert np.array_equal(again.batch.fields["token_ids"].values, template.fields["token_ids"].values)


def test_a_held_answer_is_never_overwritten(store, template, store_factory):
    one = store_factory(n_units=1)  # one unit: the answer IS the received frames
    assert not one.put_many(with_keys(template, "rp", 0, len(template))).failed
    held = one.get_many(keys(template))
    ids = held.batch.fields["token_ids"].values
    assert in_pool(ids)  # the frame came from the pool
    for _ in range(4):
        other = one.get_many(keys(template)[::-1])  # same sizes, other content order
        assert not np.shares_memory(other.batch.fields["token_ids"].values, ids)
        del other
    assert np.array_equal(ids, template.fields["token_ids"].values)


def test_workers_pool_their_frames_too(cluster_client):
    def on_worker():
        import distributed.comm.tcp as tcp
        from distributed.protocol import utils

        return receive_pool.install(), tcp.host_array is utils.host_array

    for installed, plain in cluster_client.run(on_worker).values():
        assert installed is True and plain is False


def test_config_zero_and_suspended_give_fresh_buffers(store, template):
    store.get_many(keys(template))
    with configured({"token-capture.store.receive-buffer-bytes": 0}):
        before = counters()
        got = store.get_many(keys(template))
        assert counters() == before
        assert not in_pool(got.batch.fields["token_ids"].values)
    store.get_many(keys(template))  # the default again: installs / re-arms
    with receive_pool.suspended():
        before = counters()
        store.get_many(keys(template))
        assert counters() == before
    with configured({"token-capture.store.receive-pool-min-bytes": "1GiB"}):
        before = counters()
        store.get_many(keys(template))
        assert counters() == before


def test_finalized_groups_are_gathered_into_pooled_memory(cluster_client, store_factory, monkeypatch):
    from pipeline.bench.finalize import EXPERTS, VOCAB, make_rollout
    from pipeline.finalize import Finalizer
    from tasks.packed import pack_rows

    store = store_factory(n_units=2)
    rng = np.random.default_rng(0)
    rows, receipts = [], []
    for r in range(4):  # input_ids: 4 rollouts x 2 x 32,768 tokens x 8 bytes = 2 MB
        rr, rec = make_rollout(rng, f"rp-fin-r{r}", "rp-fin", 2, 32768, None)
        rows += rr
        receipts.append(rec)
    assert not store.put_many(pack_rows(rows)).failed
    installs = []
    real = receive_pool.install
    monkeypatch.setattr(receive_pool, "install", lambda: installs.append(1) or real())
    group = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=EXPERTS).submit_step({"rp-fin": receipts}).result(timeout=120)
    out = group.groups["rp-fin"]
    assert installs  # the gather asked for the pool
    assert in_pool(out.input_ids.numpy())  # and the tensors were read into it


STAT_KEYS = ("rows", "used_bytes", "memory_bytes", "pinned_bytes", "dead_bytes", "resident_bytes", "shared_groups")


def test_a_units_puts_land_in_pooled_memory_its_deletes_give_back(store_factory, template):
    """A unit's worker reads its puts' frames into the receive pool (its cap grown by the
    unit's memory limit); the rows are views of those slabs, counted exactly (the slabs'
    extra bytes pinned), and the slabs a delete frees take the next put: no new memory."""
    from pipeline import config

    store = store_factory(n_units=1, memory_limit="1GiB")
    batch = with_keys(template, "rc-", 0, len(template))
    assert not store.put_many(batch).failed
    s = store.stats()[0]
    assert s["receive_buffer_cap_bytes"] >= config.get_bytes("store.receive-buffer-bytes") + (1 << 30)
    assert (s["rows"], s["shared_groups"], s["adopted_rows"], s["dead_bytes"]) == (len(batch), 1, len(batch), 0)
    assert s["resident_bytes"] == s["memory_bytes"] + s["pinned_bytes"]
    assert s["pinned_bytes"] <= s["memory_bytes"] // 8, "a slab's extra bytes, no more"
    allocated, reused = s["receive_buffers_allocated"], s["receive_buffers_reused"]
    frames = sum(1 for f in batch.fields.values() if f.values.nbytes >= (1 << 20))
    for n in range(3):
        assert store.delete(batch.keys).ok == batch.keys
        gone = store.stats()[0]
        assert tuple(gone[k] for k in STAT_KEYS) == (0, 0, 0, 0, 0, 0, 0), "a delete frees exactly what the rows held"
        batch = with_keys(template, f"r{n}-", 0, len(template))  # keys as long as before
        assert not store.put_many(batch).failed
        again = store.stats()[0]
        assert tuple(again[k] for k in STAT_KEYS) == tuple(s[k] for k in STAT_KEYS)
        assert again["receive_buffers_allocated"] == allocated, "the freed slabs took the put: no new memory"
        assert again["receive_buffers_reused"] >= reused + (n + 1) * frames
    got = store.get_many(batch.keys)
    assert np.array_equal(got.batch.fields["token_ids"].values, template.fields["token_ids"].values)


def test_a_puts_gathered_buffers_are_free_once_it_returns(store_factory, template):
    """A put gathers each unit's rows into the client's pooled memory; once the put has
    returned nothing of it holds them any more, even while Dask's call objects wait for a
    garbage collection: the next put reuses them."""
    import gc

    from pipeline.store.client import client_buffers
    from tasks.packed import PackedBatch

    store = store_factory(n_units=2)  # rows interleave over two units: gathered per unit
    pool = client_buffers()
    gc.collect()  # what earlier tests left in cycles
    gc.disable()
    try:
        for n in range(3):
            # The same rollouts each time (so the same rows per unit), new calls (new keys).
            batch = PackedBatch([f"gp{i}/c{n}" for i in range(len(template))], template.fields)
            assert not store.put_many(batch).failed
            in_use = [pool._refs(group, i) > pool._free_refs for group in pool._classes.values() for i in range(len(group))]
            assert in_use and not any(in_use)
            if n == 0:
                allocated = pool.allocated
        assert pool.allocated == allocated, "later puts reused the first put's buffers"
    finally:
        gc.enable()
