"""Checkpoint cut: the transaction against a real StagingStore, and the GenerationWorker actor.

The cluster is in-process (``processes=False``) so ``dask.config.set`` in a test reaches the
actors (the batch knobs are read at call time) while the store units still run as real
Dask actors with zict spilling to ``tmp_path``. Failures are injected with
:class:`~pipeline.generation.cut.FaultyStore` around the real store and a
:class:`~pipeline.generation.cut.ManualClock`; nothing of Dask is mocked.
"""
from __future__ import annotations

import asyncio

import dask
import numpy as np
import pytest
from distributed import Client, Event, LocalCluster

from pipeline.generation import CallBuffer, GenerationWorker, run_cut
from pipeline.testing.faults import FaultRules, FaultyStore, ManualClock
from pipeline.store import StagingStore
from tasks.digests import DEFAULT_VERSION
from tasks.cut.batching import BatchLimits
from tasks.cut.receipt import (
    COMPLETED,
    CONTROL_DEADLINE,
    CUT_ERROR,
    DURABLE_FAILURE,
    DURABLE_PREFIX,
    GENERATION_LOST,
    UNKNOWN_CALL,
    inventory_digest,
    prefix_digest,
)
from tasks.packed import unpack_rows
from tasks.cut.prefix import verify_prefix
from tasks.toy.policy import MoEPolicy, PolicyConfig
from tasks.toy.rollouts import advance, start_calls

pytestmark = pytest.mark.timeout(120)

L, K = 4, 2


@pytest.fixture(scope="module")
def client():
    # inproc transport: nothing is bound to a network interface (no dashboard either).
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None, worker_dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as c:
            yield c


@pytest.fixture
def store(client, tmp_path):
    # A small memory limit so cut rows really spill through zict to tmp_path.
    s = StagingStore.start(client, n_units=2, memory_limit="64KiB", spill_directory=str(tmp_path / "spill"))
    yield s
    s.close()


def buffers(n: int, *, ctx: int = 6, gen: int = 10, routes: bool = True, prefix: str = "r") -> list[CallBuffer]:
    """Calls with synthetic tokens: context ``ctx`` tokens, ``gen`` generated."""
    out = []
    for i in range(n):
        cr = np.full((ctx, L, K), i % 8, np.int16) if routes else None
        b = CallBuffer(f"{prefix}{i}", "call-0", np.arange(ctx) + i, routes_shape=(L, K) if routes else None,
                       context_routes=cr, max_new_tokens=10_000)
        b.append(np.arange(gen) + 100 + i, -np.ones(gen, np.float32) * 0.5,
                 np.full((gen, L, K), 1, np.int16) if routes else None)
        out.append(b)
    return out


def cut(bufs, store, *, clock=None, limits=BatchLimits(4, 1 << 22, 1 << 28), checkpoint_id="ck", deadline=None,
        puts_in_flight=None):
    clock = clock or ManualClock()
    calls = [(b.call, b) for b in bufs]
    return run_cut(calls, store, checkpoint_id=checkpoint_id, inventory_digest=inventory_digest([c for c, _ in calls]),
                   deadline=clock() + 10 if deadline is None else deadline, clock=clock, limits=limits,
                   puts_in_flight=puts_in_flight)


def present(store, keys) -> set[str]:
    """The subset of ``keys`` the store's cut partition holds."""
    keys = list(keys)
    if not keys:
        return set()
    got = store.get_many(keys, fields=["delta_len"], partition="cut")
    return set(got.batch.keys)


def all_cut_keys(bufs, checkpoint_id="ck", seq=0) -> list[str]:
    return [f"__cut__/{checkpoint_id}/{b.rollout_id}/{b.model_call_id}/{seq}" for b in bufs]


def assert_verifies(store, ack) -> None:
    """The restore side's verifier accepts the prefix: digests, chain, cumulative, prefix digest."""
    rows = store.get_many(list(ack.staging_keys), partition="cut").batch
    verdict = verify_prefix(rows, ack)
    assert verdict.usable, (verdict.reason, verdict.detail)


def assert_rolled_back(b: CallBuffer, ctx: int = 6, gen: int = 10) -> None:
    info = b.info()
    assert not info["cutting"] and info["cut_keys"] == [] and info["cut_tokens"] == 0
    out = b.output()
    assert len(out["token_ids"]) == ctx + gen, "rollback keeps every token exactly once"


