"""Run the token-capture loop end to end and print what happened.

Generates GRPO groups of multi-turn rollouts with the toy MoE policy on Dask workers,
stages every call's delta (with its digest) in the staging store, and finalizes each
training step through the finalization graph (one union fetch, verify tasks on
``finalize`` slots, assemble), several steps in flight. Prints per-step accepted /
rejected rollouts by reason, fetch_ms vs verify_ms and tokens/s (training tokens of the
step's accepted rows over the seconds from submitting its graph to its last group
assembled), a store summary and the dashboard address. Uses an embedded LocalCluster on
127.0.0.1 (--dashboard-address, --n-workers) unless --scheduler is given (--connect-timeout).
Step ids are <run-id>-step-<n>, with a short random run id printed first.

Then (unless --no-resume) the checkpoint/resume phase: one more step of rollouts runs on
GenerationWorker actors, is cut mid-generation, the store is checkpointed, the actors
are killed and recreated, the store is restored from its checkpoint into a fresh one,
every in-flight call resumes from its prefix (PrefixReadBatcher), the rollouts finish and
are finalized; prints cut and restore statistics and how many finalized rollouts are
bit-identical to an uninterrupted run of the same seeds.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import secrets
import signal
import sys
import threading
import time
from typing import Any, Iterable

from tasks.keys import STAGING_PARTITION

from . import config
from .capture import submit_generation
from .cli_args import host_port, non_negative_float, positive_float, positive_int, scheduler_address
from .cluster import adapt, connect, dashboard_url
from .store.report import report_store
from .progress import Progress


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="ADDR", type=scheduler_address, help="attach to an existing scheduler (e.g. tcp://127.0.0.1:8786) instead of an embedded LocalCluster")
    p.add_argument("--connect-timeout", metavar="SECONDS", type=positive_float, default=None,
                   help=f"with --scheduler: how long to wait for it (and for a worker) to answer (default {config.get('cluster.connect-timeout-s'):g}, config cluster.connect-timeout-s)")
    p.add_argument("--dashboard-address", metavar="HOST:PORT", type=host_port, default=None,
                   help=f"embedded cluster: where the dashboard listens (default {config.get('cluster.dashboard-address')}; port 0 picks a free one)")
    p.add_argument("--n-workers", type=positive_int, default=None,
                   help=f"embedded cluster: workers at start, and the adaptive minimum (default {config.get('cluster.n-workers')})")
    p.add_argument("--steps", type=positive_int, default=config.get("demo.steps"), help="training steps to finalize (default %(default)s)")
    p.add_argument("--groups", type=positive_int, default=config.get("demo.groups"), help="GRPO groups per step (default %(default)s)")
    p.add_argument("--rollouts", type=positive_int, default=config.get("demo.rollouts-per-group"), help="rollouts per group (default %(default)s)")
    p.add_argument("--turns", type=positive_int, default=config.get("demo.turns"), help="model calls per rollout (default %(default)s)")
    p.add_argument("--tokens-per-turn", type=positive_int, default=config.get("demo.tokens-per-turn"), help="generated tokens per call (default %(default)s)")
    p.add_argument("--in-flight", type=positive_int, default=config.get("demo.steps-in-flight"), help="finalization steps kept in flight (default %(default)s)")
    p.add_argument("--no-resume", action="store_true", help="skip the cut -> checkpoint -> kill -> restore -> resume -> finalize phase")
    p.add_argument("--keep-alive", action="store_true", help="after the run, keep the cluster and dashboard up and keep finalizing steps (Ctrl-C to stop)")
    p.add_argument("--keep-alive-interval", metavar="SECONDS", type=non_negative_float, default=2.0, help="seconds between steps with --keep-alive (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot see one flag at a time (``p.error``: exit 2)."""
    if args.scheduler:
        embedded_only = [f for f, v in (("--dashboard-address", args.dashboard_address), ("--n-workers", args.n_workers)) if v is not None]
        if embedded_only:
            what = " and ".join(embedded_only)
            p.error(f"{what} {'configure' if len(embedded_only) > 1 else 'configures'} the embedded cluster; drop {'them' if len(embedded_only) > 1 else 'it'} when attaching with --scheduler")
    elif args.connect_timeout is not None:
        p.error("--connect-timeout applies to --scheduler only; pass --scheduler ADDR too, or drop it")


