"""Storage scaling: the store's fill in the aggregator's signal, the pure storage policy,
how it joins the finalize decision, and a real LocalCluster whose units fill up.

The cluster tests fill real storage units (small capacity) past ``store.scale-up-fill``:
the adaptive policy adds one worker with the storage role and publishes a ``storage``
SCALE event; emptied again, a storage down retires only a storage worker hosting no
unit, never a unit's host. With the store hosted by the scheduler the loop closes: the
host gives the new worker a unit, and a storage down has it drained before the worker
is retired. Waits are on conditions, never on elapsed time.
"""
from __future__ import annotations

import threading
from typing import Any

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.actors import workers_now
from pipeline.dashboard.preload import PRELOAD
from pipeline.dashboard.state import StoreFillSettings, TokenCaptureState
from pipeline.events import FINALIZE, SCALE, STORE
from pipeline.scaling import STORAGE_RESOURCE, StorageScalingSettings, TokenCaptureAdaptive, combine, decide_storage
from pipeline.scaling.storage import InvalidScalingSettings, REASON_CODES, pending, storage_worker_spec
from support import wait_until
from tasks.gate import CaptureGate
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
SETTINGS = StorageScalingSettings(scale_up_fill=0.8, scale_down_fill=0.3, min_units=1, replicas=1,
                                  settle_s=30.0, storage_resource=True)


def signal(used: float, capacity: float, units: int, largest: float | None = None) -> dict[str, float]:
    """A signal with the store's fill (bytes); ``largest`` defaults to an even split."""
    return {"store_used_bytes": used, "store_capacity_bytes": capacity, "store_units": units,
            "store_unit_capacity_max_bytes": capacity / units if largest is None and units else (largest or 0.0)}


# ------------------------------------------------------------------ the pure policy
def test_storage_policy_table():
    d = decide_storage(signal(85 * MiB, 100 * MiB, 2), SETTINGS)
    assert (d.action, d.reason_code) == ("up", "storage-fill-high")
    assert "85% full" in d.reason and "100.00 MiB" in d.reason and "2 unit(s)" in d.reason
    assert decide_storage(signal(80 * MiB, 100 * MiB, 2), SETTINGS).action == "up"  # at the fraction counts
    assert decide_storage(signal(79 * MiB, 100 * MiB, 2), SETTINGS).reason_code == "storage-balanced"

    # down: the store would still be below 30% without its largest unit
    d = decide_storage(signal(20 * MiB, 300 * MiB, 3), SETTINGS)  # 20 / 200 = 10%
    assert (d.action, d.reason_code) == ("down", "storage-fill-low")
    assert "drained" in d.reason and "10%" in d.reason
    # 23% full, but 70 / (300 - 200) = 70% without the largest unit: balanced, not down
    assert decide_storage(signal(70 * MiB, 300 * MiB, 3, largest=200 * MiB), SETTINGS).reason_code == "storage-balanced"
    assert decide_storage(signal(61 * MiB, 300 * MiB, 3), SETTINGS).reason_code == "storage-balanced"  # 30.5% without

    # edges: no units, capacity 0, one unit, the replicas floor, min-units
    assert decide_storage({}, SETTINGS).reason_code == "storage-no-signal"
    d = decide_storage(signal(5, 0, 2), SETTINGS)
    assert (d.action, d.reason_code) == ("hold", "storage-no-signal") and "no capacity" in d.reason
    one = decide_storage(signal(1 * MiB, 100 * MiB, 1), SETTINGS)
    assert (one.action, one.reason_code) == ("hold", "storage-at-floor")  # never the last unit
    assert decide_storage(signal(99 * MiB, 100 * MiB, 1), SETTINGS).action == "up"
    two = signal(1 * MiB, 200 * MiB, 2)
    assert decide_storage(two, SETTINGS).action == "down"
    replicated = StorageScalingSettings(**{**SETTINGS.__dict__, "replicas": 2})
    d = decide_storage(two, replicated)
    assert (d.action, d.reason_code) == ("hold", "storage-at-floor") and "replicas 2" in d.reason
    assert decide_storage(signal(1 * MiB, 300 * MiB, 3), replicated).action == "down"  # 3 -> 2 keeps both copies
    floor3 = StorageScalingSettings(**{**SETTINGS.__dict__, "min_units": 3})
    assert decide_storage(signal(1 * MiB, 300 * MiB, 3), floor3).reason_code == "storage-at-floor"

    assert {decide_storage(s, SETTINGS).reason_code for s in ({}, two, signal(85, 100, 2))} <= set(REASON_CODES)