# ---- the transaction, driven directly against the real store ---------------------------


def test_cut_writes_prefixes_that_read_back_and_verify(store):
    bufs = buffers(10)
    receipt, stats = cut(bufs, store)
    assert receipt.counts() == {DURABLE_PREFIX: 10}
    assert receipt.put_calls == 3  # 4 + 4 + 2 rows
    got = store.get_many(receipt.advertised_keys, partition="cut")
    assert not got.failed
    for ack, row in zip(receipt.acks, unpack_rows(got.batch)):
        assert row.delta_len == ack.prefix_tokens == 16
        assert prefix_digest(row.token_ids) == ack.prefix_digest
        assert row.token_mask[:6].sum() == 0 and row.token_mask[6:].all()
        assert row.routed_experts.shape == (16, L, K)
    # A later cut writes only the new chunk, continuing the chain.
    b = bufs[0]
    b.append(np.array([7, 8, 9]), np.full(3, -0.1, np.float32), np.zeros((3, L, K), np.int16))
    r2, _ = cut([b], store, checkpoint_id="ck2")
    ack = r2.acks[0]
    assert ack.staging_keys == ("__cut__/ck/r0/call-0/0", "__cut__/ck2/r0/call-0/1")
    assert ack.prefix_tokens == 19
    rows = unpack_rows(store.get_many(list(ack.staging_keys), partition="cut").batch)
    assert [r.delta_len for r in rows] == [16, 3]
    assert prefix_digest([r.token_ids for r in rows]) == ack.prefix_digest
    assert np.array_equal(np.concatenate([r.token_ids for r in rows]), b.output()["token_ids"])
    for a in receipt.acks[:3] + r2.acks:
        assert_verifies(store, a)


def test_batch_size_one_gives_one_put_per_call(store):
    receipt, _ = cut(buffers(7), store, limits=BatchLimits(1, 1 << 22, 1 << 28))
    assert receipt.put_calls == 7 and receipt.counts() == {DURABLE_PREFIX: 7}
    receipt, _ = cut(buffers(7, prefix="s"), store, limits=BatchLimits(256, 1 << 22, 1 << 28))
    assert receipt.put_calls == 1 and receipt.counts() == {DURABLE_PREFIX: 7}


def test_failed_batch_put_is_retried_row_by_row(store):
    bufs = buffers(8)
    faulty = FaultyStore(store, FaultRules(fail_keys=("/r5/",)))
    receipt, _ = cut(bufs, faulty)
    # batch [0..3] ok; batch [4..7] fails on r5 -> cleared, then 4 single-row puts.
    assert [len(p) for p in faulty.puts] == [4, 4, 1, 1, 1, 1]
    assert faulty.deletes[0] == all_cut_keys(bufs[4:8]), "the failed batch's keys are all deleted first"
    assert receipt.ack("r5", "call-0").status == DURABLE_FAILURE
    assert receipt.ack("r5", "call-0").reason == CUT_ERROR
    assert sum(a.durable for a in receipt.acks) == 7
    assert present(store, all_cut_keys(bufs)) == set(all_cut_keys(bufs)) - {"__cut__/ck/r5/call-0/0"}
    assert_rolled_back(bufs[5])


def test_failed_batch_keys_are_cleared_even_if_retry_cannot_run(store):
    """The batch's good rows were written by the failed put; only the clean-up removes them."""
    bufs = buffers(4)
    clock = ManualClock()
    faulty = FaultyStore(store, FaultRules(fail_keys=("/r2/",), advance_after_put={1: 100.0}), clock=clock)
    receipt, _ = cut(bufs, faulty, clock=clock)
    assert len(faulty.puts) == 1, "past the deadline no retry put starts"
    assert {a.reason for a in receipt.acks} == {CONTROL_DEADLINE}
    assert present(store, all_cut_keys(bufs)) == set(), "written rows of the failed batch were deleted"
    for b in bufs:
        assert_rolled_back(b)