# ---- Ctrl-C --------------------------------------------------------------------------------
# The first Ctrl-C only sets this flag; the demo checks it between waits (every 0.5 s at
# most) and stops from ordinary code: futures cancelled, store closed, cluster closed, one
# "interrupted" line (pipeline.cli_args.run_command). A KeyboardInterrupt raised inside a
# blocking Dask call instead leaves asyncio/tornado tracebacks behind. A second Ctrl-C
# interrupts at once.
_STOP = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt
    _STOP.set()


@contextlib.contextmanager
def _ctrl_c() -> Any:
    _STOP.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _check_interrupt() -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt


def _as_finished(futures: list) -> Iterable[Any]:
    """``futures`` as each finishes (any order), checking for Ctrl-C twice a second."""
    from distributed import wait

    pending = set(futures)
    while pending:
        _check_interrupt()
        try:
            done, pending = wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
        except TimeoutError:
            continue
        yield from done


def _silence_teardown(client: Any, embedded: bool) -> None:
    """After Ctrl-C: the cut-short tasks' complaints while the cluster closes (cancelled
    executions, actor calls into closing pools, busy workers killed) are expected, not
    news. Silenced here, and on the workers when the cluster is ours."""
    def quiet() -> None:
        logging.disable(logging.CRITICAL)

    quiet()
    if embedded:
        with contextlib.suppress(Exception):
            client.run(quiet, wait=True)


def new_run_id() -> str:
    """A short random id that prefixes this run's step ids (two runs on one cluster differ)."""
    return secrets.token_hex(3)


def run(args: argparse.Namespace, out=sys.stdout) -> dict[str, Any]:
    """The demo proper; returns its summary (the CLI prints it).

    ``summary["rollouts"]``, ``accepted``, ``tokens`` and ``calls`` count every finalized
    rollout: the steps' and the resume phase's.
    """
    if not getattr(args, "run_id", None):
        args.run_id = new_run_id()
    summary: dict[str, Any] = {"run_id": args.run_id, "steps": []}
    cluster_kwargs: dict[str, Any] = {}
    if getattr(args, "dashboard_address", None) is not None:
        cluster_kwargs["dashboard_address"] = args.dashboard_address
    if getattr(args, "n_workers", None) is not None:
        cluster_kwargs["n_workers"] = args.n_workers
    print(f"run: {args.run_id} (step ids {args.run_id}-step-N)", file=out, flush=True)
    with _ctrl_c(), connect(args.scheduler, connect_timeout=getattr(args, "connect_timeout", None), **cluster_kwargs) as (client, cluster):
        _run_on(client, cluster, args, summary, out)
    return summary


def _run_on(client: Any, cluster: Any, args: argparse.Namespace, summary: dict[str, Any], out) -> None:
    from .finalize.controller import Finalizer
    from .store.client import StagingStore

    if cluster is not None:
        # embedded: split-timing adaptive scaling (decisions shown on the page)
        n = getattr(args, "n_workers", None)
        if n is None:
            adapt(cluster)
        else:
            adapt(cluster, minimum=n, maximum=max(n, config.get("cluster.adaptive-maximum")))
    url = dashboard_url(client, config.get("dashboard.page"))
    print(f"dashboard: {url}", file=out, flush=True)
    store = StagingStore.start(client)
    try:
        finalizer = Finalizer(client, store)  # checks that some worker has `finalize` slots
        t0 = time.perf_counter()
        total = args.steps * args.groups
        with Progress("demo", total=total, unit="groups", quiet=args.quiet) as progress:
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
    except KeyboardInterrupt:
        _silence_teardown(client, embedded=cluster is not None)  # before the store and cluster close
        raise
    finally:
        store.close()


