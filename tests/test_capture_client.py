"""The capture client on a real LocalCluster: engines outside the project stage calls in
batched puts; refusals poison only their own rollout; nothing is lost or duplicated."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import dask
import numpy as np
import pytest

from pipeline.client import CaptureClient, lookup_store, publish_store, unpublish_store
from pipeline.finalize.controller import Finalizer
from pipeline.testing.faults import FaultRules, FaultyStore
from support import wait_until
from tasks.digests import DEFAULT_VERSION
from tasks.errors import InvalidInput, InvalidRecord, StoreUnavailable, UnsupportedDigest
from tasks.gate import CaptureGate
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows, unpack_rows

ROOT = Path(__file__).resolve().parent.parent
VOCAB, EXPERTS, L, K = 64, 4, 2, 2


def delta(seed: int, n_ctx: int = 3, n_gen: int = 5, routes: bool = True) -> dict:
    """A valid call delta: context tokens (mask 0) then generated tokens (mask 1)."""
    rng = np.random.default_rng(seed)
    n = n_ctx + n_gen
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(n_gen, np.float32)])
    lp = np.where(mask > 0, -rng.random(n, dtype=np.float32) - 0.01, 0.0).astype(np.float32)
    return dict(
        token_ids=rng.integers(0, VOCAB, n),
        token_mask=mask,
        logprobs=lp,
        routed_experts=rng.integers(0, EXPERTS, (n, L, K)).astype(np.int16) if routes else None,
    )


def open_rollout(cap: CaptureClient, rid: str, group: str = "g"):
    return cap.open(rid, group, vocab_size=VOCAB, num_experts=EXPERTS)


def stage_chain(rc, n_calls: int, seed: int = 0) -> None:
    for t in range(n_calls):
        rc.stage(f"c{t}", None if t == 0 else f"c{t - 1}", **delta(seed * 100 + t))


def unit_counter(store, name: str) -> int:
    """The storage units' own counter ``name``, summed (not the client's count)."""
    return sum(s[name] for s in store.stats())


def finalize(client, store, groups):
    return Finalizer(client, store, vocab_size=VOCAB, num_experts=EXPERTS).submit_step(groups).result(timeout=120)


# ---- (1) the example: an engine in its own OS process -----------------------------------


def test_example_engine_in_a_separate_process_gets_every_rollout_accepted():
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["DASK_TOKEN_CAPTURE__CLUSTER__DASHBOARD_ADDRESS"] = "127.0.0.1:0"
    cmd = [sys.executable, str(ROOT / "examples" / "bring_your_own_engine.py"), "--groups", "2", "--rollouts", "2", "--turns", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    m = re.search(r"^summary: (.*)$", proc.stdout, re.M)
    assert m, proc.stdout
    s = json.loads(m.group(1))
    assert s["rollouts"] == 4 and s["accepted"] == 4 and s["rejected"] == {}, s
    # The engine is a separate OS process: neither the controller nor a Dask worker.
    assert s["engine_pid"] != s["controller_pid"] and s["engine_pid"] not in s["worker_pids"], s
    assert s["engine_is_dask_worker"] is False
    # The deliberately bad call was refused by the gate (named rule) and staged nothing.
    assert [b["reason"] for b in s["bad_calls"]] == ["invalid_token"], s
    assert s["engine_stats"]["rows"] == 4 * 2 and s["engine_stats"]["refused"] == 0, s


# ---- finding the store ------------------------------------------------------------------


def test_connect_finds_the_published_store_and_names_a_missing_one(cluster_client, store_factory):
    store = store_factory(n_units=1)
    name = "tc-test-store-connect"
    with pytest.raises(StoreUnavailable, match=name):
        CaptureClient.connect(cluster_client, name=name)
    publish_store(cluster_client, store, name=name)
    try:
        assert lookup_store(cluster_client, name).unit_workers == store.unit_workers
        with CaptureClient.connect(cluster_client, name=name, flush_ms=1.0) as cap:
            rc = open_rollout(cap, "conn-r0")
            stage_chain(rc, 2)
            receipt = rc.finish(1.0)
        assert not receipt.poisoned
        got = store.get_many(receipt.staging_keys, fields=["digest"])
        assert not got.failed and len(got.batch) == 2
    finally:
        unpublish_store(cluster_client, name)


# ---- (2) batching, counted by the store ---------------------------------------------------


def test_calls_of_many_rollouts_share_few_puts(store_factory):
    store = store_factory(n_units=1)  # one unit: one actor put per client put
    n_rollouts, n_calls, flush_calls = 10, 8, 16
    before_puts, before_rows = unit_counter(store, "puts"), unit_counter(store, "put_rows")
    with CaptureClient(store, flush_calls=flush_calls, flush_ms=600_000) as cap:
        rcs = [open_rollout(cap, f"batch-r{i}") for i in range(n_rollouts)]

        def stage_row(i: int) -> None:  # rollouts interleaved, as an engine's batch is
            t = i // n_rollouts
            rcs[i % n_rollouts].stage(f"c{t}", None if t == 0 else f"c{t - 1}", **delta(i))

        # Below flush-calls (and long before flush-ms) rows only queue: no put at all.
        for i in range(flush_calls - 1):
            stage_row(i)
        assert cap.stats()["queued"] == flush_calls - 1 and unit_counter(store, "puts") == before_puts
        stage_row(flush_calls - 1)  # the flush-calls-th row starts a put
        wait_until(lambda: unit_counter(store, "puts") > before_puts, timeout_s=60, what="the first flush")
        for i in range(flush_calls, n_rollouts * n_calls):
            stage_row(i)
        assert cap.flush(timeout_s=60)
        receipts = [rc.finish(0.5) for rc in rcs]
        client_puts = cap.stats()["puts"]
    n = n_rollouts * n_calls
    puts = unit_counter(store, "puts") - before_puts
    assert unit_counter(store, "put_rows") - before_rows == n
    assert 1 <= puts <= math.ceil(n / flush_calls) + 1, puts
    assert puts == client_puts
    assert not any(r.poisoned for r in receipts)


# ---- (3) bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, reason",
    [
        (dict(parent="nope"), "missing_parent"),
        (dict(token=VOCAB), "invalid_token"),
        (dict(logprob=0.5), "invalid_logprob"),
        (dict(call="c0"), "duplicate_call_id"),
    ],
)
def test_bad_call_raises_the_gate_rule_and_affects_nothing_else(cluster_client, store_factory, bad, reason):
    store = store_factory(n_units=2)
    with CaptureClient(store, flush_ms=1.0) as cap:
        a, b = open_rollout(cap, f"bad-{reason}-a"), open_rollout(cap, f"bad-{reason}-b")
        a.stage("c0", None, **delta(1))
        b.stage("c0", None, **delta(2))
        d = delta(3)
        if "token" in bad:
            d["token_ids"][-1] = bad["token"]
        if "logprob" in bad:
            d["logprobs"][-1] = bad["logprob"]
        with pytest.raises(InvalidRecord) as err:
            a.stage(bad.get("call", "bad"), bad.get("parent", "c0"), **d)
        assert err.value.reason == reason
        a.stage("c1", "c0", **delta(4))
        b.stage("c1", "c0", **delta(5))
        ra, rb = a.finish(1.0), b.finish(0.0)
        assert cap.stats()["refused"] == 0
    assert not ra.poisoned and not rb.poisoned
    assert [c.model_call_id for c in ra.calls] == ["c0", "c1"]
    result = finalize(cluster_client, store, {"g": [ra, rb]})
    assert result.groups["g"].status == ["ok", "ok"]


def test_misuse_is_invalid_input(store_factory):
    store = store_factory(n_units=1)
    cap = CaptureClient(store, flush_ms=1.0)
    rc = open_rollout(cap, "misuse-r0")
    with pytest.raises(InvalidInput, match="already open"):
        open_rollout(cap, "misuse-r0")
    rc.stage("c0", None, **delta(0))
    rc.finish(1.0)
    with pytest.raises(InvalidInput, match="finished"):
        rc.stage("c1", "c0", **delta(1))
    cap.close()
    with pytest.raises(InvalidInput, match="closed"):
        open_rollout(cap, "misuse-r1")
    with pytest.raises(InvalidInput):
        CaptureClient(object())


def test_rows_follow_the_digest_setting_read_when_the_client_is_built(cluster_client, store_factory):
    store = store_factory(n_units=1)
    with dask.config.set({"token-capture.capture.digest": "sha256"}):
        sha = CaptureClient(store, flush_ms=1.0)
    with dask.config.set({"token-capture.capture.digest": "md5"}), pytest.raises(UnsupportedDigest, match="capture.digest"):
        CaptureClient(store)
    receipts = []
    for cap, rid in ((sha, "digest-sha256"), (CaptureClient(store, flush_ms=1.0), "digest-blake3")):
        rc = open_rollout(cap, rid)
        stage_chain(rc, 2, seed=7)
        receipts.append(rc.finish(1.0))
        cap.close()
    assert [{c.digest_version for c in r.calls} for r in receipts] == [{1}, {DEFAULT_VERSION}] and DEFAULT_VERSION == 3
    got = store.get_many([c.staging_key for r in receipts for c in r.calls])
    assert [row.digest_version for row in unpack_rows(got.batch)] == [1, 1, DEFAULT_VERSION, DEFAULT_VERSION]
    assert finalize(cluster_client, store, {"g": receipts}).groups["g"].status == ["ok", "ok"]


# ---- (4) refusals poison only their own rollout -------------------------------------------


def test_refused_row_poisons_only_its_rollout_and_the_finalizer_rejects_it_alone(cluster_client, store_factory):
    store = store_factory(n_units=2)
    # Another writer already staged DIFFERENT content at conflict-b/c0 (keys are write-once).
    other = CaptureGate("conflict-b", vocab_size=VOCAB, num_experts=EXPERTS)
    store.put_many(pack_rows([other.stage_call("c0", None, **delta(99))]))
    with CaptureClient(store, flush_ms=1.0) as cap:
        a, b = open_rollout(cap, "conflict-a"), open_rollout(cap, "conflict-b")
        stage_chain(a, 2, seed=1)
        stage_chain(b, 2, seed=2)
        ra, rb = a.finish(1.0), b.finish(0.0)
        assert cap.stats()["refused"] == 1
    assert not ra.poisoned
    assert rb.poisoned and rb.failure_reason.startswith("staging_failed: key_conflict: "), rb.failure_reason
    result = finalize(cluster_client, store, {"g": [ra, rb]})
    assert result.groups["g"].status == ["ok", "capture_poisoned"]
    assert result.rejected == {"capture_poisoned": 1}


def test_put_that_raises_poisons_its_batch_and_the_client_keeps_working(store_factory):
    faulty = FaultyStore(store_factory(n_units=1), FaultRules(raise_on_puts=(1,)))
    with CaptureClient(faulty, flush_ms=600_000) as cap:
        x, y = open_rollout(cap, "raise-x"), open_rollout(cap, "raise-y")
        stage_chain(x, 2)
        cap.flush(timeout_s=60)  # put 1: raises
        stage_chain(y, 2)
        cap.flush(timeout_s=60)  # put 2: stored
        rx, ry = x.finish(1.0), y.finish(1.0)
        stats = cap.stats()
    assert rx.poisoned and rx.failure_reason.startswith("staging_failed: put_failed: InjectedStoreError: "), rx.failure_reason
    assert not ry.poisoned
    assert stats["failed_puts"] == 1 and stats["refused"] == 2 and stats["rows"] == 2


def test_key_missing_from_the_acknowledgement_poisons_its_rollout(store_factory):
    faulty = FaultyStore(store_factory(n_units=1), FaultRules(drop_ack_keys=("ack-x/c1",)))
    with CaptureClient(faulty, flush_ms=1.0) as cap:
        x, y = open_rollout(cap, "ack-x"), open_rollout(cap, "ack-y")
        stage_chain(x, 2)
        stage_chain(y, 2)
        rx, ry = x.finish(1.0), y.finish(1.0)
    assert rx.poisoned and rx.failure_reason.startswith("staging_failed: missing_ack: ")
    assert not ry.poisoned


# ---- (5) flush-ms -----------------------------------------------------------------------------


def test_a_single_queued_row_is_put_after_flush_ms_without_further_calls(store_factory):
    store = store_factory(n_units=1)
    before = unit_counter(store, "put_rows")
    # flush-ms is read from config when the client is built; flush-calls is far away.
    with dask.config.set({"token-capture.capture-client.flush-ms": 50.0, "token-capture.capture-client.flush-calls": 10_000}):
        cap = CaptureClient(store)
        try:
            rc = open_rollout(cap, "timer-r0")
            rc.stage("c0", None, **delta(0))
            wait_until(lambda: unit_counter(store, "put_rows") > before, timeout_s=60, what="the timed flush")
            # the unit has the row; the client books it once the put's answer is back
            wait_until(lambda: cap.stats()["rows"] == 1, timeout_s=60, what="the client's count of the put")
            assert cap.stats()["queued"] == 0
        finally:
            cap.close()
    got = store.get_many(["timer-r0/c0"], fields=["digest"])
    assert not got.failed and len(got.batch) == 1


def test_close_puts_every_queued_row(store_factory):
    store = store_factory(n_units=2)
    cap = CaptureClient(store, flush_calls=10_000, flush_ms=600_000)
    rc = open_rollout(cap, "close-r0")
    stage_chain(rc, 3)
    assert cap.close(timeout_s=60)
    got = store.get_many([f"close-r0/c{t}" for t in range(3)], fields=["digest"])
    assert not got.failed and len(got.batch) == 3
    assert not rc.finish(1.0).poisoned


UNCLOSED_ENGINE = """
import sys
import numpy as np
from pipeline.client import CaptureClient
cap = CaptureClient.connect(sys.argv[1], name=sys.argv[2], flush_calls=10_000, flush_ms=600_000)
rc = cap.open("exit-r0", "g", vocab_size=64, num_experts=None)
mask = np.array([0, 1, 1], np.float32)
for t in range(3):
    rc.stage(f"c{t}", None if t == 0 else f"c{t - 1}", token_ids=np.arange(3) + t, token_mask=mask,
             logprobs=np.array([0.0, -0.5, -0.25], np.float32))
