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
Also a group tampered with on purpose, rejected by reason (--no-tamper), and a scale
phase printing the adaptive policy's decisions (--no-scale-demo); see the README.
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

import dask

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
    p.add_argument("--tamper", action=argparse.BooleanOptionalAction, default=config.get("demo.tamper"),
                   help="also finalize a group of rollouts tampered on purpose, each rejected with its reason (default %(default)s, config demo.tamper)")
    p.add_argument("--scale-demo", action=argparse.BooleanOptionalAction, default=config.get("demo.scale-phase"),
                   help="embedded cluster: a verify-heavy burst of min(--steps, --scale-steps) steps, then idle, printing the adaptive "
                        "policy's scale-up/down decisions; skipped with --scheduler or below 2 steps (default %(default)s, config demo.scale-phase)")
    p.add_argument("--scale-steps", type=positive_int, default=config.get("demo.scale-steps"), help="steps in the scale phase's burst (default %(default)s)")
    p.add_argument("--scale-tokens", metavar="N", type=positive_int, default=config.get("demo.scale-tokens-per-call"),
                   help="tokens per call of the scale phase's long rollouts (default %(default)s)")
    p.add_argument("--scale-calls", metavar="N", type=positive_int, default=config.get("demo.scale-calls"),
                   help="model calls per rollout in the scale phase: long agentic chains, whose per-call checks make verification the heavy side (default %(default)s)")
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

    adaptive = None
    if cluster is not None:
        # embedded: split-timing adaptive scaling (decisions shown on the page)
        n = getattr(args, "n_workers", None)
        # The demo's bursts last seconds: decide often enough to see them (demo.adaptive-interval-s).
        interval = f"{float(config.get('demo.adaptive-interval-s'))}s"
        if n is None:
            adaptive = adapt(cluster, interval=interval)
        else:
            adaptive = adapt(cluster, minimum=n, maximum=max(n, config.get("cluster.adaptive-maximum")), interval=interval)
    url = dashboard_url(client, config.get("dashboard.page"))
    print(f"dashboard: {url}", file=out, flush=True)
    store = StagingStore.start(client)
    try:
        finalizer = Finalizer(client, store)  # checks that some worker has `finalize` slots
        t0 = time.perf_counter()
        total = args.steps * args.groups
        tamper = getattr(args, "tamper", False)
        with Progress("demo", total=total + (1 if tamper else 0), unit="groups", quiet=args.quiet) as progress:
            summary["steps"] += run_steps(client, store, finalizer, args, range(args.steps), out, progress)
            if tamper:
                summary["tampered"] = tamper_step(client, store, finalizer, args, out, progress)
        if not getattr(args, "no_resume", False):
            summary["resume"] = resume_phase(client, store, args, out)
        if getattr(args, "scale_demo", False):
            scale = scale_phase(client, store, finalizer, adaptive, args, out)
            if scale is not None:
                summary["scale"] = scale
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


# ---- the tampered group -------------------------------------------------------------------

TAMPER_GROUP = "tampered"


def generate_tampered_and_stage(store: Any, specs: list, other_group: str) -> list[Any]:
    """Task body: generate ``specs`` (ids ``tampered-<reason>-<i>``) with the toy policy,
    tamper with each as its id says (:mod:`tasks.toy.tamper`), stage what the tamperer
    left and return the tampered receipts."""
    from types import SimpleNamespace

    from tasks.toy.rollouts import generate_rollouts
    from tasks.toy.tamper import tamper, tamper_kind

    from .capture import policy_from_config, stage_rollouts

    done = []
    for ro in generate_rollouts(policy_from_config(), specs):
        t = tamper(tamper_kind(ro.spec.rollout_id), ro.rows, ro.receipt, other_group=other_group)
        done.append(SimpleNamespace(rows=t.rows, receipt=t.receipt))
    return stage_rollouts(store, done)


def tamper_specs(args: argparse.Namespace) -> list[Any]:
    """One rollout per tamper kind, group ``tampered``, shaped like the demo's others."""
    from tasks.toy.environment import synthetic_prompt
    from tasks.toy.rollouts import RolloutSpec
    from tasks.toy.tamper import TAMPER_KINDS, tampered_rollout_id

    prompt = synthetic_prompt(config.get("policy.seed"), TAMPER_GROUP, config.get("demo.prompt-tokens"), config.get("policy.vocab-size"))
    return [
        RolloutSpec(tampered_rollout_id(kind), TAMPER_GROUP, prompt, args.turns, args.tokens_per_turn, config.get("demo.tool-tokens"))
        for kind in TAMPER_KINDS
    ]


