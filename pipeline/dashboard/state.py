"""Rolling state of the token-capture events (``pipeline.events``), free of Dask.

:class:`TokenCaptureState` folds valid events (:func:`~pipeline.dashboard.parsing.parse_event`)
into bounded aggregates (totals, rings, fixed-bucket :class:`Histogram` s) and answers the
queries the page, the Prometheus collector and the adaptive policy make. It holds no
scheduler reference: whatever it needs from the scheduler is passed in as plain values.
Its knobs are read once, when it is built (:class:`~pipeline.dashboard.settings.StateSettings`).
"""
from __future__ import annotations

import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from tasks.errors import InvalidEvent

from .. import config
from ..events import CUT, FINALIZE, MISMATCH, RESTORE, SCALE, STORE, TOPICS
from .histogram import Histogram
from .parsing import (
    DETAIL_CHARS,
    DETAIL_REASONS,
    FINALIZE_KINDS,
    SCALE_ACTIONS,
    CutEvent,
    FinalizeEvent,
    ParsedEvent,
    RestoreEvent,
    ScaleEvent,
    StoreEvent,
    parse_event,
)
from .settings import StateSettings
from .snapshot import StateSnapshot, StepRecord
from .trainer_events import MismatchEvent
from .trainer_state import TrainerState

__all__ = [
    "DETAIL_CHARS", "DETAIL_REASONS", "FINALIZE_KINDS", "MS_PER_S", "RESTORE_COUNTERS", "SCALE_ACTIONS",
    "Histogram", "InvalidEvent", "SchedulerLoad", "StoreFillSettings", "TokenCaptureState", "parse_event",
]

logger = logging.getLogger(__name__)

MS_PER_S = 1000.0  # events carry milliseconds (``*_ms``); the histograms hold seconds
RESTORE_COUNTERS = ("requests", "gets", "keys", "failures", "latency_count")
"""A restore batcher's counters, cumulative since it started."""

SchedulerLoad = Mapping[str, float]
"""The scheduler's load as :meth:`TokenCaptureState.signal` takes it: ``tasks``,
``workers``, ``finalize_slots``, ``actor_hosts`` (counts)."""

STALE_REPORTS = 3
"""A unit whose latest ``STORE`` event is older than this many report intervals is gone:
its bytes no longer count toward the store's fill."""


@dataclass(frozen=True)
class StoreFillSettings:
    """``stale_s``: a unit's latest report older than this no longer counts toward the
    store's fill (s; ``STALE_REPORTS`` x ``store.report-interval-s``, infinite when units
    do not report by themselves)."""

    stale_s: float

    @classmethod
    def from_config(cls) -> StoreFillSettings:
        """The knob read now, once."""
        interval_s = float(config.get("store.report-interval-s"))
        return cls(STALE_REPORTS * interval_s if interval_s > 0 else math.inf)