def test_storage_decision_event_follows_the_schema_and_the_page_parses_it():
    d = decide_storage(signal(85 * MiB, 100 * MiB, 2), SETTINGS)
    ev = d.payload(current=2)
    assert ev["kind"] == "storage" and (ev["action"], ev["current"], ev["target"]) == ("up", 2, 3)
    assert ev["store_fill"] == pytest.approx(0.85) and ev["store_units"] == 2

    state = TokenCaptureState(history=16)
    assert state.ingest(SCALE, ev)
    assert state.ingest(SCALE, dict(action="hold", target=2, current=2, reason="balanced: x"))  # an older producer
    assert state.ingest(SCALE, dict(ev, kind="elsewhere")) is False  # an unknown kind is named and dropped
    assert state.malformed[(SCALE, "kind")] == 1
    snap = state.snapshot()
    assert [d["kind"] for d in snap["decisions"]] == ["storage", "finalize"]
    assert snap["decision_counts"] == {"up:storage-fill-high": 1, "hold:balanced": 1}

    from pipeline.dashboard.panels.scaling import ScalingPanels
    from pipeline.dashboard.widgets import PanelKit

    panels = ScalingPanels(PanelKit())
    panels.update(snap)
    data = panels.decisions.data
    assert data["kind"] == ["finalize", "storage"]  # newest first
    assert data["reason"][1].startswith("storage-fill-high: store 85% full")
    assert data["fill"][1] == "white" and data["fill"][0] != "white"  # storage markers are hollow


def test_combine_with_the_finalize_decision():
    up = decide_storage(signal(90, 100, 2), SETTINGS)
    # a storage up raises the target by one even when the finalize side holds ...
    plan = combine("hold", 2, up, current=2, minimum=1, maximum=4)
    assert (plan.target, plan.add_storage_worker) == (3, True)
    # ... on top of a finalize up, and instead of a finalize down
    assert combine("up", 3, up, current=2, minimum=1, maximum=4).target == 4
    assert combine("down", 1, up, current=2, minimum=1, maximum=4).target == 3
    # at the maximum it holds and says so
    plan = combine("hold", 4, up, current=4, minimum=1, maximum=4)
    assert (plan.target, plan.add_storage_worker, plan.storage.reason_code) == (4, False, "storage-at-maximum")
    # a pending up keeps the worker it added from a finalize idle down
    waiting = pending(up, units_at_up=2)
    assert (waiting.action, waiting.reason_code) == ("hold", "storage-up-pending")
    assert combine("down", 2, waiting, current=3, minimum=2, maximum=4).target == 3

    down = decide_storage(signal(1, 300, 3), SETTINGS)
    # a down retires a worker only once a storage worker has drained, and only while finalize holds
    assert combine("hold", 3, down, current=3, minimum=1, maximum=4).target == 3
    plan = combine("hold", 3, down, current=3, minimum=1, maximum=4, drained=True)
    assert (plan.target, plan.retire_storage_worker) == (2, True)
    assert combine("up", 4, down, current=3, minimum=1, maximum=4, drained=True).target == 4
    assert combine("hold", 3, down, current=3, minimum=3, maximum=4, drained=True).target == 3  # the minimum
    balanced = decide_storage(signal(50, 100, 2), SETTINGS)
    assert combine("down", 2, balanced, current=3, minimum=1, maximum=4).target == 2  # the finalize side alone


