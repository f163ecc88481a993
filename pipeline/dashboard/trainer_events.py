"""Validation of the trainer-side figures (``pipeline.events``): a step event's
``staleness`` and the ``token-capture-mismatch`` event, free of Dask.

Counts come back as ``int`` >= 0, figures as finite ``float`` (lags may be negative: a
rollout sampled under weights newer than the trainer's); a bad field raises
:class:`InvalidEvent` naming it (the field readers of :mod:`.fields`, as every topic's).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from tasks.errors import InvalidEvent

from .fields import count, mapping, real

MAX_BUCKETS = 16  # length buckets read from one event
MAX_EPS = 8  # ratio bounds read from one event
MAX_LAGS = 64  # lag values read from one event


class BucketRecord(TypedDict):
    bucket: str  # token-length bucket label ("<1k", ...)
    rollouts: int
    stale: int
    lag_sum: float  # versions
    mean_lag: float  # versions


class StalenessRecord(TypedDict):
    """A step's staleness figures as the state keeps them."""

    trainer_version: float | None
    reference_version: float
    max_staleness: float | None
    rollouts: int
    stale: int
    mean_lag: float
    max_lag: float
    buckets: list[BucketRecord]


class MismatchFigures(TypedDict, total=False):
    tokens: int
    mean_abs_delta: float  # nats
    max_abs_delta: float  # nats
    k3_mean: float  # nats
    frac_outside: dict[str, float]  # str(eps) -> fraction
    route_pairs: int
    route_agreement: float | None  # fraction, None without routes


class MismatchEvent(MismatchFigures, total=False):
    """A ``token-capture-mismatch`` event, normalized; unknown keys are kept too."""

    kind: str
    step_id: str
    weight_version: float
    by_lag: dict[str, MismatchFigures]
    t: float  # scheduler wall-clock time (s) the state folded it in


def _optional(topic: str, key: str, value: object) -> float | None:
    """A figure of any sign, or None."""
    return None if value is None else real(topic, key, value, low=None)


def parse_staleness(topic: str, value: object) -> StalenessRecord:
    """A step event's ``staleness`` (see :data:`pipeline.events.FINALIZE`)."""
    m = mapping(topic, "staleness", value)
    raw = m.get("buckets") or []
    if not isinstance(raw, (list, tuple)):
        raise InvalidEvent(topic, "staleness.buckets", f"expected a list, got {type(raw).__name__}")
    buckets: list[BucketRecord] = []
    for b in list(raw)[:MAX_BUCKETS]:
        b = mapping(topic, "staleness.buckets", b)
        label = b.get("bucket")
        if not isinstance(label, str):
            raise InvalidEvent(topic, "staleness.buckets.bucket", f"expected a str label, got {label!r}")
        buckets.append({"bucket": label[:32], "rollouts": count(topic, "staleness.buckets.rollouts", b.get("rollouts", 0)),
                        "stale": count(topic, "staleness.buckets.stale", b.get("stale", 0)),
                        "lag_sum": real(topic, "staleness.buckets.lag_sum", b.get("lag_sum", 0), low=None),
                        "mean_lag": real(topic, "staleness.buckets.mean_lag", b.get("mean_lag", 0), low=None)})
    return {
        "trainer_version": _optional(topic, "staleness.trainer_version", m.get("trainer_version")),
        "reference_version": real(topic, "staleness.reference_version", m.get("reference_version", 0), low=None),
        "max_staleness": _optional(topic, "staleness.max_staleness", m.get("max_staleness")),
        "rollouts": count(topic, "staleness.rollouts", m.get("rollouts", 0)),
        "stale": count(topic, "staleness.stale", m.get("stale", 0)),
        "mean_lag": real(topic, "staleness.mean_lag", m.get("mean_lag", 0), low=None),
        "max_lag": real(topic, "staleness.max_lag", m.get("max_lag", 0), low=None),
        "buckets": buckets,
    }


def _figures(topic: str, m: Mapping[str, object], prefix: str = "") -> MismatchFigures:
    """The figures of a mismatch event (or of one of its lags)."""
    fracs = mapping(topic, f"{prefix}frac_outside", m.get("frac_outside") or {})
    out: MismatchFigures = {
        "tokens": count(topic, f"{prefix}tokens", m.get("tokens", 0)),
        "mean_abs_delta": real(topic, f"{prefix}mean_abs_delta", m.get("mean_abs_delta", 0)),
        "max_abs_delta": real(topic, f"{prefix}max_abs_delta", m.get("max_abs_delta", 0)),
        "k3_mean": real(topic, f"{prefix}k3_mean", m.get("k3_mean", 0)),
        "frac_outside": {str(e)[:16]: real(topic, f"{prefix}frac_outside", f)
                         for e, f in list(fracs.items())[:MAX_EPS]},
        "route_pairs": count(topic, f"{prefix}route_pairs", m.get("route_pairs", 0)),
        "route_agreement": None,
    }
    if m.get("route_agreement") is not None:
        out["route_agreement"] = real(topic, f"{prefix}route_agreement", m["route_agreement"])
    return out


def parse_mismatch(topic: str, msg: Mapping[str, object], out: dict[str, object]) -> None:
    """Fill ``out`` as a :class:`MismatchEvent` (``kind`` must be ``"mismatch"`` if given)."""
    kind = msg.get("kind") or "mismatch"
    if kind != "mismatch":
        raise InvalidEvent(topic, "kind", f"expected 'mismatch', got {kind!r}")
    out["kind"] = "mismatch"
    step_id = msg.get("step_id")
    if step_id is not None and not isinstance(step_id, (str, int)):
        raise InvalidEvent(topic, "step_id", f"expected a str or int label, got {type(step_id).__name__}")
    out["step_id"] = "" if step_id is None else str(step_id)
    out["weight_version"] = real(topic, "weight_version", msg.get("weight_version", 0), low=None)
    out.update(_figures(topic, msg))
    lags = mapping(topic, "by_lag", msg.get("by_lag") or {})
    out["by_lag"] = {str(k)[:24]: _figures(topic, mapping(topic, "by_lag", v), "by_lag.") for k, v in list(lags.items())[:MAX_LAGS]}
