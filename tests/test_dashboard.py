"""The token-capture page on the scheduler's dashboard: served, in the menu, live, and
carrying the run's figures, checked over HTTP and rendered in headless Chromium.

Events are synthetic here (the schema real runs publish, ``pipeline.events``); the
screenshots are kept as ``artifacts/dashboard-token-capture.png`` and, full page at both
widths the page is checked at, ``artifacts/dashboard-1400.png`` / ``-1920.png`` (what
``docs/dashboard-1400.png`` / ``-1920.png`` are copied from).
"""
from __future__ import annotations

import ast
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import dask
import pytest
from distributed import Client, LocalCluster

from browser import Browser, chromium_path, image_stats, ink_fraction
from pipeline.dashboard import install
from pipeline.dashboard.preload import PRELOAD
from pipeline.events import CUT, FINALIZE, MISMATCH, RESTORE, SCALE, STORE
from support import dashboard_base as base_url, http_get as get, wait_until

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
REJECTIONS = ({}, {"corrupt_digest": 1}, {"missing_parent": 1}, {}, {"corrupt_digest": 2}, {})








def state(client: Client) -> dict[str, Any]:
    return client.sync(client.scheduler.token_capture_state)


def publish_run(client: Client, first_group: int = 0, groups: int = 6, collect: bool = True) -> dict[str, Any]:
    """A small run's events, shaped as finalization publishes them (two groups a step).

    Each group event carries its step's shared union-fetch time; ``collect`` adds the
    controller's step event. Returns the figures the page must show.
    """
    expected: dict[str, Any] = {"rollouts": 0, "accepted": 0, "rejected": {}, "details": {}}
    step_accepted = 0
    for i in range(first_group, first_group + groups):
        rej = REJECTIONS[i % len(REJECTIONS)]
        accepted = 4 - sum(rej.values())
        client.log_event(FINALIZE, dict(
            kind="group", step_id=f"step-{i // 2}", group_id=f"g{i}", rollouts=4, accepted=accepted,
            rejected=rej, rejected_details={r: f"{r} in g{i}" for r in rej}, fetch_ms=8.0 + i // 2, verify_ms=30.0 + 4 * i, assemble_ms=2.0,
            queue_wait_ms=5.0 * i, queue_depth=i % 4, calls_per_rollout=3, fetch_calls=1,
            bytes_fetched=4096, tokens=512,
        ))
        expected["rollouts"] += 4
        expected["accepted"] += accepted
        step_accepted += accepted
        for reason, n in rej.items():
            expected["rejected"][reason] = expected["rejected"].get(reason, 0) + n
            expected["details"][reason] = f"{reason} in g{i}"  # the latest detail per reason
        if collect and i % 2 == 1:
            k = i // 2
            client.log_event(FINALIZE, dict(
                kind="step", step_id=f"step-{k}", groups=2, rollouts=8, accepted=step_accepted, rejected={},
                fetch_ms=8.0 + k, verify_ms=(30.0 + 8 * k) + (34.0 + 8 * k), assemble_ms=4.0,
                queue_wait_ms=1.0, queue_depth=2, queue_depth_after=1, wall_ms=120.0 + k,
                dominant="verify", calls_per_rollout=3, fetch_calls=1, bytes_fetched=8192, tokens=1024,
            ))
            step_accepted = 0
    return expected


def publish_side_events(client: Client) -> None:
    client.log_event(CUT, dict(checkpoint_id="ck-7", worker="gen-0", calls=12, rows=14, puts=2, wall_ms=35.0,
                               durable=11, failures={"durable_failure": 1}))
    client.log_event(RESTORE, dict(worker="gen-0", requests=64, gets=3, keys=192, keys_per_get=64.0,
                                   p50_ms=11.0, p99_ms=29.0, failures=0))
    client.log_event(STORE, dict(unit="0", worker="w0", rows=120, memory_bytes=3 << 20, spilled_bytes=5 << 20))
    client.log_event(STORE, dict(unit="1", worker="w1", rows=80, memory_bytes=2 << 20, spilled_bytes=0))
    client.log_event(SCALE, dict(action="up", target=3, current=2, reason_code="verify-bound",
                                 reason="verify-bound: verify 80% of finalize time and queue depth 1 -> 5",
                                 verify_ms=400.0, fetch_ms=90.0, queue_depth=5))
    client.log_event(FINALIZE, {"fetch_ms": "n/a"})  # malformed: dropped and counted


