"""Load: 4,096 calls staged concurrently by 32 writers, and a mass resume
of 4,096 restores, through a store whose units hold 64 KiB in memory and spill the rest.

The cluster is the shared 2-process ``LocalCluster`` (conftest); the store has 2 units,
one per worker, spilling through zict to ``tmp_path``. Token counts are kept small (64-128
tokens per staged call, 40-168 per cut prefix) so the file runs well under a minute on a
shared 2-core machine; the row counts are half those the load was first specified at.

Accounting, both halves: every key written is read back (none missing, none extra, the
store's per-partition row count equals the writers'), every row's digest is recomputed
from the bytes read and equals the digest the writer computed, and the token bytes equal
what the writer generated. Wall times and rates are printed (``-s``), never asserted.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pipeline.finalize.controller import Finalizer
from pipeline.generation.call_buffer import CallBuffer
from pipeline.generation.cut import CUT_PARTITION, run_cut
from pipeline.restore.batcher import start_batchers
from pipeline.store.client import StagingStore
from tasks import hashing
from tasks.cut.batching import BatchLimits
from tasks.cut.receipt import inventory_digest, prefix_digest
from tasks.gate import CaptureGate
from tasks.packed import pack_rows, unpack_rows
from tasks.schema import ROUTES_UINT8, row_fields

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WRITERS = 32
ROLLOUTS_PER_WRITER = 8
# Half the counts the load was first specified at (8,192 each): every check below is an
# exact accounting that holds at any count, and 32 concurrent writers through spilling
# units is what loads the store; 8,192 took ~14 s per test on 2 cores.
CALLS_PER_ROLLOUT = 16  # 32 x 8 x 16 = 4,096 staged calls
ROWS_PER_PUT = 32  # a writer flushes four turns of its 8 rollouts per put: 4 puts per writer
RESTORES_PER_WRITER = 128  # 32 x 128 = 4,096 restores
VOCAB, E, L, K = 512, 8, 2, 2
UNIT_MEMORY = "64KiB"  # tiny: nearly every row goes through zict to disk
GET_CHUNK = 1024  # keys per verification get (the test's read-back, not the system under test)


def run_writers(n: int, body) -> tuple[list, float]:
    """``body(w)`` on ``n`` threads released together; (results, wall seconds). A writer's
    exception is returned as its result, never lost in a thread."""
    barrier = threading.Barrier(n + 1)
    results: list = [None] * n

    def go(w: int) -> None:
        barrier.wait()
        try:
            results[w] = body(w)
        except BaseException as e:
            results[w] = e

    threads = [threading.Thread(target=go, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(240)
    wall = time.perf_counter() - t0
    assert not any(t.is_alive() for t in threads), "a writer hangs"
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    return results, wall


def spill_totals(store: StagingStore) -> dict[str, int]:
    """Rows and bytes summed over the units; each unit's in-memory bytes stay within its limit."""
    st = store.stats()
    for s in st:
        assert int(s["memory_bytes"]) <= int(s["memory_limit"]), s
    return {k: sum(int(s[k]) for s in st) for k in ("rows", "memory_bytes", "spilled_bytes", "spilled_rows")}


def call_delta(rng: np.random.Generator, turn: int) -> tuple[np.ndarray, ...]:
    """One call's delta: context (prompt or tool tokens, mask 0) then generated tokens."""
    n_ctx = 8 if turn == 0 else 4
    n = int(rng.integers(64, 129))  # tokens in the delta
    ids = rng.integers(0, VOCAB, n, dtype=np.int64)
    mask = np.ones(n, np.float32)
    mask[:n_ctx] = 0.0
    logprobs = np.where(mask > 0, -rng.random(n, dtype=np.float32) - 1e-3, 0.0).astype(np.float32)
    routes = rng.integers(0, E, (n, L, K)).astype(np.int16)
    return ids, mask, logprobs, routes


