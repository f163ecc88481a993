"""Checkpoint cut and restore, end to end: a walkthrough to copy from.

    python examples/cut_restore_walkthrough.py                    # embedded LocalCluster
    python examples/cut_restore_walkthrough.py --scheduler tcp://127.0.0.1:8786
    python examples/cut_restore_walkthrough.py --fail-cut 2       # 2 calls' cut rows refused

What happens:
 1. multi-turn GRPO rollouts run on GenerationWorker actors (one per Dask worker), every
    completed call staged with its digest through the rollout's CaptureGate;
 2. mid-generation, a checkpoint cut freezes every in-flight call and writes its prefix
    (batched puts); the staging store (staged rows + cut prefixes) is checkpointed;
 3. the generation actors are killed (a crash) and recreated; the store is restored from
    its checkpoint into a fresh StagingStore;
 4. every in-flight call resumes from its durable prefix, read and verified through the
    per-worker PrefixReadBatcher; calls whose cut failed start over (same keys, same
    tokens);
 5. the rollouts finish, are finalized by the Dask finalization graph, and are compared,
    bit for bit, with an uninterrupted run of the same seeds.

Run from the repository root (or with it on PYTHONPATH).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pipeline import config  # noqa: E402  (loads dask-config.yaml into dask.config)
from pipeline.cli_args import non_negative_int, positive_int, scheduler_address  # noqa: E402
from pipeline.capture import policy_from_config  # noqa: E402
from pipeline.cluster import connect  # noqa: E402
from pipeline.finalize.controller import Finalizer  # noqa: E402
from pipeline.testing.faults import FaultRules, FaultyStore  # noqa: E402
from pipeline.driver import RolloutDriver, cut_round  # noqa: E402
from pipeline.store.client import StagingStore  # noqa: E402
from pipeline.testing.oracle import reference_mismatches  # noqa: E402
from tasks.toy.rollouts import generate_rollouts, make_step_specs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", type=scheduler_address, help="attach to this scheduler instead of an embedded LocalCluster")
    p.add_argument("--groups", type=positive_int, default=2, help="GRPO groups (default %(default)s)")
    p.add_argument("--rollouts", type=positive_int, default=4, help="rollouts per group (default %(default)s)")
    p.add_argument("--turns", type=positive_int, default=3, help="model calls per rollout (default %(default)s)")
    p.add_argument("--tokens-per-turn", type=positive_int, default=32, help="generated tokens per call (default %(default)s)")
    p.add_argument("--fail-cut", type=non_negative_int, default=0, help="refuse the cut rows of this many rollouts (they regenerate)")
    p.add_argument("--workdir", help="directory for the store checkpoint and spill, kept (default: a temporary one, removed on exit)")
    args = p.parse_args()

    if args.workdir:
        return walkthrough(args, args.workdir)
    # The checkpoint and spill files live in a temporary directory removed on exit (after
    # the cluster has closed), whether the walkthrough succeeds or fails.
    with tempfile.TemporaryDirectory(prefix="cut-restore-", ignore_cleanup_errors=True) as workdir:
        return walkthrough(args, workdir)


def walkthrough(args: argparse.Namespace, workdir: str) -> int:
    ckpt_dir = os.path.join(workdir, "checkpoint")

    # Workers advertise the `finalize` resource the finalization graph needs; everything
    # binds to 127.0.0.1 (config `token-capture.cluster`).
    with connect(args.scheduler, n_workers=2, threads_per_worker=1) as (client, _cluster):
        print(f"dashboard: {client.dashboard_link}")

        # ---- 1. rollouts on generation actors ------------------------------------------
        store = StagingStore.start(client, spill_directory=os.path.join(workdir, "spill"))
        groups = make_step_specs(
            "walk-", args.groups, args.rollouts, turns=args.turns, tokens_per_turn=args.tokens_per_turn,
            tool_tokens=config.get("demo.tool-tokens"), prompt_tokens=config.get("demo.prompt-tokens"),
            vocab_size=config.get("policy.vocab-size"), seed=config.get("policy.seed"),
        )
        specs = [s for g in groups for s in g]
        # The actors write cut prefixes through `cut_store`. To see the regenerate path,
        # a FaultyStore refuses the cut rows of the first --fail-cut rollouts.
        doomed = tuple(f"/{s.rollout_id}/" for s in specs[: args.fail_cut])
        cut_store = FaultyStore(store, FaultRules(fail_keys=doomed)) if doomed else None
        driver = RolloutDriver(client, store, cut_store=cut_store)
        driver.submit(groups)  # places rollouts round-robin and opens their first calls
        rounds = cut_round(args.turns, args.tokens_per_turn, driver.step_tokens)
        driver.run_rounds(rounds)  # each round: one step per actor, one staging put

        # ---- 2. cut mid-generation, checkpoint the store -------------------------------
        cut = driver.cut("walk-ckpt-1")  # checkpoint_cut on every actor at once
        print(f"cut after round {rounds}: {cut.calls} calls, {cut.rows} rows in {cut.puts} puts, "
              f"{cut.durable} durable, failed {cut.failed or 'none'}")
        manifest = driver.checkpoint_store(ckpt_dir)  # atomic: temp files, fsync, rename
        snapshot = driver.snapshot  # token-free controller state as of the cut
        print(f"store checkpoint: {manifest['rows']} rows, {manifest['bytes']} bytes in {ckpt_dir}")

        # ---- 3. crash: the generation actors die; the store comes back from disk --------
        driver.run_rounds(1)  # this work is lost with the actors; it is redone identically
        killed = driver.kill()
        store.close()  # the old store is gone too: only the checkpoint remains
        store = StagingStore.from_checkpoint(client, ckpt_dir, spill_directory=os.path.join(workdir, "spill2"))
        print(f"killed {len(killed)} generation actors; store restored from the checkpoint")

        # ---- 4. recreate the actors and resume every in-flight call --------------------
        driver, rec = RolloutDriver.recover(client, store, snapshot)
        print(f"resumed {rec.resumed} calls from their prefixes ({rec.resumed_tokens} tokens kept), "
              f"regenerated {rec.regenerated or 'none'}; {rec.restore_requests} prefixes in {rec.gets} gets "
              f"({rec.keys_per_get:.1f} keys/get)")

        # ---- 5. finish, finalize, compare with the uninterrupted run -------------------
        receipts = driver.finish()  # {group_id: [Receipt, ...]}
        step = Finalizer(client, store).submit_step(receipts).result()
        reference = generate_rollouts(policy_from_config(), specs)  # same seeds, no interruption
        bad = reference_mismatches(step.groups, reference)
        print(f"finalized {step.metrics['accepted']}/{step.metrics['rollouts']} rollouts; "
              f"{len(specs) - len(bad)}/{len(specs)} rollouts matched the uninterrupted run")
        for rid, fields in bad.items():
            print(f"  {rid}: differs in {', '.join(fields)}")
        driver.kill()
        store.close()
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