def test_storage_settings_are_checked_and_read_once():
    with pytest.raises(InvalidScalingSettings, match="store.scale-down-fill"):
        StorageScalingSettings(**{**SETTINGS.__dict__, "scale_down_fill": 0.9})
    with pytest.raises(InvalidScalingSettings, match="store.scale-up-fill"):
        StorageScalingSettings(**{**SETTINGS.__dict__, "scale_up_fill": 1.5})
    with pytest.raises(InvalidScalingSettings, match="store.min-units"):
        StorageScalingSettings(**{**SETTINGS.__dict__, "min_units": 0})
    with dask.config.set({"token-capture.store.scale-up-fill": 0.6, "token-capture.store.replicas": 2}):
        policy = TokenCaptureAdaptive(None)
    with dask.config.set({"token-capture.store.scale-up-fill": 0.99}):
        assert policy.storage_settings.scale_up_fill == 0.6 and policy.storage_settings.floor == 2
        assert decide_storage(signal(70, 100, 2), policy.storage_settings).action == "up"
    previous = policy.with_storage_settings(scale_up_fill=0.75)
    assert decide_storage(signal(70, 100, 2), policy.storage_settings).action == "hold"
    policy.restore_storage_settings(previous)
    assert policy.storage_settings.scale_up_fill == 0.6
    with pytest.raises(InvalidScalingSettings):
        policy.with_storage_settings(scale_down_fill=0.7)


def test_storage_worker_spec_adds_the_role_to_a_copy():
    template = {"cls": object, "options": {"nthreads": 1, "resources": {"finalize": 2.0}}}
    spec = storage_worker_spec(template)
    assert spec["options"]["resources"] == {"finalize": 2.0, STORAGE_RESOURCE: 1.0}
    assert template["options"]["resources"] == {"finalize": 2.0}  # the plain template is untouched
    assert storage_worker_spec(None) is None and storage_worker_spec({"cls": object}) is None


# ------------------------------------------------------------------ the fill in the signal
def test_fill_counts_only_units_that_reported_recently():
    state = TokenCaptureState(history=16, store_settings=StoreFillSettings(stale_s=6.0))
    for unit, used in (("0", 10), ("1", 30)):
        state.ingest(STORE, dict(unit=unit, worker="w", memory_bytes=used, spilled_bytes=0, used_bytes=used,
                                 capacity_bytes=100 if unit == "0" else 200))
    sig = state.signal()
    assert (sig["store_used_bytes"], sig["store_capacity_bytes"], sig["store_units"]) == (40, 300, 2)
    assert sig["store_unit_capacity_max_bytes"] == 200
    # unit 1's latest report is older than the stale bound: its bytes are gone
    state.store_units["1"]["t"] -= 7.0
    sig = state.signal()
    assert (sig["store_used_bytes"], sig["store_capacity_bytes"], sig["store_units"]) == (10, 100, 1)
    assert sig["store_unit_capacity_max_bytes"] == 100
    assert "1" in state.snapshot()["store_units"]  # the page still lists it
    state.store_units["0"]["t"] -= 7.0
    sig = state.signal()
    assert sig["store_units"] == 0 and sig["store_used_bytes"] == 0 and sig["store_unit_capacity_max_bytes"] == 0
    assert decide_storage(sig, SETTINGS).reason_code == "storage-no-signal"
    with dask.config.set({"token-capture.store.report-interval-s": 0.5}):
        assert StoreFillSettings.from_config().stale_s == pytest.approx(1.5)  # three report intervals
    with dask.config.set({"token-capture.store.report-interval-s": 0}):
        assert StoreFillSettings.from_config().stale_s == float("inf")  # units never report by themselves


# ------------------------------------------------------------------ a real cluster
FAST = {
    "token-capture.store.report-interval-s": 0.2,
    "token-capture.store.min-units": 1,
    "token-capture.store.scale-settle-s": 600.0,  # the added worker never gets a unit here: keep it pending
    "token-capture.scaling.window-s": 2.0,
    "token-capture.scaling.idle-s": 1.0,
    "token-capture.scaling.min-events": 2,
}
CAPACITY = 256 * 1024  # bytes per unit


