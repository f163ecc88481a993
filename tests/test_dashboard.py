"""The token-capture page on the scheduler's dashboard: served, in the menu, live, and
carrying the run's figures, checked over HTTP and rendered in headless Chromium.

Events are synthetic here (the schema real runs publish, ``pipeline.events``); the
screenshot is kept as ``artifacts/dashboard-token-capture.png``.
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

from browser import Browser, chromium_path, image_stats
from pipeline.dashboard import install
from pipeline.dashboard.preload import PRELOAD
from pipeline.events import CUT, FINALIZE, RESTORE, SCALE, STORE
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
    assert s["histograms"]["verify_ms"]["count"] == 3  # per step
    assert s["histograms"]["queue_wait_ms"]["count"] == 6  # per group
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
    count and the latest detail the group events carried (issue 11 #11)."""
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
            assert s["histograms"]["queue_wait_ms"]["count"] == 20


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