@pytest.fixture(scope="module")
def run():
    """A cluster with the preload that has seen one small run's events."""
    with LocalCluster(
        n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0",
        scheduler_kwargs={"preload": [PRELOAD]},
    ) as cluster, Client(cluster) as client:
        expected = publish_run(client)
        publish_side_events(client)
        wait_until(lambda: state(client)["totals"].get("steps") == 3 and state(client)["decisions"]
                   and state(client)["malformed"], what="events aggregated")
        yield client, expected


def test_page_is_served_and_listed_in_the_dashboard_menu(run):
    client, expected = run
    base = base_url(client)
    for page in ("status", "workers", "token-capture"):
        status, html = get(f"{base}/{page}")
        assert status == 200
        assert re.search(r'<a href="token-capture">\s*Token-Capture\s*</a>', html), f"menu entry missing on /{page}"
    status, html = get(f"{base}/token-capture")
    assert "static/js/bokeh.min.js" in html and "Bokeh" in html  # a Bokeh server document
    assert "<title>Dask: Token capture</title>" in html or "Token capture" in html
    served = re.search(r'id="tc-rollouts">(\d+)<', html)
    assert served and int(served.group(1)) == expected["rollouts"]
    assert int(re.search(r'id="tc-accepted">(\d+)<', html).group(1)) == expected["accepted"]
    assert int(re.search(r'id="tc-cuts">(\d+)<', html).group(1)) == 1


def test_aggregator_state_carries_the_run(run):
    client, expected = run
    s = state(client)
    assert s["totals"]["rollouts"] == expected["rollouts"]
    assert s["totals"]["accepted"] == expected["accepted"]
    assert s["rejected"] == expected["rejected"]
    assert s["rejected_details"] == expected["details"]
    assert [st["step_id"] for st in s["steps"]] == ["step-0", "step-1", "step-2"]
    assert s["totals"]["groups"] == 6 and s["totals"]["steps"] == 3
    # the step event's figures win: fetch counted once per step, not once per group
    assert [st["fetch_ms"] for st in s["steps"]] == [8.0, 9.0, 10.0]
    assert s["steps"][1]["verify_ms"] == pytest.approx(38.0 + 42.0)
    assert all(st["final"] and st["dominant"] == "verify" for st in s["steps"])
    assert s["histograms"]["verify_seconds"]["count"] == 3  # per step
    assert s["histograms"]["queue_wait_seconds"]["count"] == 6  # per group
    assert len(s["depths"]) == 9  # 6 group points + 3 step points
    assert s["cut_failures"] == {"durable_failure": 1}
    assert s["store_units"]["0"]["spilled_bytes"] == 5 << 20
    assert s["decisions"][0]["reason_code"] == "verify-bound"
    assert s["malformed"] == {f"{FINALIZE}:fetch_ms": 1}


