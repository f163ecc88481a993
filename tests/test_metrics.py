"""``token_capture_*`` series on the scheduler's ``/metrics``, matching the published events.

A real LocalCluster (worker processes) with the preload; events are published from the
client and, through ``pipeline.events.publish``, from a task on a worker (the path the
finalization graph uses). The scrape is parsed with prometheus_client's own parser.
"""
from __future__ import annotations

import re
import urllib.request
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pipeline.actors import workers_now
from pipeline.dashboard import InvalidEvent, TokenCaptureState, parse_event
from pipeline.dashboard.preload import PRELOAD
from pipeline.metrics import TokenCaptureCollector
from pipeline.events import CUT, FINALIZE, RESTORE, SCALE, STORE, publish
from pipeline.generation.call_buffer import CallBuffer
from pipeline.restore.batcher import start_batchers
from pipeline.store.client import StagingStore
from support import wait_until
from tasks import reasons
from tasks.cut.receipt import FAILURE_REASONS as CUT_FAILURE_REASONS
from tasks.packed import pack_rows

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
                queue_depth_after=1 + k, dominant="fetch" if fetch >= verify else "verify",
                cross_host_bytes=1000 * (k + 1), cross_host_bytes_planned=900 * (k + 1))


LAT_BOUNDS = [0.001, 0.01, 0.1]  # a batcher's latency buckets (s): re-binned into metrics.buckets-seconds