# --------------------------------------------------------------------------- state
class TokenCaptureState:
    """Bounded rolling aggregates of token-capture events.

    ``history`` (events per ring, default ``dashboard.history``) bounds memory: the state
    holds O(history + units + restore workers) small dicts whatever the run length.
    ``settings`` (default: read from the config now, ``history`` applied) are its knobs.
    """

    def __init__(self, history: int | None = None, settings: StateSettings | None = None,
                 store_settings: StoreFillSettings | None = None) -> None:
        self.settings = settings if settings is not None else StateSettings.from_config(history)
        self.store_settings = store_settings if store_settings is not None else StoreFillSettings.from_config()
        self.history = self.settings.history
        self.seconds_bounds = self.settings.seconds_bounds
        self.started = time.time()
        self.version = 0  # bumped on every accepted event; the page redraws on change
        # accepted events per topic: 0 means "no data yet", not a figure of zero
        self.events: Counter[str] = Counter()

        # finalize
        self.groups: deque[FinalizeEvent] = deque(maxlen=self.history)
        self.steps: OrderedDict[str, StepRecord] = OrderedDict()
        self.totals: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        # the latest detail per rejection reason, most recently updated last (bounded)
        self.rejected_details: OrderedDict[str, str] = OrderedDict()
        # Latencies in seconds (the events' *_ms / 1000), bounds metrics.buckets-seconds.
        self.hist: dict[str, Histogram] = {
            "fetch_seconds": Histogram(self.seconds_bounds),
            "verify_seconds": Histogram(self.seconds_bounds),
            "assemble_seconds": Histogram(self.seconds_bounds),
            "queue_wait_seconds": Histogram(self.seconds_bounds),
            "calls_per_rollout": Histogram(self.settings.call_bounds),
            "cut_wall_seconds": Histogram(self.seconds_bounds),
            "step_wall_seconds": Histogram(self.seconds_bounds),
        }
        self.queue_depth = 0.0  # groups in flight (latest report)
        self.depths: deque[tuple[float, float]] = deque(maxlen=self.history)  # (t (s), queue depth)
        # cut
        self.cuts: deque[CutEvent] = deque(maxlen=self.history)
        self.cut_totals: Counter[str] = Counter()
        self.cut_failures: Counter[str] = Counter()
        # restore
        self.restore_base: Counter[str] = Counter()  # counts of batchers since replaced
        self.restore_latency_base = Histogram(self.seconds_bounds)  # latencies of batchers since replaced
        self.restore_failures: Counter[str] = Counter()
        self.restore_reports = 0
        self.restore_latest: OrderedDict[str, RestoreEvent] = OrderedDict()
        self.restores: deque[RestoreEvent] = deque(maxlen=self.history)
        # store
        self.store_units: OrderedDict[str, StoreEvent] = OrderedDict()
        # scaling
        self.decisions: deque[ScaleEvent] = deque(maxlen=self.history)
        self.decision_counts: Counter[tuple[str, str]] = Counter()
        # workers over time, sampled on scaling events and by the page (bounded ring)
        self.worker_counts: deque[tuple[float, int]] = deque(maxlen=self.history)  # (t (s), workers)
        # the trainer side: staleness by rollout length, the mismatch monitor's reports
        self.trainer = TrainerState(self.history)
        # bad input
        self.malformed: Counter[tuple[str, str]] = Counter()
        self.last_error: str = ""

    # ------------------------------------------------------------------ events
    def ingest(self, topic: str, msg: object) -> bool:
        """Fold one event into the state; ignore other topics, count malformed ones.

        Returns True when the event was folded in, False when ignored or dropped.
        """
        if topic not in TOPICS:
            return False
        try:
            ev = parse_event(topic, msg)
        except InvalidEvent as e:
            self.malformed[(e.topic, e.field)] += 1
            self.last_error = str(e)
            logger.warning("dropped malformed token-capture event: %s", e)
            return False
        ev["t"] = time.time()
        self._fold(topic, ev)
        self.events[topic] += 1
        self.version += 1
        return True

    def _fold(self, topic: str, ev: ParsedEvent) -> None:
        """Fold ``ev`` into its topic's aggregates (``parse_event`` made it that topic's record)."""
        if topic == FINALIZE:
            self._finalize(cast(FinalizeEvent, ev))
        elif topic == CUT:
            self._cut(cast(CutEvent, ev))
        elif topic == RESTORE:
            self._restore(cast(RestoreEvent, ev))
        elif topic == STORE:
            self._store(cast(StoreEvent, ev))
        elif topic == SCALE:
            self._scale(cast(ScaleEvent, ev))
        elif topic == MISMATCH:
            self.trainer.fold_mismatch(cast(MismatchEvent, ev))
        else:
            raise KeyError(topic)

    def _finalize(self, ev: FinalizeEvent) -> None:
        if ev["kind"] == "step":
            self._finalize_step(ev)
        else:
            self._finalize_group(ev)

    def _step_entry(self, ev: FinalizeEvent) -> StepRecord:
        """The step ``ev`` belongs to, added (oldest dropped past ``history``) if new."""
        key = ev["step_id"] or f"group-{self.totals['groups']}"
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = StepRecord(
                step_id=key, groups=0, rollouts=0, accepted=0, fetch_ms=0.0,
                verify_ms=0.0, assemble_ms=0.0, wall_ms=0.0, dominant="",
                cross_host_bytes=0.0, cross_host_bytes_planned=0.0, final=False, t=ev["t"], t_last=ev["t"],
            )
            while len(self.steps) > self.history:
                self.steps.popitem(last=False)
        step["t_last"] = ev["t"]
        return step

    def _finalize_group(self, ev: FinalizeEvent) -> None:
        self.groups.append(ev)
        t = self.totals
        t["groups"] += 1
        t["rollouts"] += int(ev["rollouts"])
        t["accepted"] += int(ev["accepted"])
        t["rejected"] += sum(ev["rejected"].values())
        if ev.get("internal_errors", 0):  # optional; absent on events from older publishers
            t["internal_errors"] += int(ev["internal_errors"])
        for k in ("fetch_calls", "bytes_fetched", "tokens"):
            t[k] += ev[k]
        self.rejected.update(ev["rejected"])
        for reason, detail in ev["rejected_details"].items():
            self.rejected_details[reason] = detail
            self.rejected_details.move_to_end(reason)
        while len(self.rejected_details) > DETAIL_REASONS:
            self.rejected_details.popitem(last=False)
        self.hist["queue_wait_seconds"].observe(ev["queue_wait_ms"] / MS_PER_S)
        if ev["calls_per_rollout"]:
            self.hist["calls_per_rollout"].observe(ev["calls_per_rollout"])
        self.queue_depth = ev["queue_depth"]
        self.depths.append((ev["t"], ev["queue_depth"]))

        step = self._step_entry(ev)
        step["groups"] += 1
        step["rollouts"] += int(ev["rollouts"])
        step["accepted"] += int(ev["accepted"])
        if not step["final"]:  # provisional until the step event arrives
            step["fetch_ms"] = max(step["fetch_ms"], ev["fetch_ms"])  # one union fetch per step
            step["verify_ms"] += ev["verify_ms"]
            step["assemble_ms"] += ev["assemble_ms"]

    def _finalize_step(self, ev: FinalizeEvent) -> None:
        step = self._step_entry(ev)
        step.update(
            final=True, fetch_ms=ev["fetch_ms"], verify_ms=ev["verify_ms"], assemble_ms=ev["assemble_ms"],
            wall_ms=ev["wall_ms"], dominant=str(ev.get("dominant") or ""),
            cross_host_bytes=ev["cross_host_bytes"], cross_host_bytes_planned=ev["cross_host_bytes_planned"],
        )
        self.totals["cross_host_bytes"] += ev["cross_host_bytes"]
        self.totals["cross_host_bytes_planned"] += ev["cross_host_bytes_planned"]
        if ev["groups"]:
            step["groups"] = int(ev["groups"])
        if ev["rollouts"]:
            step["rollouts"], step["accepted"] = int(ev["rollouts"]), int(ev["accepted"])
        self.totals["steps"] += 1
        for phase in ("fetch", "verify", "assemble"):
            ms = ev[f"{phase}_ms"]
            self.totals[f"{phase}_ms"] += ms
            self.hist[f"{phase}_seconds"].observe(ms / MS_PER_S)
        self.hist["step_wall_seconds"].observe(ev["wall_ms"] / MS_PER_S)
        if "staleness" in ev:
            self.trainer.fold_staleness(step["step_id"], ev["t"], ev["staleness"])
        depth = ev["queue_depth_after"] if "queue_depth_after" in ev else ev["queue_depth"]
        self.queue_depth = depth
        self.depths.append((ev["t"], depth))

    def _cut(self, ev: CutEvent) -> None:
        self.cuts.append(ev)
        self.cut_totals["cuts"] += 1
        for k in ("calls", "rows", "puts", "durable", "wall_ms"):
            self.cut_totals[k] += ev[k]
        self.cut_failures.update(ev["failures"])
        self.hist["cut_wall_seconds"].observe(ev["wall_ms"] / MS_PER_S)

    def _restore(self, ev: RestoreEvent) -> None:
        # Reports carry counters cumulative since the batcher started.
        self.restores.append(ev)
        self.restore_reports += 1
        worker = ev["worker"] or "?"
        prev = self.restore_latest.pop(worker, None)
        if prev is not None and any(ev[k] < prev[k] for k in RESTORE_COUNTERS):
            self._retire_restore(prev)  # a new batcher on this worker: keep the old counts
        self.restore_latest[worker] = ev
        while len(self.restore_latest) > self.history:
            self._retire_restore(self.restore_latest.popitem(last=False)[1])

    def _retire_restore(self, ev: RestoreEvent) -> None:
        """Keep a replaced (or dropped) batcher's counts and latencies in the base."""
        for k in RESTORE_COUNTERS:
            self.restore_base[k] += ev[k]
        self.restore_failures.update(ev["failures_by_reason"])
        self.restore_latency_base.add_counts(ev["latency_bounds_s"], ev["latency_counts"], ev["latency_sum_s"])

    def _store(self, ev: StoreEvent) -> None:
        self.store_units[ev["unit"]] = ev
        while len(self.store_units) > self.history:
            self.store_units.popitem(last=False)

    def _scale(self, ev: ScaleEvent) -> None:
        self.decisions.append(ev)
        self.decision_counts[(ev["action"], ev["reason_code"])] += 1

    def sample_workers(self, n_workers: int) -> None:
        """Record the current worker count ``n_workers`` (for the page's scaling plot).

        A sample is kept only when the count changed or the last one is older than
        ``dashboard.update-ms`` (read when the state was built), so the ring covers the
        same span however often it is called (every open page calls it on each refresh).
        """
        now, n = time.time(), int(n_workers)
        if self.worker_counts:
            last_t, last_n = self.worker_counts[-1]
            if n == last_n and (now - last_t) * 1000 < self.settings.worker_sample_ms:
                return
        self.worker_counts.append((now, n))

    # ------------------------------------------------------------------ queries
    def restore_latency(self) -> Histogram:
        """Restore request latency (s) over all batchers, past and present: each batcher's
        latest cumulative counts plus those of batchers since replaced."""
        out = Histogram(self.seconds_bounds)
        base = self.restore_latency_base
        out.counts, out.total, out.n = list(base.counts), base.total, base.n
        for ev in self.restore_latest.values():
            out.add_counts(ev["latency_bounds_s"], ev["latency_counts"], ev["latency_sum_s"])
        return out

    @property
    def restore_totals(self) -> Counter[str]:
        """Restore counters over all batchers, past and present (``reports`` counts events)."""
        out: Counter[str] = Counter(self.restore_base)
        for ev in self.restore_latest.values():
            for k in RESTORE_COUNTERS:
                out[k] += ev[k]
        del out["latency_count"]  # in restore_latency()
        out["reports"] = self.restore_reports
        return out

    def restore_failures_by_reason(self) -> Counter[str]:
        """Restore failures by verdict over all batchers, past and present."""
        out: Counter[str] = Counter(self.restore_failures)
        for ev in self.restore_latest.values():
            out.update(ev["failures_by_reason"])
        return out

    def signal(self, window_s: float | None = None, load: SchedulerLoad | None = None) -> dict[str, float]:
        """The adaptive policy's input: recent split timing, queue trend and load.

        Over the last ``window_s`` seconds (default ``scaling.window-s``, read when the
        state was built): ``events`` (finalize events), ``steps`` (steps updated),
        ``fetch_ms``/``verify_ms``/``assemble_ms`` summed over those steps (per step: the
        step event's figures, or the provisional split of its groups so far),
        ``queue_depth_first``/``_last``/``_max``; ``last_event_age_s`` (seconds since the
        newest finalize event, ``inf`` if none); the store's fill (:meth:`store_fill`). The
        scheduler load ``tasks``, ``workers``, ``finalize_slots`` and ``actor_hosts`` come
        from ``load`` (0 when not given).
        """
        window = float(window_s if window_s is not None else self.settings.window_s)
        now = time.time()
        # split per step (provisional or final), over steps updated in the window
        recent_steps = [st for st in self.steps.values() if now - st["t_last"] <= window]
        depths = [d for t, d in self.depths if now - t <= window]
        newest = self.depths[-1][0] if self.depths else None
        out: dict[str, float] = {
            "window_s": window,
            "events": len(depths),
            "steps": len(recent_steps),
            "fetch_ms": sum(st["fetch_ms"] for st in recent_steps),
            "verify_ms": sum(st["verify_ms"] for st in recent_steps),
            "assemble_ms": sum(st["assemble_ms"] for st in recent_steps),
            "queue_depth_first": depths[0] if depths else 0.0,
            "queue_depth_last": depths[-1] if depths else 0.0,
            "queue_depth_max": max(depths) if depths else 0.0,
            "last_event_age_s": (now - newest) if newest is not None else math.inf,
            "tasks": 0,
            "workers": 0,
            "finalize_slots": 0.0,
            "actor_hosts": 0,
            **self.store_fill(now),
        }
        if load is not None:
            out.update(load)
        return out

    def store_fill(self, now: float | None = None) -> dict[str, float]:
        """The store's fill from the latest ``STORE`` event of each live unit (one that
        reported within ``store_settings.stale_s`` of ``now``, scheduler wall-clock s):
        ``store_used_bytes``, ``store_capacity_bytes`` (sums), ``store_units`` (count) and
        ``store_unit_capacity_max_bytes`` (the largest unit's capacity); 0 when none."""
        now = time.time() if now is None else now
        live = [ev for ev in self.store_units.values() if now - ev["t"] <= self.store_settings.stale_s]
        return {
            "store_used_bytes": sum(ev["used_bytes"] for ev in live),
            "store_capacity_bytes": sum(ev["capacity_bytes"] for ev in live),
            "store_units": len(live),
            "store_unit_capacity_max_bytes": max((ev["capacity_bytes"] for ev in live), default=0.0),
        }

    def snapshot(self) -> StateSnapshot:
        """All state as plain JSON-able data (for the RPC handler, tests and tools).

        ``events`` counts the events folded in per topic: a topic at 0 (or absent) has
        no data yet, which a view shows as such rather than as figures of zero.
        ``histograms`` hold seconds (``*_seconds``) or counts (``calls_per_rollout``).
        """
        hists = dict(self.hist, restore_latency_seconds=self.restore_latency(), **self.trainer.hist)
        return {
            "version": self.version,
            "events": {topic: self.events.get(topic, 0) for topic in TOPICS},
            "totals": dict(self.totals),
            "rejected": dict(self.rejected),
            "rejected_details": dict(self.rejected_details),
            "queue_depth": self.queue_depth,
            "groups": [g.copy() for g in self.groups],
            "steps": [s.copy() for s in self.steps.values()],
            "cut_totals": dict(self.cut_totals),
            "cut_failures": dict(self.cut_failures),
            "cuts": [c.copy() for c in self.cuts],
            "restore_totals": dict(self.restore_totals),
            "restore_failures": dict(self.restore_failures_by_reason()),
            "depths": [list(d) for d in self.depths],
            "restore_latest": {k: v.copy() for k, v in self.restore_latest.items()},
            "store_units": {k: v.copy() for k, v in self.store_units.items()},
            "decisions": [d.copy() for d in self.decisions],
            "decision_counts": {f"{a}:{r}": n for (a, r), n in self.decision_counts.items()},
            "malformed": {f"{t}:{f}": n for (t, f), n in self.malformed.items()},
            "last_error": self.last_error,
            **self.trainer.snapshot(),  # type: ignore[typeddict-item]
            "histograms": {
                k: {"buckets": h.cumulative(), "sum": h.total, "count": h.n} for k, h in hists.items()
            },
        }
