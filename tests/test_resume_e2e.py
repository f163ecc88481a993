"""End to end: generate, cut mid-generation, checkpoint the store, kill and recreate the
generation actors, restore, resume, finish, finalize -- bit-identical to an uninterrupted
run of the same seeds. A real 2-worker LocalCluster, a StagingStore spilling to tmp_path,
the real cut, PrefixReadBatcher and finalization graph; faults injected with FaultyStore
(cut puts) and by deleting rows from the store."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.capture import policy_from_config, stage_rollouts
from pipeline.finalize.controller import Finalizer
from pipeline.testing.faults import FaultRules, FaultyStore
from pipeline.driver import RolloutDriver
from pipeline.store.client import StagingStore
from pipeline.testing.oracle import reference_mismatches
from tasks.cut.resume import NOT_CUT
from tasks.errors import InvalidRecord
from tasks.gate import CaptureGate
from tasks.toy.rollouts import generate_rollouts, make_step_specs

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts")


def specs(prefix: str, groups: int = 2, rollouts: int = 3, turns: int = 3, tokens: int = 20):
    return make_step_specs(prefix, groups, rollouts, turns=turns, tokens_per_turn=tokens, tool_tokens=5,
                           prompt_tokens=7, vocab_size=policy_from_config().vocab_size)


def flat(groups):
    return [s for g in groups for s in g]


def new_store(client, path: Path) -> StagingStore:
    # A tiny memory limit: most rows go through zict to disk under tmp_path.
    return StagingStore.start(client, n_units=2, memory_limit="16KiB", spill_directory=str(path))


def generation_actors(client) -> set[str]:
    found = client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors if "GenerationWorker" in str(k)])
    return {k for keys in found.values() for k in keys}


def wait_gone(client, keys, timeout=10.0) -> set[str]:
    deadline = time.monotonic() + timeout
    while (left := generation_actors(client) & set(keys)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ---- the gate survives: rebuilt from staged rows, hashes recomputed -----------------------------


def test_gate_resume_continues_the_chain_and_refuses_tampered_rows():
    policy = policy_from_config()
    ro = generate_rollouts(policy, flat(specs("g", 1, 1)))[0]
    rows = ro.rows
    kw = dict(vocab_size=policy.vocab_size, num_experts=policy.num_experts, group_id=ro.spec.group_id)
    gate = CaptureGate.resume(ro.spec.rollout_id, rows[:2], records=ro.receipt.calls[:2], **kw)
    last = rows[2]
    again = gate.stage_call(last.model_call_id, last.parent_call_id, last.token_ids, last.token_mask, last.logprobs,
                            routed_experts=last.routed_experts, weight_version=last.weight_version)
    # The rebuilt gate continues the chain exactly as the uninterrupted one did.
    assert (again.digest, again.chain_hash, again.cumulative_hash) == (last.digest, last.chain_hash, last.cumulative_hash)
    assert gate.receipt(ro.receipt.reward) == ro.receipt

    forged = dataclasses.replace(rows[1], token_ids=rows[1].token_ids.copy())
    forged.token_ids[-1] = (forged.token_ids[-1] + 1) % policy.vocab_size  # digest kept: a lie
    with pytest.raises(InvalidRecord) as err:
        CaptureGate.resume(ro.spec.rollout_id, [rows[0], forged], **kw)
    assert err.value.reason == "corrupt_digest"
    # A row that is intact but is not what the controller's receipt says.
    other = generate_rollouts(policy, flat(specs("h", 1, 1)))[0]
    with pytest.raises(InvalidRecord) as err:
        CaptureGate.resume(ro.spec.rollout_id, rows[:1], records=other.receipt.calls[:1], **kw)
    assert err.value.reason == "corrupt_digest"
    with pytest.raises(InvalidRecord) as err:
        CaptureGate.resume(ro.spec.rollout_id, rows[:1], records=ro.receipt.calls[:2], **kw)
    assert err.value.reason == "missing_staging_row"


# ---- the bit-identical resume -----------------------------------------------------------------------


def test_cut_checkpoint_kill_restore_resume_is_bit_identical(cluster_client, tmp_path):
    client = cluster_client
    groups = specs("bi")
    store = new_store(client, tmp_path / "spill")
    driver = RolloutDriver(client, store, step_tokens=8)
    driver.submit(groups)
    driver.run_rounds(1)
    first = driver.cut("ck-1")  # every call mid-generation of turn 0
    assert first.calls == 6 and first.durable == 6 and first.rows == 6
    assert first.puts < first.rows  # batched: one put per actor, not one per call
    driver.run_rounds(3)  # turn 0 done and staged, turn 1 mid-generation
    cut = driver.cut("ck-2")
    assert cut.durable == cut.calls == 6 and not cut.failed
    driver.checkpoint_store(str(tmp_path / "ckpt"))
    snapshot = driver.snapshot
    driver.run_rounds(2)  # work after the checkpoint: lost with the crash, redone identically
    old = driver.kill()
    assert not wait_gone(client, old), "the generation actors survived the crash"
    with pytest.raises(Exception):
        driver.run_rounds(1)

    restored = StagingStore.from_checkpoint(client, str(tmp_path / "ckpt"), n_units=2, memory_limit="16KiB",
                                            spill_directory=str(tmp_path / "spill2"))
    resumed, rec = RolloutDriver.recover(client, restored, snapshot)
    assert rec.resumed == 6 and rec.regenerated == {} and rec.poisoned == {}
    assert rec.resumed_tokens == 6 * (5 + 8)  # tool tokens + 8 generated, no regeneration
    assert rec.gets < rec.restore_requests  # prefixes read through coalesced gets
    receipts = resumed.finish()
    step = Finalizer(client, restored).submit_step(receipts).result()
    assert step.metrics["accepted"] == 6

    # Uninterrupted reference: same seeds, staged and finalized through the same graph.
    reference = generate_rollouts(policy_from_config(), flat(groups))
    ref_store = new_store(client, tmp_path / "spill-ref")
    ref_receipts = stage_rollouts(ref_store, reference)
    ref_step = Finalizer(client, ref_store).submit_step(
        {g[0].group_id: ref_receipts[i * 3 : i * 3 + 3] for i, g in enumerate(groups)}
    ).result()
    for gid, group in step.groups.items():
        want = ref_step.groups[gid]
        assert group.rollout_ids == want.rollout_ids and group.status == want.status == ["ok"] * 3
        for name in TENSORS:
            a, b = getattr(group, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert reference_mismatches(step.groups, reference) == {}
    # Receipts agree call by call (digests cover ids, mask, logprobs, routes and both chains).
    got = {r.rollout_id: r for rs in receipts.values() for r in rs}
    assert all(got[ro.spec.rollout_id] == ro.receipt for ro in reference)
    resumed.kill()
    for s in (store, restored, ref_store):
        s.close()


def test_durable_failures_and_unusable_prefixes_regenerate(cluster_client, tmp_path):
    """Some cut rows are refused (durable_failure), one durable prefix disappears (unusable),
    one staged row is lost (that rollout alone is poisoned), calls started after the cut
    were never cut; the store is the original one (idempotent re-puts of work redone)."""
    client = cluster_client
    groups = specs("df-", rollouts=3, tokens=16)
    store = new_store(client, tmp_path / "spill")
    faulty = FaultyStore(store, FaultRules(fail_keys=("/df-p0-1/", "/df-p1-2/")))
    driver = RolloutDriver(client, store, cut_store=faulty, step_tokens=6)
    driver.submit(groups)
    driver.run_rounds(4)  # turn 0 (3 rounds) staged, turn 1 one round in
    cut = driver.cut("ck")
    assert cut.failed == {"cut_error": 2} and cut.durable == 4, [a for r in cut.receipts for a in r.acks]
    snapshot = driver.snapshot
    driver.run_rounds(3)  # turn 1 completes and is staged before the crash
    driver.kill()

    durable = [a for a in snapshot.acks.values() if a.durable]
    lost_prefix = next(a for a in durable if a.rollout_id == "df-p0-0")
    assert not store.delete(list(lost_prefix.staging_keys), partition="cut").failed
    assert not store.delete(["df-p1-0/call-0"]).failed  # a completed call's staged row

    resumed, rec = RolloutDriver.recover(client, store, snapshot)
    assert rec.poisoned.keys() == {"df-p1-0"} and "missing_staging_row" in rec.poisoned["df-p1-0"]
    assert rec.regenerated == {"cut_error": 2, "missing_staging_row": 1}
    assert rec.resumed == 2  # the 6 in-flight calls less 2 refused, 1 lost, 1 poisoned rollout
    receipts = resumed.finish()
    step = Finalizer(client, store).submit_step(receipts).result()
    assert step.rejected == {"capture_poisoned": 1}
    reference = generate_rollouts(policy_from_config(), flat(groups))
    bad = reference_mismatches(step.groups, reference)
    assert bad.keys() == {"df-p1-0"} and "status=capture_poisoned" in bad["df-p1-0"]
    resumed.kill()
    store.close()


def test_calls_started_after_the_cut_start_over(cluster_client, tmp_path):
    client = cluster_client
    groups = specs("nc-", groups=1, rollouts=2, turns=2, tokens=8)
    store = new_store(client, tmp_path / "spill")
    driver = RolloutDriver(client, store, step_tokens=8)
    driver.submit(groups)
    snapshot_cut = driver.cut("ck")  # calls just opened: prefixes hold only the prompt
    assert snapshot_cut.durable == 2
    snapshot = driver.snapshot
    driver.run_rounds(1)
    driver.kill()
    # The snapshot knows only the cut's calls; pretend the cut missed one of them.
    acks = dict(snapshot.acks)
    acks.pop(("nc-p0-1", "call-0"))
    resumed, rec = RolloutDriver.recover(client, store, dataclasses.replace(snapshot, acks=acks))
    assert rec.regenerated == {NOT_CUT: 1} and rec.resumed == 1 and rec.resumed_tokens == 7
    step = Finalizer(client, store).submit_step(resumed.finish()).result()
    assert reference_mismatches(step.groups, generate_rollouts(policy_from_config(), flat(groups))) == {}
    resumed.kill()
    store.close()


# ---- the walkthrough a user copies from -----------------------------------------------------------


def test_walkthrough_example_runs(tmp_path):
    env = dict(os.environ, DASK_TOKEN_CAPTURE__CLUSTER__DASHBOARD_ADDRESS="127.0.0.1:0")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cut_restore_walkthrough.py"), "--groups", "1", "--rollouts", "2",
         "--turns", "2", "--tokens-per-turn", "8", "--workdir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2/2 rollouts matched the uninterrupted run" in proc.stdout, proc.stdout


def test_demo_resume_phase_reports_cut_restore_and_matches(cluster_client, tmp_path):
    import argparse
    import io

    from pipeline.cli import build_parser
    from pipeline.demo import resume_phase

    assert build_parser().parse_args(["demo", "--no-resume"]).no_resume is True
    assert build_parser().parse_args(["demo"]).no_resume is False
    store = new_store(cluster_client, tmp_path / "spill")
    before = generation_actors(cluster_client)
    out = io.StringIO()
    args = argparse.Namespace(groups=1, rollouts=2, turns=2, tokens_per_turn=12)
    summary = resume_phase(cluster_client, store, args, out)
    text = out.getvalue()
    assert "2 in-flight calls, 2 rows in" in text and "2 durable / 0 failed" in text, text
    assert "2 calls resumed from their prefixes" in text and "keys/get" in text, text
    assert "2/2 rollouts matched the uninterrupted run" in text, text
    assert summary["matched"] == 2 and summary["resumed"] == 2 and summary["regenerated"] == {}
    assert not wait_gone(cluster_client, generation_actors(cluster_client) - before), "the demo left generation actors behind"
    store.close()
