"""Rolling state of the trainer-side figures, free of Dask: staleness by rollout length
(from the step events) and the mismatch monitor's reports (``token-capture-mismatch``).

Bounded like the rest of the state: rings of ``history`` steps and reports, totals per
length bucket since the scheduler started (``/metrics`` counters) and over the steps in
the ring (the page's chart: what staleness is now, not since the start), the latest
report (``/metrics`` gauges) and two per-report histograms (k3 and mean |delta logprob|,
nats).
"""
from __future__ import annotations

from collections import deque
from typing import Any, TypedDict

from tasks.finalize.staleness import BUCKET_LABELS

from .histogram import Histogram
from .trainer_events import MismatchEvent, StalenessRecord

# Upper bounds (nats) of the per-report histograms of k3 and of mean |delta logprob|.
MISMATCH_BOUNDS: tuple[float, ...] = (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0)


class StalenessStep(TypedDict):
    """One step's staleness as the page draws it."""

    step_id: str
    t: float
    rollouts: int
    stale: int
    mean_lag: float
    max_lag: float
    trainer_version: float | None


class BucketTotals(TypedDict):
    """A length bucket over some steps: rollouts, dropped stale, mean lag (versions)."""

    bucket: str
    rollouts: int
    stale: int
    lag_sum: float
    mean_lag: float


class TrainerState:
    """The staleness and mismatch aggregates of :class:`~.state.TokenCaptureState`."""

    def __init__(self, history: int) -> None:
        self.history = history
        self.staleness_steps: deque[StalenessStep] = deque(maxlen=history)
        self.step_buckets: deque[list[BucketTotals]] = deque(maxlen=history)  # beside staleness_steps
        self.buckets: dict[str, BucketTotals] = {b: _bucket(b) for b in BUCKET_LABELS}  # since the start
        self.mismatch: deque[MismatchEvent] = deque(maxlen=history)
        self.mismatch_reports = 0
        self.latest: MismatchEvent | None = None
        self.hist = {"mismatch_k3": Histogram(MISMATCH_BOUNDS), "mismatch_abs_delta": Histogram(MISMATCH_BOUNDS)}

    def fold_staleness(self, step_id: str, t: float, rec: StalenessRecord) -> None:
        """A step event's staleness figures."""
        self.staleness_steps.append({
            "step_id": step_id, "t": t, "rollouts": rec["rollouts"], "stale": rec["stale"],
            "mean_lag": rec["mean_lag"], "max_lag": rec["max_lag"], "trainer_version": rec["trainer_version"]})
        kept = [b for b in rec["buckets"] if _add(self.buckets, b)]
        self.step_buckets.append(kept)

    def recent_buckets(self) -> list[BucketTotals]:
        """Totals per length bucket over the steps in the ring (the last ``history``)."""
        out: dict[str, BucketTotals] = {b: _bucket(b) for b in BUCKET_LABELS}
        for step in self.step_buckets:
            for b in step:
                _add(out, b)
        return list(out.values())

    def fold_mismatch(self, ev: MismatchEvent) -> None:
        """One mismatch report."""
        self.mismatch_reports += 1
        ev["seq"] = self.mismatch_reports  # type: ignore[typeddict-unknown-key]
        self.mismatch.append(ev)
        self.latest = ev
        self.hist["mismatch_k3"].observe(ev.get("k3_mean", 0.0))
        self.hist["mismatch_abs_delta"].observe(ev.get("mean_abs_delta", 0.0))

    def snapshot(self) -> dict[str, Any]:
        """``staleness`` ({steps, buckets}) and ``mismatch`` ({reports, latest, events})."""
        return {
            "staleness": {"steps": [s.copy() for s in self.staleness_steps],
                          "buckets": [b.copy() for b in self.buckets.values()],
                          "recent_buckets": self.recent_buckets(), "recent_steps": len(self.step_buckets)},
            "mismatch": {"reports": self.mismatch_reports, "latest": dict(self.latest) if self.latest else None,
                         "events": [dict(e) for e in self.mismatch]},
        }


def _bucket(label: str) -> BucketTotals:
    return {"bucket": label, "rollouts": 0, "stale": 0, "lag_sum": 0.0, "mean_lag": 0.0}


def _add(totals: dict[str, BucketTotals], b: BucketTotals) -> bool:
    """Add one step's bucket ``b`` into ``totals``; False (nothing added) for a label past
    the bound (a producer with other buckets: the state stays bounded)."""
    tot = totals.get(b["bucket"])
    if tot is None:
        if len(totals) >= 2 * len(BUCKET_LABELS):
            return False
        tot = totals[b["bucket"]] = _bucket(b["bucket"])
    tot["rollouts"] += b["rollouts"]
    tot["stale"] += b["stale"]
    tot["lag_sum"] += b["lag_sum"]
    tot["mean_lag"] = tot["lag_sum"] / tot["rollouts"] if tot["rollouts"] else 0.0
    return True
