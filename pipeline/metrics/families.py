"""The ``token_capture_*`` metric families of one token-capture state, one builder per group.

:func:`metric_families` formats a :class:`~pipeline.dashboard.state.TokenCaptureState`
(it computes nothing itself) in a fixed order: finalization, cuts, restores, the staging
store, scaling decisions, staleness, the mismatch monitor, dropped events. Units are in the names (``_seconds``, ``_bytes``;
counters end in ``_total`` on the wire); histograms are in seconds except
``calls_per_rollout`` (calls). Labels of a fixed vocabulary (rejection and cut failure
reasons) are served at 0 before the first event.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric

from tasks.cut.receipt import FAILURE_REASONS as CUT_FAILURE_REASONS
from tasks.reasons import ALL_REASONS as REJECTION_REASONS

if TYPE_CHECKING:  # types only: importing pipeline.dashboard at run time would import the plugin, a cycle
    from ..dashboard.state import Histogram, TokenCaptureState

PREFIX = "token_capture"


def metric_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Every ``token_capture_*`` family of ``agg``, as a scrape serves them."""
    yield from finalize_families(agg)
    yield from cut_families(agg)
    yield from restore_families(agg)
    yield from store_families(agg)
    yield from scaling_families(agg)
    yield from staleness_families(agg)
    yield from mismatch_families(agg)
    yield from dropped_event_families(agg)


# --------------------------------------------------------------------------- builders
def _hist(name: str, doc: str, hists: list[tuple[list[str], Histogram]], labels: list[str]) -> HistogramMetricFamily:
    """A histogram family: one series per ``(label values, histogram)``."""
    fam = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)
    for values, h in hists:
        fam.add_metric(values, h.cumulative(), sum_value=h.total)
    return fam


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """An unlabelled counter (prometheus_client appends ``_total``: give it the bare name)."""
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _by_reason(name: str, doc: str, counts: Mapping[str, float], vocabulary: Iterable[str]) -> CounterMetricFamily:
    """A counter labelled ``reason``: every word of ``vocabulary`` (0 until seen), plus any
    other reason an event named."""
    fam = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["reason"])
    for reason in sorted(set(vocabulary) | set(counts)):
        fam.add_metric([reason], counts.get(reason, 0))
    return fam


# --------------------------------------------------------------------------- groups
def finalize_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Groups and steps finalized, rollouts by status and rejection reason, verifier
    internal errors, fetch calls / bytes / tokens, bytes crossing hosts, the phase, step wall, queue wait
    (seconds) and calls-per-rollout (calls) histograms, and the queue depth (groups)."""
    t = agg.totals
    yield _counter("groups_finalized", "Finalized groups", t["groups"])
    yield _counter("steps_finalized", "Finalized (collected) steps", t["steps"])
    fam = CounterMetricFamily(f"{PREFIX}_rollouts", "Finalized rollouts by status", labels=["status"])
    fam.add_metric(["accepted"], t["accepted"])
    fam.add_metric(["rejected"], t["rejected"])
    yield fam
    yield _by_reason(
        "rollouts_rejected", "Rejected rollouts by reason (the verification vocabulary)", agg.rejected, REJECTION_REASONS
    )
    yield _counter(
        "verifier_internal_errors",
        "Rollouts whose verification hit an internal error, counted apart from rejections",
        t["internal_errors"],
    )
    yield _counter("fetch_calls", "Store fetch calls made by finalization", t["fetch_calls"])
    yield _counter("fetched_bytes", "Bytes fetched from the store by finalization", t["bytes_fetched"])
    yield _counter("finalized_tokens", "Tokens in finalized training rows", t["tokens"])
    yield _counter("cross_host_bytes", "Bytes finalize tasks moved between hosts (measured on the scheduler)",
                   t["cross_host_bytes"])
    yield _counter("cross_host_planned_bytes", "Bytes the finalize layouts planned to ship between hosts",
                   t["cross_host_bytes_planned"])
    yield _hist(
        "finalize_phase_seconds",
        "Finalization work time per step by phase, in seconds",
        [([p], agg.hist[f"{p}_seconds"]) for p in ("fetch", "verify", "assemble")],
        ["phase"],
    )
    yield _hist(
        "step_wall_seconds", "Step wall time, submission to collection on the controller, in seconds",
        [([], agg.hist["step_wall_seconds"])], [],
    )
    yield _hist(
        "queue_wait_seconds", "Per-group queue wait before finalization, in seconds", [([], agg.hist["queue_wait_seconds"])], []
    )
    yield _hist("calls_per_rollout", "Model calls per rollout (per group mean)", [([], agg.hist["calls_per_rollout"])], [])
    yield GaugeMetricFamily(f"{PREFIX}_queue_depth", "Groups waiting for finalization (latest report)", value=agg.queue_depth)


def cut_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Cut reports, rows, puts, durable calls, failures by reason, wall time (seconds)."""
    c = agg.cut_totals
    yield _counter("cuts", "Checkpoint cut reports (one per cut per generation worker)", c["cuts"])
    yield _counter("cut_rows", "Prefix rows written by cuts", c["rows"])
    yield _counter("cut_puts", "Batched store puts made by cuts", c["puts"])
    yield _counter("cut_durable", "Calls made durable by cuts", c["durable"])
    yield _by_reason("cut_failures", "Calls a cut could not make durable, by reason", agg.cut_failures, CUT_FAILURE_REASONS)
    yield _hist("cut_wall_seconds", "Cut wall time per generation worker, in seconds", [([], agg.hist["cut_wall_seconds"])], [])


