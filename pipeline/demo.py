"""Run the token-capture loop end to end and print what happened.

Generates GRPO groups of multi-turn rollouts with the toy MoE policy on Dask workers,
stages every call's delta (with its digest) in the staging store, and finalizes each
training step through the finalization graph (one union fetch, verify tasks on
``finalize`` slots, assemble), several steps in flight. Prints per-step accepted /
rejected rollouts by reason, fetch_ms vs verify_ms and tokens/s, a store summary and the
dashboard address. Uses an embedded LocalCluster on 127.0.0.1 unless --scheduler is given.

Then (unless --no-resume) the checkpoint/resume phase: one more step of rollouts runs on
GenerationWorker actors, is cut mid-generation, the store is checkpointed, the actors
are killed and recreated, the store is restored from its checkpoint into a fresh one,
every in-flight call resumes from its prefix (PrefixReadBatcher), the rollouts finish and
are finalized; prints cut and restore statistics and how many finalized rollouts are
bit-identical to an uninterrupted run of the same seeds.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Iterable

from tasks.keys import STAGING_PARTITION

from . import config
from .capture import submit_generation
from .cluster import adapt, connect, dashboard_url
from .store.report import report_store
from .progress import Progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="ADDR", help="attach to an existing scheduler (e.g. tcp://127.0.0.1:8786) instead of an embedded LocalCluster")
    p.add_argument("--steps", type=int, default=config.get("demo.steps"), help="training steps to finalize (default %(default)s)")
    p.add_argument("--groups", type=int, default=config.get("demo.groups"), help="GRPO groups per step (default %(default)s)")
    p.add_argument("--rollouts", type=int, default=config.get("demo.rollouts-per-group"), help="rollouts per group (default %(default)s)")
    p.add_argument("--turns", type=int, default=config.get("demo.turns"), help="model calls per rollout (default %(default)s)")
    p.add_argument("--tokens-per-turn", type=int, default=config.get("demo.tokens-per-turn"), help="generated tokens per call (default %(default)s)")
    p.add_argument("--in-flight", type=int, default=config.get("demo.steps-in-flight"), help="finalization steps kept in flight (default %(default)s)")
    p.add_argument("--no-resume", action="store_true", help="skip the cut -> checkpoint -> kill -> restore -> resume -> finalize phase")
    p.add_argument("--keep-alive", action="store_true", help="after the run, keep the cluster and dashboard up and keep finalizing steps (Ctrl-C to stop)")
    p.add_argument("--keep-alive-interval", type=float, default=2.0, help="seconds between steps with --keep-alive (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace, out=sys.stdout) -> dict[str, Any]:
    """The demo proper; returns its summary (the CLI prints it)."""
    from .finalize.controller import Finalizer
    from .store.client import StagingStore

    summary: dict[str, Any] = {"steps": []}
    with connect(args.scheduler) as (client, cluster):
        if cluster is not None:
            adapt(cluster)  # embedded: split-timing adaptive scaling (decisions shown on the page)
        url = dashboard_url(client, config.get("dashboard.page"))
        print(f"dashboard: {url}", file=out, flush=True)
        store = StagingStore.start(client)
        finalizer = Finalizer(client, store)
        t0 = time.perf_counter()
        with Progress("demo", total=args.steps, quiet=args.quiet) as progress:
            summary["steps"] += run_steps(client, store, finalizer, args, range(args.steps), out, progress)
        if not getattr(args, "no_resume", False):
            summary["resume"] = resume_phase(client, store, args, out)
        wall_s = time.perf_counter() - t0
        stats = report_store(store)
        summary.update(_store_summary(stats))
        summary["wall_s"] = wall_s
        summary["dashboard"] = url
        _print_summary(summary, out)
        if args.keep_alive:
            keep_alive(client, store, finalizer, args, out)
        store.close()
    return summary


def run_steps(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, steps: Iterable[int], out, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Generate, stage and finalize ``steps``, keeping ``args.in_flight`` steps in flight."""
    from tasks.toy.rollouts import make_step_specs

    steps = list(steps)
    pending: list[Any] = []
    done: list[dict[str, Any]] = []
    for i, s in enumerate(steps):
        groups = make_step_specs(
            f"s{s}",
            args.groups,
            args.rollouts,
            turns=args.turns,
            tokens_per_turn=args.tokens_per_turn,
            tool_tokens=config.get("demo.tool-tokens"),
            prompt_tokens=config.get("demo.prompt-tokens"),
            vocab_size=config.get("policy.vocab-size"),
            seed=config.get("policy.seed"),
        )
        receipts = client.gather(submit_generation(client, store, groups))
        pending.append(finalizer.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)}, step_id=f"step-{s}"))
        while len(pending) >= args.in_flight or (pending and i == len(steps) - 1):
            step = pending.pop(0).result()
            done.append(_print_step(step, out))
            report_store(store)
            if progress is not None:
                progress.advance(1, f"{step.step_id} done")
    return done


