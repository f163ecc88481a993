"""The chaos soak's figures and verdict (pure: no Dask): one run's figures from its
controller's records, the failures of a pair of runs (fault-free and faulty), and the
report, with the throughput ratio only when nothing failed.

A failure is: an acknowledged row lost (a step's rollout rejected for a missing or lost
staging row), a rollout whose tensors differ from the oracle's or from the fault-free
run's, a step saved and never delivered (or given up on), a controller that exited by
itself or did not drain, a lost key in the store's own counters, a run that delivered no
step. Steps and tokens per second are from a run's first delivery to its last (the first
step carries the start-up; a run with fewer than 2 steps has no pace).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def run_figures(delivered: Mapping[str, dict], saved: Mapping[str, int], wall_s: float,
                store: Mapping[str, Any] | None = None, problems: list[str] | None = None) -> dict[str, Any]:
    """One run's figures: ``delivered`` (step id -> the controller's record), ``saved``
    (step id -> index of every step it saved), ``wall_s`` (s), ``store`` (its counters),
    ``problems`` (what the driver saw go wrong: a controller exiting by itself...)."""
    done = {s: r for s, r in delivered.items() if "failed" not in r}
    differing = {rid: fields for r in done.values() for rid, fields in r["mismatched"].items()}
    tokens = sum(int(r["tokens"]) for r in done.values())
    # Steady pace: from the first delivery to the last (the first step carries the start-up).
    times = sorted(float(r["t"]) for r in done.values())
    steady_s = times[-1] - times[0] if len(times) > 1 else 0.0
    first = min(done.values(), key=lambda r: float(r["t"])) if done else None
    steady_tokens = tokens - (int(first["tokens"]) if first else 0)
    gap_s, gap_at = longest_gap(times)
    return {
        "wall_s": round(wall_s, 2),
        "steps_saved": len(saved),
        "steps_finalized": len(done),
        "steps_given_up": sorted(s for s, r in delivered.items() if "failed" in r),
        "steps_never_finished": sorted(s for s in saved if s not in delivered),
        "rollouts": sum(int(r["rollouts"]) for r in done.values()),
        "rollouts_acknowledged": sum(int(r["acknowledged"]) for r in done.values()),
        "rows_acknowledged": sum(int(r["rows"]) for r in done.values()),
        "rows_lost": sum(int(r["rows_lost"]) for r in done.values()),
        "rollouts_differing_from_oracle": len(differing),
        "differing_examples": dict(list(differing.items())[:3]),
        "resubmitted_steps": sum(1 for r in done.values() if r.get("resubmitted")),
        "tokens": tokens,
        "steady_s": round(steady_s, 2),
        "steps_per_s": round((len(done) - 1) / steady_s, 3) if steady_s > 0 else 0.0,
        "tokens_per_s": round(steady_tokens / steady_s, 1) if steady_s > 0 else 0.0,
        "longest_delivery_gap_s": round(gap_s, 2),  # what a fault held every step for
        "longest_gap_after_first_s": round(gap_at, 2),  # where that gap began, s after the first delivery
        "store": dict(store or {}),
        "problems": list(problems or []),
    }


def longest_gap(times: list[float]) -> tuple[float, float]:
    """The longest wait between two consecutive deliveries of sorted ``times`` (s) and
    when it began, s after the first delivery; (0, 0) with fewer than two."""
    if len(times) < 2:
        return 0.0, 0.0
    gap, i = max((b - a, k) for k, (a, b) in enumerate(zip(times, times[1:])))
    return gap, times[i] - times[0]


def digests_differing(fault_free: Mapping[str, dict], faulty: Mapping[str, dict]) -> list[str]:
    """Rollouts acknowledged in both runs whose tensors' digests differ."""
    out = []
    for sid, rec in faulty.items():
        other = fault_free.get(sid)
        if other is None or "digests" not in rec or "digests" not in other:
            continue
        out += [rid for rid, d in rec["digests"].items() if rid in other["digests"] and other["digests"][rid] != d]
    return sorted(out)


def failures(name: str, run: Mapping[str, Any]) -> list[str]:
    """What failed in one run's figures (empty: nothing)."""
    out = [f"{name}: {p}" for p in run["problems"]]
    if run["steps_finalized"] == 0:
        out.append(f"{name}: no step was finalized")
    if run["rows_lost"]:
        out.append(f"{name}: {run['rows_lost']} acknowledged row(s) lost")
    if run["rollouts_differing_from_oracle"]:
        out.append(f"{name}: {run['rollouts_differing_from_oracle']} rollout(s) differ from the oracle, e.g. "
                   f"{run['differing_examples']}")
    if run["steps_never_finished"]:
        out.append(f"{name}: step(s) never finished: {run['steps_never_finished'][:5]}")
    if run["steps_given_up"]:
        out.append(f"{name}: step(s) failed every attempt: {run['steps_given_up'][:5]}")
    if int(run["store"].get("lost_keys", 0)):
        out.append(f"{name}: the store counts {run['store']['lost_keys']} lost key(s)")
    return out


def report(fault_free: dict[str, Any], chaos: dict[str, Any], differing_runs: list[str],
           timeline: list[dict], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON report: headline figures of the faulty run, both runs, the timeline, the
    failures; ``throughput_ratio`` (faulty tokens/s over fault-free) only when none."""
    failed = failures("fault-free", fault_free) + failures("chaos", chaos)
    if differing_runs:
        failed.append(f"chaos: {len(differing_runs)} rollout(s) differ from the fault-free run, e.g. {differing_runs[:3]}")
    out: dict[str, Any] = {
        **meta,
        "steps_finalized": chaos["steps_finalized"],
        "rows_acknowledged": chaos["rows_acknowledged"],
        "rows_lost": chaos["rows_lost"],
        "rollouts_differing_from_oracle": chaos["rollouts_differing_from_oracle"],
        "rollouts_differing_from_fault_free": len(differing_runs),
        "faults": len(timeline),
        "fault_free": fault_free,
        "chaos": chaos,
        "timeline": timeline,
        "failures": failed,
        "ok": not failed,
    }
    if not failed and fault_free["tokens_per_s"] > 0:
        out["throughput_ratio"] = round(chaos["tokens_per_s"] / fault_free["tokens_per_s"], 3)
    return out


def exit_status(result: Mapping[str, Any]) -> int:
    """0 when nothing failed, else 1."""
    return 0 if result.get("ok") else 1
