"""``token_capture_*`` series on the scheduler's ``/metrics``, matching the published events.

A real LocalCluster (worker processes) with the preload; events are published from the
client and, through ``pipeline.events.publish``, from a task on a worker (the path the
finalization graph uses). The scrape is parsed with prometheus_client's own parser.
"""
from __future__ import annotations

import urllib.request
from typing import Any

import pytest
from distributed import Client, LocalCluster
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeline.dashboard import InvalidEvent, TokenCaptureState, parse_event
from pipeline.dashboard.preload import PRELOAD
from pipeline.metrics import TokenCaptureCollector
from pipeline.events import CUT, FINALIZE, RESTORE, SCALE, STORE, publish
from support import wait_until

GROUPS = [
    # (queue_wait_ms, queue_depth, accepted, rejected, verify_ms)
    (3.0, 4, 4, {}, 40.0),
    (12.0, 6, 3, {"corrupt_digest": 1}, 60.0),
    (30.0, 2, 2, {"missing_parent": 1, "corrupt_digest": 1}, 5.0),
]
STEPS = [
    # (step_id, fetch_ms, verify_ms, assemble_ms, wall_ms): the controller's step events
    ("step-0", 10.0, 100.0, 3.0, 150.0),
    ("step-1", 700.0, 5.0, 1.5, 900.0),
]


def finalize_event(i: int) -> dict[str, Any]:
    """Group ``i`` of GROUPS; groups 0 and 1 form step-0, group 2 is step-1."""
    wait, depth, ok, rej, verify = GROUPS[i]
    step = 0 if i < 2 else 1
    return dict(
        kind="group", step_id=STEPS[step][0], group_id=f"g{i}", rollouts=ok + sum(rej.values()),
        accepted=ok, rejected=rej, fetch_ms=STEPS[step][1], verify_ms=verify, assemble_ms=1.0,
        queue_wait_ms=wait, queue_depth=depth, calls_per_rollout=3 + i, fetch_calls=1,
        bytes_fetched=1000 * (i + 1), tokens=100 * (i + 1),
    )


def step_event(k: int) -> dict[str, Any]:
    step_id, fetch, verify, assemble, wall = STEPS[k]
    return dict(kind="step", step_id=step_id, groups=2 - k, rollouts=0, accepted=0, rejected={},
                fetch_ms=fetch, verify_ms=verify, assemble_ms=assemble, wall_ms=wall, queue_depth=3,
                queue_depth_after=1 + k, dominant="fetch" if fetch >= verify else "verify")


def publish_from_worker(event: dict[str, Any]) -> bool:
    publish(FINALIZE, event)  # get_worker().log_event inside a task
    return True




def scrape(client: Client) -> dict[str, Any]:
    port = client.scheduler_info()["services"]["dashboard"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("token_capture_")}


def sample(families: dict[str, Any], family: str, sample_name: str, **labels: str) -> float:
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample_name} {labels} not in {family}")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0",
        scheduler_kwargs={"preload": [PRELOAD]},
    ) as cluster, Client(cluster) as client:
        yield client