JS_FIGURES = """
(() => {
  const doc = Bokeh.documents[0];
  const data = (name) => doc.get_model_by_name(name).data;
  const arr = (x) => Array.from(x);
  const split = data('tc-split'), out = data('tc-outcome'), cut = data('tc-cut');
  const rst = data('tc-restore'), store = data('tc-store'), dec = data('tc-decisions'), rej = data('tc-rejections');
  return {
    steps: arr(split.step), step_rollouts: arr(split.rollouts), verify_ms: arr(split.verify_ms),
    outcome: Object.fromEntries(arr(out.outcome).map((o, i) => [o, out.count[i]])),
    rejection_details: Object.fromEntries(arr(rej.reason).map((r, i) => [r, rej.detail[i]])),
    depth_points: data('tc-depth').queue_depth.length, wait_points: data('tc-queue').queue_wait_ms.length,
    fetch_ms: arr(split.fetch_ms), state: arr(split.state),
    cut_rows: arr(cut.rows), cut_failures: arr(cut.failures),
    restore_gets: arr(rst.gets), restore_p99: arr(rst.p99_ms),
    store_units: arr(store.unit), spilled: arr(store.spilled_bytes),
    decisions: arr(dec.reason), workers_points: data('tc-workers').workers.length,
    cross_steps: arr(data('tc-cross-host').step),
    header: doc.get_model_by_name('tc-header').text,
  };
})()
"""


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_renders_in_chromium_with_the_run_figures_and_updates_live(run):
    client, expected = run
    url = f"{base_url(client)}/token-capture"
    with Browser(width=1400, height=1000) as browser:
        browser.navigate(url)
        browser.wait_for("window.Bokeh && Bokeh.documents.length > 0 && "
                         "Bokeh.documents[0].get_model_by_name('tc-split').data.step.length > 0",
                         timeout_s=60)
        fig = browser.evaluate(JS_FIGURES)

        assert fig["steps"] == ["step-0", "step-1", "step-2"]
        assert fig["cross_steps"] == ["step-0", "step-1", "step-2"]  # collected steps' bytes crossing hosts
        assert sum(fig["step_rollouts"]) == expected["rollouts"]
        assert fig["verify_ms"][1] == pytest.approx(80.0)
        assert fig["fetch_ms"] == [8.0, 9.0, 10.0]
        assert fig["state"] == ["collected (verify-bound)"] * 3
        assert fig["outcome"] == {"accepted": expected["accepted"], **expected["rejected"]}
        assert fig["rejection_details"] == expected["details"]
        assert fig["depth_points"] == 9 and fig["wait_points"] == 6
        assert fig["cut_rows"] == [14] and fig["cut_failures"] == ["durable_failure: 1"]
        assert fig["restore_gets"] == [3] and fig["restore_p99"] == [29.0]
        assert fig["store_units"] == ["0", "1"] and fig["spilled"] == [5 << 20, 0]
        assert "verify-bound" in fig["decisions"][0]
        assert fig["workers_points"] >= 1
        assert f"<b>{expected['rollouts']}</b> rollouts finalized" in fig["header"]
        assert "1 malformed" in fig["header"]

        # let the canvases paint, then keep the picture
        browser.wait_for("document.readyState === 'complete'")
        time.sleep(1.0)  # paint settle for the screenshot only; nothing is asserted on time
        shot = browser.screenshot(ARTIFACTS / "dashboard-token-capture.png")
        stats = image_stats(shot)
        assert (stats["width"], stats["height"]) == (1400, 1000)
        assert stats["colors"] > 200, stats  # plots drawn, not a blank page
        assert shot.stat().st_size > 30_000

        # live: a new step's groups finalize (not yet collected); the open page follows
        more = publish_run(client, first_group=6, groups=2, collect=False)
        total = expected["rollouts"] + more["rollouts"]
        browser.wait_for(
            f"Array.from(Bokeh.documents[0].get_model_by_name('tc-split').data.rollouts)"
            f".reduce((a, b) => a + b, 0) === {total}", timeout_s=30)
        live = browser.evaluate(JS_FIGURES)
        assert live["steps"][-1] == "step-3" and live["state"][-1] == "running"
        assert live["fetch_ms"][-1] == 11.0  # provisional: the shared fetch once, not per group


