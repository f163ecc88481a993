"""Rolling state of the token-capture events (``pipeline.events``), free of Dask.

:func:`parse_event` validates one event; :class:`TokenCaptureState` folds valid events
into bounded aggregates (totals, rings, fixed-bucket :class:`Histogram` s) and answers the
queries the page, the Prometheus collector and the adaptive policy make. It holds no
scheduler reference: whatever it needs from the scheduler is passed in as plain values.
"""
from __future__ import annotations

import logging
import math
import time
from bisect import bisect_left
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tasks.errors import InvalidEvent

from .. import config
from ..events import CUT, FINALIZE, RESTORE, RESTORE_OPTIONAL, SCALE, STORE, TOPICS

logger = logging.getLogger(__name__)

SCALE_ACTIONS = ("up", "down", "hold")
MS_PER_S = 1000.0  # events carry milliseconds (``*_ms``); the histograms hold seconds
DETAIL_CHARS = 200  # a rejection detail is kept this many characters long
DETAIL_REASONS = 64  # latest details kept, one per reason (oldest reason dropped first)


# --------------------------------------------------------------------------- parsing
def _number(topic: str, msg: Mapping[str, Any], key: str, required: bool) -> float:
    """A finite, non-negative number from ``msg[key]`` (0.0 when optional and absent)."""
    if key not in msg or msg[key] is None:
        if required:
            raise InvalidEvent(topic, key, "missing")
        return 0.0
    value = msg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidEvent(topic, key, f"expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise InvalidEvent(topic, key, f"expected a finite number >= 0, got {value!r}")
    return value


def _counts(topic: str, msg: Mapping[str, Any], key: str) -> dict[str, int]:
    """A ``reason -> count`` mapping from ``msg[key]`` (empty when absent)."""
    value = msg.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidEvent(topic, key, f"expected a mapping reason -> count, got {type(value).__name__}")
    out: dict[str, int] = {}
    for reason, count in value.items():
        n = _number(topic, {key: count}, key, required=True)
        out[str(reason)] = int(n)
    return out


def _label(topic: str, msg: Mapping[str, Any], key: str, required: bool) -> str:
    """A string label from ``msg[key]`` (str or int; ``""`` when optional and absent)."""
    value = msg.get(key)
    if value is None:
        if required:
            raise InvalidEvent(topic, key, "missing")
        return ""
    if not isinstance(value, (str, int)):
        raise InvalidEvent(topic, key, f"expected a str or int label, got {type(value).__name__}")
    return str(value)


def _details(topic: str, msg: Mapping[str, Any], key: str) -> dict[str, str]:
    """A ``reason -> detail`` mapping from ``msg[key]`` (empty when absent), each detail a
    string cut to :data:`DETAIL_CHARS` characters and at most :data:`DETAIL_REASONS` reasons."""
    value = msg.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidEvent(topic, key, f"expected a mapping reason -> detail, got {type(value).__name__}")
    out: dict[str, str] = {}
    for reason, detail in list(value.items())[:DETAIL_REASONS]:
        if not isinstance(detail, str):
            raise InvalidEvent(topic, key, f"expected a str detail, got {type(detail).__name__}")
        out[str(reason)[:DETAIL_CHARS]] = detail[:DETAIL_CHARS]
    return out


FINALIZE_KINDS = ("group", "step")
_FINALIZE_NUMBERS = {
    # name: required
    "fetch_ms": True,
    "verify_ms": True,
    "assemble_ms": True,
    "rollouts": False,
    "accepted": False,
    "queue_wait_ms": False,
    "queue_depth": False,
    "calls_per_rollout": False,
    "fetch_calls": False,
    "bytes_fetched": False,
    "tokens": False,
    "internal_errors": False,  # group events: verifier bugs, counted apart from rejections
    "groups": False,  # step events
    "wall_ms": False,  # step events
    "queue_depth_after": False,  # step events
}
_CUT_NUMBERS = {"wall_ms": True, "rows": True, "puts": True, "calls": False, "durable": False}
_RESTORE_NUMBERS = {
    "requests": False,
    "gets": False,
    "keys": False,
    "keys_per_get": False,
    "p50_ms": False,
    "p99_ms": False,
}
RESTORE_COUNTERS = ("requests", "gets", "keys", "failures", "latency_count")
_STORE_NUMBERS = {
    "memory_bytes": True, "spilled_bytes": True, "rows": False, "used_bytes": False, "capacity_bytes": False,
    "lost_keys": False,  # keys staged whose both copies were lost (replicas=2)
}
_SCALE_NUMBERS = {"target": True, "current": True, "verify_ms": False, "fetch_ms": False, "queue_depth": False}


def parse_event(topic: str, msg: Any) -> dict[str, Any]:
    """Validate one event of ``topic`` and return it normalized (numbers as float).

    Raises :class:`InvalidEvent` naming the topic and field when ``msg`` does not follow
    the schema in ``pipeline.events``. Unknown extra keys are kept as they are.
    """
    if topic not in TOPICS:
        raise InvalidEvent(topic, "topic", "not a token-capture topic")
    if not isinstance(msg, Mapping):
        raise InvalidEvent(topic, "msg", f"expected a mapping, got {type(msg).__name__}")
    out = dict(msg)
    if topic == FINALIZE:
        out.update({k: _number(topic, msg, k, req) for k, req in _FINALIZE_NUMBERS.items()})
        out["rejected"] = _counts(topic, msg, "rejected")
        out["rejected_details"] = _details(topic, msg, "rejected_details")
        out["step_id"] = _label(topic, msg, "step_id", required=False)
        out["group_id"] = _label(topic, msg, "group_id", required=False)
        out["kind"] = msg.get("kind") or "group"
        if out["kind"] not in FINALIZE_KINDS:
            raise InvalidEvent(topic, "kind", f"expected one of {FINALIZE_KINDS}, got {out['kind']!r}")
        if "accepted" not in msg and "rollouts" in msg:
            out["accepted"] = max(0.0, out["rollouts"] - sum(out["rejected"].values()))
        if "rollouts" not in msg:
            out["rollouts"] = out["accepted"] + sum(out["rejected"].values())
    elif topic == CUT:
        out.update({k: _number(topic, msg, k, req) for k, req in _CUT_NUMBERS.items()})
        out["failures"] = _counts(topic, msg, "failures")
        out["checkpoint_id"] = _label(topic, msg, "checkpoint_id", required=False)
        out["worker"] = _label(topic, msg, "worker", required=False)
    elif topic == RESTORE:
        out.update({k: _number(topic, msg, k, req) for k, req in _RESTORE_NUMBERS.items()})
        out["worker"] = _label(topic, msg, "worker", required=False)
        # failures: a count, or {verdict: count} as PrefixReadBatcher publishes them
        if isinstance(msg.get("failures"), Mapping):
            out["failures_by_reason"] = _counts(topic, msg, "failures")
            out["failures"] = float(sum(out["failures_by_reason"].values()))
        else:
            out["failures"] = _number(topic, msg, "failures", required=False)
            out["failures_by_reason"] = {}
        if "keys_per_get" not in msg and out["gets"]:
            out["keys_per_get"] = out["keys"] / out["gets"]
        _latency_histogram(topic, msg, out)
    elif topic == STORE:
        out.update({k: _number(topic, msg, k, req) for k, req in _STORE_NUMBERS.items()})
        out["unit"] = _label(topic, msg, "unit", required=True)
        out["worker"] = _label(topic, msg, "worker", required=False)
    elif topic == SCALE:
        out.update({k: _number(topic, msg, k, req) for k, req in _SCALE_NUMBERS.items()})
        action = msg.get("action")
        if action not in SCALE_ACTIONS:
            raise InvalidEvent(topic, "action", f"expected one of {SCALE_ACTIONS}, got {action!r}")
        out["reason"] = _label(topic, msg, "reason", required=True)
        out["reason_code"] = _label(topic, msg, "reason_code", required=False) or out["reason"].split(":")[0]
    return out


def _latency_histogram(topic: str, msg: Mapping[str, Any], out: dict[str, Any]) -> None:
    """A restore event's latency histogram (optional keys, :data:`RESTORE_OPTIONAL`):
    ``latency_bounds_s`` increasing finite bounds (s), ``latency_counts`` one non-negative
    count per bucket plus +Inf, ``latency_sum_s``; adds ``latency_count`` (their sum)."""
    bounds = msg.get("latency_bounds_s", RESTORE_OPTIONAL["latency_bounds_s"])
    counts = msg.get("latency_counts", RESTORE_OPTIONAL["latency_counts"])
    if not isinstance(bounds, (list, tuple)):
        raise InvalidEvent(topic, "latency_bounds_s", f"expected a list of bounds, got {type(bounds).__name__}")
    if not isinstance(counts, (list, tuple)):
        raise InvalidEvent(topic, "latency_counts", f"expected a list of counts, got {type(counts).__name__}")
    b = [_number(topic, {"latency_bounds_s": x}, "latency_bounds_s", required=True) for x in bounds]
    if any(hi <= lo for lo, hi in zip(b, b[1:])):
        raise InvalidEvent(topic, "latency_bounds_s", "bounds must increase")
    c = [int(_number(topic, {"latency_counts": x}, "latency_counts", required=True)) for x in counts]
    if (b or c) and len(c) != len(b) + 1:
        raise InvalidEvent(topic, "latency_counts", f"expected {len(b) + 1} counts (one per bound, then +Inf), got {len(c)}")
    out["latency_bounds_s"] = b
    out["latency_counts"] = c
    out["latency_sum_s"] = _number(topic, msg, "latency_sum_s", required=False)
    out["latency_count"] = float(sum(c))


# --------------------------------------------------------------------------- histograms
@dataclass
class Histogram:
    """Fixed-bucket histogram with Prometheus semantics (a value lands in ``le >= value``).

    ``counts[i]`` counts values in ``(bounds[i-1], bounds[i]]``; the last slot is +Inf.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.bounds = tuple(sorted(float(b) for b in self.bounds))
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def add_counts(self, bounds: list[float], counts: list[int], total: float) -> None:
        """Add another histogram's per-bucket ``counts`` over ``bounds`` (plus +Inf) and its
        sum. Each bucket lands in ours whose ``le`` is >= its own upper bound: exact when
        the bounds match (both sides read ``metrics.buckets-seconds``), an upper estimate
        otherwise."""
        for i, n in enumerate(counts):
            slot = bisect_left(self.bounds, bounds[i]) if i < len(bounds) else len(self.bounds)
            self.counts[slot] += n
            self.n += n
        self.total += total

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` ending with ``("+Inf", n)``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append((_le(bound), running))
        out.append(("+Inf", self.n))
        return out


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else repr(bound)


# --------------------------------------------------------------------------- state
class TokenCaptureState:
    """Bounded rolling aggregates of token-capture events.

    ``history`` (events per ring, default ``dashboard.history``) bounds memory: the state
    holds O(history + units + restore workers) small dicts whatever the run length.
    """

    def __init__(self, history: int | None = None) -> None:
        self.history = int(history if history is not None else config.get("dashboard.history"))
        self.seconds_bounds = tuple(float(b) for b in config.get("metrics.buckets-seconds"))
        call_bounds = tuple(config.get("metrics.buckets-calls"))
        self.started = time.time()
        self.version = 0  # bumped on every accepted event; the page redraws on change
        # accepted events per topic: 0 means "no data yet", not a figure of zero
        self.events: Counter[str] = Counter()

        # finalize
        self.groups: deque[dict[str, Any]] = deque(maxlen=self.history)
        self.steps: OrderedDict[str, dict[str, Any]] = OrderedDict()
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
            "calls_per_rollout": Histogram(call_bounds),
            "cut_wall_seconds": Histogram(self.seconds_bounds),
            "step_wall_seconds": Histogram(self.seconds_bounds),
        }
        self.queue_depth = 0.0
        self.depths: deque[tuple[float, float]] = deque(maxlen=self.history)  # (t, queue depth)
        # cut
        self.cuts: deque[dict[str, Any]] = deque(maxlen=self.history)
        self.cut_totals: Counter[str] = Counter()
        self.cut_failures: Counter[str] = Counter()
        # restore
        self.restore_base: Counter[str] = Counter()  # counts of batchers since replaced
        self.restore_latency_base = Histogram(self.seconds_bounds)  # latencies of batchers since replaced
        self.restore_failures: Counter[str] = Counter()
        self.restore_reports = 0
        self.restore_latest: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.restores: deque[dict[str, Any]] = deque(maxlen=self.history)
        # store
        self.store_units: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # scaling
        self.decisions: deque[dict[str, Any]] = deque(maxlen=self.history)
        self.decision_counts: Counter[tuple[str, str]] = Counter()
        # workers over time, sampled on scaling events and by the page (bounded ring)
        self.worker_counts: deque[tuple[float, int]] = deque(maxlen=self.history)
        # bad input
        self.malformed: Counter[tuple[str, str]] = Counter()
        self.last_error: str = ""

    # ------------------------------------------------------------------ events
    def ingest(self, topic: str, msg: Any) -> bool:
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
        {
            FINALIZE: self._finalize,
            CUT: self._cut,
            RESTORE: self._restore,
            STORE: self._store,
            SCALE: self._scale,
        }[topic](ev)
        self.events[topic] += 1
        self.version += 1
        return True

    def _finalize(self, ev: dict[str, Any]) -> None:
        if ev["kind"] == "step":
            self._finalize_step(ev)
        else:
            self._finalize_group(ev)

    def _step_entry(self, ev: dict[str, Any]) -> dict[str, Any]:
        key = ev["step_id"] or f"group-{self.totals['groups']}"
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = {
                "step_id": key, "groups": 0, "rollouts": 0, "accepted": 0, "fetch_ms": 0.0,
                "verify_ms": 0.0, "assemble_ms": 0.0, "wall_ms": 0.0, "dominant": "",
                "final": False, "t": ev["t"], "t_last": ev["t"],
            }
            while len(self.steps) > self.history:
                self.steps.popitem(last=False)
        step["t_last"] = ev["t"]
        return step

    def _finalize_group(self, ev: dict[str, Any]) -> None:
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

    def _finalize_step(self, ev: dict[str, Any]) -> None:
        step = self._step_entry(ev)
        step.update(
            final=True, fetch_ms=ev["fetch_ms"], verify_ms=ev["verify_ms"], assemble_ms=ev["assemble_ms"],
            wall_ms=ev["wall_ms"], dominant=str(ev.get("dominant") or ""),
        )
        if ev["groups"]:
            step["groups"] = int(ev["groups"])
        if ev["rollouts"]:
            step["rollouts"], step["accepted"] = int(ev["rollouts"]), int(ev["accepted"])
        self.totals["steps"] += 1
        for phase in ("fetch", "verify", "assemble"):
            self.totals[f"{phase}_ms"] += ev[f"{phase}_ms"]
            self.hist[f"{phase}_seconds"].observe(ev[f"{phase}_ms"] / MS_PER_S)
        self.hist["step_wall_seconds"].observe(ev["wall_ms"] / MS_PER_S)
        depth = ev["queue_depth_after"] if "queue_depth_after" in ev else ev["queue_depth"]
        self.queue_depth = depth
        self.depths.append((ev["t"], depth))

    def _cut(self, ev: dict[str, Any]) -> None:
        self.cuts.append(ev)
        self.cut_totals["cuts"] += 1
        for k in ("calls", "rows", "puts", "durable", "wall_ms"):
            self.cut_totals[k] += ev[k]
        self.cut_failures.update(ev["failures"])
        self.hist["cut_wall_seconds"].observe(ev["wall_ms"] / MS_PER_S)

    def _restore(self, ev: dict[str, Any]) -> None:
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

    def _retire_restore(self, ev: dict[str, Any]) -> None:
        for k in RESTORE_COUNTERS:
            self.restore_base[k] += ev[k]
        self.restore_failures.update(ev["failures_by_reason"])
        self.restore_latency_base.add_counts(ev["latency_bounds_s"], ev["latency_counts"], ev["latency_sum_s"])

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

    def _store(self, ev: dict[str, Any]) -> None:
        self.store_units[ev["unit"]] = ev
        while len(self.store_units) > self.history:
            self.store_units.popitem(last=False)

    def _scale(self, ev: dict[str, Any]) -> None:
        self.decisions.append(ev)
        self.decision_counts[(ev["action"], ev["reason_code"])] += 1

    def sample_workers(self, n_workers: int) -> None:
        """Record the current worker count ``n_workers`` (for the page's scaling plot).

        A sample is kept only when the count changed or the last one is older than
        ``dashboard.update-ms``, so the ring covers the same span however often it is
        called (every open page calls it on each refresh).
        """
        now, n = time.time(), int(n_workers)
        if self.worker_counts:
            last_t, last_n = self.worker_counts[-1]
            if n == last_n and (now - last_t) * 1000 < float(config.get("dashboard.update-ms")):
                return
        self.worker_counts.append((now, n))

    # ------------------------------------------------------------------ queries
    def signal(self, window_s: float | None = None, load: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The adaptive policy's input: recent split timing, queue trend and load.

        Over the last ``window_s`` seconds (default ``scaling.window-s``): ``events``
        (finalize events), ``steps`` (steps updated), ``fetch_ms``/``verify_ms``/
        ``assemble_ms`` summed over those steps (per step: the step event's figures, or
        the provisional split of its groups so far), ``queue_depth_first``/``_last``/
        ``_max``; ``last_event_age_s`` (seconds since the newest finalize event, ``inf``
        if none). The scheduler load ``tasks``, ``workers``, ``finalize_slots`` and
        ``actor_hosts`` come from ``load`` (0 when not given).
        """
        window = float(window_s if window_s is not None else config.get("scaling.window-s"))
        now = time.time()
        # split per step (provisional or final), over steps updated in the window
        recent_steps = [st for st in self.steps.values() if now - st["t_last"] <= window]
        depths = [d for t, d in self.depths if now - t <= window]
        newest = self.depths[-1][0] if self.depths else None
        out: dict[str, Any] = {
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
        }
        if load is not None:
            out.update(load)
        return out

    def snapshot(self) -> dict[str, Any]:
        """All state as plain JSON-able data (for the RPC handler, tests and tools).

        ``events`` counts the events folded in per topic: a topic at 0 (or absent) has
        no data yet, which a view shows as such rather than as figures of zero.
        ``histograms`` hold seconds (``*_seconds``) or counts (``calls_per_rollout``).
        """
        hists = dict(self.hist, restore_latency_seconds=self.restore_latency())
        return {
            "version": self.version,
            "events": {topic: self.events.get(topic, 0) for topic in TOPICS},
            "totals": dict(self.totals),
            "rejected": dict(self.rejected),
            "rejected_details": dict(self.rejected_details),
            "queue_depth": self.queue_depth,
            "groups": [dict(g) for g in self.groups],
            "steps": [dict(s) for s in self.steps.values()],
            "cut_totals": dict(self.cut_totals),
            "cut_failures": dict(self.cut_failures),
            "cuts": [dict(c) for c in self.cuts],
            "restore_totals": dict(self.restore_totals),
            "restore_failures": dict(self.restore_failures_by_reason()),
            "depths": [list(d) for d in self.depths],
            "restore_latest": {k: dict(v) for k, v in self.restore_latest.items()},
            "store_units": {k: dict(v) for k, v in self.store_units.items()},
            "decisions": [dict(d) for d in self.decisions],
            "decision_counts": {f"{a}:{r}": n for (a, r), n in self.decision_counts.items()},
            "malformed": {f"{t}:{f}": n for (t, f), n in self.malformed.items()},
            "last_error": self.last_error,
            "histograms": {
                k: {"buckets": h.cumulative(), "sum": h.total, "count": h.n} for k, h in hists.items()
            },
        }
