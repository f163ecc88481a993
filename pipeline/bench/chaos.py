"""Chaos soak: steps keep flowing on a cluster of hosts while workers, the controller and
the network fail, side by side with the same soak without faults.

Both runs: a ``dask scheduler`` and hosts of ``dask worker`` processes on their own
loopback addresses (a generation host of 2 workers, a finalize host, 3 storage hosts), a
store hosted by the scheduler (replicas 2) and a controller process keeping
``--in-flight`` steps finalizing (:mod:`.chaos_controller`). The faulty run also follows
:mod:`.chaos_schedule`: a random storage or finalize worker SIGKILLed every 30-60 s (a
replacement joins), the controller SIGKILLed once (the next one attaches and resubmits),
a storage or finalize host stalled once (SIGSTOP, SIGCONT after 15 s), one storage host
cut off once (:mod:`pipeline.testing.partition`, 20 s). ``--short``: about 2 minutes.

Reported (JSON on stdout, progress on stderr): steps finalized, rows acknowledged, rows
lost (must be 0), rollouts whose tensors differ from the oracle or from the fault-free
run (must be 0), both runs' throughput and longest wait between deliveries, the timeline, the store's end figures (with
``repair_wait_s``/``repair_unsettled``: what a repair still lacked when the wait gave up).
Failures (those, or a step that never finishes) are printed and exit 1, with no ratio.

    python -m pipeline bench chaos --json
    python -m pipeline bench chaos --short --json
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import tempfile
import time
from typing import Any, Callable

from tasks.errors import UsageError

from ..cli_args import int_between, non_negative_int, positive_float, positive_int
from .chaos_report import digests_differing, exit_status, report, run_figures  # noqa: F401 (exit_status: the CLI's)
from .chaos_schedule import Fault, ScheduleSettings, fault_schedule
from .common import main, notes

# (faulty run s, fault-free run s, interval scale, partition s, gap s, tail s, stall s)
FULL = (210.0, 60.0, 1.0, 20.0, 10.0, 30.0, 15.0)
SHORT = (75.0, 20.0, 0.4, 8.0, 4.0, 14.0, 6.0)
PROGRESS_EVERY_S = 15.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench chaos``."""
    p.add_argument("--short", action="store_true", help="about 2 minutes: shorter runs, faults every 12-24 s, an 8 s cut")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the fault schedule's and the rollouts' seed (default 0)")
    p.add_argument("--duration", type=positive_float, default=None, help="faulty run length, s (default 210; 75 with --short)")
    p.add_argument("--fault-free-duration", type=positive_float, default=None, help="fault-free run length, s (default 60; 20 with --short)")
    p.add_argument("--partition-s", type=positive_float, default=None, help="how long the storage host is cut off, s (default 20; 8 with --short)")
    p.add_argument("--stall-s", type=positive_float, default=None,
                   help="how long a storage or finalize host is stopped (SIGSTOP, then SIGCONT), s (default 15: longer "
                        "than the soak's 10 s worker TTL: the scheduler may remove the host, which is then replaced; 6 with "
                        "--short: it resumes)")
    p.add_argument("--groups", type=positive_int, default=2, help="GRPO groups per step (default 2)")
    p.add_argument("--rollouts", type=positive_int, default=4, help="rollouts per group (default 4)")
    p.add_argument("--turns", type=positive_int, default=2, help="model calls per rollout (default 2)")
    p.add_argument("--tokens-per-turn", type=positive_int, default=8, help="tokens each call generates (default 8)")
    p.add_argument("--in-flight", type=int_between(1, 8), default=3, help="finalization steps in flight, 1-8 (default 3)")
    p.add_argument("--step-timeout", type=positive_float, default=90.0, help="one attempt at a step, s; 3 attempts (default 90)")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep each run's state (controller logs and records, host logs) under DIR instead of a temporary directory")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def plan(args: argparse.Namespace) -> tuple[ScheduleSettings, float]:
    """The faulty run's schedule settings and the fault-free run's length (s)."""
    duration, fault_free, scale, cut, gap, tail, stall = SHORT if args.short else FULL
    settings = ScheduleSettings(duration_s=args.duration or duration, scale=scale,
                                partition_s=args.partition_s or cut, gap_s=gap, tail_s=tail,
                                stall_s=args.stall_s or stall)
    return settings, args.fault_free_duration or fault_free