def make_rows(n: int, tag: str, tokens: int = 256) -> list:
    rng = np.random.default_rng(len(tag) + n)
    rows = []
    for r in range(n):
        gate = CaptureGate(f"{tag}{r}", vocab_size=512, num_experts=None)
        ids = rng.integers(0, 512, tokens)
        mask = np.ones(tokens, np.float32)
        rows.append(gate.stage_call("c0", None, ids, mask, -rng.random(tokens, dtype=np.float32) - 0.01))
    return rows


class FetchBound:
    """Publishes fetch-heavy FINALIZE events from a thread: the finalize side holds."""

    def __init__(self, client: Client) -> None:
        self.client, self._stop = client, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            self.client.log_event(FINALIZE, dict(step_id=f"s{n}", group_id="g", rollouts=1, accepted=1, rejected={},
                                                 fetch_ms=80.0, verify_ms=5.0, assemble_ms=1.0, queue_depth=1))
            self._stop.wait(0.05)

    def __enter__(self) -> "FetchBound":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)


def storage_events(client: Client) -> list[dict]:
    return [msg for _, msg in client.get_events(SCALE) if msg.get("kind") == "storage"]


@pytest.fixture(scope="module")
def storage_cluster(tmp_path_factory):
    from pipeline.store.client import StagingStore

    with dask.config.set(FAST):
        with LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
            worker_dashboard_address="127.0.0.1:0", scheduler_kwargs={"preload": [PRELOAD]},
        ) as cluster, Client(cluster) as client:
            hosts = sorted(workers_now(client))
            store = StagingStore.start(client, n_units=2, capacity=CAPACITY, workers=hosts,
                                       spill_directory=str(tmp_path_factory.mktemp("spill")))
            try:
                adaptive = cluster.adapt(Adaptive=TokenCaptureAdaptive, minimum=2, maximum=3, interval="100ms", wait_count=1)
                yield cluster, client, store, adaptive, hosts
            finally:
                store.close()


def fill_store(store: Any, fraction: float) -> list[str]:
    """Put rows until the units hold ``fraction`` of their capacity; the keys put."""
    keys: list[str] = []
    for i in range(200):
        stats = store.stats()
        if sum(s["used_bytes"] for s in stats) >= fraction * sum(s["capacity"] for s in stats):
            return keys
        res = store.put_many(pack_rows(make_rows(4, f"fill{i}-")))
        keys += res.ok
    raise AssertionError(f"the store did not fill to {fraction:.0%}: {store.stats()}")


def test_units_filling_up_raise_the_target_with_a_storage_decision_and_emptied_retire_only_a_drained_storage_worker(storage_cluster):
    cluster, client, store, adaptive, hosts = storage_cluster
    n_workers = lambda: len(workers_now(client))  # noqa: E731
    wait_until(lambda: adaptive.last_storage_decision and adaptive.last_storage_decision.units == 2,
               what="both units' own reports in the signal")
    # Nearly empty, min-units 1: a storage down, but both workers host a unit: nobody goes.
    wait_until(lambda: adaptive.last_storage_decision.reason_code == "storage-fill-low", what="a storage-fill-low down")
    start = len(adaptive.storage_decisions)
    wait_until(lambda: len(adaptive.storage_decisions) >= start + 5, what="5 more storage rounds")
    assert n_workers() == 2 and "drained" in adaptive.last_storage_decision.reason

    # 1. the real units fill past 80%: one more worker, with the storage role
    keys = fill_store(store, 0.85)
    wait_until(lambda: n_workers() == 3, timeout_s=60, what="a third worker for the store")
    ups = [e for e in storage_events(client) if e["action"] == "up"]
    assert ups and ups[0]["reason_code"] == "storage-fill-high" and (ups[0]["current"], ups[0]["target"]) == (2, 3)
    assert ups[0]["store_units"] == 2 and ups[0]["store_fill"] >= 0.8
    infos = workers_now(client)
    (added,) = set(infos) - set(hosts)
    assert infos[added]["resources"].get(STORAGE_RESOURCE) == 1 and infos[added]["resources"].get("finalize", 0) > 0
    assert STORAGE_RESOURCE not in cluster.new_spec["options"].get("resources", {})  # later workers are plain
    # the finalize side alone would retire the idle third worker; the pending up keeps it
    wait_until(lambda: adaptive.last_storage_decision.reason_code == "storage-up-pending", what="the up pending")
    assert adaptive.last_decision.action == "down" and n_workers() == 3
    # ... on the scheduler and in the page's scaling data
    snap = client.sync(client.scheduler.token_capture_state)
    storage_ds = [d for d in snap["decisions"] if d["kind"] == "storage"]
    assert any(d["reason_code"] == "storage-fill-high" and d["action"] == "up" for d in storage_ds)
    assert snap["decision_counts"].get("up:storage-fill-high", 0) == len(ups) == 1  # published once

    # 2. emptied while the finalize side holds: the drained storage worker goes, the unit hosts stay
    with FetchBound(client):
        wait_until(lambda: adaptive.last_decision.reason_code == "fetch-bound", what="finalize holding")
        store.delete(keys)
        wait_until(lambda: n_workers() == 2, timeout_s=60, what="the storage worker without a unit retired")
        assert sorted(workers_now(client)) == hosts
        downs = [e for e in storage_events(client) if e["action"] == "down"]
        assert downs and downs[-1]["reason_code"] == "storage-fill-low" and "drained" in downs[-1]["reason"]
        # still low: a down every round, but only unit hosts are left, so they stay
        start = len(adaptive.storage_decisions)
        wait_until(lambda: len(adaptive.storage_decisions) >= start + 5, what="5 more storage rounds")
        assert adaptive.last_storage_decision.action == "down" and n_workers() == 2
    assert sum(s["rows"] for s in store.stats()) == 0 and len(store.stats()) == 2  # both units still serve