def test_call_whose_rows_always_fail_leaves_other_cuts_intact(store):
    bufs = buffers(12)
    faulty = FaultyStore(store, FaultRules(fail_keys=("/r1/",)))
    receipt, _ = cut(bufs, faulty)
    bad = receipt.ack("r1", "call-0")
    assert bad.status == DURABLE_FAILURE and bad.reason == CUT_ERROR and "injected_fault" in bad.detail
    good = [a for a in receipt.acks if a.rollout_id != "r1"]
    assert all(a.durable for a in good) and len(good) == 11
    assert present(store, [k for a in good for k in a.staging_keys]) == {k for a in good for k in a.staging_keys}
    assert_rolled_back(bufs[1])
    # The failed call keeps decoding, and a later clean cut writes its whole prefix.
    bufs[1].append(np.array([5, 6]), np.full(2, -0.3, np.float32), np.zeros((2, L, K), np.int16))
    r2, _ = cut([bufs[1]], store, checkpoint_id="ck2")
    assert r2.acks[0].durable and r2.acks[0].prefix_tokens == 18
    assert r2.acks[0].staging_keys == ("__cut__/ck2/r1/call-0/0",)
    assert_verifies(store, r2.acks[0])


def test_failed_ack_fails_only_its_call_and_clears_its_row(store):
    bufs = buffers(6)
    faulty = FaultyStore(store, FaultRules(drop_ack_keys=("/r2/",)))
    receipt, _ = cut(bufs, faulty)
    a = receipt.ack("r2", "call-0")
    assert a.status == DURABLE_FAILURE and a.reason == CUT_ERROR and "ack" in a.detail
    assert sum(x.durable for x in receipt.acks) == 5
    # The store did write r2's row; the call cleared it.
    assert "__cut__/ck/r2/call-0/0" not in present(store, all_cut_keys(bufs))
    assert len(present(store, all_cut_keys(bufs))) == 5
    assert_rolled_back(bufs[2])


def test_interruption_clears_rows_no_call_received(store):
    bufs = buffers(8)
    faulty = FaultyStore(store, FaultRules(interrupt_after_put=2))
    with pytest.raises(asyncio.CancelledError):
        cut(bufs, faulty)
    first, second = all_cut_keys(bufs[:4]), all_cut_keys(bufs[4:])
    assert present(store, second) == set(), "rows written by the interrupted put were deleted"
    assert present(store, first) == set(first), "sealed rows belong to their calls and stay"
    for b in bufs[4:]:
        assert_rolled_back(b)
    assert all(b.info()["cut_keys"] == [k] for b, k in zip(bufs[:4], first))
    # Nothing is left frozen: the next cut covers every call, chains intact.
    for b in bufs:
        b.append(np.array([1, 2, 3]), np.full(3, -0.3, np.float32), np.zeros((3, L, K), np.int16))
    r2, _ = cut(bufs, store, checkpoint_id="ck2")
    assert r2.counts() == {DURABLE_PREFIX: 8}
    for a in r2.acks:
        assert_verifies(store, a)
    assert [len(a.staging_keys) for a in r2.acks] == [2] * 4 + [1] * 4


@pytest.mark.parametrize("in_flight", [1, 2])
def test_deadline_passing_between_batches(store, in_flight):
    """The deadline passes during put 1. One put at a time: no put 2. Two in flight:
    batch 2 was sent while put 1 ran, so batch 3 is not sent, and batch 2's answer is
    still sealed (its put ended within its bound). Nothing unsealed stays."""
    bufs = buffers(12)
    clock = ManualClock()
    faulty = FaultyStore(store, FaultRules(advance_after_put={1: 100.0}), clock=clock)
    receipt, _ = cut(bufs, faulty, clock=clock, puts_in_flight=in_flight)
    sent = 4 * in_flight  # rows in the batches sent before the deadline was seen
    assert receipt.deadline_passed and receipt.put_calls == in_flight
    assert [a.status for a in receipt.acks[:sent]] == [DURABLE_PREFIX] * sent
    assert {a.reason for a in receipt.acks[sent:]} == {CONTROL_DEADLINE}
    assert present(store, all_cut_keys(bufs)) == set(all_cut_keys(bufs[:sent]))
    for b in bufs[sent:]:
        assert_rolled_back(b)


def test_deadline_passing_between_batches_flushed_together(store):
    """Two dtype/shape groups flushed at the end: the deadline stops the second put."""
    bufs = buffers(3, prefix="a") + buffers(3, routes=False, prefix="b")
    clock = ManualClock()
    faulty = FaultyStore(store, FaultRules(advance_after_put={1: 100.0}), clock=clock)
    receipt, _ = cut(bufs, faulty, clock=clock, puts_in_flight=1)
    assert [len(p) for p in faulty.puts] == [3]
    assert [a.status for a in receipt.acks[:3]] == [DURABLE_PREFIX] * 3
    assert {a.reason for a in receipt.acks[3:]} == {CONTROL_DEADLINE}
    assert present(store, all_cut_keys(bufs)) == set(all_cut_keys(bufs[:3]))
    for b in bufs[3:]:
        assert_rolled_back(b)