def test_rejection_table_shows_the_last_detail_per_reason():
    """The page's rejection table (source ``tc-rejections``): one row per reason, with its
    count and the latest detail the group events carried."""
    from pipeline.dashboard.page import TokenCapturePage
    from pipeline.dashboard.state import TokenCaptureState

    class _Scheduler:
        workers: dict = {}

    agg = TokenCaptureState(history=8)
    base = dict(kind="group", fetch_ms=1.0, verify_ms=1.0, assemble_ms=1.0, rollouts=4)
    agg.ingest(FINALIZE, dict(base, rejected={"corrupt_digest": 2, "wrong_group": 1},
                              rejected_details={"corrupt_digest": "old", "wrong_group": "names group 'g2'"}))
    agg.ingest(FINALIZE, dict(base, rejected={"corrupt_digest": 1}, rejected_details={"corrupt_digest": "call 'c1'"}))
    agg.ingest(FINALIZE, dict(base, rejected={"missing_parent": 1}))  # an older producer: no detail
    page = TokenCapturePage(_Scheduler(), lambda _: agg)
    page.update()
    rows = {r: (n, d) for r, n, d in zip(page.rejections.data["reason"], page.rejections.data["count"], page.rejections.data["detail"])}
    assert rows == {"corrupt_digest": (3, "call 'c1'"), "wrong_group": (1, "names group 'g2'"), "missing_parent": (1, "")}
    assert [c.title for c in page.rejection_table.columns] == ["rejection reason", "rollouts", "last detail"]


def test_install_on_a_running_cluster_serves_page_and_metrics():
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0") as cluster, \
            Client(cluster) as client:
        base = base_url(client)
        with pytest.raises(urllib.error.HTTPError):
            get(f"{base}/token-capture")
        install(client)
        install(client)  # idempotent
        plugins = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
        assert "token-capture-aggregator" in plugins and "token-capture-protect" in plugins
        publish_run(client, groups=2)
        wait_until(lambda: state(client)["totals"].get("groups") == 2, what="events aggregated")
        status, html = get(f"{base}/token-capture")
        assert status == 200 and int(re.search(r'id="tc-rollouts">(\d+)<', html).group(1)) == 8
        assert 'href="token-capture"' in get(f"{base}/status")[1]
        assert "token_capture_groups_finalized_total 2.0" in get(f"{base}/metrics")[1]


def test_state_is_bounded_by_history():
    with dask.config.set({"token-capture.dashboard.history": 5}):
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0",
                          scheduler_kwargs={"preload": [PRELOAD]}) as cluster, Client(cluster) as client:
            for i in range(20):
                client.log_event(FINALIZE, dict(step_id=f"s{i}", rollouts=2, accepted=2, fetch_ms=1.0,
                                                verify_ms=1.0, assemble_ms=1.0))
                client.log_event(CUT, dict(checkpoint_id=f"c{i}", rows=1, puts=1, wall_ms=1.0))
            wait_until(lambda: state(client)["cut_totals"].get("cuts") == 20, what="events aggregated")
            s = state(client)
            assert len(s["groups"]) == 5 and len(s["steps"]) == 5 and len(s["cuts"]) == 5
            assert [st["step_id"] for st in s["steps"]] == [f"s{i}" for i in range(15, 20)]  # newest kept
            assert s["totals"]["groups"] == 20 and s["totals"]["rollouts"] == 40  # totals are not windowed
            assert s["histograms"]["queue_wait_seconds"]["count"] == 20