def keep_alive(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, out) -> None:
    """Keep finalizing a step every ``--keep-alive-interval`` seconds until Ctrl-C, so the
    page's split timing, queue depth and scaling decisions keep moving."""
    print(f"keeping the cluster up and finalizing a step every {args.keep_alive_interval:g} s; Ctrl-C to stop", file=out, flush=True)
    s = args.steps
    try:
        while True:
            run_steps(client, store, finalizer, args, [s], out)
            s += 1
            time.sleep(args.keep_alive_interval)
    except KeyboardInterrupt:
        pass


def resume_phase(client: Any, store: Any, args: argparse.Namespace, out) -> dict[str, Any]:
    """Cut -> checkpoint -> kill/recreate -> restore -> resume -> finish -> finalize.

    One step of ``args.groups`` x ``args.rollouts`` rollouts (ids ``rs-p*``) on
    :class:`~pipeline.driver.RolloutDriver`; compared with
    :func:`tasks.toy.rollouts.generate_rollouts` (same seeds, never interrupted).
    """
    import tempfile

    from tasks.toy.rollouts import generate_rollouts, make_step_specs

    from .capture import policy_from_config
    from .finalize.controller import Finalizer
    from .driver import RolloutDriver, cut_round
    from .store.client import StagingStore
    from .testing.oracle import reference_mismatches

    groups = make_step_specs(
        "rs-", args.groups, args.rollouts, turns=args.turns, tokens_per_turn=args.tokens_per_turn,
        tool_tokens=config.get("demo.tool-tokens"), prompt_tokens=config.get("demo.prompt-tokens"),
        vocab_size=config.get("policy.vocab-size"), seed=config.get("policy.seed"),
    )
    specs = [s for g in groups for s in g]
    driver = RolloutDriver(client, store)
    driver.submit(groups)
    rounds = cut_round(args.turns, args.tokens_per_turn, driver.step_tokens)
    driver.run_rounds(rounds)
    cut = driver.cut("demo-ckpt")
    print(
        f"resume: {len(specs)} rollouts on {len(driver.actors)} generation actors; cut after round {rounds}: "
        f"{cut.calls} in-flight calls, {cut.rows} rows in {cut.puts} puts, {cut.durable} durable / "
        f"{sum(cut.failed.values())} failed{_reasons(cut.failed)}, {cut.wall_ms:.1f} ms",
        file=out, flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="token-capture-demo-") as tmp:
        manifest = driver.checkpoint_store(tmp)
        snapshot = driver.snapshot
        driver.run_rounds(1)  # work after the checkpoint: lost in the crash, redone identically
        killed = driver.kill()
        fresh = StagingStore.start(client)
        loaded = fresh.restore(tmp, client=client)
    print(
        f"checkpoint: {manifest['rows']} rows ({manifest['bytes']} bytes); crash: {len(killed)} generation actors killed; "
        f"a fresh store restored {loaded['rows']} rows from the checkpoint",
        file=out, flush=True,
    )
    try:
        resumed, rec = RolloutDriver.recover(client, fresh, snapshot)
        regenerated = sum(rec.regenerated.values())
        print(
            f"restore: {rec.resumed} calls resumed from their prefixes ({rec.resumed_tokens} tokens kept), "
            f"{regenerated} regenerated{_reasons(rec.regenerated)}; {rec.restore_requests} prefix reads in "
            f"{rec.gets} gets, {rec.keys_per_get:.1f} keys/get; {rec.wall_ms:.0f} ms",
            file=out, flush=True,
        )
        receipts = resumed.finish()
        step = Finalizer(client, fresh).submit_step(receipts, step_id="resumed").result()
        resumed.kill()
        bad = reference_mismatches(step.groups, generate_rollouts(policy_from_config(), specs))
        matched = len(specs) - len(bad)
        print(
            f"finalize: {step.metrics['accepted']}/{step.metrics['rollouts']} accepted; "
            f"{matched}/{len(specs)} rollouts matched the uninterrupted run",
            file=out, flush=True,
        )
        for rid, fields in list(bad.items())[:5]:
            print(f"  mismatch {rid}: {', '.join(fields)}", file=out, flush=True)
    finally:
        fresh.close()
    return {
        "rollouts": len(specs), "matched": matched, "cut_calls": cut.calls, "cut_rows": cut.rows,
        "cut_puts": cut.puts, "cut_durable": cut.durable, "cut_failed": dict(cut.failed),
        "resumed": rec.resumed, "regenerated": dict(rec.regenerated), "restore_gets": rec.gets,
        "restore_keys_per_get": rec.keys_per_get, "accepted": step.metrics["accepted"],
    }