def test_deadline_passing_while_rows_are_pending(store):
    """The deadline passes during the row-by-row retry: the pending rows roll back."""
    bufs = buffers(8)
    clock = ManualClock()
    rules = FaultRules(fail_keys=("/r1/",), advance_after_put={2: 100.0})  # put 2 = first retry (r0)
    faulty = FaultyStore(store, rules, clock=clock)
    receipt, _ = cut(bufs, faulty, clock=clock, puts_in_flight=1)
    assert [len(p) for p in faulty.puts] == [4, 1]
    assert receipt.ack("r0", "call-0").durable
    assert {receipt.ack(f"r{i}", "call-0").reason for i in range(1, 8)} == {CONTROL_DEADLINE}
    assert present(store, all_cut_keys(bufs)) == {"__cut__/ck/r0/call-0/0"}
    for b in bufs[1:]:
        assert_rolled_back(b)


def test_deadline_already_passed_writes_nothing(store):
    clock = ManualClock()
    faulty = FaultyStore(store, clock=clock)
    bufs = buffers(3)
    receipt, _ = cut(bufs, faulty, clock=clock, deadline=clock() - 1)
    assert faulty.puts == [] and {a.reason for a in receipt.acks} == {CONTROL_DEADLINE}
    for b in bufs:
        assert_rolled_back(b)


def test_seal_refuses_a_call_that_completed_or_failed_after_its_freeze():
    bufs = buffers(2)
    frozen = [b.freeze("ck") for b in bufs]
    bufs[0].append(np.array([1, 2]), np.full(2, -0.2, np.float32), np.zeros((2, L, K), np.int16))
    bufs[0].complete()
    bufs[1].fail("engine died")
    done, lost = bufs[0].seal(frozen[0]), bufs[1].seal(frozen[1])
    assert done.status == COMPLETED and done.total_tokens == 18
    assert lost.status == DURABLE_FAILURE and lost.reason == GENERATION_LOST
    out = bufs[0].output()
    assert out["token_ids"][6:].tolist() == list(range(100, 110)) + [1, 2], "frozen tokens kept once, in order"
    assert bufs[0].info()["cut_keys"] == [] and not bufs[0].info()["cutting"]


# ---- through the GenerationWorker actor ------------------------------------------------


def _policy_config():
    return dict(PolicyConfig().__dict__)


def _reference_tokens(rollout_id: str, context: np.ndarray, n: int) -> np.ndarray:
    policy = MoEPolicy(PolicyConfig(**_policy_config()))
    st = start_calls(policy, [rollout_id], [np.zeros(0, np.int64)], [context], [n])[0]
    advance(policy, [st], n)
    return st.delta(0).token_ids


def _start(client, store, n_calls: int, max_new: int = 64, name: str = "gen"):
    gen = client.submit(GenerationWorker, store, name=name, policy=_policy_config(), actor=True).result()
    specs = [{"rollout_id": f"g{i}", "model_call_id": "call-0", "context": np.arange(5) + i, "max_new_tokens": max_new}
             for i in range(n_calls)]
    gen.start_calls(specs).result()
    return gen