def tamper_step(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, out, progress: Progress | None = None) -> dict[str, Any]:
    """Finalize step ``<run-id>-tampered``: one group of rollouts tampered with on purpose,
    one per kind of :data:`tasks.toy.tamper.TAMPER_KINDS`. Prints the step and, per
    rollout, its verdict against the reason its tampering must produce."""
    from tasks.toy.tamper import TAMPER_KINDS, tamper_kind

    run_id = getattr(args, "run_id", None) or new_run_id()
    step_id = f"{run_id}-tampered"
    specs = tamper_specs(args)
    fut = client.submit(generate_tampered_and_stage, store, specs, "s0p0", pure=False)
    try:
        receipts = next(iter(_as_finished([fut]))).result()
    except BaseException:
        client.cancel([fut])
        raise
    if progress is not None:
        progress.advance(1, f"{step_id}: {TAMPER_GROUP} staged")
    handle = finalizer.submit_step({TAMPER_GROUP: receipts}, step_id=step_id)
    submitted_s = _timing_wall_s()
    finished = _watch_finish(handle)
    try:
        for _ in _as_finished(handle.futures):
            pass
    except KeyboardInterrupt:
        handle.cancel()
        raise
    step = handle.result()
    finalize_s = max(0.0, finished["last_s"] - submitted_s) if finished["n"] else step.metrics["wall_ms"] / 1e3
    g = step.groups[TAMPER_GROUP]
    verdicts = {rid: (st, det) for rid, st, det in zip(g.rollout_ids, g.status, g.details or [""] * len(g.status))}
    expected = {rid: tamper_kind(rid) for rid in verdicts}
    as_expected = [rid for rid, (st, _d) in verdicts.items() if st == expected[rid]]
    note = f"demo: {len(verdicts)} rollouts tampered on purpose; {len(as_expected)}/{len(verdicts)} rejected with the expected reason"
    row = _print_step(step, out, finalize_s, note=note)
    for rid, (st, det) in verdicts.items():
        want = expected[rid]
        verdict = f"rejected {st}" if st != "ok" else "ACCEPTED"
        check = "as expected" if st == want else f"EXPECTED {want}: the verifier did not catch it as it should"
        print(f"  {rid}: {verdict} ({check}) <- {TAMPER_KINDS.get(want, '?')}{': ' + det if det and st == want else ''}", file=out, flush=True)
    row.update(
        verdicts={rid: st for rid, (st, _d) in verdicts.items()},
        as_expected=len(as_expected),
    )
    return row


def _timing_wall_s() -> float:
    from .finalize import timing

    return timing.wall_s()


# ---- the scale phase --------------------------------------------------------------------------


def stage_synthetic(store: Any, group_id: str, rollout_ids: list[str], calls: int, tokens_per_call: int,
                    prompt_tokens: int, tool_tokens: int, vocab_size: int, seed: int) -> list[Any]:
    """Task body of the scale phase: long rollouts of a dense model (no routed experts),
    their tokens and logprobs drawn at random (seeded per rollout), captured call by call
    through the :class:`~tasks.gate.CaptureGate` and staged in one put. Cheap to make, so
    the finalizer's verification, not generation, is what the burst loads."""
    import zlib
    from types import SimpleNamespace

    import numpy as np

    from tasks.gate import CaptureGate
    from tasks.toy.rollouts import call_id, parent_call_id, toy_reward

    from .capture import stage_rollouts

    made = []
    for rid in rollout_ids:
        rng = np.random.default_rng([seed, zlib.crc32(rid.encode())])
        gate = CaptureGate(rid, vocab_size=vocab_size, num_experts=None, group_id=group_id)
        rows, generated = [], []
        for c in range(calls):
            n_ctx = prompt_tokens if c == 0 else tool_tokens
            ids = rng.integers(0, vocab_size, size=n_ctx + tokens_per_call, dtype=np.int64)
            mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(tokens_per_call, np.float32)])
            lps = np.zeros(n_ctx + tokens_per_call, np.float32)
            lps[n_ctx:] = -rng.exponential(1.0, size=tokens_per_call).astype(np.float32)
            rows.append(gate.stage_call(call_id(c), parent_call_id(c), ids, mask, lps))
            generated.append(ids[n_ctx:])
        made.append(SimpleNamespace(rows=rows, receipt=gate.receipt(toy_reward(np.concatenate(generated)))))
    return stage_rollouts(store, made)