assert cap.stats()["queued"] == 3  # nothing put yet: the thresholds are far away
print("exiting without close", flush=True)
"""


def test_an_engine_that_never_closes_still_stores_every_row_at_exit(cluster_client, store_factory):
    # The flusher is a daemon thread; without the exit handler these rows would be lost.
    store = store_factory(n_units=2)
    name = "tc-test-store-exit"
    publish_store(cluster_client, store, name=name)
    try:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        proc = subprocess.run(
            [sys.executable, "-c", UNCLOSED_ENGINE, cluster_client.scheduler.address, name],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
    finally:
        unpublish_store(cluster_client, name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting without close" in proc.stdout
    assert "never closed: putting its 3 unsettled row(s)" in proc.stderr  # the fix is named
    got = store.get_many([f"exit-r0/c{t}" for t in range(3)], fields=["token_ids"])
    assert not got.failed and len(got.batch) == 3
    assert np.array_equal(got.batch.fields["token_ids"].row(2), np.arange(3) + 2)


# ---- (6) many engine threads ----------------------------------------------------------------


def test_concurrent_stage_from_many_threads_puts_every_row_once(cluster_client, store_factory):
    store = store_factory(n_units=2)
    n_threads, per_thread, n_calls = 8, 4, 3
    before = unit_counter(store, "put_rows")
    barrier = threading.Barrier(n_threads)
    receipts: list = []
    errors: list = []
    with CaptureClient(store, flush_calls=7, flush_ms=5.0) as cap:

        def engine(t: int) -> None:
            try:
                rcs = [open_rollout(cap, f"mt-t{t}-r{i}", group=f"mt-g{t}") for i in range(per_thread)]
                barrier.wait()
                for c in range(n_calls):
                    for i, rc in enumerate(rcs):
                        rc.stage(f"c{c}", None if c == 0 else f"c{c - 1}", **delta(t * 1000 + i * 10 + c, n_gen=4 + c))
                receipts.extend(rc.finish(float(t)) for rc in rcs)
            except BaseException as e:  # reported below, not lost in the thread
                errors.append(e)

        threads = [threading.Thread(target=engine, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        stats = cap.stats()
    assert not errors, errors
    n = n_threads * per_thread * n_calls
    expected = {f"mt-t{t}-r{i}/c{c}" for t in range(n_threads) for i in range(per_thread) for c in range(n_calls)}
    assert unit_counter(store, "put_rows") - before == n  # each row put exactly once
    assert set(k for k in store.keys(STAGING_PARTITION) if k.startswith("mt-")) == expected
    assert stats["rows"] == n and stats["refused"] == 0
    assert len(receipts) == n_threads * per_thread and not any(r.poisoned for r in receipts)
    groups = {f"mt-g{t}": [r for r in receipts if r.group_id == f"mt-g{t}"] for t in range(n_threads)}
    result = finalize(cluster_client, store, groups)
    assert result.metrics["accepted"] == n_threads * per_thread


def test_stage_rollouts_poisons_a_refused_rollout_the_same_way(store_factory):
    # pipeline.capture.stage_rollouts and the capture client share one refusal->receipt path.
    from pipeline.capture import policy_from_config, stage_rollouts
    from tasks.toy.rollouts import generate_rollouts, make_group_specs

    store = store_factory(n_units=2)
    policy = policy_from_config()
    specs = make_group_specs("sr", 2, turns=2, tokens_per_turn=4, tool_tokens=2, prompt_tokens=3, vocab_size=policy.vocab_size)
    first, second = generate_rollouts(policy, specs)
    # Different content already at the second rollout's last key.
    other = CaptureGate(second.spec.rollout_id, vocab_size=VOCAB, num_experts=EXPERTS)
    other.stage_call("x", None, **delta(7, routes=False))
    store.put_many(pack_rows([other.stage_call(second.rows[-1].model_call_id, "x", **delta(8, routes=False))]))
    receipts = stage_rollouts(store, [first, second])
    assert not receipts[0].poisoned
    assert receipts[1].poisoned and receipts[1].failure_reason.startswith("staging_failed: key_conflict: ")


def test_a_rollout_with_other_routes_dimensions_does_not_fail_the_batch_it_is_flushed_with(store_factory):
    # Rows of one flush are packed together; routes of another [L, K] cannot share the
    # routes field. The odd rollout gets the store's own per-key answer; its neighbours
    # in the same flush are stored.
    store = store_factory(n_units=1)
    with CaptureClient(store, flush_calls=10_000, flush_ms=600_000) as cap:
        good, odd = open_rollout(cap, "shape-good"), open_rollout(cap, "shape-odd")
        stage_chain(good, 2, seed=1)
        d = delta(5)
        d["routed_experts"] = np.zeros((len(d["token_ids"]), L + 1, K - 1), np.int16)
        odd.stage("c0", None, **d)
        assert cap.flush(timeout_s=60)  # one flush: the three rows together
        rg, ro = good.finish(1.0), odd.finish(1.0)
    assert not rg.poisoned, rg.failure_reason
    got = store.get_many(rg.staging_keys, fields=["digest"])
    assert not got.failed and len(got.batch) == 2
    assert ro.poisoned and not ro.failure_reason.startswith("staging_failed: put_failed"), ro.failure_reason


def test_stage_rollouts_poisons_a_rollout_whose_key_the_store_did_not_acknowledge(store_factory):
    # The same rule as the capture client's: a key answered neither ok nor failed is not stored.
    from pipeline.capture import policy_from_config, stage_rollouts
    from tasks.toy.rollouts import generate_rollouts, make_group_specs

    policy = policy_from_config()
    specs = make_group_specs("sra", 2, turns=2, tokens_per_turn=4, tool_tokens=2, prompt_tokens=3, vocab_size=policy.vocab_size)
    first, second = generate_rollouts(policy, specs)
    faulty = FaultyStore(store_factory(n_units=1), FaultRules(drop_ack_keys=(second.rows[-1].staging_key,)))
    receipts = stage_rollouts(faulty, [first, second])
    assert not receipts[0].poisoned
    assert receipts[1].poisoned and receipts[1].failure_reason.startswith("staging_failed: missing_ack: "), receipts[1].failure_reason
