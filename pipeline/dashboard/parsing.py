"""Validation of one token-capture event (``pipeline.events`` is the schema), free of Dask.

:func:`parse_event` checks an event of any topic and returns it normalized, as the typed
record of its topic (:class:`FinalizeEvent`, :class:`CutEvent`, :class:`RestoreEvent`,
:class:`StoreEvent`, :class:`ScaleEvent`, and the trainer-side
:class:`~.trainer_events.MismatchEvent`); a bad field raises :class:`InvalidEvent`
naming it (the readers of :mod:`.fields`). Units are the schema's: ``*_ms`` milliseconds, ``*_s`` seconds, ``*_bytes``
bytes, counts otherwise; every number comes back as a finite ``float`` >= 0.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, TypedDict, Union, cast

from tasks.errors import InvalidEvent

from ..events import CUT, FINALIZE, MISMATCH, RESTORE, RESTORE_OPTIONAL, SCALE, STORE, TOPICS
from . import fields
from .fields import Message
from .trainer_events import MismatchEvent, StalenessRecord, parse_mismatch, parse_staleness

SCALE_ACTIONS = ("up", "down", "hold")
SCALE_KINDS = ("finalize", "storage")  # which side of the adaptive policy decided
FINALIZE_KINDS = ("group", "step")
DETAIL_CHARS = 200  # a rejection detail is kept this many characters long
DETAIL_REASONS = 64  # latest details kept, one per reason (oldest reason dropped first)


# --------------------------------------------------------------------------- records
class _Stamped(TypedDict, total=False):
    t: float  # scheduler wall-clock time (s, ``time.time()``) the state folded it in; set by the state


class _FinalizeOptional(_Stamped, total=False):
    dominant: object  # step events: the side that dominated (``"verify"``, ...), passed through unchecked
    staleness: StalenessRecord  # step events: lags of the step's verified rollouts by length


class FinalizeEvent(_FinalizeOptional):
    """A finalize event (``kind`` ``"group"`` or ``"step"``); unknown keys are kept too."""

    kind: Literal["group", "step"]
    step_id: str
    group_id: str
    fetch_ms: float
    verify_ms: float
    assemble_ms: float
    rollouts: float
    accepted: float
    queue_wait_ms: float
    queue_depth: float  # groups in flight
    calls_per_rollout: float
    fetch_calls: float
    bytes_fetched: float
    tokens: float
    internal_errors: float  # group events: rollouts whose verification hit a verifier bug
    groups: float  # step events
    wall_ms: float  # step events
    queue_depth_after: float  # step events
    cross_host_bytes: float  # step events (bytes)
    cross_host_bytes_planned: float  # step events (bytes)
    rejected: dict[str, int]  # reason -> rollouts
    rejected_details: dict[str, str]  # reason -> latest detail (cut to DETAIL_CHARS)


class CutEvent(_Stamped):
    """A checkpoint cut report of one generation worker; unknown keys are kept too."""

    wall_ms: float
    rows: float
    puts: float
    calls: float
    durable: float
    failures: dict[str, int]  # reason -> calls not made durable
    checkpoint_id: str
    worker: str


class RestoreEvent(_Stamped):
    """A restore batcher's report, counters cumulative since it started; unknown keys kept."""

    requests: float
    gets: float
    keys: float
    keys_per_get: float
    p50_ms: float
    p99_ms: float
    worker: str
    failures: float
    failures_by_reason: dict[str, int]  # verdict -> failed requests
    latency_bounds_s: list[float]  # bucket upper bounds (s), increasing
    latency_counts: list[int]  # one count per bucket, then +Inf
    latency_sum_s: float
    latency_count: float  # sum of latency_counts


class StoreEvent(_Stamped):
    """A storage unit's report; unknown keys are kept too."""

    memory_bytes: float
    spilled_bytes: float
    rows: float
    used_bytes: float
    capacity_bytes: float
    lost_keys: float  # keys staged whose both copies were lost (replicas=2)
    unit: str
    worker: str


