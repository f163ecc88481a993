"""Split timing and queue signals of finalization, and the events that publish them.

Every finalize task measures its own work (``time.perf_counter`` around it) and returns
the figures next to its result, so the numbers describe the work, not the scheduler.
Task start stamps are wall-clock seconds (``time.time()``) because they are compared with
the controller's submission stamp: on one machine they share a clock; across machines
``queue_wait_ms`` is only as good as the hosts' clock sync.

Units: ``_ms`` milliseconds, ``_s`` seconds since the epoch, ``bytes`` bytes, ``tokens``
tokens, everything else a count.

Event schema (topic :data:`pipeline.events.FINALIZE`, ``"token-capture-finalize"``)
------------------------------------------------------------------------------------
Two kinds of flat dicts share the topic; ``kind`` tells them apart.

``kind: "group"`` -- published by the assemble task (on the worker) as each group is
assembled, so a dashboard sees groups finish before anyone collects them:

    step_id, group_id       str
    rollouts                rows in the group (rejected rows included)
    accepted                rows with status "ok"
    rejected                {reason: count}
    tokens                  training tokens of the accepted rows
    fetch_ms                work time of the union fetches that served the group (shared
                            by every group of the step: one fetch serves them all)
    verify_ms               verify + linearize time of the group's rollouts (summed)
    assemble_ms             the group's assemble task
    queue_wait_ms           step submission -> first verify start of the group's rollouts
    queue_depth             groups submitted and not finished when the step was submitted
    calls_per_rollout       staged calls per rollout of the group (mean over planned rows)
    fetch_calls             store reads that served the group (1, or 2 with routes)
    bytes_fetched           payload bytes of the group's rows (staging + routes fields)

``kind: "step"`` -- published by the controller (``Client.log_event``) when a step's
result is collected (:meth:`pipeline.finalize.controller.StepHandle.result`):

    step_id                 str
    groups, rollouts, accepted, rejected ({reason: count}), tokens
    fetch_ms                work time of the step's fetch tasks (staging + routes)
    split_ms                cutting fetched rows into per-verify-task pieces
    verify_ms               sum of the verify tasks' work time
    verify_tasks            number of verify tasks
    assemble_ms             sum of the assemble tasks' work time
    queue_wait_ms           submission -> first verify start in the step
    queue_depth             groups in flight when the step was submitted (itself included)
    queue_depth_after       groups still in flight when the step was collected
    calls_per_rollout, fetch_calls, bytes_fetched
    wall_ms                 submission -> collection on the controller
    tokens_per_s            tokens / wall
    dominant                "fetch" or "verify": which side to scale (see :func:`sizing_hint`)

Inside tasks the same phases are also charged to Dask's fine performance metrics
(``context_meter`` labels ``tc-fetch``, ``tc-verify``, ``tc-assemble``) under the step's
span ``("token-capture", "finalize", step_id)``, so the dashboard's Fine Performance
Metrics page splits them without any code of ours.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any, Iterable, Iterator, Mapping, Optional

EVENT_KIND_GROUP = "group"
EVENT_KIND_STEP = "step"

# Fine-performance-metric labels charged inside the tasks.
METER_FETCH = "tc-fetch"
METER_VERIFY = "tc-verify"
METER_ASSEMBLE = "tc-assemble"


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
    """``with Stopwatch() as sw: ...`` then ``sw.ms`` (perf_counter) and ``sw.start_s`` (wall)."""

    __slots__ = ("start_s", "ms", "_t0")

    def __enter__(self) -> "Stopwatch":
        self.start_s = wall_s()
        self._t0 = time.perf_counter()
        self.ms = 0.0
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ms = (time.perf_counter() - self._t0) * 1e3


def _min_or_none(values: Iterable[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return min(vals) if vals else None


def queue_wait_ms(submitted_s: float, first_start_s: Optional[float]) -> float:
    """Submission -> first verify start, in ms; 0.0 when nothing had to be verified."""
    if first_start_s is None:
        return 0.0
    return max(0.0, (first_start_s - submitted_s) * 1e3)


def status_counts(statuses: Iterable[str]) -> tuple[int, dict[str, int]]:
    """(accepted, {reason: count}) of a list of per-row statuses."""
    c = Counter(statuses)
    accepted = c.pop("ok", 0)
    return accepted, dict(sorted(c.items()))


def sizing_hint(fetch_ms: float, verify_ms: float) -> str:
    """SPEC section 5's sizing rule: ``"fetch"``-dominant -> batch more (bigger steps), do
    not add workers; ``"verify"``-dominant -> add finalize workers up to free CPUs."""
    return "fetch" if fetch_ms >= verify_ms else "verify"


def step_metrics(
    *,
    step_id: str,
    group_metrics: Mapping[str, Mapping[str, Any]],
    submitted_s: float,
    collected_s: float,
    queue_depth: int,
    queue_depth_after: int,
) -> dict[str, Any]:
    """Step-level figures from the per-group metrics and the fetch tasks' timings.

    ``group_metrics`` are the dicts the assemble tasks put on each group; their private
    ``_verify_tasks`` / ``_fetch_timings`` lists let each shared task count once here.
    """
    fetch_by_kind: dict[str, Mapping[str, Any]] = {}
    verify_tasks: dict[Any, Mapping[str, Any]] = {}
    rollouts = accepted = tokens = 0
    rejected: Counter = Counter()
    calls = planned = 0
    assemble_ms = 0.0
    bytes_fetched = 0
    for m in group_metrics.values():
        for t in m.get("_verify_tasks", ()):
            verify_tasks[t["task"]] = t
        for t in m.get("_fetch_timings", ()):
            fetch_by_kind[t["kind"]] = t
        rollouts += m["rollouts"]
        accepted += m["accepted"]
        tokens += m["tokens"]
        rejected.update(m["rejected"])
        calls += m["_calls"]
        planned += m["_planned"]
        assemble_ms += m["assemble_ms"]
        bytes_fetched += m["bytes_fetched"]
    fetch_timings = list(fetch_by_kind.values())
    fetch_ms = sum(t["fetch_ms"] for t in fetch_timings)
    verify_ms = sum(t["ms"] for t in verify_tasks.values())
    wall_ms = max(0.0, (collected_s - submitted_s) * 1e3)
    return {
        "kind": EVENT_KIND_STEP,
        "step_id": step_id,
        "groups": len(group_metrics),
        "rollouts": rollouts,
        "accepted": accepted,
        "rejected": dict(sorted(rejected.items())),
        "tokens": tokens,
        "fetch_ms": fetch_ms,
        "split_ms": sum(t.get("split_ms", 0.0) for t in fetch_timings),
        "verify_ms": verify_ms,
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
    }


def public(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` without the private ``_``-prefixed bookkeeping keys (what events carry)."""
    return {k: v for k, v in metrics.items() if not k.startswith("_")}
