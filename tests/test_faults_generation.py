"""Generation worker loss mid-cut.

A process cluster of two named nannies (``SpecCluster``, the machinery under
``LocalCluster``), so a test finds a worker again after its nanny restarted it:

    store   hosts both storage units and one GenerationWorker (survives)
    gen     hosts the other GenerationWorker (the victim)

The fault: on the victim's process only (``client.run``), ``StagingStore.put_many`` is
wrapped so that the cut's N-th put into the ``cut`` partition hangs, either before it
reaches the store (``before``: nothing of that batch written) or after the store applied
it (``after``: its rows are written but no call was ever sealed with them). The cut batch
size is 2 rows there, so by then the victim has also written and sealed an earlier batch
whose receipt will never reach the controller. The hang writes the process id to a marker
file; the test SIGKILLs that process while the driver's ``cut`` waits for its answer.

What must hold: the collected cut reports every call of the victim ``durable_failure`` /
``generation_lost`` and the survivor's calls ``durable_prefix``; the cut partition holds
exactly the keys the durable acks advertise (listed with ``StagingStore.keys``); after
recovery on the restarted worker the lost calls regenerate, the others resume from their
prefixes, and the finalized step is bit-identical to an uninterrupted run.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from pipeline.cluster import finalize_resources
from pipeline.capture import policy_from_config, stage_rollouts
from pipeline.finalize.controller import Finalizer
from pipeline.driver import RolloutDriver, cut_round
from pipeline.store.client import StagingStore
from pipeline.testing.oracle import reference_mismatches
from tasks.keys import CUT_PARTITION
from tasks.cut.receipt import DURABLE_FAILURE, DURABLE_PREFIX, GENERATION_LOST
from tasks.toy.rollouts import generate_rollouts, make_step_specs
from support import named_nanny_cluster, wait_for_names, wait_replaced

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts")
CUT_BATCH = 2  # rows per cut put on the victim: several puts per cut


@pytest.fixture(scope="module")
def gen_cluster():
    workers = {"store": {"resources": finalize_resources()}, "gen": {"resources": finalize_resources()}}
    with named_nanny_cluster(workers) as client:
        yield client








# ---- fault injection (runs inside the victim's process via client.run) ------------------


def _install_cut_hang(marker: str, put_no: int, when: str, batch_rows: int) -> int:
    """In this process: cut puts of ``batch_rows`` rows, and the ``put_no``-th put into the
    cut partition hangs (``when`` = "before" or "after" the store applies it), after
    writing this pid to ``marker``. Only the victim's GenerationWorker puts from here."""
    import dataclasses

    import pipeline.generation.worker as gw
    import pipeline.store.client as sc

    # The worker read its cut limits when it was built: hand this process's cuts smaller ones.
    orig_cut = getattr(gw.run_cut, "_tc_orig", gw.run_cut)

    def run_cut(*args, limits=None, **kwargs):
        return orig_cut(*args, limits=dataclasses.replace(limits, max_rows=batch_rows), **kwargs)

    run_cut._tc_orig = orig_cut
    gw.run_cut = run_cut
    orig = getattr(sc.StagingStore.put_many, "_tc_orig", sc.StagingStore.put_many)
    count = [0]

    def hang() -> None:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # the test kills this process long before

    def put_many(self, batch, partition="staging", adopt=False):
        mine = 0  # this put's number among the cut's puts (two may be on the wire at once)
        if partition == "cut":
            count[0] += 1
            mine = count[0]
            if mine == put_no and when == "before":
                hang()
        result = orig(self, batch, partition=partition, adopt=adopt)
        if mine == put_no and when == "after":
            hang()
        return result

    put_many._tc_orig = orig
    sc.StagingStore.put_many = put_many
    return os.getpid()


def wait_marker(marker: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(marker) and os.path.getsize(marker)):
        assert time.monotonic() < deadline, "the victim's cut never reached the fault"
        time.sleep(0.02)
    return int(open(marker).read())


def specs(prefix: str):
    # 8 rollouts, alternately on the store worker's actor (even) and the victim's (odd).
    return make_step_specs(prefix, 2, 4, turns=3, tokens_per_turn=16, tool_tokens=5, prompt_tokens=7,
                           vocab_size=policy_from_config().vocab_size)