def test_4096_calls_from_32_writers_all_accounted_for(cluster_client, tmp_path):
    client = cluster_client
    store = StagingStore.start(client, n_units=2, memory_limit=UNIT_MEMORY, spill_directory=str(tmp_path / "spill"))

    def writer(w: int) -> dict:
        """A writer gating its 8 rollouts turn by turn, staging 32 rows per put."""
        rng = np.random.default_rng(1000 + w)
        gates = [CaptureGate(f"ld-w{w:02d}-r{r:02d}", vocab_size=VOCAB, num_experts=E, group_id=f"ld-g{w:02d}")
                 for r in range(ROLLOUTS_PER_WRITER)]
        expect: dict[str, tuple[bytes, bytes]] = {}  # key -> (writer's digest, token id bytes)
        pending, puts, refused = [], 0, {}
        for t in range(CALLS_PER_ROLLOUT):
            for g in gates:
                ids, mask, lps, routes = call_delta(rng, t)
                row = g.stage_call(f"c{t}", None if t == 0 else f"c{t - 1}", ids, mask, lps, routed_experts=routes)
                expect[row.staging_key] = (row.digest, ids.tobytes())
                pending.append(row)
            if len(pending) >= ROWS_PER_PUT or t == CALLS_PER_ROLLOUT - 1:
                res = store.put_many(pack_rows(pending))
                puts += 1
                refused.update(res.failed)
                assert len(res.ok) + len(res.failed) == len(pending)
                pending = []
        return {"expect": expect, "puts": puts, "refused": refused,
                "receipts": [g.receipt(float(i)) for i, g in enumerate(gates)]}

    results, wall = run_writers(WRITERS, writer)
    expect = {k: v for r in results for k, v in r["expect"].items()}
    total = WRITERS * ROLLOUTS_PER_WRITER * CALLS_PER_ROLLOUT
    assert len(expect) == total == 4096
    assert not any(r["refused"] for r in results), [r["refused"] for r in results if r["refused"]][:1]
    puts = sum(r["puts"] for r in results)
    spill = spill_totals(store)
    print(f"\n[load] staged {total} calls from {WRITERS} writers in {puts} puts: {wall:.2f} s, "
          f"{total / wall:,.0f} rows/s; store {spill}")

    # The store holds exactly the writers' rows, and most of them on disk.
    assert sorted(store.keys("staging")) == sorted(expect)
    assert spill["rows"] == total
    assert spill["spilled_rows"] > total // 2

    # Everything is served back: recomputed digests equal the writers', token bytes too.
    keys = sorted(expect)
    t0 = time.perf_counter()
    got_n = 0
    for i in range(0, len(keys), GET_CHUNK):
        got = store.get_many(keys[i : i + GET_CHUNK], list(row_fields(ROUTES_UINT8)))  # 8 experts: uint8 routes
        assert not got.failed, dict(list(got.failed.items())[:3])
        assert got.batch.keys == keys[i : i + GET_CHUNK]
        for key, row in zip(got.batch.keys, unpack_rows(got.batch)):
            digest, ids = expect[key]
            assert hashing.row_digest(row) == digest == row.digest, key
            assert row.token_ids.tobytes() == ids, key
            got_n += 1
    print(f"[load] read back and re-hashed {got_n} rows from disk in {time.perf_counter() - t0:.2f} s")
    assert got_n == total

    # End to end: one finalization step over all 256 rollouts (32 groups of 8) accepts every one.
    receipts = {f"ld-g{w:02d}": results[w]["receipts"] for w in range(WRITERS)}
    t0 = time.perf_counter()
    step = Finalizer(client, store).submit_step(receipts).result()
    print(f"[load] finalized {WRITERS * ROLLOUTS_PER_WRITER} rollouts ({total} calls) in one step: "
          f"{time.perf_counter() - t0:.2f} s")
    assert step.metrics["accepted"] == WRITERS * ROLLOUTS_PER_WRITER and not step.rejected
    for gid, group in step.groups.items():
        assert group.status == ["ok"] * ROLLOUTS_PER_WRITER, (gid, group.status)
        for i, rid in enumerate(group.rollout_ids):
            want = b"".join(expect[f"{rid}/c{t}"][1] for t in range(CALLS_PER_ROLLOUT))
            n = int(group.input_lengths[i])
            assert group.input_ids[i, :n].numpy().tobytes() == want, rid
    store.close()