def test_dask_scheduler_cli_preload_serves_the_page(tmp_path):
    """``dask scheduler --preload pipeline.dashboard.preload``, as documented."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
    log = tmp_path / "scheduler.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0",
             "--dashboard-address", "127.0.0.1:0", "--preload", PRELOAD],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
        )
    try:
        def addresses() -> Any:
            text = log.read_text()
            sched = re.search(r"Scheduler at:\s+(tcp://127\.0\.0\.1:\d+)", text)
            dash = re.search(r"dashboard at:\s+http://127\.0\.0\.1:(\d+)/", text)
            assert proc.poll() is None, text
            return (sched.group(1), int(dash.group(1))) if sched and dash and "Run preload setup" in text else None

        address, port = wait_until(addresses, timeout_s=60, what="the scheduler to start")
        with Client(address) as client:
            publish_run(client, groups=3)
            wait_until(lambda: state(client)["totals"].get("groups") == 3, what="events aggregated")
        status, html = get(f"http://127.0.0.1:{port}/token-capture")
        assert status == 200 and int(re.search(r'id="tc-rollouts">(\d+)<', html).group(1)) == 12
        assert "token_capture_groups_finalized_total 3.0" in get(f"http://127.0.0.1:{port}/metrics")[1]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _imported_modules(module_file: Path, package: str) -> set[str]:
    """Every module ``module_file`` imports (relative imports resolved against ``package``,
    ``from x import y`` also yields ``x.y``, since ``y`` may be a submodule)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def _imported_names(module_file: Path) -> set[str]:
    return {alias.name for node in ast.walk(ast.parse(module_file.read_text()))
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


def _hits(imported: set[str], forbidden: tuple[str, ...]) -> set[str]:
    return {m for m in imported if any(m == f or m.startswith(f + ".") for f in forbidden)}


def test_dashboard_dependencies_run_one_way():
    """state <- views (page, /metrics collector) <- plugin <- preload: nothing imports back."""
    repo = Path(__file__).resolve().parent.parent
    dashboard = repo / "pipeline" / "dashboard"
    state = _imported_modules(dashboard / "state.py", "pipeline.dashboard")
    assert not _hits(state, (
        "pipeline.dashboard.plugin", "pipeline.dashboard.page", "pipeline.dashboard.preload",
        "pipeline.metrics", "distributed", "bokeh", "prometheus_client",
    ))
    assert "pipeline.dashboard" not in state  # the package's __init__ imports the plugin
    assert not {n for n in _imported_names(dashboard / "state.py") if n.endswith("Plugin")}
    plugin_side = ("pipeline.dashboard.plugin", "pipeline.dashboard.preload")
    assert not _hits(_imported_modules(dashboard / "page.py", "pipeline.dashboard"), plugin_side)
    assert not _hits(_imported_modules(repo / "pipeline" / "metrics" / "prometheus.py", "pipeline.metrics"),
                     plugin_side + ("pipeline.dashboard.page",))
    assert not _hits(_imported_modules(dashboard / "plugin.py", "pipeline.dashboard"), ("pipeline.dashboard.preload",))



# --------------------------------------------------------------------------- readable at a glance
RUN_ID = "3fa2c1"
WORKERS = ("tcp://127.0.0.1:40401", "tcp://127.0.0.1:40403", "tcp://127.0.0.1:41219")
REASONS = ("corrupt_digest", "missing_parent", "cumulative_hash_mismatch")
TILE_KEYS = ("rollouts", "accepted", "rejected", "groups", "steps", "cuts", "gets", "decisions")


def publish_full_run(client: Client, run_id: str = RUN_ID, steps: int = 6, pace_s: float = 0.0) -> None:
    """Every kind of event a demo run publishes, with its ids: steps ``<run>-step-<n>`` of 4
    groups of 8 rollouts (some rejected by reason, with details), a checkpoint cut on two
    generation workers (one durable failure), two restore batchers, four storage units
    and scaling decisions of every action. ``pace_s`` spaces the steps in time."""
    decisions = [
        dict(action="hold", target=2, current=2, reason_code="no-signal",
             reason="no-signal: 1 finalize event(s) in the window, need 3"),
        dict(action="up", target=3, current=2, reason_code="verify-bound", verify_ms=400.0, fetch_ms=90.0, queue_depth=5,
             reason="verify-bound: verify 81% of finalize time and queue depth 1 -> 5"),
        dict(action="hold", target=3, current=3, reason_code="balanced",
             reason="balanced: fetch 30%, verify 60%, queue depth 2 -> 2"),
    ]
    depth = 0
    for s in range(steps):
        step_id, accepted = f"{run_id}-step-{s}", 0
        for g in range(4):
            rejected = {REASONS[(s + g) % 3]: 1} if (s + g) % 2 else {}
            if s % 3 == 2 and g == 3:
                rejected[REASONS[0]] = rejected.get(REASONS[0], 0) + 1
            depth = max(0, depth + (1 if (s + g) % 3 else -1))
            client.log_event(FINALIZE, dict(
                kind="group", step_id=step_id, group_id=f"prompt{4 * s + g}", rollouts=8,
                accepted=8 - sum(rejected.values()), rejected=rejected,
                rejected_details={r: f"rollout prompt{4 * s + g}-r3 call c2: staged row digest 9f2c41e0 does not match "
                                     f"the receipt's 77ab03d1" for r in rejected},
                fetch_ms=20.0 + s, verify_ms=40.0 + 9 * g + 5 * s, assemble_ms=4.0 + g, queue_wait_ms=30.0 * g + 11 * s,
                queue_depth=depth, calls_per_rollout=2 + (s + g) % 4 * 0.75, fetch_calls=1, bytes_fetched=1 << 20, tokens=4096))
            accepted += 8 - sum(rejected.values())
        client.log_event(FINALIZE, dict(
            kind="step", step_id=step_id, groups=4, rollouts=32, accepted=accepted, fetch_ms=20.0 + s,
            verify_ms=220.0 + 20 * s, assemble_ms=22.0, wall_ms=420.0 + 25 * s, dominant="verify", queue_depth_after=depth,
            staleness=staleness_figures(s)))
        client.log_event(MISMATCH, mismatch_figures(step_id, s))
        if s < len(decisions):
            client.log_event(SCALE, decisions[s])
        time.sleep(pace_s)
    for i, worker in enumerate(WORKERS[:2]):
        client.log_event(CUT, dict(checkpoint_id=f"{run_id}-ckpt-0", worker=worker, calls=24 + i, rows=26 + i, puts=2,
                                   wall_ms=31.0 + 9 * i, durable=24, failures={"durable_failure": 1} if i else {}))
        client.log_event(RESTORE, dict(worker=worker, requests=48, gets=3 + i, keys=48, keys_per_get=48 / (3 + i),
                                       p50_ms=4.0 + i, p99_ms=12.0 + 3 * i, failures=0))
    for u in range(4):
        client.log_event(STORE, dict(unit=str(u), worker=WORKERS[u % 3], rows=300 + 20 * u,
                                     memory_bytes=(3 + u) << 20, spilled_bytes=(u % 2) * (5 << 20)))
    client.log_event(SCALE, dict(action="down", target=2, current=3, reason_code="idle",
                                 reason="idle: no finalize event for 31.0s and no tasks; 2 worker(s) host actors and stay"))


def staleness_figures(s: int) -> dict[str, Any]:
    """A step's staleness: long rollouts lag more and are dropped stale more often."""
    buckets = [dict(bucket=b, rollouts=n, stale=k, lag_sum=lag * n, mean_lag=float(lag))
               for b, n, k, lag in (("<1k", 14, 0, 1), ("1-4k", 10, 1, 2), ("4-16k", 6, 2 + s % 2, 3), (">=16k", 2, 2, 5))]
    return dict(trainer_version=10 + s, reference_version=10 + s, max_staleness=3, rollouts=32, stale=5 + s % 2,
                mean_lag=2.0, max_lag=5, buckets=buckets)


def mismatch_figures(step_id: str, s: int) -> dict[str, Any]:
    """A mismatch report of step ``s``: the trainer drifts away from the sampler."""
    return dict(kind="mismatch", step_id=step_id, weight_version=10 + s, tokens=4096, mean_abs_delta=0.02 + 0.01 * s,
                max_abs_delta=0.4 + 0.1 * s, k3_mean=0.001 * (s + 1), frac_outside={"0.1": 0.05 + 0.02 * s, "0.2": 0.01 * (s + 1)},
                route_pairs=4096 * 4, route_agreement=0.97 - 0.01 * s, by_lag={"0": dict(tokens=2048, mean_abs_delta=0.01)})


def _page_cluster() -> LocalCluster:
    return LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0",
                        worker_dashboard_address="127.0.0.1:0", scheduler_kwargs={"preload": [PRELOAD]})


