"""Split timing of finalization and the figures its finalize events carry.

Every finalize task times its own work and returns the figures next to its result, so
the numbers describe the work, not the scheduler. :func:`step_metrics` folds the
per-group figures into the step's; the event schema is listed at
:data:`pipeline.events.FINALIZE`. Units: ``_ms`` milliseconds, ``_s`` wall-clock seconds
since the epoch, ``bytes`` bytes, ``tokens`` tokens, everything else a count.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Iterable, Iterator, Mapping, Sequence, TypedDict

from tasks import reasons
from tasks.finalize.staleness import StalenessFigures

EVENT_KIND_GROUP = "group"
EVENT_KIND_STEP = "step"

# Fine-performance-metric labels charged inside the tasks.
METER_FETCH = "tc-fetch"
METER_VERIFY = "tc-verify"
METER_ASSEMBLE = "tc-assemble"

# A group event carries at most one rejection detail per reason, this many characters long.
DETAIL_CHARS = 200


class _FetchFigures(TypedDict):
    kind: str  # the fetch's kind (staging rows or routes)
    id: str  # "{kind}-{site}": one per fetch task
    start_s: float
    fetch_ms: float
    keys: int
    rows: int
    failed: int  # keys the store could not serve
    bytes: int  # payload bytes fetched


class FetchTiming(_FetchFigures, total=False):
    """A fetch task's figures (shared by the pieces it cut)."""

    split_ms: float  # cutting the fetch into pieces, once done


class VerifyTiming(TypedDict):
    """A verify task's figures."""

    task: int
    start_s: float
    ms: float
    cpu_ms: float
    rollouts: int
    out_bytes: int  # what Dask weighs the task's output at (bytes); 0 from older workers


class RowCounts(TypedDict):
    """A group's rollouts: accepted, rejected by reason, internal errors, accepted tokens."""

    rollouts: int
    accepted: int
    rejected: dict[str, int]
    internal_errors: int
    tokens: int


class GroupMetrics(RowCounts):
    """A group's ``kind: "group"`` finalize event (:data:`pipeline.events.FINALIZE`) and the
    private ``_``-prefixed bookkeeping the step's aggregate and clear read (:func:`public`
    strips it)."""

    kind: str
    step_id: str
    group_id: str
    fetch_ms: float
    verify_ms: float
    assemble_ms: float
    queue_wait_ms: float
    queue_depth: int
    calls_per_rollout: float
    fetch_calls: int
    bytes_fetched: int
    rejected_details: dict[str, str]
    _verify_tasks: list[VerifyTiming]
    _fetch_timings: list[FetchTiming]
    _calls: int
    _planned: int
    _unread_rollouts: list[str]  # read by the step's clear (:mod:`pipeline.finalize.kept_rows`)


class _StepFigures(TypedDict):
    """The figures every step event carries."""

    kind: str
    step_id: str
    groups: int
    rollouts: int
    accepted: int
    rejected: dict[str, int]
    internal_errors: int
    tokens: int
    fetch_ms: float
    split_ms: float
    verify_ms: float
    verify_cpu_ms: float
    verify_tasks: int
    assemble_ms: float
    queue_wait_ms: float
    queue_depth: int
    queue_depth_after: int
    calls_per_rollout: float
    fetch_calls: int
    bytes_fetched: int
    wall_ms: float
    tokens_per_s: float
    dominant: str  # "fetch" or "verify" (:func:`sizing_hint`)
    cross_host_bytes: int  # bytes the step's tasks moved between hosts, as measured (0 when not measured)
    cross_host_measured: bool  # whether the scheduler measured them (its plugin answered)
    cross_host_bytes_planned: int  # bytes the layout ships between hosts (verify outputs read on another host)
    verified_ms: float  # submission -> the step's last verify task ended
    tail_ms: float  # the last verify task ended -> the groups in the caller's process (gather + assembly)
    collect_ms: float  # the caller's result(): waiting for, gathering and assembling the groups
    collected_bytes: int  # bytes gathered into the caller's process (verified rows, or the groups' tensors)
    assembled_on: str  # "controller" (the caller's process) or "cluster" (assemble tasks on workers)


class StepMetrics(_StepFigures, total=False):
    """A step's ``kind: "step"`` finalize event: the groups' figures summed (:func:`step_metrics`)."""

    staleness: StalenessFigures  # lags of its verified rollouts by length (tasks.finalize.staleness)