def test_actor_cut_batch_size_knob_and_cached_retry(client, store):
    # The knob is read once, when the generation worker is built (in-process cluster: the
    # actor is built under this config); a later config change does not reach it.
    with dask.config.set({"token-capture.cut.generation-prefix-batch-size": 1}):
        small = _start(client, store, 6, name="gen-small")
    small.step(8).result()
    with dask.config.set({"token-capture.cut.generation-prefix-batch-size": 256}):
        r1 = small.checkpoint_cut("a1").result()
    assert r1.put_calls == 6 and r1.counts() == {DURABLE_PREFIX: 6}, "batch size 1: one put per call"
    gen = _start(client, store, 6)
    gen.step(12).result()
    with dask.config.set({"token-capture.cut.generation-prefix-batch-size": 256}):
        r2 = gen.checkpoint_cut("a2").result()
        assert r2.put_calls == 1 and all(a.prefix_tokens == 17 for a in r2.acks)
        # A retried cut (same checkpoint, same inventory in another order) answers the same.
        gen.step(4).result()
        inv = [(f"g{i}", "call-0") for i in reversed(range(6))]
        r2b = gen.checkpoint_cut("a2", inv).result()
        r2c = gen.checkpoint_cut("a2", inv).result()
    assert r2b.inventory_digest == inventory_digest([(f"g{i}", "call-0") for i in range(6)])
    assert r2c == r2b and r2b.acks[0].rollout_id == "g5"
    assert all(a.prefix_tokens == 21 for a in r2b.acks), "a new inventory is a new cut"
    assert r2c.put_calls == r2b.put_calls
    # Resume check: the durable prefix is exactly what the policy generates.
    rows = unpack_rows(store.get_many(list(r2b.ack("g0", "call-0").staging_keys), partition="cut").batch)
    ids = np.concatenate([r.token_ids for r in rows])
    assert np.array_equal(ids, _reference_tokens("g0", np.arange(5), 64)[:21])
    unknown = gen.checkpoint_cut("a3", [("nope", "call-0"), ("g1", "call-0")]).result()
    assert unknown.ack("nope", "call-0").reason == UNKNOWN_CALL and unknown.ack("g1", "call-0").durable


def test_actor_cut_follows_the_digest_setting_read_when_built(client, store):
    # capture.digest is read once, when the worker is built: a worker built under sha256
    # cuts SHA-256 rows (digest version 1) and says so in its acks, whatever the setting
    # is at cut time; the verifier recomputes with the version the rows and ack declare.
    with dask.config.set({"token-capture.capture.digest": "sha256"}):
        gen = _start(client, store, 3, name="gen-sha256")
    gen.step(6).result()
    receipt = gen.checkpoint_cut("dg").result()
    assert receipt.counts() == {DURABLE_PREFIX: 3}
    for ack in receipt.acks:
        rows = unpack_rows(store.get_many(list(ack.staging_keys), partition="cut").batch)
        assert ack.digest_version == 1 and {r.digest_version for r in rows} == {1}
        ids = [r.token_ids for r in rows]
        assert prefix_digest(ids, 1) == ack.prefix_digest != prefix_digest(ids, 2)
        verdict = verify_prefix(store.get_many(list(ack.staging_keys), partition="cut").batch, ack)
        assert verdict.usable and verdict.prefix.digest_version == 1, (verdict.reason, verdict.detail)
        assert verdict.prefix.resume_kwargs()["digest_version"] == 1  # a resumed call keeps SHA-256
    blake = _start(client, store, 1, name="gen-blake3")  # the default
    blake.step(3).result()
    (ack,) = blake.checkpoint_cut("dg2").result().acks
    assert ack.digest_version == DEFAULT_VERSION == 3
    assert_verifies(store, ack)


def test_actor_call_finishing_mid_cut_is_neither_lost_nor_doubled(client, store):
    """Decoding continues while the cut's put is paused; calls finish, fail, or keep going."""
    faulty = FaultyStore(store, FaultRules(pause_put=1, event_prefix="midcut"))
    gen = client.submit(GenerationWorker, faulty, name="gen-mid", policy=_policy_config(), actor=True).result()
    specs = [{"rollout_id": f"m{i}", "model_call_id": "call-0", "context": np.arange(5) + i, "max_new_tokens": 32}
             for i in range(4)]
    specs[3]["max_new_tokens"] = 64
    gen.start_calls(specs).result()
    gen.step(10).result()
    started, release = Event("midcut-started", client=client), Event("midcut-release", client=client)
    fut = gen.checkpoint_cut("mid")
    assert started.wait(timeout=30)
    # While the put is in flight: m0..m2 reach 32 tokens (m3 goes on to 32 of 64) ...
    step = gen.step(22).result()
    assert sorted(map(tuple, step["completed"])) == [("m0", "call-0"), ("m1", "call-0"), ("m2", "call-0")]
    out0 = gen.finish_call("m0", "call-0").result()  # taken before the cut ends
    gen.fail_call("m2", "call-0", "engine died").result()
    release.set()
    receipt = fut.result()
    assert receipt.ack("m0", "call-0").status == COMPLETED
    assert receipt.ack("m1", "call-0").status == COMPLETED
    assert receipt.ack("m1", "call-0").total_tokens == 5 + 32
    assert receipt.ack("m2", "call-0").status == COMPLETED, "m2 completed before it was failed"
    m3 = receipt.ack("m3", "call-0")
    assert m3.durable and m3.prefix_tokens == 15, "the prefix is what was frozen, not what came after"
    keys = [f"__cut__/mid/m{i}/call-0/0" for i in range(4)]
    assert present(store, keys) == {keys[3]}, "completed calls' rows are cleared, not advertised"
    # Outputs: every token exactly once, equal to the uninterrupted call.
    (out1,) = [o for o in gen.take_completed().result() if o["rollout_id"] == "m1"]
    for o, i in ((out0, 0), (out1, 1)):
        assert len(o["token_ids"]) == 5 + 32
        assert np.array_equal(o["token_ids"], _reference_tokens(f"m{i}", np.arange(5) + i, 32))
    out3 = gen.output("m3", "call-0").result()
    assert np.array_equal(out3["token_ids"], _reference_tokens("m3", np.arange(5) + 3, 64)[:5 + 32])