def _full_run_in(client: Client) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        s = state(client)
        full = len(s["decisions"]) == 4 and len(s["store_units"]) == 4 and len(s["cuts"]) == 2 and len(s["restore_latest"]) == 2 \
            and s["mismatch"]["reports"] == 6
        return s if full else None

    return wait_until(done, what="the full run aggregated")


JS_NOTES = """(() => { const out = {};
  for (const m of Bokeh.documents[0].all_models) {
    if (m.name && m.name.startsWith('tc-empty-')) { out[m.name.slice(9)] = m.visible; } }
  return out; })()"""
JS_TILES = "Object.fromEntries(%s.map((k) => [k, Number(document.getElementById('tc-' + k).textContent)]))" % list(TILE_KEYS)
JS_READY = "window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].get_model_by_name('tc-header').text.length > 0"
PANELS = {"split", "outcome", "rejections", "depth", "wait", "calls", "scale", "decisions", "cut", "cuts", "restore",
          "restores", "store", "units", "cross-host", "staleness", "mismatch"}


def _tiles_of(snap: dict[str, Any]) -> dict[str, int]:
    """The header's totals, computed here from a state snapshot."""
    return {k: int(v) for k, v in dict(rollouts=snap["totals"]["rollouts"], accepted=snap["totals"]["accepted"], rejected=snap["totals"]["rejected"],
                groups=snap["totals"]["groups"], steps=snap["totals"].get("steps", 0), cuts=snap["cut_totals"].get("cuts", 0),
                gets=snap["restore_totals"].get("gets", 0), decisions=sum(snap["decision_counts"].values())).items()}