def test_fill_is_read_from_the_units_own_reports_and_stale_ones_drop_out(storage_cluster):
    cluster, client, store, adaptive, hosts = storage_cluster
    sig = lambda: client.sync(client.scheduler.token_capture_signal, window_s=None)  # noqa: E731
    keys = store.put_many(pack_rows(make_rows(3, "own-"))).ok
    used = sum(s["used_bytes"] for s in store.stats())
    assert used > 0
    # the units' periodic reports carry their bytes into the signal, nothing else asked
    wait_until(lambda: sig()["store_used_bytes"] == used, what="the units' own figures")
    assert sig()["store_capacity_bytes"] == 2 * CAPACITY and sig()["store_unit_capacity_max_bytes"] == CAPACITY
    # a unit that reports and then stops (dead) counts only until its last report is stale
    ghost = dict(unit="ghost", worker="tcp://127.0.0.1:1", memory_bytes=0, spilled_bytes=0,
                 used_bytes=10 * CAPACITY, capacity_bytes=10 * CAPACITY)
    stop = threading.Event()

    def haunt() -> None:
        while not stop.is_set():
            client.log_event(STORE, ghost)
            stop.wait(0.05)

    thread = threading.Thread(target=haunt, daemon=True)
    thread.start()
    try:
        wait_until(lambda: sig()["store_units"] == 3 and sig()["store_used_bytes"] == used + 10 * CAPACITY,
                   what="the ghost's reports counted while they come")
    finally:
        stop.set()
        thread.join(10)
    wait_until(lambda: sig()["store_units"] == 2, what="the ghost's last report gone stale")
    s = sig()
    assert (s["store_used_bytes"], s["store_capacity_bytes"]) == (used, 2 * CAPACITY)
    assert "ghost" in client.sync(client.scheduler.token_capture_state)["store_units"]  # still on the page
    store.delete(keys)


# ------------------------------------------------------------------ with the store host
@pytest.fixture(scope="module")
def hosted_cluster(tmp_path_factory):
    """A store hosted by the scheduler: a worker joining with the storage role gets a unit,
    a drain moves a unit's keys away and closes it."""
    from pipeline.store.hosted import close_hosted, start_hosted

    with dask.config.set({**FAST, "token-capture.store.min-units": 2}):
        with LocalCluster(
            n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
            worker_dashboard_address="127.0.0.1:0", scheduler_kwargs={"preload": [PRELOAD]},
        ) as cluster, Client(cluster) as client:
            hosts = sorted(workers_now(client))
            store = start_hosted(client, "scaling-store", n_units=2, capacity=CAPACITY, workers=hosts,
                                 spill_directory=str(tmp_path_factory.mktemp("hosted")))
            try:
                adaptive = cluster.adapt(Adaptive=TokenCaptureAdaptive, minimum=2, maximum=3, interval="100ms", wait_count=1)
                yield client, store, adaptive, hosts
            finally:
                close_hosted(client, "scaling-store")