def latency(counts: list[int], sum_s: float) -> dict[str, Any]:
    """A restore event's latency histogram: per-bucket counts over LAT_BOUNDS, then +Inf."""
    return dict(latency_bounds_s=LAT_BOUNDS, latency_counts=counts, latency_sum_s=sum_s)


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
    # restore reports are cumulative per batcher (as PrefixReadBatcher publishes them),
    # latency counts per bucket of LAT_BOUNDS (then +Inf), sums in seconds
    client.log_event(RESTORE, dict(worker="w1", requests=10, gets=1, keys=20, keys_per_get=20.0,
                                   p50_ms=2.0, p99_ms=5.0, failures={}, **latency([5, 5, 0, 0], 0.02)))
    client.log_event(RESTORE, dict(worker="w1", requests=64, gets=4, keys=256, keys_per_get=64.0,
                                   p50_ms=12.5, p99_ms=40.0, failures={"unusable_prefix": 1},
                                   **latency([20, 30, 13, 1], 2.5)))
    client.log_event(RESTORE, dict(worker="w2", requests=6, gets=2, keys=12, keys_per_get=6.0,
                                   p50_ms=3.0, p99_ms=7.0, failures=0, **latency([6, 0, 0, 0], 0.003)))
    # w2's batcher restarted: its counters start again, the old counts are kept
    client.log_event(RESTORE, dict(worker="w2", requests=3, gets=1, keys=5, keys_per_get=5.0,
                                   p50_ms=1.0, p99_ms=2.0, failures=0, **latency([2, 1, 0, 0], 0.004)))
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
    assert fams["token_capture_finalize_phase_seconds"].type == "histogram"
    assert fams["token_capture_cut_wall_seconds"].type == "histogram"
    assert fams["token_capture_restore_latency_seconds"].type == "histogram"
    assert fams["token_capture_store_memory_bytes"].type == "gauge"

    accepted = sum(g[2] for g in GROUPS)
    rejected = sum(sum(g[3].values()) for g in GROUPS)
    assert sample(fams, "token_capture_rollouts", "token_capture_rollouts_total", status="accepted") == accepted
    assert sample(fams, "token_capture_rollouts", "token_capture_rollouts_total", status="rejected") == rejected
    assert sample(fams, "token_capture_rollouts_rejected", "token_capture_rollouts_rejected_total", reason="corrupt_digest") == 2
    assert sample(fams, "token_capture_rollouts_rejected", "token_capture_rollouts_rejected_total", reason="missing_parent") == 1
    assert sample(fams, "token_capture_fetched_bytes", "token_capture_fetched_bytes_total") == 6000
    assert sample(fams, "token_capture_finalized_tokens", "token_capture_finalized_tokens_total") == 600
    # bytes crossing hosts: the step events' figures summed (steps 1000 + 2000 measured)
    assert sample(fams, "token_capture_cross_host_bytes", "token_capture_cross_host_bytes_total") == 3000
    assert sample(fams, "token_capture_cross_host_planned_bytes", "token_capture_cross_host_planned_bytes_total") == 2700
    assert sample(fams, "token_capture_queue_depth", "token_capture_queue_depth") == 2  # step-1's depth after
    # times are published in ms and served in seconds
    assert sample(fams, "token_capture_step_wall_seconds", "token_capture_step_wall_seconds_sum") == pytest.approx(1.05)
    assert sample(fams, "token_capture_step_wall_seconds", "token_capture_step_wall_seconds_bucket", le="0.25") == 1
    assert sample(fams, "token_capture_step_wall_seconds", "token_capture_step_wall_seconds_bucket", le="1") == 2

    # histograms: count, sum and the le-buckets of each phase, one observation per step
    h = "token_capture_finalize_phase_seconds"
    for phase, col in (("fetch", 1), ("verify", 2), ("assemble", 3)):
        values = [st[col] / 1000 for st in STEPS]
        assert sample(fams, h, f"{h}_count", phase=phase) == 2
        assert sample(fams, h, f"{h}_sum", phase=phase) == pytest.approx(sum(values))
        for le in ("0.001", "0.002", "0.005", "0.01", "0.1", "0.5", "1", "+Inf"):
            bound = float(le)
            assert sample(fams, h, f"{h}_bucket", phase=phase, le=le) == sum(v <= bound for v in values), (phase, le)
    assert sample(fams, "token_capture_queue_wait_seconds", "token_capture_queue_wait_seconds_sum") == pytest.approx(0.045)
    assert sample(fams, "token_capture_calls_per_rollout", "token_capture_calls_per_rollout_count") == 3

    # cuts
    assert sample(fams, "token_capture_cuts", "token_capture_cuts_total") == 2
    assert sample(fams, "token_capture_cut_rows", "token_capture_cut_rows_total") == 17
    assert sample(fams, "token_capture_cut_puts", "token_capture_cut_puts_total") == 3
    assert sample(fams, "token_capture_cut_durable", "token_capture_cut_durable_total") == 14
    assert sample(fams, "token_capture_cut_failures", "token_capture_cut_failures_total", reason="durable_failure") == 1
    assert sample(fams, "token_capture_cut_failures", "token_capture_cut_failures_total", reason="control_deadline") == 0
    assert sample(fams, "token_capture_cut_wall_seconds", "token_capture_cut_wall_seconds_sum") == pytest.approx(0.06)
    assert sample(fams, "token_capture_cut_wall_seconds", "token_capture_cut_wall_seconds_bucket", le="0.025") == 1

    # restores: period reports add up; latency gauges show the latest report per worker
    assert sample(fams, "token_capture_restore_requests", "token_capture_restore_requests_total") == 64 + 6 + 3
    assert sample(fams, "token_capture_restore_gets", "token_capture_restore_gets_total") == 4 + 2 + 1
    assert sample(fams, "token_capture_restore_keys", "token_capture_restore_keys_total") == 256 + 12 + 5
    assert sample(fams, "token_capture_restore_failures", "token_capture_restore_failures_total") == 1
    # latency: w1's latest counts + w2's old batcher's + w2's new one's, re-binned by upper bound
    h = "token_capture_restore_latency_seconds"
    assert sample(fams, h, f"{h}_count") == 64 + 6 + 3
    assert sample(fams, h, f"{h}_sum") == pytest.approx(2.5 + 0.003 + 0.004)
    assert sample(fams, h, f"{h}_bucket", le="0.001") == 20 + 6 + 2
    assert sample(fams, h, f"{h}_bucket", le="0.005") == 20 + 6 + 2  # no batcher bucket ends between
    assert sample(fams, h, f"{h}_bucket", le="0.01") == 50 + 6 + 3
    assert sample(fams, h, f"{h}_bucket", le="0.1") == 63 + 6 + 3
    assert sample(fams, h, f"{h}_bucket", le="30") == 63 + 6 + 3
    assert sample(fams, h, f"{h}_bucket", le="+Inf") == 64 + 6 + 3
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
    (RESTORE, {"worker": "w", "latency_bounds_s": [0.1, 0.01], "latency_counts": [1, 1, 1]}, "latency_bounds_s"),
    (RESTORE, {"worker": "w", "latency_bounds_s": [0.1], "latency_counts": [1]}, "latency_counts"),
    (RESTORE, {"worker": "w", "latency_bounds_s": [0.1], "latency_counts": [1, -1]}, "latency_counts"),
    (RESTORE, {"worker": "w", "latency_bounds_s": "0.1", "latency_counts": [1, 1]}, "latency_bounds_s"),
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