@pytest.fixture(scope="module")
def full_run():
    """A cluster whose page has seen every kind of event, with run-id step ids."""
    with _page_cluster() as cluster, Client(cluster) as client:
        publish_full_run(client)
        yield client, _full_run_in(client)


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_no_data_notes_show_on_a_fresh_scheduler_and_go_once_events_arrive():
    """Nothing on the page is empty without saying so; the notes go as data arrive (no reload)."""
    with _page_cluster() as cluster, Client(cluster) as client, Browser(width=1400, height=1000) as browser:
        browser.navigate(f"{base_url(client)}/token-capture")
        browser.wait_for(JS_READY, timeout_s=60)
        notes = browser.evaluate(JS_NOTES)
        assert set(notes) == PANELS and all(notes.values()), notes  # one note per chart and table, all shown
        assert browser.evaluate(JS_TILES) == dict.fromkeys(TILE_KEYS, 0)
        # the notes are drawn: the canvases carry ink (axes, the note), the page is not blank
        shot = browser.full_page_screenshot(ARTIFACTS / "dashboard-empty.png", settle_s=0.5)
        plots = browser.layout()["plots"]
        assert len(plots) == 12 and all(ink_fraction(shot, (p["left"], p["top"], p["width"], p["height"])) > 0.002
                                       for p in plots), plots
        browser.evaluate("window.__tc_same_page = true")

        publish_full_run(client)
        snap = _full_run_in(client)
        browser.wait_for(f"Object.values({JS_NOTES}).every((shown) => !shown)", timeout_s=30)
        assert browser.evaluate("window.__tc_same_page === true")  # live, not reloaded
        assert browser.wait_for(f"JSON.stringify({JS_TILES}) === '{json_dumps(_tiles_of(snap))}'", timeout_s=30)
        assert not browser.errors, browser.errors


