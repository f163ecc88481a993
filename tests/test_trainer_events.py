"""The trainer-side events as the dashboard reads them (no cluster): a step event's
``staleness`` and the ``token-capture-mismatch`` event, normalized (counts as int, lags
that may be negative), each bad field named."""
from __future__ import annotations

import math

import pytest

from pipeline.dashboard import InvalidEvent, parse_event
from pipeline.events import FINALIZE, MISMATCH

STEP = {"kind": "step", "fetch_ms": 1, "verify_ms": 2, "assemble_ms": 3}
STALENESS = {"trainer_version": 7, "reference_version": 7, "max_staleness": 4, "rollouts": 4, "stale": 1,
             "mean_lag": 3.25, "max_lag": 6,
             "buckets": [{"bucket": "<1k", "rollouts": 4, "stale": 1, "lag_sum": 13, "mean_lag": 3.25}]}
MISMATCH_EVENT = {"step_id": "s1", "weight_version": 7, "tokens": 30, "mean_abs_delta": 0.01, "max_abs_delta": 0.2,
                  "k3_mean": 0.001, "frac_outside": {0.2: 0.1}, "route_pairs": 60, "route_agreement": 0.9,
                  "by_lag": {0: {"tokens": 30, "k3_mean": 0.001}}}


def test_trainer_figures_are_normalized():
    ev = parse_event(FINALIZE, {**STEP, "staleness": {**STALENESS, "mean_lag": -0.5, "max_staleness": None}})
    s = ev["staleness"]
    assert s["mean_lag"] == -0.5 and s["max_staleness"] is None  # a rollout newer than the trainer lags < 0
    assert s["rollouts"] == 4 and isinstance(s["rollouts"], int) and isinstance(s["buckets"][0]["stale"], int)
    assert s["buckets"][0] == {"bucket": "<1k", "rollouts": 4, "stale": 1, "lag_sum": 13.0, "mean_lag": 3.25}
    m = parse_event(MISMATCH, MISMATCH_EVENT)
    assert m["kind"] == "mismatch" and m["weight_version"] == 7.0 and m["frac_outside"] == {"0.2": 0.1}
    assert m["tokens"] == 30 and isinstance(m["tokens"], int) and m["route_agreement"] == 0.9
    assert m["by_lag"]["0"]["tokens"] == 30 and m["by_lag"]["0"]["route_agreement"] is None
    assert parse_event(MISMATCH, {})["tokens"] == 0  # absent figures read as 0


@pytest.mark.parametrize("topic, msg, field", [
    (FINALIZE, {**STEP, "staleness": [1]}, "staleness"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "rollouts": -1}}, "staleness.rollouts"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "mean_lag": math.nan}}, "staleness.mean_lag"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "trainer_version": "7"}}, "staleness.trainer_version"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "buckets": "<1k"}}, "staleness.buckets"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "buckets": [{"bucket": 1}]}}, "staleness.buckets.bucket"),
    (FINALIZE, {**STEP, "staleness": {**STALENESS, "buckets": [{"bucket": "<1k", "stale": True}]}}, "staleness.buckets.stale"),
    (MISMATCH, {**MISMATCH_EVENT, "kind": "step"}, "kind"),
    (MISMATCH, {**MISMATCH_EVENT, "step_id": 1.5}, "step_id"),
    (MISMATCH, {**MISMATCH_EVENT, "weight_version": math.inf}, "weight_version"),
    (MISMATCH, {**MISMATCH_EVENT, "k3_mean": -0.1}, "k3_mean"),
    (MISMATCH, {**MISMATCH_EVENT, "tokens": "30"}, "tokens"),
    (MISMATCH, {**MISMATCH_EVENT, "frac_outside": [0.1]}, "frac_outside"),
    (MISMATCH, {**MISMATCH_EVENT, "route_agreement": -1}, "route_agreement"),
    (MISMATCH, {**MISMATCH_EVENT, "by_lag": {0: 1}}, "by_lag"),
    (MISMATCH, {**MISMATCH_EVENT, "by_lag": {0: {"tokens": -3}}}, "by_lag.tokens"),
])
def test_a_bad_trainer_field_is_named(topic, msg, field):
    with pytest.raises(InvalidEvent) as info:
        parse_event(topic, msg)
    assert info.value.field == field and field in str(info.value)
