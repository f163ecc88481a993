"""Adaptive scaling from the finalize split, on a real LocalCluster with ``adapt``.

Synthetic FINALIZE events (the schema real finalization publishes) drive the policy:
a fetch-heavy signal holds, a verify-heavy one with a rising queue scales up, idle scales
down, and workers hosting actors are never retired. Waits are on conditions, never on
elapsed time.
"""
from __future__ import annotations

import math
import threading
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

from pipeline.actors import workers_now
from pipeline.dashboard.preload import PRELOAD
from pipeline.events import FINALIZE, SCALE
from pipeline.scaling import ScalingDecision, TokenCaptureAdaptive, decide
from support import wait_until

FAST = {
    "token-capture.scaling.window-s": 2.0,
    "token-capture.scaling.idle-s": 1.0,
    "token-capture.scaling.min-events": 2,
    "token-capture.scaling.step-up": 1,
}




class Publisher:
    """Publishes FINALIZE events with a given split every ``period_s`` from a thread."""

    def __init__(self, client: Client, *, fetch_ms: float, verify_ms: float, period_s: float = 0.05) -> None:
        self.client, self.fetch_ms, self.verify_ms, self.period_s = client, fetch_ms, verify_ms, period_s
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sent += 1
            self.client.log_event(FINALIZE, dict(
                step_id=f"s{self.sent}", group_id="g", rollouts=4, accepted=4, rejected={},
                fetch_ms=self.fetch_ms, verify_ms=self.verify_ms, assemble_ms=1.0,
                queue_wait_ms=10.0, queue_depth=self.sent,  # rising queue
                calls_per_rollout=3, fetch_calls=1, bytes_fetched=4096, tokens=512,
            ))
            self._stop.wait(self.period_s)

    def __enter__(self) -> "Publisher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)


class Ping:
    """A trivial actor standing in for a storage unit / generation actor."""

    def ping(self) -> str:
        return "pong"


def scale_events(client: Client) -> list[dict]:
    return [msg for _, msg in client.get_events(SCALE)]


# ------------------------------------------------------------------ the pure policy
def test_decide_policy_table():
    with dask.config.set(FAST):
        verify = dict(events=5, fetch_ms=10, verify_ms=90, assemble_ms=1, queue_depth_first=1,
                      queue_depth_last=6, last_event_age_s=0.1, tasks=3)
        d = decide(verify, current=2, minimum=1, maximum=4)
        assert (d.action, d.target, d.reason_code) == ("up", 3, "verify-bound")
        assert "verify 89%" in d.reason
        assert decide(verify, current=4, minimum=1, maximum=4).reason_code == "at-maximum"

        fetch = dict(verify, fetch_ms=90, verify_ms=10)
        d = decide(fetch, current=2, minimum=1, maximum=4)
        assert (d.action, d.target, d.reason_code) == ("hold", 2, "fetch-bound")

        flat = dict(verify, queue_depth_first=3, queue_depth_last=3)
        assert decide(flat, current=2, minimum=1, maximum=4).reason_code == "verify-bound-no-queue"
        high = dict(flat, queue_depth_first=9, queue_depth_last=9)  # >= queue-depth-high (8)
        assert decide(high, current=2, minimum=1, maximum=4).action == "up"

        idle = dict(events=0, last_event_age_s=math.inf, tasks=0, actor_hosts=2)
        d = decide(idle, current=4, minimum=1, maximum=4)
        assert (d.action, d.target, d.reason_code) == ("down", 2, "idle")  # actor hosts stay
        assert decide(idle, current=2, minimum=1, maximum=4).reason_code == "idle-at-floor"
        busy_no_events = dict(idle, tasks=5)
        assert decide(busy_no_events, current=4, minimum=1, maximum=4).action == "hold"

        d = ScalingDecision("up", 3, 2, "verify-bound", "why", 1.0, 2.0, 3.0)
        assert set(d.payload()) >= {"action", "target", "current", "reason", "verify_ms", "fetch_ms", "queue_depth"}


# ------------------------------------------------------------------ a real cluster
@pytest.fixture
def adaptive_cluster():
    with dask.config.set(FAST):
        # No `resources=` here on purpose: the adaptive policy must add `finalize` itself.
        with LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0",
            scheduler_kwargs={"preload": [PRELOAD]},
        ) as cluster, Client(cluster) as client:
            adaptive = cluster.adapt(
                Adaptive=TokenCaptureAdaptive, minimum=1, maximum=3, interval="100ms", wait_count=1,
            )
            yield cluster, client, adaptive