def scaling_since(decisions: Iterable[dict[str, Any]], since: float) -> list[dict[str, Any]]:
    """The scheduler's recorded scaling decisions (``token_capture_state()["decisions"]``)
    made at or after ``since`` (scheduler wall-clock seconds), oldest first."""
    return [d for d in decisions if float(d.get("t", 0.0)) >= since]


def describe_decision(d: dict[str, Any]) -> str:
    """``up 2 -> 3 (verify-bound: ...)``: one decision for people."""
    return f"{d['action']} {int(d['current'])} -> {int(d['target'])} ({d.get('reason') or d.get('reason_code', '?')})"


def _decisions(client: Any, since: float) -> list[dict[str, Any]]:
    try:
        state = client.sync(client.scheduler.token_capture_state)
    except Exception:  # no aggregator answered: nothing recorded
        return []
    return scaling_since(state.get("decisions", []) if isinstance(state, dict) else [], since)


def _last_event_age_s(client: Any) -> float:
    try:
        sig = client.sync(client.scheduler.token_capture_signal, window_s=None)
        return float(sig["last_event_age_s"])
    except Exception:
        return float("inf")


def _wait_for_decision(client: Any, since: float, action: str, bound_s: float, progress: Progress, note: str) -> list[dict[str, Any]]:
    """Poll the scheduler's decisions until one ``action`` since ``since`` or ``bound_s`` passed."""
    deadline = time.monotonic() + bound_s
    while True:
        ds = _decisions(client, since)
        if any(d["action"] == action for d in ds) or time.monotonic() >= deadline:
            return ds
        progress.advance(0, note)
        _check_interrupt()
        _STOP.wait(0.25)


def scale_phase(client: Any, store: Any, finalizer: Any, adaptive: Any, args: argparse.Namespace, out) -> dict[str, Any] | None:
    """A verify-heavy burst, then idle: the adaptive policy should scale up, then down.

    ``min(args.steps, args.scale_steps)`` steps (ids ``<run-id>-scale-<k>``) of
    ``args.groups`` x ``args.rollouts`` long synthetic dense rollouts (``args.scale_calls``
    calls of ``args.scale_tokens`` tokens): all generated first, then all submitted back
    to back, so the queue rises while verification dominates the finalize split. Then
    the phase waits (bounded) for an ``up`` decision, and idles (bounded: ``scaling.idle-s``
    plus a few adaptive intervals) for a ``down``. Decisions are read from the scheduler's
    aggregator and printed; none within its bound is said plainly, not an error.
    Skipped (one line, returns None) when attached with --scheduler or below 2 steps.
    """
    n_steps = args.scale_steps if args.steps > 1 else 0
    if adaptive is None:
        print("scaling: phase skipped: attached with --scheduler, this demo does not scale that cluster", file=out, flush=True)
        return None
    if n_steps < 2:
        why = "--steps 1 runs only the quick story" if args.steps <= 1 else f"{n_steps} step cannot make the queue rise"
        print(f"scaling: phase skipped ({why}; the verify-heavy burst needs --steps 2 or more and --scale-steps 2 or more)", file=out, flush=True)
        return None
    run_id = getattr(args, "run_id", None) or new_run_id()
    interval_s = float(getattr(adaptive, "interval", 1.0) or 1.0)
    wait_count = int(getattr(adaptive, "wait_count", 3) or 3)
    idle_s = float(config.get("scaling.idle-s"))
    window_s = float(config.get("scaling.window-s"))
    with Progress("scale", quiet=getattr(args, "quiet", True)) as progress:
        # The policy reads the finalize split of the last window-s seconds: let the earlier
        # (fetch-bound, short-rollout) steps leave it first, so it sees the burst alone.
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline and _last_event_age_s(client) < window_s:
            progress.advance(0, f"letting the {window_s:g} s scaling window clear of the earlier steps")
            _check_interrupt()
            _STOP.wait(0.25)
    since = time.time()
    bursts = int(config.get("demo.scale-bursts"))
    # On a small machine the toy store's fetch and verify cost about the same per byte, so the
    # split hovers around the deployment threshold; the demo lowers it for its own cluster,
    # and says so, so the mechanism shows on every run.
    share = float(config.get("demo.scale-verify-share"))
    print(f"scaling: verify counts as dominant above {share:.0%} of finalize time during this phase (demo setting; "
          f"deployment default {float(config.get('scaling.verify-dominant-share')):.0%})", file=out, flush=True)
    with dask.config.set({"token-capture.scaling.verify-dominant-share": share}):
        return _run_scale_bursts(client, store, finalizer, args, out, run_id, n_steps, since, bursts, interval_s, wait_count, idle_s)