class ScaleEvent(_Stamped):
    """An adaptive scaling decision (``kind`` ``"finalize"``, the default, or ``"storage"``);
    unknown keys are kept too."""

    kind: Literal["finalize", "storage"]
    action: Literal["up", "down", "hold"]
    target: float  # workers
    current: float  # workers
    verify_ms: float
    fetch_ms: float
    queue_depth: float
    store_used_bytes: float  # storage decisions: bytes used in the live units
    store_capacity_bytes: float  # storage decisions: their capacity (bytes)
    store_units: float  # storage decisions: live units
    store_fill: float  # storage decisions: used / capacity (fraction)
    reason: str
    reason_code: str


ParsedEvent = Union[FinalizeEvent, CutEvent, RestoreEvent, StoreEvent, ScaleEvent, MismatchEvent]

# the numeric fields of each topic, ``name: required``
_FINALIZE_NUMBERS = {
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
    "cross_host_bytes": False,  # step events: bytes the step's tasks moved between hosts (measured)
    "cross_host_bytes_planned": False,  # step events: bytes the step's layout ships between hosts
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
_STORE_NUMBERS = {
    "memory_bytes": True, "spilled_bytes": True, "rows": False, "used_bytes": False, "capacity_bytes": False,
    "lost_keys": False,  # keys staged whose both copies were lost (replicas=2)
}
_SCALE_NUMBERS = {
    "target": True, "current": True, "verify_ms": False, "fetch_ms": False, "queue_depth": False,
    "store_used_bytes": False, "store_capacity_bytes": False, "store_units": False, "store_fill": False,  # storage
}


# --------------------------------------------------------------------------- fields
def _details(topic: str, msg: Message, key: str) -> dict[str, str]:
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


# --------------------------------------------------------------------------- topics
def _finalize(topic: str, msg: Message, out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`FinalizeEvent`; ``accepted`` / ``rollouts`` are derived
    from each other and the rejections when one is absent."""
    numbers = fields.numbers(topic, msg, _FINALIZE_NUMBERS)
    out.update(numbers)
    rejected = fields.counts(topic, msg, "rejected")
    out["rejected"] = rejected
    out["rejected_details"] = _details(topic, msg, "rejected_details")
    out["step_id"] = fields.label(topic, msg, "step_id", required=False)
    out["group_id"] = fields.label(topic, msg, "group_id", required=False)
    out["kind"] = msg.get("kind") or "group"
    if out["kind"] not in FINALIZE_KINDS:
        raise InvalidEvent(topic, "kind", f"expected one of {FINALIZE_KINDS}, got {out['kind']!r}")
    if "accepted" not in msg and "rollouts" in msg:
        numbers["accepted"] = out["accepted"] = max(0.0, numbers["rollouts"] - sum(rejected.values()))
    if "rollouts" not in msg:
        out["rollouts"] = numbers["accepted"] + sum(rejected.values())
    if msg.get("staleness") is not None:
        out["staleness"] = parse_staleness(topic, msg["staleness"])
    else:
        out.pop("staleness", None)


def _cut(topic: str, msg: Message, out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`CutEvent`."""
    out.update(fields.numbers(topic, msg, _CUT_NUMBERS))
    out["failures"] = fields.counts(topic, msg, "failures")
    out["checkpoint_id"] = fields.label(topic, msg, "checkpoint_id", required=False)
    out["worker"] = fields.label(topic, msg, "worker", required=False)


def _restore(topic: str, msg: Message, out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`RestoreEvent`; ``failures`` is a count, or ``{verdict:
    count}`` as PrefixReadBatcher publishes them; ``keys_per_get`` is derived when absent."""
    numbers = fields.numbers(topic, msg, _RESTORE_NUMBERS)
    out.update(numbers)
    out["worker"] = fields.label(topic, msg, "worker", required=False)
    if isinstance(msg.get("failures"), Mapping):
        by_reason = fields.counts(topic, msg, "failures")
        out["failures_by_reason"] = by_reason
        out["failures"] = float(sum(by_reason.values()))
    else:
        out["failures"] = fields.number(topic, msg, "failures", required=False)
        out["failures_by_reason"] = {}
    if "keys_per_get" not in msg and numbers["gets"]:
        out["keys_per_get"] = numbers["keys"] / numbers["gets"]
    _latency_histogram(topic, msg, out)


def _latency_histogram(topic: str, msg: Message, out: dict[str, object]) -> None:
    """A restore event's latency histogram (optional keys, :data:`RESTORE_OPTIONAL`):
    ``latency_bounds_s`` increasing finite bounds (s), ``latency_counts`` one non-negative
    count per bucket plus +Inf, ``latency_sum_s``; adds ``latency_count`` (their sum)."""
    bounds = msg.get("latency_bounds_s", RESTORE_OPTIONAL["latency_bounds_s"])
    counts = msg.get("latency_counts", RESTORE_OPTIONAL["latency_counts"])
    if not isinstance(bounds, (list, tuple)):
        raise InvalidEvent(topic, "latency_bounds_s", f"expected a list of bounds, got {type(bounds).__name__}")
    if not isinstance(counts, (list, tuple)):
        raise InvalidEvent(topic, "latency_counts", f"expected a list of counts, got {type(counts).__name__}")
    b = [fields.number(topic, {"latency_bounds_s": x}, "latency_bounds_s", required=True) for x in bounds]
    if any(hi <= lo for lo, hi in zip(b, b[1:])):
        raise InvalidEvent(topic, "latency_bounds_s", "bounds must increase")
    c = [int(fields.number(topic, {"latency_counts": x}, "latency_counts", required=True)) for x in counts]
    if (b or c) and len(c) != len(b) + 1:
        raise InvalidEvent(topic, "latency_counts", f"expected {len(b) + 1} counts (one per bound, then +Inf), got {len(c)}")
    out["latency_bounds_s"] = b
    out["latency_counts"] = c
    out["latency_sum_s"] = fields.number(topic, msg, "latency_sum_s", required=False)
    out["latency_count"] = float(sum(c))


def _store(topic: str, msg: Message, out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`StoreEvent` (``unit`` required)."""
    out.update(fields.numbers(topic, msg, _STORE_NUMBERS))
    out["unit"] = fields.label(topic, msg, "unit", required=True)
    out["worker"] = fields.label(topic, msg, "worker", required=False)


def _scale(topic: str, msg: Message, out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`ScaleEvent`; ``reason_code`` defaults to the reason's
    words before its first ``:``, ``kind`` to ``"finalize"``."""
    out.update(fields.numbers(topic, msg, _SCALE_NUMBERS))
    action = msg.get("action")
    if action not in SCALE_ACTIONS:
        raise InvalidEvent(topic, "action", f"expected one of {SCALE_ACTIONS}, got {action!r}")
    out["kind"] = msg.get("kind") or "finalize"
    if out["kind"] not in SCALE_KINDS:
        raise InvalidEvent(topic, "kind", f"expected one of {SCALE_KINDS}, got {out['kind']!r}")
    reason = fields.label(topic, msg, "reason", required=True)
    out["reason"] = reason
    out["reason_code"] = fields.label(topic, msg, "reason_code", required=False) or reason.split(":")[0]


_TOPIC_FIELDS: dict[str, Callable[[str, Message, dict[str, object]], None]] = {
    FINALIZE: _finalize,
    CUT: _cut,
    RESTORE: _restore,
    STORE: _store,
    SCALE: _scale,
    MISMATCH: parse_mismatch,
}
"""topic -> what fills its record's fields (into a copy of the message)."""


def parse_event(topic: str, msg: object) -> ParsedEvent:
    """Validate one event of ``topic`` and return it normalized (numbers as float).

    Raises :class:`InvalidEvent` naming the topic and field when ``msg`` does not follow
    the schema in ``pipeline.events``. Unknown extra keys are kept as they are.
    """
    if topic not in TOPICS:
        raise InvalidEvent(topic, "topic", "not a token-capture topic")
    if not isinstance(msg, Mapping):
        raise InvalidEvent(topic, "msg", f"expected a mapping, got {type(msg).__name__}")
    out: dict[str, object] = dict(msg)
    _TOPIC_FIELDS[topic](topic, msg, out)
    return cast(ParsedEvent, out)