def _generate(client: Any, store: Any, groups: list, label: str, progress: Progress | None) -> list[Any]:
    """One generation task per group; receipts in group order, advancing ``progress`` as
    each group's receipts arrive."""
    futures = submit_generation(client, store, groups)
    index = {f.key: i for i, f in enumerate(futures)}
    receipts: list[Any] = [None] * len(futures)
    try:
        for fut in _as_finished(futures):
            i = index[fut.key]
            receipts[i] = fut.result()
            if progress is not None:
                progress.advance(1, f"{label}: {groups[i][0].group_id} staged")
    except BaseException:
        client.cancel(futures)
        raise
    return receipts


def _watch_finish(handle: Any) -> dict[str, float]:
    """Record (``timing.wall_s``) when the step's last group is assembled."""
    from .finalize import timing

    done = {"n": 0, "last_s": 0.0}
    futures = handle.futures
    lock = threading.Lock()

    def one(_fut: Any) -> None:
        with lock:
            done["n"] += 1
            done["last_s"] = max(done["last_s"], timing.wall_s())

    for f in futures:
        f.add_done_callback(one)
    return done


def run_steps(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, steps: Iterable[int], out, progress: Progress | None = None) -> list[dict[str, Any]]:
    """Generate, stage and finalize ``steps``, keeping ``args.in_flight`` steps in flight.

    Step ids are ``<run-id>-step-<n>``.
    """
    from tasks.toy.rollouts import make_step_specs

    from .finalize import timing

    run_id = getattr(args, "run_id", None) or new_run_id()
    steps = list(steps)
    pending: list[tuple[Any, float, dict[str, float]]] = []
    done: list[dict[str, Any]] = []
    for i, s in enumerate(steps):
        step_id = f"{run_id}-step-{s}"
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
        receipts = _generate(client, store, groups, step_id, progress)
        submitted_s = timing.wall_s()
        handle = finalizer.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)}, step_id=step_id)
        pending.append((handle, submitted_s, _watch_finish(handle)))
        while len(pending) >= args.in_flight or (pending and i == len(steps) - 1):
            handle, submitted_s, finished = pending.pop(0)
            try:
                for _ in _as_finished(handle.futures):
                    pass
            except KeyboardInterrupt:
                for h, _s, _f in [(handle, submitted_s, finished), *pending]:
                    h.cancel()
                raise
            step = handle.result()
            finalize_s = max(0.0, finished["last_s"] - submitted_s) if finished["n"] else step.metrics["wall_ms"] / 1e3
            done.append(_print_step(step, out, finalize_s))
            report_store(store)
            if progress is not None:
                progress.advance(0, f"{step.step_id} finalized")
    return done


def keep_alive(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, out) -> None:
    """Keep finalizing a step every ``--keep-alive-interval`` seconds until Ctrl-C, so the
    page's split timing, queue depth and scaling decisions keep moving."""
    print(f"keeping the cluster up and finalizing a step every {args.keep_alive_interval:g} s; Ctrl-C to stop", file=out, flush=True)
    s = args.steps
    try:
        while not _STOP.is_set():
            run_steps(client, store, finalizer, args, [s], out)
            s += 1
            _STOP.wait(args.keep_alive_interval)
    except KeyboardInterrupt:
        pass
    print("stopped", file=out, flush=True)