def run(args: argparse.Namespace) -> dict[str, Any]:
    from .chaos_controller import ControllerConfig

    say = notes("chaos", args.quiet)
    settings, fault_free_s = plan(args)
    try:
        schedule = fault_schedule(settings, args.seed)
    except ValueError as e:
        raise UsageError(f"{e}; give a longer --duration or a shorter --stall-s / --partition-s") from None
    say(f"{'short' if args.short else 'full'} mode: fault-free {fault_free_s:g} s, then faulty {settings.duration_s:g} s "
        f"with {len(schedule)} faults: " + ", ".join(f"{f.kind}@{f.at_s:g}s" for f in schedule))
    from .. import config

    cfg = ControllerConfig(scheduler="", store="", seed=args.seed, groups=args.groups, rollouts=args.rollouts,
                           turns=args.turns, tokens_per_turn=args.tokens_per_turn, in_flight=args.in_flight,
                           step_timeout_s=args.step_timeout, experts=int(config.get("policy.experts")))
    base, base_records, _ = one_run("fault-free", cfg, [], fault_free_s, say, args.keep)
    chaos, chaos_records, timeline = one_run("chaos", cfg, schedule, settings.duration_s, say, args.keep)
    meta = {"mode": "short" if args.short else "full", "seed": args.seed, "in_flight": args.in_flight,
            "schedule": [f.to_dict() for f in schedule]}
    result = report(base, chaos, digests_differing(base_records, chaos_records), timeline, meta)
    for line in result["failures"]:
        say(f"FAILED: {line}")
    if result["ok"]:
        say(f"ok: {chaos['steps_finalized']} steps, {chaos['rows_acknowledged']} rows acknowledged, 0 lost, "
            f"0 differ; throughput x{result['throughput_ratio']} of the fault-free run")
    return result


def one_run(name: str, cfg: Any, faults: list[Fault], duration_s: float, say: Callable[[str], None],
            keep: str | None = None) -> tuple[dict[str, Any], dict[str, dict], list[dict]]:
    """One run on a fresh cluster (its state under ``keep``/``name`` if given, else in a
    temporary directory): its figures, the controller's records, the timeline."""
    from .chaos_cluster import ChaosCluster
    from .chaos_controller import Book, read_delivered

    problems: list[str] = []
    if keep:
        os.makedirs(os.path.join(keep, name), exist_ok=False)
    with (contextlib.nullcontext(os.path.join(keep, name)) if keep
          else tempfile.TemporaryDirectory(prefix=f"token-capture-chaos-{name}-")) as d:
        say(f"{name}: starting the cluster")
        with ChaosCluster(d, cfg, say=lambda line: say(f"{name}: {line}")) as cl:
            say(f"{name}: cluster up ({len(cl.hosts.hosts)} hosts); steps flowing for {duration_s:g} s")
            _drive(cl, faults, duration_s, problems, lambda line: say(f"{name}: {line}"), d)
            if not cl.stop_controller(timeout_s=3 * cfg.step_timeout_s + 30):
                problems.append(f"the controller did not drain its steps: {cl.controller_log_tail()}")
            wall_s = cl.now()
            store = cl.store_figures()
            records, saved = read_delivered(d), Book(d).saved()
            figures = run_figures(records, saved, wall_s, store, problems)
            say(f"{name}: {figures['steps_finalized']} steps in {wall_s:.0f} s ({figures['tokens_per_s']} tokens/s), "
                f"{figures['rows_lost']} rows lost, {figures['rollouts_differing_from_oracle']} differ, longest wait "
                f"between deliveries {figures['longest_delivery_gap_s']} s")
            return figures, records, cl.timeline


def _drive(cl: Any, faults: list[Fault], duration_s: float, problems: list[str], say: Callable[[str], None],
           state_dir: str) -> None:
    """Until ``duration_s``: each fault at its time, the controller watched, progress lines."""
    from .chaos_controller import read_delivered

    rng = random.Random(cl.cfg.seed + 1)  # which host each fault hits
    pending = list(faults)
    next_note = PROGRESS_EVERY_S
    while cl.now() < duration_s:
        if pending and cl.now() >= pending[0].at_s:
            cl.do(pending.pop(0), rng)
            continue
        code = cl.controller.poll()
        if code is not None:
            problems.append(f"controller {cl.incarnation} exited by itself with code {code}: {cl.controller_log_tail()}")
            cl.start_controller()
        if cl.now() >= next_note:
            delivered = read_delivered(state_dir)
            say(f"{cl.now():.0f} s: {len(delivered)} steps delivered, controller {cl.incarnation}")
            next_note += PROGRESS_EVERY_S
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