def test_actor_failed_call_mid_cut_reports_generation_lost(client, store):
    faulty = FaultyStore(store, FaultRules(pause_put=1, event_prefix="lost"))
    gen = client.submit(GenerationWorker, faulty, name="gen-lost", policy=_policy_config(), actor=True).result()
    gen.start_calls([{"rollout_id": f"x{i}", "model_call_id": "call-0", "context": np.arange(3), "max_new_tokens": 50}
                     for i in range(2)]).result()
    gen.step(5).result()
    fut = gen.checkpoint_cut("lost")
    assert Event("lost-started", client=client).wait(timeout=30)
    gen.fail_call("x0", "call-0", "aborted").result()
    Event("lost-release", client=client).set()
    receipt = fut.result()
    assert receipt.ack("x0", "call-0").reason == GENERATION_LOST
    assert receipt.ack("x1", "call-0").durable
    assert present(store, ["__cut__/lost/x0/call-0/0", "__cut__/lost/x1/call-0/0"]) == {"__cut__/lost/x1/call-0/0"}


# ---- the process-wide CPU gate (cut.cpu-slots) -------------------------------------------
#
# Cuts sharing a process take a slot of a process-wide semaphore for their CPU-bound steps
# (freezing, packing) and leave it while they wait on the store.

import threading  # noqa: E402

from pipeline.generation import cut as cut_module  # noqa: E402
from pipeline.process_state import configured  # noqa: E402


class PackProbe:
    """Wraps ``pack_chunks``: counts packs running at once (``max_active``).

    The first pack is held open until a second pack starts or ``hold_s`` passes, so a gate
    that admits two cuts shows them overlapping instead of depending on a lucky schedule
    (``hold_s`` only bounds the wait; nothing asserts on time)."""

    def __init__(self, real, hold_s: float):
        self.real, self.hold_s = real, hold_s
        self.lock = threading.Lock()
        self.active = self.max_active = self.calls = 0
        self.overlap = threading.Event()

    def __call__(self, chunks, *args):
        with self.lock:
            self.active += 1
            self.calls += 1
            first = self.calls == 1
            self.max_active = max(self.max_active, self.active)
            if self.active > 1:
                self.overlap.set()
        try:
            if first:
                self.overlap.wait(self.hold_s)
            return self.real(chunks, *args)
        finally:
            with self.lock:
                self.active -= 1


def _in_threads(*jobs):
    """Run each zero-argument job in its own thread; return their results (re-raise errors)."""
    out, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            out[i] = job()
        except BaseException as e:  # reported to the test thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a cut never finished"
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("slots, expected", [(1, 1), (2, 2)])
def test_cuts_in_one_process_pack_one_at_a_time_with_one_cpu_slot(store, monkeypatch, slots, expected):
    probe = PackProbe(cut_module.pack_chunks, hold_s=2.0 if slots == 1 else 30.0)
    monkeypatch.setattr(cut_module, "pack_chunks", probe)
    a, b = buffers(6, prefix="ga"), buffers(6, prefix="gb")
    limits = BatchLimits(2, 1 << 22, 1 << 28)  # 3 packs per cut
    with configured({"token-capture.cut.cpu-slots": slots}):
        (ra, _), (rb, _) = _in_threads(lambda: cut(a, store, limits=limits, checkpoint_id="gate-a"),
                                       lambda: cut(b, store, limits=limits, checkpoint_id="gate-b"))
    assert probe.calls == 6
    # One slot: never two packs at once. Two slots (the control): the probe does see overlap.
    assert probe.max_active == expected
    for r in (ra, rb):
        assert r.counts() == {DURABLE_PREFIX: 6}
        for ack in r.acks:
            assert_verifies(store, ack)