def json_dumps(value: Any) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_header_totals_change_after_new_events_without_reloading(run):
    """The header's totals (served in the HTML) follow the state live, like the rest."""
    client, _ = run
    with Browser(width=1400, height=1000) as browser:
        browser.navigate(f"{base_url(client)}/token-capture")
        browser.wait_for(JS_READY, timeout_s=60)
        before = browser.evaluate(JS_TILES)
        assert before == _tiles_of(state(client))
        browser.evaluate("window.__tc_same_page = true")

        publish_run(client, first_group=100, groups=2)  # one more collected step: 8 rollouts, 2 groups
        publish_side_events(client)  # one more cut report, restore report, scaling decision
        def arrived() -> dict[str, Any] | None:
            s = state(client)
            new = s["totals"]["groups"] == before["groups"] + 2 and sum(s["decision_counts"].values()) == before["decisions"] + 1
            return s if new else None

        after = wait_until(arrived, what="the new events aggregated")
        expected = _tiles_of(after)
        assert expected["rollouts"] == before["rollouts"] + 8 and expected["steps"] == before["steps"] + 1
        browser.wait_for(f"JSON.stringify({JS_TILES}) === '{json_dumps(expected)}'", timeout_s=30)
        assert browser.evaluate("window.__tc_same_page === true")  # no reload happened
        header = browser.evaluate("Bokeh.documents[0].get_model_by_name('tc-header').text")
        assert f"<b>{expected['rollouts']}</b> rollouts finalized" in header  # the line under the tiles agrees


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (apt-get install -y chromium)")
@pytest.mark.parametrize("width", [1400, 1920])
def test_page_is_readable_at_a_glance(full_run, width):
    """At 1400 and 1920 px: every chart drawn at least 220 px tall in a two-column grid,
    no table cell cut off, nothing wider than the window, short step labels (run id in the
    group label, the full id in the hover source), and a screenshot that is not blank."""
    client, snap = full_run
    with Browser(width=width, height=1000) as browser:
        browser.navigate(f"{base_url(client)}/token-capture")
        browser.wait_for(JS_READY + " && Bokeh.documents[0].get_model_by_name('tc-store').data.unit.length === 4",
                         timeout_s=60)
        browser.wait_for("document.readyState === 'complete'")
        time.sleep(1.0)  # let the tables size their columns and the canvases paint
        layout = browser.layout()
        assert layout["page_width"] <= layout["viewport_width"], layout  # no horizontal scrolling
        plots = layout["plots"]
        assert len(plots) == 12, plots
        assert all(p["height"] >= 220 for p in plots), plots
        assert all(0.4 * width <= p["width"] <= 0.5 * width for p in plots), plots  # two columns
        assert layout["cells"] >= 40 and not layout["truncated"], layout["truncated"]
        assert browser.evaluate(f"Object.values({JS_NOTES}).every((shown) => !shown)")

        split = browser.evaluate("(() => { const d = Bokeh.documents[0].get_model_by_name('tc-split').data;"
                                 " return {x: Array.from(d.x), step: Array.from(d.step)}; })()")
        assert split["step"] == [f"{RUN_ID}-step-{i}" for i in range(6)]  # the hover's full id
        assert split["x"] == [[f"run {RUN_ID}", str(i)] for i in range(6)]  # the axis: step number under its run
        store = browser.evaluate("Array.from(Bokeh.documents[0].get_model_by_name('tc-store').data.label)")
        assert store[0] == "unit 0 \u00b7 127.0.0.1:40401"  # names, not "0"/"1"
        assert browser.evaluate(JS_TILES) == _tiles_of(snap)

        shot = browser.full_page_screenshot(ARTIFACTS / f"dashboard-{width}.png")
        stats = image_stats(shot)
        assert stats["width"] == width and stats["height"] >= 1500 and stats["colors"] > 200, stats
        for p in plots:  # every chart has something drawn in it
            assert ink_fraction(shot, (p["left"], p["top"], p["width"], p["height"])) > 0.01, p
        assert not browser.errors, browser.errors