def resume_phase(client: Any, store: Any, args: argparse.Namespace, out) -> dict[str, Any]:
    """Cut -> checkpoint -> kill/recreate -> restore -> resume -> finish -> finalize.

    One step of ``args.groups`` x ``args.rollouts`` rollouts (ids ``rs-p*``, step id
    ``<run-id>-resume``) on :class:`~pipeline.driver.RolloutDriver`; compared with
    :func:`tasks.toy.rollouts.generate_rollouts` (same seeds, never interrupted). Progress
    (stderr, unless ``args.quiet``) names each phase and round.
    """
    import tempfile

    from tasks.toy.rollouts import generate_rollouts, make_step_specs

    from .capture import policy_from_config
    from .finalize.controller import Finalizer
    from .driver import RolloutDriver, cut_round
    from .store.client import StagingStore
    from .testing.oracle import reference_mismatches

    run_id = getattr(args, "run_id", None) or new_run_id()
    groups = make_step_specs(
        "rs-", args.groups, args.rollouts, turns=args.turns, tokens_per_turn=args.tokens_per_turn,
        tool_tokens=config.get("demo.tool-tokens"), prompt_tokens=config.get("demo.prompt-tokens"),
        vocab_size=config.get("policy.vocab-size"), seed=config.get("policy.seed"),
    )
    specs = [s for g in groups for s in g]
    # Phases: rounds before the cut, cut, checkpoint, crash + restore, resume, finish, finalize, compare.
    progress = Progress("resume", total=8, unit="phases", quiet=getattr(args, "quiet", True))
    with progress:
        driver = RolloutDriver(client, store)
        driver.submit(groups)
        rounds = cut_round(args.turns, args.tokens_per_turn, driver.step_tokens)
        for r in range(rounds):
            progress.advance(0, f"generating: round {r + 1}/{rounds} before the cut")
            _check_interrupt()
            driver.run_rounds(1)
        progress.advance(1, "cutting in-flight calls", force=True)
        cut = driver.cut("demo-ckpt")
        print(
            f"resume: {len(specs)} rollouts on {len(driver.actors)} generation actors; cut after round {rounds}: "
            f"{cut.calls} in-flight calls, {cut.rows} rows in {cut.puts} puts, {cut.durable} durable / "
            f"{sum(cut.failed.values())} failed{_reasons(cut.failed)}, {cut.wall_ms:.1f} ms",
            file=out, flush=True,
        )
        progress.advance(1, "checkpointing the store", force=True)
        with tempfile.TemporaryDirectory(prefix="token-capture-demo-") as tmp:
            manifest = driver.checkpoint_store(tmp)
            snapshot = driver.snapshot
            progress.advance(1, "crash: killing the generation actors, restoring the store", force=True)
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
            progress.advance(1, "resuming calls from their prefixes", force=True)
            resumed, rec = RolloutDriver.recover(client, fresh, snapshot)
            regenerated = sum(rec.regenerated.values())
            print(
                f"restore: {rec.resumed} calls resumed from their prefixes ({rec.resumed_tokens} tokens kept), "
                f"{regenerated} regenerated{_reasons(rec.regenerated)}; {rec.restore_requests} prefix reads in "
                f"{rec.gets} gets, {rec.keys_per_get:.1f} keys/get; {rec.wall_ms:.0f} ms",
                file=out, flush=True,
            )
            progress.advance(1, "finishing the rollouts", force=True)
            after, bound = 0, args.turns * -(-args.tokens_per_turn // resumed.step_tokens) + 1
            while resumed.active and after < bound and not _check_interrupt() and resumed.run_rounds(1):
                after += 1
                progress.advance(0, f"finishing: round {after} after the restore, {resumed.active} rollouts running")
            receipts = resumed.finish()
            progress.advance(1, "finalizing", force=True)
            step = Finalizer(client, fresh).submit_step(receipts, step_id=f"{run_id}-resume").result()
            resumed.kill()
            progress.advance(1, "comparing with an uninterrupted run", force=True)
            bad = reference_mismatches(step.groups, generate_rollouts(policy_from_config(), specs))
            progress.advance(1, "done", force=True)
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
    m = step.metrics
    return {
        "step_id": step.step_id, "rollouts": m["rollouts"], "matched": matched, "cut_calls": cut.calls, "cut_rows": cut.rows,
        "cut_puts": cut.puts, "cut_durable": cut.durable, "cut_failed": dict(cut.failed),
        "resumed": rec.resumed, "regenerated": dict(rec.regenerated), "restore_gets": rec.gets,
        "restore_keys_per_get": rec.keys_per_get, "accepted": m["accepted"], "tokens": m["tokens"],
        "calls": int(round(m["calls_per_rollout"] * m["rollouts"])),
    }


def _reasons(counts: dict[str, int]) -> str:
    return f" ({', '.join(f'{k}={v}' for k, v in counts.items())})" if counts else ""


def _print_step(step: Any, out, finalize_s: float | None = None) -> dict[str, Any]:
    """One line per finalized step. Throughput: the training tokens of the step's accepted
    rows (``metrics["tokens"]``) over ``finalize_s``, the seconds from submitting the step's
    graph to its last group assembled (the demo's generation of the next step overlaps it)."""
    m = step.metrics
    finalize_s = m["wall_ms"] / 1e3 if finalize_s is None else finalize_s
    rate = m["tokens"] / finalize_s if finalize_s > 0 else 0.0
    rejected = ", ".join(f"{k}={v}" for k, v in m["rejected"].items()) or "none"
    print(
        f"{step.step_id}: {m['accepted']}/{m['rollouts']} rollouts accepted (rejected: {rejected}); "
        f"fetch {m['fetch_ms']:.1f} ms vs verify {m['verify_ms']:.1f} ms (assemble {m['assemble_ms']:.1f} ms, "
        f"{m['fetch_calls']} fetch calls); {m['tokens']} training tokens in accepted rows / "
        f"{finalize_s:.2f} s from submit to last group assembled = {rate:.0f} tokens/s",
        file=out,
        flush=True,
    )
    row = {k: m[k] for k in ("step_id", "rollouts", "accepted", "rejected", "fetch_ms", "verify_ms", "assemble_ms", "tokens", "tokens_per_s", "fetch_calls", "calls_per_rollout")}
    row.update(finalize_s=finalize_s, finalize_tokens_per_s=rate)
    return row


def _store_summary(stats: list[dict]) -> dict[str, Any]:
    return {
        "rows_staged": sum(s.get("partitions", {}).get(STAGING_PARTITION, 0) for s in stats),
        "bytes_staged": sum(s["used_bytes"] for s in stats),
        "spilled_bytes": sum(s["spilled_bytes"] for s in stats),
        "units": len(stats),
    }


def _print_summary(summary: dict[str, Any], out) -> None:
    """Totals over every finalized rollout: the steps' and the resume phase's."""
    steps = summary["steps"]
    resume = summary.get("resume")
    step_rollouts = sum(s["rollouts"] for s in steps)
    rollouts = step_rollouts + (resume["rollouts"] if resume else 0)
    accepted = sum(s["accepted"] for s in steps) + (resume["accepted"] if resume else 0)
    tokens = sum(s["tokens"] for s in steps) + (resume["tokens"] if resume else 0)
    calls = int(round(sum(s["calls_per_rollout"] * s["rollouts"] for s in steps))) + (resume["calls"] if resume else 0)
    wall_s = summary["wall_s"]
    summary.update(rollouts=rollouts, accepted=accepted, tokens=tokens, calls=calls, tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0)
    parts = f"{step_rollouts} in {len(steps)} steps" + (f" + {resume['rollouts']} in the resume step" if resume else "")
    print(
        f"summary: {rollouts} rollouts finalized ({parts}), {accepted} accepted, {calls} calls; "
        f"{tokens} training tokens in accepted rows / {wall_s:.1f} s run wall time (generation + finalization"
        f"{' + resume' if resume else ''}) = {summary['tokens_per_s']:.0f} tokens/s; "
        f"store: {summary['rows_staged']} rows, {summary['bytes_staged']} bytes staged in {summary['units']} units, "
        f"{summary['spilled_bytes']} bytes spilled",
        file=out,
        flush=True,
    )
    print(f"dashboard: {summary['dashboard']}", file=out, flush=True)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