def _reasons(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in counts.items())})" if counts else ""


def _print_step(step: Any, out) -> dict[str, Any]:
    m = step.metrics
    rejected = ", ".join(f"{k}={v}" for k, v in m["rejected"].items()) or "none"
    print(
        f"{step.step_id}: {m['accepted']}/{m['rollouts']} rollouts accepted (rejected: {rejected}); "
        f"fetch {m['fetch_ms']:.1f} ms vs verify {m['verify_ms']:.1f} ms (assemble {m['assemble_ms']:.1f} ms, "
        f"{m['fetch_calls']} fetch calls); {m['tokens']} tokens, {m['tokens_per_s']:.0f} tokens/s",
        file=out,
        flush=True,
    )
    return {k: m[k] for k in ("step_id", "rollouts", "accepted", "rejected", "fetch_ms", "verify_ms", "assemble_ms", "tokens", "tokens_per_s", "fetch_calls", "calls_per_rollout")}


def _store_summary(stats: list[dict]) -> dict[str, Any]:
    return {
        "rows_staged": sum(s.get("partitions", {}).get(STAGING_PARTITION, 0) for s in stats),
        "bytes_staged": sum(s["used_bytes"] for s in stats),
        "spilled_bytes": sum(s["spilled_bytes"] for s in stats),
        "units": len(stats),
    }


def _print_summary(summary: dict[str, Any], out) -> None:
    steps = summary["steps"]
    rollouts = sum(s["rollouts"] for s in steps)
    accepted = sum(s["accepted"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    calls = sum(s["calls_per_rollout"] * s["rollouts"] for s in steps)
    summary.update(rollouts=rollouts, accepted=accepted, tokens=tokens, calls=int(round(calls)))
    print(
        f"summary: {rollouts} rollouts ({accepted} accepted), {int(round(calls))} calls, {tokens} tokens; "
        f"store: {summary['rows_staged']} rows, {summary['bytes_staged']} bytes staged in {summary['units']} units, "
        f"{summary['spilled_bytes']} bytes spilled; wall {summary['wall_s']:.1f} s",
        file=out,
        flush=True,
    )
    print(f"dashboard: {summary['dashboard']}", file=out, flush=True)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