def test_mass_resume_of_4096_prefixes_all_accounted_for(cluster_client, tmp_path):
    client = cluster_client
    store = StagingStore.start(client, n_units=2, memory_limit=UNIT_MEMORY, spill_directory=str(tmp_path / "spill"))
    limits = BatchLimits(max_rows=256, max_tokens=4_194_304, max_bytes=256 << 20)

    def writer(w: int) -> dict:
        """A generation worker's 128 in-flight calls, cut twice (2 chunks per prefix)."""
        rng = np.random.default_rng(2000 + w)
        bufs, full = [], {}
        for i in range(RESTORES_PER_WRITER):
            ctx = rng.integers(0, VOCAB, 8, dtype=np.int64)
            b = CallBuffer(f"rs-w{w:02d}-r{i:03d}", "c0", ctx, routes_shape=(L, K),
                           context_routes=rng.integers(0, E, (8, L, K)).astype(np.int16), max_new_tokens=1000)
            bufs.append(b)
            full[b.call] = [ctx, np.zeros(8, np.float32), b.context_routes]
        out = {}
        for ck in ("rs-a", "rs-b"):
            for b in bufs:  # decode a chunk of 16-80 tokens, then cut every call
                n = int(rng.integers(16, 81))
                ids = rng.integers(0, VOCAB, n, dtype=np.int64)
                lps = -rng.random(n, dtype=np.float32) - 1e-3
                routes = rng.integers(0, E, (n, L, K)).astype(np.int16)
                b.append(ids, lps, routes)
                f = full[b.call]
                f[:] = np.concatenate([f[0], ids]), np.concatenate([f[1], lps]), np.concatenate([f[2], routes])
            calls = [(b.call, b) for b in bufs]
            receipt, _ = run_cut(calls, store, checkpoint_id=ck, inventory_digest=inventory_digest([c for c, _ in calls]),
                                 deadline=time.time() + 3600, limits=limits, worker=f"writer-{w}")
            out[ck] = receipt
        return {"receipts": out, "full": full}

    results, wall = run_writers(WRITERS, writer)
    acks = [a for r in results for a in r["receipts"]["rs-b"].acks]
    full = {c: v for r in results for c, v in r["full"].items()}
    assert len(acks) == WRITERS * RESTORES_PER_WRITER == 4096
    assert all(a.durable and len(a.staging_keys) == 2 for a in acks), next(a for a in acks if not a.durable)
    n_rows = 2 * len(acks)
    assert sorted(store.keys(CUT_PARTITION)) == sorted(k for a in acks for k in a.staging_keys)
    spill = spill_totals(store)
    assert spill["rows"] == n_rows and spill["spilled_rows"] > n_rows // 2
    print(f"\n[load] cut {n_rows} prefix rows (2 checkpoints x {len(acks)} calls) from {WRITERS} writers: {wall:.2f} s; "
          f"store {spill}")

    # Mass resume: 32 resumers at once, each restore_many(128) on its worker's batcher.
    batchers = start_batchers(client, store, vocab_size=VOCAB, num_experts=E, routes_shape=(L, K))
    handles = [batchers[a] for a in sorted(batchers)]
    t0 = time.perf_counter()
    futures = [handles[w % len(handles)].restore_many(acks[w * RESTORES_PER_WRITER : (w + 1) * RESTORES_PER_WRITER])
               for w in range(WRITERS)]
    verdicts = [v for f in futures for v in f.result()]
    wall = time.perf_counter() - t0
    stats = [b.stats().result() for b in handles]
    gets, fetched = sum(s["gets"] for s in stats), sum(s["keys_fetched"] for s in stats)
    print(f"[load] restored {len(verdicts)} prefixes ({fetched} keys) in {wall:.2f} s through {len(handles)} batchers: "
          f"{gets} gets, {fetched / max(gets, 1):.1f} keys/get, verdicts {[s['verdicts'] for s in stats]}")

    assert len(verdicts) == len(acks)
    bad = [(a.rollout_id, v.reason, v.detail) for a, v in zip(acks, verdicts) if not v.usable]
    assert not bad, bad[:3]
    for a, v in zip(acks, verdicts):
        p = v.prefix
        ids, lps, routes = full[a.call]
        # The bytes the writer generated, and digests recomputed from what was read.
        assert (p.rollout_id, p.model_call_id, p.keys) == (a.rollout_id, a.model_call_id, a.staging_keys)
        assert p.token_ids.tobytes() == ids.tobytes() and p.logprobs.tobytes() == lps.tobytes()
        assert p.routed_experts.tobytes() == routes.tobytes()
        assert p.tokens == a.prefix_tokens and prefix_digest(p.token_ids) == prefix_digest(ids) == a.prefix_digest
    assert sum(s["verdicts"].get("ok", 0) for s in stats) == len(acks)
    assert fetched == n_rows and gets < len(acks)  # every key read once, through coalesced gets
    for b in handles:
        b.close().result()
    store.close()
