"""A real demo run feeds the dashboard page and /metrics (no synthetic events here).

The demo runs against a cluster started with the token-capture preload; afterwards the
page is fetched over HTTP and rendered in headless Chromium, and its figures must equal
what the demo printed. The screenshot is kept as ``artifacts/demo-dashboard.png``.
"""
from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
from distributed import Client

from browser import Browser, chromium_path, image_stats
from pipeline import demo
from pipeline.cli import build_parser
from pipeline.cluster import local_cluster
from support import http_get, wait_until

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"






@pytest.fixture(scope="module")
def demo_run():
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        args = build_parser().parse_args(
            ["demo", "--scheduler", cluster.scheduler_address, "--steps", "2", "--groups", "2", "--rollouts", "3", "--turns", "2", "--quiet"]
        )
        out = io.StringIO()
        summary = demo.run(args, out=out)
        base = f"http://127.0.0.1:{client.scheduler_info()['services']['dashboard']}"
        # Events reach the scheduler asynchronously; wait until the run's steps are in.
        # The resume phase finalizes one more step of groups x rollouts on top of the steps.
        expected = summary["rollouts"]  # every finalized rollout, the resume step included
        expected += summary["tampered"]["rollouts"]  # and the group tampered on purpose (counted apart)
        wait_until(lambda: client.sync(client.scheduler.token_capture_state)["totals"].get("rollouts") == expected)
        yield client, base, summary, out.getvalue()


def test_demo_prints_the_page_address_and_its_figures(demo_run):
    client, base, summary, text = demo_run
    port = client.scheduler_info()["services"]["dashboard"]
    assert re.search(rf"dashboard: http://[^/]+:{port}/token-capture", text), text
    # Two regular steps of 2 x 3 rollouts, then the resume phase's step of 2 x 3.
    assert summary["rollouts"] == 2 * 2 * 3 + 2 * 3 and summary["accepted"] == summary["rollouts"]
    assert summary["resume"]["rollouts"] == 2 * 3
    assert "rollouts matched the uninterrupted run" in text


def test_page_over_http_carries_the_demo_figures(demo_run):
    client, base, summary, _ = demo_run
    status, html = http_get(f"{base}/token-capture")
    assert status == 200
    state = client.sync(client.scheduler.token_capture_state)
    finalized = state["totals"]["rollouts"]
    assert int(re.search(r'id="tc-rollouts">(\d+)<', html).group(1)) == finalized
    assert int(re.search(r'id="tc-accepted">(\d+)<', html).group(1)) == state["totals"]["accepted"]
    # The demo's steps, the resume phase's cut and its restore all reached the page's state.
    run_id = summary["run_id"]
    assert {s["step_id"] for s in state["steps"]} >= {f"{run_id}-step-0", f"{run_id}-step-1", f"{run_id}-resume"}
    assert int(re.search(r'id="tc-cuts">(\d+)<', html).group(1)) >= 1
    assert state["store_units"], "store figures were published"


def test_metrics_endpoint_matches_the_demo(demo_run):
    client, base, summary, _ = demo_run
    status, text = http_get(f"{base}/metrics")
    assert status == 200
    state = client.sync(client.scheduler.token_capture_state)
    m = re.search(r'^token_capture_rollouts_total\{status="accepted"\} ([0-9.e+]+)$', text, re.M)
    assert m and float(m.group(1)) == state["totals"]["accepted"] >= summary["accepted"]
    assert re.search(r"^token_capture_finalize_phase_seconds_count\{phase=\"verify\"\} [1-9]", text, re.M)
    assert re.search(r"^token_capture_cut_rows_total [1-9]", text, re.M)
    assert re.search(r"^token_capture_store_rows\{", text, re.M)


@pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_page_renders_the_demo_in_chromium(demo_run):
    client, base, summary, _ = demo_run
    finalized = client.sync(client.scheduler.token_capture_state)["totals"]["rollouts"]
    with Browser(width=1400, height=1000) as browser:
        browser.navigate(f"{base}/token-capture")
        browser.wait_for(
            "window.Bokeh && Bokeh.documents.length > 0 && "
            "Bokeh.documents[0].get_model_by_name('tc-split').data.step.length > 0",
            timeout_s=60,
        )
        header = browser.evaluate("Bokeh.documents[0].get_model_by_name('tc-header').text")
        rollouts = browser.evaluate(
            "Array.from(Bokeh.documents[0].get_model_by_name('tc-split').data.rollouts).reduce((a, b) => a + b, 0)"
        )
        assert f"<b>{finalized}</b> rollouts finalized" in header
        assert rollouts == finalized
        time.sleep(1.0)  # paint settle for the picture only
        shot = browser.screenshot(ARTIFACTS / "demo-dashboard.png")
    stats = image_stats(shot)
    assert stats["colors"] > 200, stats


def test_the_tampered_rollouts_reach_the_page_rejected_by_reason(demo_run):
    from tasks.toy.tamper import TAMPER_KINDS

    client, base, summary, text = demo_run
    state = client.sync(client.scheduler.token_capture_state)
    assert state["rejected"] == {kind: 1 for kind in TAMPER_KINDS}
    assert set(state["rejected_details"]) == set(TAMPER_KINDS)
    assert summary["tampered"]["as_expected"] == len(TAMPER_KINDS)
    assert "(demo: 5 rollouts tampered on purpose; rejected: " in text
    for kind in TAMPER_KINDS:
        assert f"  tampered-{kind}-0: rejected {kind} (as expected)" in text
    # attached with --scheduler: this demo does not scale that cluster, and says so
    assert "scaling: phase skipped: attached with --scheduler" in text