def wall_s() -> float:
    """Wall-clock seconds since the epoch (comparable between controller and workers)."""
    return time.time()


@contextlib.contextmanager
def meter(label: str) -> Iterator[None]:
    """Charge the block to Dask's fine performance metrics under ``label`` (if available).

    Outside a task (or on a distributed without ``context_meter``) this is a no-op.
    """
    try:
        from distributed.metrics import context_meter
    except ImportError:  # pragma: no cover - older distributed
        yield
        return
    with context_meter.meter(label):
        yield


class Stopwatch:
    """``with Stopwatch() as sw: ...`` then ``sw.ms`` (perf_counter), ``sw.cpu_ms`` (this
    thread's CPU time: what the block computed, whatever else ran on the machine) and
    ``sw.start_s`` (wall)."""

    __slots__ = ("start_s", "ms", "cpu_ms", "_t0", "_c0")

    def __enter__(self) -> "Stopwatch":
        self.start_s = wall_s()
        self._c0 = time.thread_time()
        self._t0 = time.perf_counter()
        self.ms = self.cpu_ms = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.ms = (time.perf_counter() - self._t0) * 1e3
        self.cpu_ms = (time.thread_time() - self._c0) * 1e3


def _min_or_none(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def queue_wait_ms(submitted_s: float, first_start_s: float | None) -> float:
    """Submission -> first verify start, in ms; 0.0 when nothing had to be verified."""
    if first_start_s is None:
        return 0.0
    return max(0.0, (first_start_s - submitted_s) * 1e3)


def status_counts(statuses: Iterable[str]) -> tuple[int, dict[str, int], int]:
    """(accepted, {reason: count}, internal errors) of a list of per-row statuses.

    Internal errors (the verifier failed, not the data) are counted apart, never as a
    rejection reason.
    """
    c = Counter(statuses)
    accepted = c.pop(reasons.OK, 0)
    internal_errors = c.pop(reasons.INTERNAL_ERROR, 0)
    return accepted, dict(sorted(c.items())), internal_errors


def detail_sample(statuses: Sequence[str], details: Sequence[str], limit: int = DETAIL_CHARS) -> dict[str, str]:
    """``{reason: detail}``: the first row's detail for each rejection reason of a group,
    cut to ``limit`` characters (the bounded sample a group event carries). Accepted rows
    and internal errors (not rejections) are left out."""
    out: dict[str, str] = {}
    for status, detail in zip(statuses, details):
        if status in (reasons.OK, reasons.INTERNAL_ERROR) or status in out:
            continue
        out[status] = str(detail)[:limit]
    return dict(sorted(out.items()))


def sizing_hint(fetch_ms: float, verify_ms: float) -> str:
    """The sizing rule: ``"fetch"``-dominant -> batch more (bigger steps), do
    not add workers; ``"verify"``-dominant -> add finalize workers up to free CPUs."""
    return "fetch" if fetch_ms >= verify_ms else "verify"


def _sums(group_metrics: Mapping[str, GroupMetrics]) -> tuple[int, int, int, Counter[str], int, int, int, float, int]:
    """The groups' rollouts, accepted, tokens, rejected (by reason), internal errors, chain
    calls, planned rollouts, assemble ms and bytes fetched, each summed."""
    rejected: Counter[str] = Counter()
    for m in group_metrics.values():
        rejected.update(m["rejected"])
    ms = list(group_metrics.values())
    return (sum(m["rollouts"] for m in ms), sum(m["accepted"] for m in ms), sum(m["tokens"] for m in ms), rejected,
            sum(m.get("internal_errors", 0) for m in ms), sum(m["_calls"] for m in ms), sum(m["_planned"] for m in ms),
            sum(m["assemble_ms"] for m in ms), sum(m["bytes_fetched"] for m in ms))


def step_metrics(
    *,
    step_id: str,
    group_metrics: Mapping[str, GroupMetrics],
    submitted_s: float,
    collected_s: float,
    queue_depth: int,
    queue_depth_after: int,
    crossing_tasks: Sequence[int] = (),
    cross_host_bytes: int = -1,
    collect_ms: float = 0.0,
    collected_bytes: int = 0,
    assembled_on: str = "controller",
    staleness: StalenessFigures | None = None,
) -> StepMetrics:
    """Step-level figures from the per-group metrics and the fetch tasks' timings.

    ``group_metrics`` are the dicts the assemble tasks put on each group; their private
    ``_verify_tasks`` / ``_fetch_timings`` lists let each shared task count once here.
    ``crossing_tasks``: the verify tasks whose output the layout ships to another host
    (:meth:`tasks.finalize.layout.StepLayout.crossing_tasks`), summed by their output
    bytes into ``cross_host_bytes_planned``; ``cross_host_bytes``: the scheduler's
    measure (:mod:`pipeline.finalize.transfers`; -1: not measured). ``collect_ms``: how
    long the caller's ``result()`` took to hold the groups, ``collected_bytes`` what it
    gathered; ``assembled_on``: where they were assembled; ``staleness``: the step's
    staleness figures (left out when None). The tail (``tail_ms``) runs from the last
    verify task's end (its worker's clock) to ``collected_s``.
    """
    fetch_by_id: dict[str, FetchTiming] = {}
    verify_tasks: dict[int, VerifyTiming] = {}
    for m in group_metrics.values():
        for t in m.get("_verify_tasks", ()):
            verify_tasks[t["task"]] = t
        for t in m.get("_fetch_timings", ()):
            fetch_by_id[t.get("id", t["kind"])] = t
    rollouts, accepted, tokens, rejected, internal_errors, calls, planned, assemble_ms, bytes_fetched = _sums(group_metrics)
    fetch_timings = list(fetch_by_id.values())
    fetch_ms = sum(t["fetch_ms"] for t in fetch_timings)
    verify_ms = sum(t["ms"] for t in verify_tasks.values())
    wall_ms = max(0.0, (collected_s - submitted_s) * 1e3)
    verified_s = max((t["start_s"] + t["ms"] / 1e3 for t in verify_tasks.values()), default=submitted_s)
    out: StepMetrics = {
        "kind": EVENT_KIND_STEP,
        "step_id": step_id,
        "groups": len(group_metrics),
        "rollouts": rollouts,
        "accepted": accepted,
        "rejected": dict(sorted(rejected.items())),
        "internal_errors": internal_errors,
        "tokens": tokens,
        "fetch_ms": fetch_ms,
        "split_ms": sum(t.get("split_ms", 0.0) for t in fetch_timings),
        "verify_ms": verify_ms,
        "verify_cpu_ms": sum(t.get("cpu_ms", 0.0) for t in verify_tasks.values()),
        "verify_tasks": len(verify_tasks),
        "assemble_ms": assemble_ms,
        "queue_wait_ms": queue_wait_ms(submitted_s, _min_or_none(t["start_s"] for t in verify_tasks.values())),
        "queue_depth": queue_depth,
        "queue_depth_after": queue_depth_after,
        "calls_per_rollout": calls / planned if planned else 0.0,
        "fetch_calls": len(fetch_timings),
        "bytes_fetched": bytes_fetched,
        "wall_ms": wall_ms,
        "tokens_per_s": tokens / (wall_ms / 1e3) if wall_ms > 0 else 0.0,
        "dominant": sizing_hint(fetch_ms, verify_ms),
        "cross_host_bytes": max(0, int(cross_host_bytes)),
        "cross_host_measured": cross_host_bytes >= 0,
        "cross_host_bytes_planned": sum(int(verify_tasks[t].get("out_bytes", 0)) for t in crossing_tasks if t in verify_tasks),
        "verified_ms": max(0.0, (verified_s - submitted_s) * 1e3),
        "tail_ms": max(0.0, (collected_s - verified_s) * 1e3),
        "collect_ms": collect_ms,
        "collected_bytes": int(collected_bytes),
        "assembled_on": assembled_on,
    }
    if staleness is not None:
        out["staleness"] = staleness
    return out


def with_cross_host(metrics: Mapping[str, object], measured_bytes: int) -> dict[str, object]:
    """A step's metrics with the scheduler's measure of its cross-host bytes filled in
    (``measured_bytes`` < 0: not measured)."""
    return {**metrics, "cross_host_bytes": max(0, int(measured_bytes)), "cross_host_measured": measured_bytes >= 0}


def public(metrics: Mapping[str, object]) -> dict[str, object]:
    """``metrics`` without the private ``_``-prefixed bookkeeping keys (what events carry)."""
    return {k: v for k, v in metrics.items() if not k.startswith("_")}