def restore_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Restore requests, gets, keys and failures over all batchers, keys per get per
    worker (latest report), and the request latency histogram (seconds)."""
    r = agg.restore_totals
    yield _counter("restore_requests", "Prefix restore requests", r["requests"])
    yield _counter("restore_gets", "Coalesced store gets made by restore batchers", r["gets"])
    yield _counter("restore_keys", "Keys read by restore batchers", r["keys"])
    yield _counter("restore_failures", "Failed restore requests", r["failures"])
    kpg = GaugeMetricFamily(
        f"{PREFIX}_restore_keys_per_get", "Keys per coalesced get since the batcher started (latest report)", labels=["worker"]
    )
    for worker, ev in agg.restore_latest.items():
        kpg.add_metric([worker], ev["keys_per_get"])
    yield kpg
    yield _hist(
        "restore_latency_seconds", "Prefix read request latency in the restore batchers, in seconds",
        [([], agg.restore_latency())], [],
    )


def store_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Per storage unit (latest report): rows, bytes in memory, bytes spilled, lost keys."""
    rows = GaugeMetricFamily(f"{PREFIX}_store_rows", "Rows held per storage unit (latest report)", labels=["unit", "worker"])
    mem = GaugeMetricFamily(
        f"{PREFIX}_store_memory_bytes", "Bytes of rows in memory per storage unit (latest report)", labels=["unit", "worker"]
    )
    spill = GaugeMetricFamily(
        f"{PREFIX}_store_spilled_bytes", "Bytes of rows spilled to disk per storage unit (latest report)", labels=["unit", "worker"]
    )
    lost = GaugeMetricFamily(
        f"{PREFIX}_store_lost_keys",
        "Keys staged whose both copies were lost, per storage unit recording them (latest report)",
        labels=["unit", "worker"],
    )
    for unit, ev in agg.store_units.items():
        labels = [unit, ev["worker"]]
        rows.add_metric(labels, ev["rows"])
        mem.add_metric(labels, ev["memory_bytes"])
        spill.add_metric(labels, ev["spilled_bytes"])
        lost.add_metric(labels, ev["lost_keys"])
    yield rows
    yield mem
    yield spill
    yield lost


def scaling_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Adaptive scaling decisions by action and reason code."""
    fam = CounterMetricFamily(
        f"{PREFIX}_scaling_decisions", "Adaptive scaling decisions by action and reason", labels=["action", "reason"]
    )
    for (action, reason), n in sorted(agg.decision_counts.items()):
        fam.add_metric([action, reason], n)
    yield fam


def staleness_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Per rollout-length bucket (every step seen): verified rollouts, those dropped
    ``stale``, and their weight-version lags summed (versions: rate(sum) / rate(count)
    is the mean lag). Every bucket is served at 0 from the start."""
    buckets = agg.trainer.buckets.values()
    fams = (
        (CounterMetricFamily(f"{PREFIX}_staleness_rollouts", "Verified rollouts by token-length bucket", labels=["bucket"]), "rollouts"),
        (CounterMetricFamily(f"{PREFIX}_staleness_dropped", "Rollouts dropped stale (finalize.max-staleness) by token-length bucket",
                             labels=["bucket"]), "stale"),
        (CounterMetricFamily(f"{PREFIX}_staleness_lag_versions",
                             "Weight-version lags of verified rollouts summed, by token-length bucket (versions)", labels=["bucket"]),
         "lag_sum"),
    )
    for fam, key in fams:
        for b in buckets:
            fam.add_metric([b["bucket"]], b[key])
        yield fam


def mismatch_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """The mismatch monitor: reports, the latest report's figures as gauges (nats, or
    fractions), and per-report histograms of k3 and of mean |delta logprob| (nats)."""
    tr = agg.trainer
    yield _counter("mismatch_reports", "Mismatch reports (StepResult.report_mismatch calls)", tr.mismatch_reports)
    last = tr.latest or {}
    for key, doc in (("tokens", "Loss-mask tokens compared in the latest mismatch report"),
                     ("mean_abs_delta", "Mean |trainer - sampler| logprob over the latest report's tokens (nats)"),
                     ("max_abs_delta", "Max |trainer - sampler| logprob over the latest report's tokens (nats)"),
                     ("k3_mean", "Mean k3 estimate of KL(sampler || trainer) in the latest report (nats)")):
        yield GaugeMetricFamily(f"{PREFIX}_mismatch_{key}", doc, value=float(last.get(key, 0.0) or 0.0))
    frac = GaugeMetricFamily(f"{PREFIX}_mismatch_frac_outside",
                             "Fraction of the latest report's tokens whose ratio exp(delta) lies outside [1 - eps, 1 + eps]",
                             labels=["eps"])
    for eps, f in sorted((last.get("frac_outside") or {}).items()):
        frac.add_metric([eps], f)
    yield frac
    route = GaugeMetricFamily(f"{PREFIX}_mismatch_route_agreement",
                              "Fraction of (token, layer) pairs whose expert set matches, latest report with routes")
    if last.get("route_agreement") is not None:
        route.add_metric([], last["route_agreement"])
    yield route
    yield _hist("mismatch_k3", "Mean k3 KL estimate per mismatch report (nats)", [([], tr.hist["mismatch_k3"])], [])
    yield _hist("mismatch_abs_delta", "Mean |delta logprob| per mismatch report (nats)", [([], tr.hist["mismatch_abs_delta"])], [])


def dropped_event_families(agg: TokenCaptureState) -> Iterator[Metric]:
    """Malformed events dropped, by topic and the field that was wrong."""
    fam = CounterMetricFamily(
        f"{PREFIX}_malformed_events", "Dropped malformed token-capture events", labels=["topic", "field"]
    )
    for (topic, fld), n in sorted(agg.malformed.items()):
        fam.add_metric([topic, fld], n)
    yield fam