# --------------------------------------------------------------------------- conventions
# Every token_capture_* family the collector serves (the parser drops a counter's _total).
COUNTERS = {
    "groups_finalized", "steps_finalized", "rollouts", "rollouts_rejected", "verifier_internal_errors",
    "fetch_calls", "fetched_bytes", "finalized_tokens", "cuts", "cut_rows", "cut_puts", "cut_durable",
    "cut_failures", "restore_requests", "restore_gets", "restore_keys", "restore_failures",
    "scaling_decisions", "malformed_events", "cross_host_bytes", "cross_host_planned_bytes",
    "staleness_rollouts", "staleness_dropped", "staleness_lag_versions", "mismatch_reports",
}
LATENCY_HISTOGRAMS = {
    "finalize_phase_seconds", "step_wall_seconds", "queue_wait_seconds", "cut_wall_seconds", "restore_latency_seconds",
}
COUNT_HISTOGRAMS = {"calls_per_rollout", "mismatch_k3", "mismatch_abs_delta"}  # not seconds: model calls, nats
BYTE_GAUGES = {"store_memory_bytes", "store_spilled_bytes"}
UNITLESS_GAUGES = {"queue_depth", "restore_keys_per_get", "store_rows", "store_lost_keys",  # counts, not units
                   "mismatch_tokens", "mismatch_mean_abs_delta", "mismatch_max_abs_delta", "mismatch_k3_mean",  # nats
                   "mismatch_frac_outside", "mismatch_route_agreement"}  # fractions


def check_conventions(text: str, fams: dict[str, Any]) -> None:
    """Names, types and units of every token_capture_* family, as Prometheus and Dask's own
    series on the same endpoint have them."""
    assert not re.search(r"token_capture_\w*_ms\b", text), "a token_capture_ series in milliseconds"
    for fam in fams.values():
        for s in fam.samples:
            assert not any(k.endswith("_ms") for k in s.labels), (s.name, s.labels)
    expected = {f"token_capture_{n}" for n in COUNTERS | LATENCY_HISTOGRAMS | COUNT_HISTOGRAMS | BYTE_GAUGES | UNITLESS_GAUGES}
    assert set(fams) == expected
    for name, fam in fams.items():
        short = name[len("token_capture_"):]
        if short in COUNTERS:
            assert fam.type == "counter", name
            assert all(s.name.endswith("_total") for s in fam.samples), name
        elif short in LATENCY_HISTOGRAMS:
            assert fam.type == "histogram" and name.endswith("_seconds"), name
        elif short in COUNT_HISTOGRAMS:
            assert fam.type == "histogram", name
        elif short in BYTE_GAUGES:
            assert fam.type == "gauge" and name.endswith("_bytes"), name
        else:
            assert fam.type == "gauge", name
        if fam.type == "histogram":
            # cumulative buckets ending with +Inf == _count, for each label set
            series: dict[tuple, list[tuple[float, float]]] = {}
            counts: dict[tuple, float] = {}
            for s in fam.samples:
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                if s.name.endswith("_bucket"):
                    series.setdefault(key, []).append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_count"):
                    counts[key] = s.value
            for key, buckets in series.items():
                values = [v for _, v in sorted(buckets)]
                assert values == sorted(values) and sorted(buckets)[-1][0] == float("inf"), (name, key)
                assert values[-1] == counts[key], (name, key)


def scrape_text(client: Client) -> str:
    port = client.scheduler_info()["services"]["dashboard"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        return r.read().decode()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("token_capture_")}


def stage_cut_calls(store, n_calls: int, tag: str, seed: int = 0) -> list:
    """``n_calls`` synthetic calls cut (real CallBuffer freeze/seal) into the cut partition, two
    prefix rows each; returns their acks (the continuations a restore reads)."""
    rng = np.random.default_rng(seed)
    acks, rows = [], []
    for i in range(n_calls):
        buf = CallBuffer(f"{tag}-r{i}", "c0", rng.integers(0, 512, 16))
        ack = None
        for j, n in enumerate((24, 16)):
            buf.append(rng.integers(0, 512, n), -rng.random(n).astype(np.float32))
            frozen = buf.freeze(f"{tag}-ck{j}")
            ack = buf.seal(frozen)
            rows.append((frozen.key, frozen.row))
        acks.append(ack)
    batch = pack_rows([r for _, r in rows])
    batch.keys = [k for k, _ in rows]
    assert not store.put_many(batch, partition="cut").failed
    return acks