@pytest.mark.parametrize("when", ["before", "after"])
def test_generation_worker_killed_mid_cut(gen_cluster, tmp_path, when):
    client = gen_cluster
    addr = wait_for_names(client, ["store", "gen"])  # an earlier case may have just killed "gen"
    store = StagingStore.start(client, n_units=2, memory_limit="16KiB", spill_directory=str(tmp_path / "spill"),
                               workers=[addr["store"]])
    groups = specs(f"gl{when[0]}-")
    flat = [s for g in groups for s in g]
    victim_rollouts = {s.rollout_id for i, s in enumerate(flat) if i % 2 == 1}
    driver = RolloutDriver(client, store, step_tokens=6, workers=[addr["store"], addr["gen"]])
    driver.submit(groups)
    driver.run_rounds(cut_round(3, 16, 6))  # every call mid-generation of turn 1

    marker = str(tmp_path / "victim.pid")
    pids = client.run(_install_cut_hang, marker, 2, when, CUT_BATCH, workers=[addr["gen"]])
    out: dict = {}
    cutter = threading.Thread(target=lambda: out.update(stats=driver.cut("ck")), daemon=True)
    cutter.start()
    pid = wait_marker(marker)
    assert pid == pids[addr["gen"]]
    # The victim wrote batch 1 (sealed on its side), and batch 2 too when hung after it
    # (batch 1's put may still be on the wire beside the hung one: waited for).
    want = 2 * CUT_BATCH if when == "after" else CUT_BATCH
    end = time.monotonic() + 30
    while len(victim_keys := [k for k in store.keys(CUT_PARTITION) if k.split("/")[2] in victim_rollouts]) < want:
        assert time.monotonic() < end, victim_keys
        time.sleep(0.05)
    assert len(victim_keys) == want, victim_keys
    os.kill(pid, signal.SIGKILL)
    cutter.join(60)
    assert not cutter.is_alive(), "the driver's cut hangs on a dead generation actor"
    cut = out["stats"]

    # The collected cut: the victim's 4 calls generation_lost, the survivor's 4 durable.
    assert cut.lost_workers == [addr["gen"]]
    assert cut.calls == 8 and cut.durable == 4 and cut.failed == {GENERATION_LOST: 4}, cut
    acks = driver.snapshot.acks
    for (rid, _), ack in acks.items():
        if rid in victim_rollouts:
            assert ack.status == DURABLE_FAILURE and ack.reason == GENERATION_LOST and not ack.staging_keys
            # The driver, not the dead worker, cleared the rows the victim had written.
            assert f"{len(victim_keys)} unadvertised cut rows of the lost calls deleted" in ack.detail, ack.detail
        else:
            assert ack.status == DURABLE_PREFIX and ack.staging_keys
    # No unsealed (or unadvertised) row stays: the cut partition is exactly what the acks advertise.
    advertised = {k for a in acks.values() if a.durable for k in a.staging_keys}
    assert set(store.keys(CUT_PARTITION)) == advertised
    assert not set(store.keys(CUT_PARTITION, prefix="__cut__/ck/")) & set(victim_keys)

    snapshot = driver.snapshot
    driver.kill()
    new_gen = wait_replaced(client, "gen", addr["gen"])
    resumed, rec = RolloutDriver.recover(client, store, snapshot, workers=[addr["store"], new_gen])
    assert rec.regenerated == {GENERATION_LOST: 4} and rec.resumed == 4 and rec.poisoned == {}
    receipts = resumed.finish()
    step = Finalizer(client, store).submit_step(receipts).result()
    assert step.metrics["accepted"] == 8

    # Bit-identical to an uninterrupted run of the same seeds, finalized the same way.
    reference = generate_rollouts(policy_from_config(), flat)
    assert reference_mismatches(step.groups, reference) == {}
    got = {r.rollout_id: r for rs in receipts.values() for r in rs}
    assert all(got[ro.spec.rollout_id] == ro.receipt for ro in reference)
    ref_store = StagingStore.start(client, n_units=2, memory_limit="16KiB", spill_directory=str(tmp_path / "ref"),
                                   workers=[addr["store"]])
    ref_receipts = stage_rollouts(ref_store, reference)
    ref_step = Finalizer(client, ref_store).submit_step(
        {g[0].group_id: ref_receipts[i * 4 : i * 4 + 4] for i, g in enumerate(groups)}).result()
    for gid, group in step.groups.items():
        want = ref_step.groups[gid]
        assert group.rollout_ids == want.rollout_ids and group.status == want.status == ["ok"] * 4
        for name in TENSORS:
            a, b = getattr(group, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    resumed.kill()
    for s in (store, ref_store):
        s.close()