def _run_scale_bursts(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, out, run_id: str, n_steps: int,
                      since: float, bursts: int, interval_s: float, wait_count: int, idle_s: float) -> dict[str, Any]:
    """The scale phase's bursts and idle wait (see :func:`scale_phase`)."""
    consts = dict(prompt_tokens=config.get("demo.prompt-tokens"), tool_tokens=config.get("demo.tool-tokens"),
                  vocab_size=config.get("policy.vocab-size"), seed=config.get("policy.seed"))
    rows: list[dict[str, Any]] = []
    up: list[dict[str, Any]] = []
    down: list[dict[str, Any]] = []
    ds: list[dict[str, Any]] = []
    up_bound_s = idle_s + 2 * interval_s  # an up needs a fresh signal: until the pool has idled idle-s
    down_bound_s = idle_s + (wait_count + 2) * interval_s
    with Progress("scale", total=bursts * n_steps * args.groups, unit="groups", quiet=getattr(args, "quiet", True)) as progress:
        for b in range(bursts):
            rows += _burst(client, store, finalizer, args, out, progress, run_id, b, n_steps, consts)
            ds = _wait_for_decision(client, since, "up", up_bound_s, progress, "waiting for the adaptive policy's scale-up decision")
            up = [d for d in ds if d["action"] == "up"]
            if up:
                break
        if up:
            ds = _wait_for_decision(client, float(up[-1]["t"]), "down", down_bound_s, progress,
                                    f"idle: waiting for the scale-down decision (after {idle_s:g} s without finalize events)")
            ds = _decisions(client, since)
            down = [d for d in ds if d["action"] == "down" and float(d["t"]) >= float(up[0]["t"])]
    shown = [d for d in ds if d["action"] in ("up", "down")][:6]
    if shown:
        print(f"scaling: {'; '.join(describe_decision(d) for d in shown)}", file=out, flush=True)
    if not up:
        last = ds[-1] if ds else None
        why = f"; its last decision: {last['action']} ({last.get('reason', '')})" if last else "; it recorded no decision"
        print(f"scaling: the policy did not scale up within {up_bound_s:g} s of {bursts} burst(s) (not an error: verify "
              f"did not dominate while the queue rose){why}", file=out, flush=True)
    elif not down:
        print(f"scaling: no scale-down decision within {down_bound_s:g} s of idling", file=out, flush=True)
    return {
        "steps": rows,
        "decisions": ds,
        "up": bool(up),
        "down": bool(down),
        "rollouts": sum(r["rollouts"] for r in rows),
        "accepted": sum(r["accepted"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "calls": int(round(sum(r["calls_per_rollout"] * r["rollouts"] for r in rows))),
    }


def _burst(client: Any, store: Any, finalizer: Any, args: argparse.Namespace, out, progress: Progress, run_id: str,
           b: int, n_steps: int, consts: dict[str, Any]) -> list[dict[str, Any]]:
    """Stage ``n_steps`` steps of long rollouts, then submit all their graphs back to back
    (each finds the earlier ones queued) and collect them; the printed step rows."""
    steps = [
        {gid: [f"{gid}-{i}" for i in range(args.rollouts)] for gid in (f"sc{b}x{k}p{g}" for g in range(args.groups))}
        for k in range(n_steps)
    ]
    futures = {
        (k, gid): client.submit(stage_synthetic, store, gid, rids, args.scale_calls, args.scale_tokens, **consts, pure=False)
        for k, step in enumerate(steps) for gid, rids in step.items()
    }
    by_key = {f.key: kg for kg, f in futures.items()}
    receipts: dict[tuple[int, str], Any] = {}
    try:
        for fut in _as_finished(list(futures.values())):
            receipts[by_key[fut.key]] = fut.result()
            progress.advance(1, f"long rollouts of {by_key[fut.key][1]} staged")
    except BaseException:
        client.cancel(list(futures.values()))
        raise
    handles = []
    for k, step in enumerate(steps):
        h = finalizer.submit_step({gid: receipts[(k, gid)] for gid in step}, step_id=f"{run_id}-scale-{b * n_steps + k}")
        handles.append((h, _timing_wall_s(), _watch_finish(h)))
    rows = []
    try:
        for h, submitted_s, finished in handles:
            for _ in _as_finished(h.futures):
                pass
            step = h.result()
            finalize_s = max(0.0, finished["last_s"] - submitted_s) if finished["n"] else step.metrics["wall_ms"] / 1e3
            rows.append(_print_step(step, out, finalize_s))
            progress.advance(0, f"{step.step_id} finalized")
    except KeyboardInterrupt:
        for h, _s, _f in handles:
            h.cancel()
        raise
    return rows


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


def _print_step(step: Any, out, finalize_s: float | None = None, note: str = "") -> dict[str, Any]:
    """One line per finalized step. Throughput: the training tokens of the step's accepted
    rows (``metrics["tokens"]``) over ``finalize_s``, the seconds from submitting the step's
    graph to its last group assembled (the demo's generation of the next step overlaps it)."""
    m = step.metrics
    finalize_s = m["wall_ms"] / 1e3 if finalize_s is None else finalize_s
    rate = m["tokens"] / finalize_s if finalize_s > 0 else 0.0
    rejected = ", ".join(f"{k}={v}" for k, v in m["rejected"].items()) or "none"
    print(
        f"{step.step_id}: {m['accepted']}/{m['rollouts']} rollouts accepted (rejected: {rejected}){f' ({note})' if note else ''}; "
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
    """Totals over every finalized honest rollout: the steps', the scale phase's and the
    resume phase's. Rollouts tampered on purpose are counted apart."""
    steps = summary["steps"]
    parts_of = [p for p in (summary.get("scale"), summary.get("resume")) if p]
    step_rollouts = sum(s["rollouts"] for s in steps)
    rollouts = step_rollouts + sum(p["rollouts"] for p in parts_of)
    accepted = sum(s["accepted"] for s in steps) + sum(p["accepted"] for p in parts_of)
    tokens = sum(s["tokens"] for s in steps) + sum(p["tokens"] for p in parts_of)
    calls = int(round(sum(s["calls_per_rollout"] * s["rollouts"] for s in steps))) + sum(p["calls"] for p in parts_of)
    wall_s = summary["wall_s"]
    summary.update(rollouts=rollouts, accepted=accepted, tokens=tokens, calls=calls, tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0)
    scale, resume, tampered = summary.get("scale"), summary.get("resume"), summary.get("tampered")
    parts = f"{step_rollouts} in {len(steps)} steps"
    if scale:
        parts += f" + {scale['rollouts']} in the scale phase"
    if resume:
        parts += f" + {resume['rollouts']} in the resume step"
    demo_note = ""
    if tampered:
        rejected = ", ".join(f"{k}={v}" for k, v in sorted(tampered["rejected"].items())) or "none"
        demo_note = (f" (demo: {tampered['rollouts']} rollouts tampered on purpose; rejected: {rejected}; "
                     f"{tampered['as_expected']}/{tampered['rollouts']} with the expected reason)")
    phases = "generation + finalization" + (" + resume" if resume else "") + (" + scale phase" if scale else "")
    print(
        f"summary: {rollouts} rollouts finalized ({parts}), {accepted} accepted{demo_note}, {calls} calls; "
        f"{tokens} training tokens in accepted rows / {wall_s:.1f} s run wall time ({phases}) = {summary['tokens_per_s']:.0f} tokens/s; "
        f"store: {summary['rows_staged']} rows, {summary['bytes_staged']} bytes staged in {summary['units']} units, "
        f"{summary['spilled_bytes']} bytes spilled",
        file=out,
        flush=True,
    )
    print(f"dashboard: {summary['dashboard']}", file=out, flush=True)


def main(args: argparse.Namespace) -> int:
    run(args)
    return 0
