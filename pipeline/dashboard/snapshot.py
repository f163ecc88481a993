"""The plain data the token-capture state hands out, as typed records.

:class:`StepRecord` is the state's view of one step; :class:`StateSnapshot` is what
:meth:`~pipeline.dashboard.state.TokenCaptureState.snapshot` returns (plain JSON-able
dicts and lists: the ``token_capture_state`` RPC's answer, and what the page draws).
Units follow the event schema: ``*_ms`` milliseconds, ``*_bytes`` bytes, ``*_seconds``
histograms seconds, times ``t`` scheduler wall-clock seconds, counts otherwise.
"""
from __future__ import annotations

from typing import Any, TypedDict

from .parsing import CutEvent, FinalizeEvent, RestoreEvent, ScaleEvent, StoreEvent


class StepRecord(TypedDict):
    """One step as the state keeps it: provisional from its group events (``final``
    False) until the controller's step event replaces the split with its own figures."""

    step_id: str
    groups: int
    rollouts: int
    accepted: int
    fetch_ms: float  # the step's one union fetch (the largest of its groups' until final)
    verify_ms: float
    assemble_ms: float
    wall_ms: float  # submission to collection (0 until final)
    dominant: str  # the side that dominated ("" until final)
    cross_host_bytes: float  # bytes its tasks moved between hosts, measured (0 until final)
    cross_host_bytes_planned: float  # bytes its layout ships between hosts (0 until final)
    final: bool
    t: float  # first event of the step (s)
    t_last: float  # latest event of the step (s)


class HistogramSnapshot(TypedDict):
    """``buckets``: ``[(le, cumulative count), ...]`` ending with ``("+Inf", count)``;
    ``sum``: sum of the values (in the histogram's unit); ``count``: values seen."""

    buckets: list[tuple[str, int]]
    sum: float
    count: int


class StateSnapshot(TypedDict):
    """All state as plain data (see :meth:`TokenCaptureState.snapshot`)."""

    version: int  # bumped on every event folded in
    events: dict[str, int]  # topic -> events folded in (0: no data yet)
    totals: dict[str, float]  # groups, steps, rollouts, accepted, rejected, ..., fetch_ms/verify_ms/assemble_ms
    rejected: dict[str, int]  # reason -> rollouts
    rejected_details: dict[str, str]  # reason -> its latest detail
    queue_depth: float  # groups in flight (latest report)
    groups: list[FinalizeEvent]  # newest last
    steps: list[StepRecord]  # oldest first
    cut_totals: dict[str, float]  # cuts, calls, rows, puts, durable, wall_ms
    cut_failures: dict[str, int]  # reason -> calls
    cuts: list[CutEvent]
    restore_totals: dict[str, float]  # requests, gets, keys, failures over all batchers; reports
    restore_failures: dict[str, int]  # verdict -> requests
    depths: list[list[float]]  # [t (s), queue depth]
    restore_latest: dict[str, RestoreEvent]  # worker -> its batcher's latest report
    store_units: dict[str, StoreEvent]  # unit -> its latest report
    decisions: list[ScaleEvent]
    decision_counts: dict[str, int]  # "action:reason_code" -> decisions
    malformed: dict[str, int]  # "topic:field" -> events dropped
    last_error: str
    staleness: dict[str, Any]  # steps: [{step_id, t, rollouts, stale, mean_lag, max_lag, trainer_version}], buckets (since the start) and recent_buckets (the last recent_steps steps): [{bucket, rollouts, stale, lag_sum, mean_lag}]
    mismatch: dict[str, Any]  # reports (count), latest (the newest event or None), events (newest last, each with its seq)
    histograms: dict[str, HistogramSnapshot]