@pytest.fixture
def quiet_cluster(tmp_path):
    """A fresh cluster (no event published yet) whose units report every 0.2 s and whose
    batchers publish on every request."""
    with dask.config.set({"token-capture.store.report-interval-s": 0.2, "token-capture.restore.publish-interval-s": 0.0}):
        with LocalCluster(
            n_workers=1, threads_per_worker=2, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"preload": [PRELOAD]},
        ) as cluster, Client(cluster) as client:
            yield client, tmp_path


def test_metrics_follow_conventions_and_report_store_and_restores_by_themselves(quiet_cluster):
    client, tmp_path = quiet_cluster
    (worker,) = workers_now(client)

    # Before any event: every family is served, reasons of the fixed vocabularies at 0.
    text = scrape_text(client)
    fams = families(text)
    check_conventions(text, fams)
    rejected = {s.labels["reason"]: s.value for s in fams["token_capture_rollouts_rejected"].samples}
    assert rejected == {r: 0 for r in reasons.ALL_REASONS}
    assert rejected["wrong_group"] == 0 and rejected["terminal_not_leaf"] == 0
    cut_failures = {s.labels["reason"]: s.value for s in fams["token_capture_cut_failures"].samples}
    assert cut_failures == {r: 0 for r in CUT_FAILURE_REASONS}
    h = "token_capture_restore_latency_seconds"
    assert sample(fams, h, f"{h}_count") == 0 and sample(fams, h, f"{h}_bucket", le="+Inf") == 0
    assert fams["token_capture_store_rows"].samples == []
    snap = client.sync(client.scheduler.token_capture_state)
    assert snap["events"][STORE] == 0 and snap["store_units"] == {}  # "no data yet", not zero figures

    # The store's units report by themselves: no report_store() call anywhere here.
    store = StagingStore.start(client, n_units=2, spill_directory=str(tmp_path / "spill"))
    try:
        def store_series(min_rows: int) -> Any:
            f = families(scrape_text(client))
            rows = {(s.labels["unit"], s.labels["worker"]): s.value for s in f["token_capture_store_rows"].samples}
            return f if set(rows) == {("0", worker), ("1", worker)} and sum(rows.values()) >= min_rows else None

        fams = wait_until(lambda: store_series(0), what="store units' own reports on /metrics")
        for name in ("token_capture_store_memory_bytes", "token_capture_store_spilled_bytes"):
            assert {(s.labels["unit"], s.labels["worker"]) for s in fams[name].samples} == {("0", worker), ("1", worker)}
        snap = client.sync(client.scheduler.token_capture_state)
        assert snap["events"][STORE] >= 2

        # Later figures follow the store (periodic, not a report at start only).
        acks = stage_cut_calls(store, 6, "m")
        fams = wait_until(lambda: store_series(12), what="the units' rows on /metrics")
        assert sum(s.value for s in fams["token_capture_store_memory_bytes"].samples) > 0

        # Restores: the latency histogram counts every request, across batchers.
        batchers = start_batchers(client, store)
        b = batchers[worker]
        verdicts = b.restore_many(acks[:4], vocab_size=512).result()
        assert all(v.usable for v in verdicts), [(v.reason, v.detail) for v in verdicts]

        def restore_count(n: int) -> Any:
            f = families(scrape_text(client))
            return f if sample(f, h, f"{h}_count") >= n else None

        fams = wait_until(lambda: restore_count(4), what="restore latency on /metrics")
        assert sample(fams, h, f"{h}_count") == 4
        assert sample(fams, h, f"{h}_bucket", le="+Inf") == 4
        assert sample(fams, h, f"{h}_sum") > 0
        first = {s.labels["le"]: s.value for s in fams[h].samples if s.name == f"{h}_bucket"}

        b.restore_many(acks[4:], vocab_size=512).result()
        fams = wait_until(lambda: restore_count(6), what="more restore latency on /metrics")
        later = {s.labels["le"]: s.value for s in fams[h].samples if s.name == f"{h}_bucket"}
        assert later["+Inf"] == 6 and all(later[le] >= first[le] for le in first)
        assert sum(later.values()) > sum(first.values())
        assert sample(fams, "token_capture_restore_requests", "token_capture_restore_requests_total") == 6
        check_conventions(scrape_text(client), families(scrape_text(client)))
        for actor in batchers.values():
            actor.close().result()
    finally:
        store.close()