def test_a_hosted_store_grows_onto_the_storage_worker_and_a_storage_down_drains_it_before_retiring_it(hosted_cluster):
    client, store, adaptive, hosts = hosted_cluster
    n_workers = lambda: len(workers_now(client))  # noqa: E731
    units = lambda: client.sync(client.scheduler.token_capture_signal, window_s=None)["store_units"]  # noqa: E731
    wait_until(lambda: adaptive.last_storage_decision and adaptive.last_storage_decision.reason_code == "storage-at-floor",
               what="2 nearly empty units: at the floor (store.min-units 2)")

    # full: one more worker with the storage role; the store host gives it a unit, which
    # ends the pending up (no second storage worker is asked for)
    keys = fill_store(store, 0.85)
    wait_until(lambda: n_workers() == 3, timeout_s=60, what="the storage worker")
    wait_until(lambda: units() == 3, timeout_s=60, what="its unit reporting")
    wait_until(lambda: adaptive.last_storage_decision.reason_code == "storage-balanced", what="the up settled by the new unit")
    (added,) = set(workers_now(client)) - set(hosts)
    hosted_by = client.run_on_scheduler(lambda dask_scheduler: {a: len(ws.actors) for a, ws in dask_scheduler.workers.items()})
    assert hosted_by[added] >= 1 and workers_now(client)[added]["resources"].get(STORAGE_RESOURCE) == 1

    # emptied, the finalize side holding: the store host drains the storage worker's unit,
    # then (no actor left on it) the storage down retires that worker; the first two stay
    with FetchBound(client):
        wait_until(lambda: adaptive.last_decision.reason_code == "fetch-bound", what="finalize holding")
        store.delete(keys)
        wait_until(lambda: n_workers() == 2, timeout_s=90, what="the drained storage worker retired")
        assert sorted(workers_now(client)) == hosts
        wait_until(lambda: units() == 2, what="the drained unit's reports gone stale")
        wait_until(lambda: adaptive.last_storage_decision.reason_code == "storage-at-floor", what="back at the floor")
    downs = [msg for _, msg in client.get_events(SCALE) if msg.get("kind") == "storage" and msg["action"] == "down"]
    assert downs and downs[0]["reason_code"] == "storage-fill-low" and downs[0]["store_units"] == 3
    # the store still takes and serves rows on its two units
    rows = make_rows(2, "after-")
    assert not store.put_many(pack_rows(rows)).failed
    got = store.get_many([r.staging_key for r in rows])
    assert not got.failed and len(got.batch) == 2


def test_the_demo_scale_phase_tells_storage_decisions_apart():
    from pipeline.demo import reporter
    from pipeline.demo.scale import kind_of

    storage_up = decide_storage(signal(85 * MiB, 100 * MiB, 2), SETTINGS).payload(current=2)
    finalize_up = {"kind": "finalize", "action": "up", "current": 3, "target": 4, "reason": "verify-bound: verify 60%"}
    older = {"action": "down", "current": 4, "target": 2, "reason": "idle: no finalize event for 5.1s"}  # names no kind
    ds = [storage_up, finalize_up, older]
    assert [kind_of(d) for d in ds] == ["storage", "finalize", "finalize"]
    line = reporter.scale_storage_line([d for d in ds if kind_of(d) == "storage"])
    assert line.startswith("scaling (storage): up 2 -> 3 (storage-fill-high: store 85% full")
    assert "verify-bound" not in line
    assert "no storage decision" in reporter.scale_storage_line([])
    assert "full above 0.0150% (demo setting" in reporter.scale_store_line(0.00015, 0.8, 40e6, 128 * 2**30, 2)