def test_metrics_match_published_events(client):
    client.log_event(FINALIZE, finalize_event(0))
    client.log_event(FINALIZE, finalize_event(1))
    assert client.submit(publish_from_worker, finalize_event(2), pure=False).result()
    client.log_event(FINALIZE, step_event(0))
    client.log_event(FINALIZE, step_event(1))
    client.log_event(CUT, dict(checkpoint_id="ck1", worker="w1", calls=10, rows=12, puts=2, wall_ms=40.0,
                               durable=9, failures={"durable_failure": 1}))
    client.log_event(CUT, dict(checkpoint_id="ck1", worker="w2", calls=5, rows=5, puts=1, wall_ms=20.0,
                               durable=5, failures={}))
    # restore reports are cumulative per batcher (as PrefixReadBatcher publishes them)
    client.log_event(RESTORE, dict(worker="w1", requests=10, gets=1, keys=20, keys_per_get=20.0,
                                   p50_ms=2.0, p99_ms=5.0, failures={}))
    client.log_event(RESTORE, dict(worker="w1", requests=64, gets=4, keys=256, keys_per_get=64.0,
                                   p50_ms=12.5, p99_ms=40.0, failures={"unusable_prefix": 1}))
    client.log_event(RESTORE, dict(worker="w2", requests=6, gets=2, keys=12, keys_per_get=6.0,
                                   p50_ms=3.0, p99_ms=7.0, failures=0))
    # w2's batcher restarted: its counters start again, the old counts are kept
    client.log_event(RESTORE, dict(worker="w2", requests=3, gets=1, keys=5, keys_per_get=5.0,
                                   p50_ms=1.0, p99_ms=2.0, failures=0))
    client.log_event(STORE, dict(unit="0", worker="w1", rows=100, memory_bytes=1 << 20, spilled_bytes=1 << 22))
    client.log_event(STORE, dict(unit="1", worker="w2", rows=50, memory_bytes=1 << 19, spilled_bytes=0))
    client.log_event(SCALE, dict(action="up", target=3, current=2, reason="verify-bound: test",
                                 reason_code="verify-bound", verify_ms=1.0, fetch_ms=1.0, queue_depth=4))
    # bad input: counted and dropped; the good events around it are unaffected
    client.log_event(FINALIZE, dict(fetch_ms="slow", verify_ms=1.0, assemble_ms=1.0))
    client.log_event(STORE, dict(worker="w9", memory_bytes=1, spilled_bytes=1))  # no unit
    client.log_event(SCALE, dict(action="sideways", target=1, current=1, reason="?"))

    def everything_arrived() -> Any:
        f = scrape(client)
        try:
            done = (
                sample(f, "token_capture_groups_finalized", "token_capture_groups_finalized_total") == 3
                and sample(f, "token_capture_steps_finalized", "token_capture_steps_finalized_total") == 2
                and sample(f, "token_capture_malformed_events", "token_capture_malformed_events_total",
                           topic=SCALE, field="action") == 1
            )
        except KeyError:  # a labelled series not there yet
            return None
        return f if done else None

    fams = wait_until(everything_arrived, what="all events on /metrics")

    # types: counters and histograms, not just gauges
    assert fams["token_capture_rollouts"].type == "counter"
    assert fams["token_capture_finalize_phase_ms"].type == "histogram"
    assert fams["token_capture_cut_wall_ms"].type == "histogram"
    assert fams["token_capture_store_memory_bytes"].type == "gauge"

    accepted = sum(g[2] for g in GROUPS)
    rejected = sum(sum(g[3].values()) for g in GROUPS)
    assert sample(fams, "token_capture_rollouts", "token_capture_rollouts_total", status="accepted") == accepted
    assert sample(fams, "token_capture_rollouts", "token_capture_rollouts_total", status="rejected") == rejected
    assert sample(fams, "token_capture_rollouts_rejected", "token_capture_rollouts_rejected_total", reason="corrupt_digest") == 2
    assert sample(fams, "token_capture_rollouts_rejected", "token_capture_rollouts_rejected_total", reason="missing_parent") == 1
    assert sample(fams, "token_capture_fetched_bytes", "token_capture_fetched_bytes_total") == 6000
    assert sample(fams, "token_capture_finalized_tokens", "token_capture_finalized_tokens_total") == 600
    assert sample(fams, "token_capture_queue_depth", "token_capture_queue_depth") == 2  # step-1's depth after
    assert sample(fams, "token_capture_step_wall_ms", "token_capture_step_wall_ms_sum") == pytest.approx(1050.0)
    assert sample(fams, "token_capture_step_wall_ms", "token_capture_step_wall_ms_bucket", le="250") == 1

    # histograms: count, sum and the le-buckets of each phase, one observation per step
    h = "token_capture_finalize_phase_ms"
    for phase, col in (("fetch", 1), ("verify", 2), ("assemble", 3)):
        values = [st[col] for st in STEPS]
        assert sample(fams, h, f"{h}_count", phase=phase) == 2
        assert sample(fams, h, f"{h}_sum", phase=phase) == pytest.approx(sum(values))
        for le in ("1", "2", "5", "10", "100", "500", "1000", "+Inf"):
            bound = float(le)
            assert sample(fams, h, f"{h}_bucket", phase=phase, le=le) == sum(v <= bound for v in values), (phase, le)
    assert sample(fams, "token_capture_queue_wait_ms", "token_capture_queue_wait_ms_sum") == pytest.approx(45.0)
    assert sample(fams, "token_capture_calls_per_rollout", "token_capture_calls_per_rollout_count") == 3

    # cuts
    assert sample(fams, "token_capture_cuts", "token_capture_cuts_total") == 2
    assert sample(fams, "token_capture_cut_rows", "token_capture_cut_rows_total") == 17
    assert sample(fams, "token_capture_cut_puts", "token_capture_cut_puts_total") == 3
    assert sample(fams, "token_capture_cut_durable", "token_capture_cut_durable_total") == 14
    assert sample(fams, "token_capture_cut_failures", "token_capture_cut_failures_total", reason="durable_failure") == 1
    assert sample(fams, "token_capture_cut_wall_ms", "token_capture_cut_wall_ms_sum") == pytest.approx(60.0)
    assert sample(fams, "token_capture_cut_wall_ms", "token_capture_cut_wall_ms_bucket", le="25") == 1

    # restores: period reports add up; latency gauges show the latest report per worker
    assert sample(fams, "token_capture_restore_requests", "token_capture_restore_requests_total") == 64 + 6 + 3
    assert sample(fams, "token_capture_restore_gets", "token_capture_restore_gets_total") == 4 + 2 + 1
    assert sample(fams, "token_capture_restore_keys", "token_capture_restore_keys_total") == 256 + 12 + 5
    assert sample(fams, "token_capture_restore_failures", "token_capture_restore_failures_total") == 1
    assert sample(fams, "token_capture_restore_latency_ms", "token_capture_restore_latency_ms", worker="w1", quantile="0.99") == 40.0
    assert sample(fams, "token_capture_restore_latency_ms", "token_capture_restore_latency_ms", worker="w2", quantile="0.5") == 1.0
    assert sample(fams, "token_capture_restore_keys_per_get", "token_capture_restore_keys_per_get", worker="w1") == 64.0

    # store: memory vs spilled per unit
    assert sample(fams, "token_capture_store_memory_bytes", "token_capture_store_memory_bytes", unit="0") == 1 << 20
    assert sample(fams, "token_capture_store_spilled_bytes", "token_capture_store_spilled_bytes", unit="0") == 1 << 22
    assert sample(fams, "token_capture_store_rows", "token_capture_store_rows", unit="1", worker="w2") == 50

    # scaling decisions and the dropped events, by what was wrong
    assert sample(fams, "token_capture_scaling_decisions", "token_capture_scaling_decisions_total",
                  action="up", reason="verify-bound") == 1
    assert sample(fams, "token_capture_malformed_events", "token_capture_malformed_events_total",
                  topic=FINALIZE, field="fetch_ms") == 1
    assert sample(fams, "token_capture_malformed_events", "token_capture_malformed_events_total",
                  topic=STORE, field="unit") == 1

    # distributed's own series are still served next to ours
    port = client.scheduler_info()["services"]["dashboard"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert "dask_scheduler_workers" in r.read().decode()


@pytest.mark.parametrize("topic, msg, field", [
    (FINALIZE, {"verify_ms": 1, "assemble_ms": 1}, "fetch_ms"),
    (FINALIZE, {"fetch_ms": -1, "verify_ms": 1, "assemble_ms": 1}, "fetch_ms"),
    (FINALIZE, {"fetch_ms": float("nan"), "verify_ms": 1, "assemble_ms": 1}, "fetch_ms"),
    (FINALIZE, {"fetch_ms": True, "verify_ms": 1, "assemble_ms": 1}, "fetch_ms"),
    (FINALIZE, {"fetch_ms": 1, "verify_ms": 1, "assemble_ms": 1, "rejected": ["x"]}, "rejected"),
    (FINALIZE, {"fetch_ms": 1, "verify_ms": 1, "assemble_ms": 1, "rejected": {"x": "1"}}, "rejected"),
    (FINALIZE, {"fetch_ms": 1, "verify_ms": 1, "assemble_ms": 1, "kind": "epoch"}, "kind"),
    (RESTORE, {"worker": "w", "failures": {"timeout": -1}}, "failures"),
    (CUT, {"rows": 1, "puts": 1}, "wall_ms"),
    (STORE, {"unit": ["u"], "memory_bytes": 1, "spilled_bytes": 0}, "unit"),
    (SCALE, {"action": "up", "target": 1, "current": 1}, "reason"),
    (RESTORE, "not a dict", "msg"),
    ("token-capture-unknown", {}, "topic"),
])
def test_parse_event_names_the_bad_field(topic, msg, field):
    with pytest.raises(InvalidEvent) as info:
        parse_event(topic, msg)
    assert info.value.field == field
    assert field in str(info.value)


def test_parse_event_fills_optional_fields():
    ev = parse_event(FINALIZE, {"fetch_ms": 1, "verify_ms": 2, "assemble_ms": 3, "rollouts": 5,
                                "rejected": {"corrupt_digest": 2}, "extra": "kept"})
    assert ev["accepted"] == 3 and ev["queue_depth"] == 0.0 and ev["extra"] == "kept"
    ev = parse_event(RESTORE, {"worker": "w", "gets": 4, "keys": 10})
    assert ev["keys_per_get"] == 2.5


def test_verifier_internal_errors_are_counted_apart_from_rejections():
    """A group event's optional ``internal_errors`` reaches its own counter (no cluster)."""
    state = TokenCaptureState(history=10)
    registry = CollectorRegistry()
    registry.register(TokenCaptureCollector(state))
    name = "token_capture_verifier_internal_errors_total"
    assert registry.get_sample_value(name) == 0  # served before any event
    event = dict(finalize_event(0), internal_errors=2)
    assert state.ingest(FINALIZE, event)
    state.ingest(FINALIZE, finalize_event(1))  # no internal_errors field: counts as 0
    assert registry.get_sample_value(name) == 2
    # rejections are unchanged by it
    assert registry.get_sample_value("token_capture_rollouts_total", {"status": "rejected"}) == 1
