"""Readers of one event field, shared by the event parsers (:mod:`.parsing`,
:mod:`.trainer_events`), free of Dask: each returns the field normalized or raises
:class:`InvalidEvent` naming the topic and field."""
from __future__ import annotations

import math
from collections.abc import Mapping

from tasks.errors import InvalidEvent

Message = Mapping[str, object]
"""An event as published: a mapping of field name to a value not yet checked."""


def real(topic: str, key: str, value: object, *, low: float | None = 0.0) -> float:
    """``value`` as a finite float, >= ``low`` (None: any sign, e.g. a lag in versions)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidEvent(topic, key, f"expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or (low is not None and value < low):
        bound = "" if low is None else f" >= {low:g}"
        raise InvalidEvent(topic, key, f"expected a finite number{bound}, got {value!r}")
    return value


def number(topic: str, msg: Message, key: str, required: bool) -> float:
    """A finite, non-negative number from ``msg[key]`` (0.0 when optional and absent)."""
    if key not in msg or msg[key] is None:
        if required:
            raise InvalidEvent(topic, key, "missing")
        return 0.0
    return real(topic, key, msg[key])


def numbers(topic: str, msg: Message, fields: Mapping[str, bool]) -> dict[str, float]:
    """``fields`` (``name: required``) read from ``msg`` with :func:`number`."""
    return {k: number(topic, msg, k, req) for k, req in fields.items()}


def count(topic: str, key: str, value: object) -> int:
    """``value`` as a count (an int >= 0)."""
    return int(real(topic, key, value))


def mapping(topic: str, key: str, value: object) -> Mapping[str, object]:
    """``value``, which must be a mapping."""
    if not isinstance(value, Mapping):
        raise InvalidEvent(topic, key, f"expected a mapping, got {type(value).__name__}")
    return value


def counts(topic: str, msg: Message, key: str) -> dict[str, int]:
    """A ``reason -> count`` mapping from ``msg[key]`` (empty when absent)."""
    value = msg.get(key) or {}
    if not isinstance(value, Mapping):
        raise InvalidEvent(topic, key, f"expected a mapping reason -> count, got {type(value).__name__}")
    return {str(reason): int(number(topic, {key: n}, key, required=True)) for reason, n in value.items()}


def label(topic: str, msg: Message, key: str, required: bool) -> str:
    """A string label from ``msg[key]`` (str or int; ``""`` when optional and absent)."""
    value = msg.get(key)
    if value is None:
        if required:
            raise InvalidEvent(topic, key, "missing")
        return ""
    if not isinstance(value, (str, int)):
        raise InvalidEvent(topic, key, f"expected a str or int label, got {type(value).__name__}")
    return str(value)