def test_fetch_heavy_holds_verify_heavy_scales_up_idle_scales_down_sparing_actor_hosts(adaptive_cluster):
    cluster, client, adaptive = adaptive_cluster
    assert isinstance(adaptive, TokenCaptureAdaptive)
    wait_until(lambda: adaptive.state == "running", what="adaptive running")
    n_workers = lambda: len(workers_now(client))  # noqa: E731

    # 1. fetch-heavy with a rising queue: many policy rounds, all hold, no new worker.
    with Publisher(client, fetch_ms=80.0, verify_ms=15.0):
        wait_until(lambda: adaptive.last_decision and adaptive.last_decision.reason_code == "fetch-bound",
                   what="a fetch-bound decision")
        start = len(adaptive.decisions)
        wait_until(lambda: len(adaptive.decisions) >= start + 10, what="10 more policy rounds")
        recent = list(adaptive.decisions)[start:]
    # A loaded machine may stall the publisher past the window (no-signal / idle at the
    # floor); every decision made on a signal must be the fetch-bound hold.
    assert all(d.action == "hold" for d in recent)
    assert {d.reason_code for d in recent} - {"no-signal", "idle-at-floor"} == {"fetch-bound"}
    assert n_workers() == 1 and len(cluster.worker_spec) == 1
    fetch_events = [e for e in scale_events(client) if e["reason_code"] == "fetch-bound"]
    assert fetch_events and fetch_events[0]["action"] == "hold" and "batch more" in fetch_events[0]["reason"]

    # 2. verify-heavy with a rising queue: scales up to the maximum, with the reason recorded.
    with Publisher(client, fetch_ms=5.0, verify_ms=120.0):
        wait_until(lambda: n_workers() == 3, timeout_s=60, what="scale up to 3 workers")
    ups = [e for e in scale_events(client) if e["action"] == "up"]
    assert ups and all(e["reason_code"] == "verify-bound" for e in ups)
    assert "verify" in ups[0]["reason"] and ups[0]["target"] > ups[0]["current"]
    # every worker the adaptive cluster added carries the finalize resource
    infos = workers_now(client)
    added = [a for a, w in infos.items() if w["name"] != 0]
    assert len(added) == 2
    assert all(infos[a]["resources"].get("finalize", 0) > 0 for a in added)

    # 3. two workers host actors (stand-ins for storage units / generation actors); a
    #    fetch-bound signal keeps the cluster from going idle while they are placed
    with Publisher(client, fetch_ms=80.0, verify_ms=5.0):
        hosts = sorted(infos)[:2]
        actors = [client.submit(Ping, actor=True, workers=[h], pure=False).result() for h in hosts]
        wait_until(lambda: all(a.ping().result() == "pong" for a in actors), what="actors up")

        # Data on the third worker makes it the one distributed would keep, so without the
        # protection plugin the scale-down below would pick an actor host.
        (other,) = set(infos) - set(hosts)
        ballast = client.scatter(bytes(4 << 20), workers=[other])
        wait_until(lambda: client.who_has([ballast])[ballast.key], what="ballast stored")

        # the plugin keeps them out of every downscaling suggestion, even "close all"
        suggested = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.workers_to_close(n=3))
        assert set(suggested).isdisjoint(hosts)

    # 4. idle: scale down to the floor (minimum 1, but two workers host actors)
    wait_until(lambda: n_workers() == 2, timeout_s=60, what="scale down to the 2 actor hosts")
    downs = [e for e in scale_events(client) if e["action"] == "down"]
    assert downs and downs[-1]["reason_code"] == "idle" and "host actors" in downs[-1]["reason"]
    # the policy keeps holding at the floor; the actor hosts are still there and serving
    wait_until(lambda: adaptive.last_decision.reason_code == "idle-at-floor", what="hold at floor")
    assert sorted(workers_now(client)) == hosts
    assert [a.ping().result() for a in actors] == ["pong", "pong"]
    assert len(ballast.result()) == 4 << 20  # retirement moved the data, it did not drop it

    # the aggregator saw every recorded decision (page and /metrics read it)
    state = client.sync(client.scheduler.token_capture_state)
    assert len(state["decisions"]) == len(scale_events(client))
    assert state["decision_counts"].get("up:verify-bound", 0) == len(ups)


def test_without_aggregator_the_policy_holds_and_says_why():
    with dask.config.set(FAST):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0") as cluster, \
                Client(cluster) as client:
            adaptive = cluster.adapt(Adaptive=TokenCaptureAdaptive, minimum=1, maximum=2, interval="100ms", wait_count=1)
            wait_until(lambda: adaptive.last_decision is not None, what="a decision")
            assert adaptive.last_decision.reason_code == "no-aggregator"
            assert adaptive.last_decision.action == "hold"
            assert len(workers_now(client)) == 1
            events = wait_until(lambda: scale_events(client), what="the hold recorded in the event log")
            assert "preload" in events[0]["reason"]


def test_policy_settings_are_read_once_and_changed_only_through_with_settings():
    """A built policy keeps its knobs when dask.config changes; with_settings changes them
    for the next decision (the demo's scale phase), restore_settings puts them back."""
    verify = dict(events=5, fetch_ms=40, verify_ms=60, assemble_ms=0, queue_depth_first=1,
                  queue_depth_last=6, last_event_age_s=0.1, tasks=3)
    with dask.config.set({**FAST, "token-capture.scaling.verify-dominant-share": 0.9}):
        policy = TokenCaptureAdaptive(None)
    with dask.config.set({"token-capture.scaling.verify-dominant-share": 0.1}):
        assert policy.settings.verify_dominant_share == 0.9
        assert decide(verify, 2, 1, 4, policy.settings).action == "hold"
    previous = policy.with_settings(verify_dominant_share=0.5)
    assert decide(verify, 2, 1, 4, policy.settings).action == "up"
    policy.restore_settings(previous)
    assert policy.settings.verify_dominant_share == 0.9