class BlockingStore:
    """The real store; a put carrying a key that contains ``block`` waits for ``release``."""

    def __init__(self, store, block: str):
        self.store, self.block = store, block
        self.units = store.units  # the cut orders rows by unit
        self.entered, self.release = threading.Event(), threading.Event()

    def put_many(self, batch, partition="staging", adopt=False):
        if any(self.block in k for k in batch.keys):
            self.entered.set()
            if not self.release.wait(60):
                raise RuntimeError("blocked put never released")
        return self.store.put_many(batch, partition=partition, adopt=adopt)

    def delete(self, keys, partition="staging"):
        return self.store.delete(keys, partition=partition)


def test_a_cut_waiting_on_the_store_holds_no_cpu_slot(store, monkeypatch):
    probe = PackProbe(cut_module.pack_chunks, hold_s=0.0)
    monkeypatch.setattr(cut_module, "pack_chunks", probe)
    blocking = BlockingStore(store, block="/wait-a/")
    a, b = buffers(4, prefix="wa"), buffers(4, prefix="wb")
    with configured({"token-capture.cut.cpu-slots": 1}):
        results: dict = {}
        waiting = threading.Thread(target=lambda: results.setdefault("a", cut(a, blocking, checkpoint_id="wait-a")),
                                   daemon=True)
        waiting.start()
        try:
            assert blocking.entered.wait(30), "cut A reached its put"
            # A sits in its put with the only slot's holder gone: B freezes, packs, puts, seals.
            (rb, _), = _in_threads(lambda: cut(b, blocking, checkpoint_id="wait-b"))
            assert waiting.is_alive() and "a" not in results, "A was still waiting on the store"
        finally:
            blocking.release.set()
            waiting.join(timeout=60)
    assert not waiting.is_alive()
    ra = results["a"][0]
    assert probe.calls == 2
    for r in (ra, rb):
        assert r.counts() == {DURABLE_PREFIX: 4} and r.put_calls == 1
        for ack in r.acks:
            assert_verifies(store, ack)


def test_call_with_nothing_to_save_is_not_written():
    """No context and no generated token: no zero-token row is put and advertised; the call
    is acknowledged ``durable_failure``/``empty_prefix`` and regenerates after a restore."""
    from pipeline.generation.call_buffer import CallBuffer
    from tasks.cut.receipt import DURABLE_FAILURE, EMPTY_PREFIX

    buf = CallBuffer("r-empty", "call-0", np.zeros(0, np.int64))
    ack = buf.freeze("ck-empty")
    assert ack.status == DURABLE_FAILURE and ack.reason == EMPTY_PREFIX
    buf.append(np.array([3], np.int64), np.array([-0.5], np.float32))
    frozen = buf.freeze("ck-empty-2")
    assert getattr(frozen, "tokens", None) == 1  # once a token exists, it is cut


def test_a_row_that_cannot_be_packed_fails_alone(store, monkeypatch):
    # Packing never raises for rows a CallBuffer froze; if it did (a bug), the batch is
    # retried one row per put like a refused batch, so only the row that cannot be packed
    # fails (cut_error) and the others of its batch are sealed.
    real = cut_module.pack_chunks

    def pack(chunks, allocate=None):
        if any(c.rollout_id == "bad2" for c in chunks):
            raise ValueError("cannot pack (test)")
        return real(chunks, allocate)

    monkeypatch.setattr(cut_module, "pack_chunks", pack)
    bufs = buffers(4, prefix="bad")
    receipt, _ = cut(bufs, store)  # one batch of 4
    assert receipt.ack("bad2", "call-0").reason == CUT_ERROR and "packing raised ValueError" in receipt.ack("bad2", "call-0").detail
    for i in (0, 1, 3):
        ack = receipt.ack(f"bad{i}", "call-0")
        assert ack.durable, ack
        assert_verifies(store, ack)
    assert_rolled_back(bufs[2])
