"""The demo's runner: connect, start the store and the finalizer, run the phases in
order (:data:`PHASES`), add up the summary and print it.

A phase is a :class:`Phase`: where its result goes in the summary, whether the flags
want it, and the function that runs it on the :class:`~pipeline.demo.context.DemoRun`.
The phases that stage groups on the shared ``[demo]`` progress line (``groups`` set) run
first, under that one line; the others run after it, each with its own progress.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TextIO

from tasks.keys import STAGING_PARTITION

from ..cluster import adapt, connect, dashboard_url
from ..progress import Progress
from ..store.report import report_store
from . import reporter
from .context import DemoRun, DemoSettings, Row, new_run_id
from .interrupt import ctrl_c, silence_teardown
from .resume import run_resume
from .scale import scale_phase
from .steps import keep_alive, steps_phase
from .tamper import tamper_phase

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from ..scaling.adaptive import TokenCaptureAdaptive

# The whole run's summary: the run id, the phases' rows (``steps``, ``tampered``,
# ``resume``, ``scale``), the store's figures and the totals.
Summary = dict[str, Any]


@dataclass(frozen=True)
class Phase:
    """One phase as the runner sees it."""

    key: str  # where its result goes in the summary (not recorded when it returns None)
    wanted: Callable[[argparse.Namespace], bool]  # whether the flags ask for it
    run: Callable[[DemoRun, Progress | None], Row | list[Row] | None]
    groups: Callable[[argparse.Namespace], int] | None = None  # groups it counts on the shared progress line


PHASES: tuple[Phase, ...] = (
    Phase("steps", lambda a: True, steps_phase, groups=lambda a: a.steps * a.groups),
    Phase("tampered", lambda a: getattr(a, "tamper", False), tamper_phase, groups=lambda a: 1),
    Phase("resume", lambda a: not getattr(a, "no_resume", False), run_resume),
    Phase("scale", lambda a: getattr(a, "scale_demo", False), scale_phase),
)


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> Summary:
    """The demo proper; returns its summary (the CLI prints it).

    ``summary["rollouts"]``, ``accepted``, ``tokens`` and ``calls`` count every finalized
    rollout: the steps' and the resume phase's.
    """
    if not getattr(args, "run_id", None):
        args.run_id = new_run_id()
    summary: Summary = {"run_id": args.run_id, "steps": []}
    cluster_kwargs: dict[str, str | int] = {}
    if getattr(args, "dashboard_address", None) is not None:
        cluster_kwargs["dashboard_address"] = args.dashboard_address
    if getattr(args, "n_workers", None) is not None:
        cluster_kwargs["n_workers"] = args.n_workers
    report = reporter.Reporter(out)
    report.line(reporter.run_line(args.run_id))
    with ctrl_c(), connect(args.scheduler, connect_timeout=getattr(args, "connect_timeout", None), **cluster_kwargs) as (client, cluster):
        _run_on(client, cluster, args, summary, report)
    return summary


def _adapt(cluster: LocalCluster | None, args: argparse.Namespace, settings: DemoSettings) -> TokenCaptureAdaptive | None:
    """Embedded: split-timing adaptive scaling (decisions shown on the page), deciding
    often enough to see the demo's bursts of seconds (demo.adaptive-interval-s)."""
    if cluster is None:
        return None
    n = getattr(args, "n_workers", None)
    interval = f"{settings.adaptive_interval_s}s"
    if n is None:
        return adapt(cluster, interval=interval)
    return adapt(cluster, minimum=n, maximum=max(n, settings.adaptive_maximum), interval=interval)


def _run_on(client: Client, cluster: LocalCluster | None, args: argparse.Namespace, summary: Summary, report: reporter.Reporter) -> None:
    """Everything after connecting: the store and finalizer, the phases, the summary."""
    from ..finalize.controller import Finalizer
    from ..store.client import StagingStore

    settings = DemoSettings.from_config()
    adaptive = _adapt(cluster, args, settings)
    url = dashboard_url(client, settings.dashboard_page)
    report.line(reporter.dashboard_line(url))
    store = StagingStore.start(client)
    try:
        finalizer = Finalizer(client, store)  # checks that some worker has `finalize` slots
        demo = DemoRun(client=client, store=store, finalizer=finalizer, args=args, report=report, settings=settings,
                       run_id=args.run_id, quiet=args.quiet, adaptive=adaptive)
        t0 = time.perf_counter()
        run_phases(demo, summary)
        wall_s = time.perf_counter() - t0
        summary.update(_store_summary(report_store(store)))
        summary["wall_s"] = wall_s
        summary["dashboard"] = url
        add_totals(summary)
        report.lines([reporter.summary_line(summary), reporter.dashboard_line(summary["dashboard"])])
        if args.keep_alive:
            keep_alive(demo)
    except KeyboardInterrupt:
        silence_teardown(client, embedded=cluster is not None)  # before the store and cluster close
        raise
    finally:
        store.close()


def run_phases(demo: DemoRun, summary: Summary, phases: tuple[Phase, ...] = PHASES) -> None:
    """Run the wanted ``phases``, recording each result under its key: first those on the
    shared ``[demo]`` progress line (in order, under one line), then the others."""
    wanted = [p for p in phases if p.wanted(demo.args)]
    shared = [p for p in wanted if p.groups is not None]
    total = sum(p.groups(demo.args) for p in shared if p.groups is not None)
    with Progress("demo", total=total, unit="groups", quiet=demo.quiet) as progress:
        for phase in shared:
            _record(summary, phase, phase.run(demo, progress))
    for phase in wanted:
        if phase.groups is None:
            _record(summary, phase, phase.run(demo, None))


def _record(summary: Summary, phase: Phase, result: Row | list[Row] | None) -> None:
    """``summary[phase.key] = result`` unless the phase returned None (skipped)."""
    if result is not None:
        summary[phase.key] = result


def _store_summary(stats: list[dict[str, Any]]) -> dict[str, int]:
    """The store's figures for the summary: rows and bytes staged, bytes spilled, units."""
    return {
        "rows_staged": sum(s.get("partitions", {}).get(STAGING_PARTITION, 0) for s in stats),
        "bytes_staged": sum(s["used_bytes"] for s in stats),
        "spilled_bytes": sum(s["spilled_bytes"] for s in stats),
        "units": len(stats),
    }


def add_totals(summary: Summary) -> None:
    """Totals over every finalized honest rollout: the steps', the scale phase's and the
    resume phase's (rollouts tampered on purpose are counted apart); and tokens/s over
    ``summary["wall_s"]``."""
    steps = summary["steps"]
    parts_of = [p for p in (summary.get("scale"), summary.get("resume")) if p]
    rollouts = sum(s["rollouts"] for s in steps) + sum(p["rollouts"] for p in parts_of)
    accepted = sum(s["accepted"] for s in steps) + sum(p["accepted"] for p in parts_of)
    tokens = sum(s["tokens"] for s in steps) + sum(p["tokens"] for p in parts_of)
    calls = int(round(sum(s["calls_per_rollout"] * s["rollouts"] for s in steps))) + sum(p["calls"] for p in parts_of)
    wall_s = summary["wall_s"]
    summary.update(rollouts=rollouts, accepted=accepted, tokens=tokens, calls=calls, tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0)


def main(args: argparse.Namespace) -> int:
    """``python -m pipeline demo``: run it; exit code 0."""
    run(args)
    return 0
