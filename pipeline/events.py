"""Event topics the pipeline publishes to the scheduler (``Client.log_event``).

The dashboard page, the Prometheus exporter and the adaptive policy all read these,
so this module is the schema: one topic per concern, one flat dict per event, numbers
in the units the key names (``_ms`` milliseconds, ``_s`` seconds, ``bytes`` bytes,
counts otherwise). ``/metrics`` converts to base units (seconds) when it formats them.
Events are published from the controller (``Client.log_event``) or from inside tasks
and actors (``distributed.get_worker().log_event``); both land in the scheduler's
event log and reach every ``SchedulerPlugin.log_event`` hook.
"""
from __future__ import annotations

from typing import Mapping

FINALIZE = "token-capture-finalize"
"""One per finalized group. Keys: step_id, group_id, rollouts, accepted, rejected (dict
reason -> count), internal_errors (rollouts the verifier failed on: bugs, not bad data,
never in ``rejected``; optional, see :data:`FINALIZE_OPTIONAL`), fetch_ms, verify_ms,
assemble_ms, queue_wait_ms, queue_depth, calls_per_rollout, fetch_calls, bytes_fetched,
tokens, rejected_details (dict reason -> the first rejected row's detail for that reason,
at most 200 characters, one entry per reason of ``rejected``; optional); ``kind`` is
``"group"``. The controller's ``kind: "step"`` events on this topic carry the same counts
summed over the step, without rejected_details (count each rollout from one kind only),
and cross_host_bytes (bytes the step's tasks moved between hosts, measured on the
scheduler; 0 with cross_host_measured false when it could not be read) and cross_host_bytes_planned (the bytes the step's layout
ships between hosts), and the step's tail: verified_ms (submission to its last verify
task's end), tail_ms (from there to the groups in the controller), collect_ms (the
controller's result() call), collected_bytes (what it gathered), assembled_on
("controller" or "cluster"), and (optional) staleness: the step's verified rollouts by
weight-version lag (:class:`tasks.finalize.staleness.StalenessFigures`: trainer_version
(or None), reference_version, max_staleness (or None), rollouts, stale, mean_lag,
max_lag (versions), buckets: a list of {bucket ("<1k", "1-4k", "4-16k", ">=16k" tokens),
rollouts, stale, lag_sum, mean_lag})."""

FINALIZE_OPTIONAL: Mapping[str, object] = {"internal_errors": 0, "rejected_details": {}}
"""Finalize event keys an event may lack (older producers), with the value to read then."""

CUT = "token-capture-cut"
"""One per checkpoint cut per generation worker. Keys: checkpoint_id, worker, calls,
rows, puts, wall_ms, durable (count), failures (dict reason -> count)."""

RESTORE = "token-capture-restore"
"""Periodic per PrefixReadBatcher, every figure cumulative since the batcher started.
Keys: worker, requests, gets, keys, keys_per_get, p50_ms, p99_ms (recent request latency
quantiles), failures (dict verdict reason -> count), and the request latency histogram:
latency_bounds_s (bucket upper bounds, seconds, ``metrics.buckets-seconds`` where the
batcher runs), latency_counts (requests per bucket, not cumulative over buckets: one more
entry than bounds, the last for +Inf), latency_sum_s (seconds). The three latency keys
are optional (see :data:`RESTORE_OPTIONAL`)."""

RESTORE_OPTIONAL: Mapping[str, object] = {"latency_bounds_s": [], "latency_counts": [], "latency_sum_s": 0.0}
"""Restore event keys an event may lack (older producers), with the value to read then."""

STORE = "token-capture-store"
"""Periodic per storage unit (every ``store.report-interval-s`` seconds, published by the
unit itself; ``report_store()`` publishes one more at once). Keys: unit, worker, rows,
memory_bytes, spilled_bytes; optional: used_bytes, capacity_bytes, lost_keys (keys staged whose both copies were lost)."""

SCALE = "token-capture-scale"
"""One per adaptive scaling decision (published when it changes). Keys: action ("up",
"down", "hold"), target, current (workers), reason, reason_code, kind (optional:
"finalize", the default, for the finalize pool's decisions, or "storage" for the
store's). Finalize decisions add verify_ms, fetch_ms, queue_depth; storage ones (reason
codes ``storage-*``) add store_used_bytes, store_capacity_bytes, store_units (the live
units the decision read) and store_fill (used / capacity, a fraction)."""

MISMATCH = "token-capture-mismatch"
"""One per ``StepResult.report_mismatch`` call (the trainer's logprobs against the
sampler's over the step batch's loss-mask tokens). Keys: kind ("mismatch"), step_id,
weight_version (the trainer's), tokens, mean_abs_delta, max_abs_delta (|trainer -
sampler| logprob, nats), k3_mean (nats), frac_outside (dict str(eps) -> fraction of
tokens whose ratio exp(delta) lies outside [1 - eps, 1 + eps]), route_pairs; optional
route_agreement (fraction of (token, layer) pairs whose expert set matches) and by_lag
(dict str(lag) -> the same figures for the rows lagging that many versions)."""

TOPICS = (FINALIZE, CUT, RESTORE, STORE, SCALE, MISMATCH)


def host_name(default: str = "local") -> str:
    """The address of the worker we run on (how events name their producer), or ``default``
    outside a worker (in-process use, tests)."""
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return default


def publish(topic: str, payload: Mapping[str, object]) -> None:
    """Log ``payload`` under ``topic`` from wherever we run (worker, actor or client).

    Never raises: metrics must not fail the work they describe.
    """
    if topic not in TOPICS:
        raise ValueError(f"unknown token-capture event topic {topic!r}")
    msg = dict(payload)
    try:
        from distributed import get_worker

        get_worker().log_event(topic, msg)
        return
    except ValueError:
        pass  # not on a worker
    try:
        from distributed import default_client

        default_client().log_event(topic, msg)
    except Exception:
        pass
