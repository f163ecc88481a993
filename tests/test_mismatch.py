"""The mismatch monitor: figures against a per-token oracle, route agreement over expert
SETS, the split by weight-version lag, bad input named by field, and one report through
a real Finalizer to the scheduler's state, ``/metrics`` over HTTP and the page's models."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from rollout_factory import VOCAB, make_rollout

from pipeline.dashboard.page import TokenCapturePage
from pipeline.finalize import Finalizer
from support import dashboard_base, http_get, store_maker, wait_until
from tasks import reasons as R
from tasks.errors import InvalidInput
from tasks.mismatch import mismatch_stats
from tasks.packed import pack_rows

EPS = (0.1, 0.2)


def oracle(old, new, mask, lag, eps):
    """Token by token: every figure, overall and per lag value (test-only reference)."""
    per: dict = {}
    for b in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[b, t] > 0:
                d = float(new[b, t]) - float(old[b, t])
                r = math.exp(d)
                per.setdefault(None, []).append((abs(d), (r - 1) - math.log(r), r))
                per.setdefault(int(lag[b]), []).append((abs(d), (r - 1) - math.log(r), r))
    out = {}
    for key, rows in per.items():
        out[key] = dict(tokens=len(rows), mean=sum(a for a, _, _ in rows) / len(rows), max=max(a for a, _, _ in rows),
                        k3=sum(k for _, k, _ in rows) / len(rows),
                        outside={e: sum(1 for _, _, r in rows if r < 1 - e or r > 1 + e) / len(rows) for e in eps})
    return out


def check(report, want):
    assert report.tokens == want["tokens"]
    assert report.mean_abs_delta == pytest.approx(want["mean"], rel=1e-9)
    assert report.max_abs_delta == pytest.approx(want["max"], rel=1e-9)
    assert report.k3_mean == pytest.approx(want["k3"], rel=1e-6, abs=1e-12)
    assert report.frac_outside == pytest.approx(want["outside"])


@pytest.mark.parametrize("as_torch", [False, True])
def test_figures_match_a_per_token_oracle_overall_and_by_lag(as_torch):
    rng = np.random.default_rng(0)
    B, T = 4, 9
    old = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    new = (old + rng.normal(0.0, 0.15, (B, T))).astype(np.float32)
    mask = (rng.random((B, T)) < 0.6).astype(np.float32)
    lag = np.array([0, 2, 0, 5], dtype=np.int64)
    new[0, ~(mask[0] > 0)] = np.nan  # garbage off the loss mask is never read
    args = [torch.from_numpy(a) for a in (old, new, mask, lag)] if as_torch else [old, new, mask, lag]
    rep = mismatch_stats(*args[:3], weight_lag=args[3], eps=EPS)
    want = oracle(old, new, mask, lag, EPS)
    check(rep, want[None])
    assert sorted(rep.by_lag) == [0, 2, 5]
    for v, sub in rep.by_lag.items():
        check(sub, want[v])
        assert sub.by_lag == {}
    assert 0 < rep.frac_outside[0.2] <= rep.frac_outside[0.1] < 1
    same = mismatch_stats(old, old, mask)
    assert (same.mean_abs_delta, same.k3_mean, same.frac_outside) == (0.0, 0.0, {0.1: 0.0, 0.2: 0.0}) and same.by_lag == {}


def test_route_agreement_compares_expert_sets_per_token_and_layer():
    B, T, L, K = 2, 3, 2, 2
    sampler = np.zeros((B, T, L, K), np.int64)
    sampler[..., 0], sampler[..., 1] = 1, 3
    trainer = sampler[..., ::-1].copy()  # the same sets in the other order: all agree
    mask = np.ones((B, T), np.float32)
    lp = np.zeros((B, T), np.float32)
    assert mismatch_stats(lp, lp, mask, sampler_routes=sampler, trainer_routes=trainer).route_agreement == 1.0
    trainer[0, 0, 1] = (3, 4)  # one (token, layer) pair of 12 disagrees
    trainer[1, 2, 0] = (5, 1)  # and one of row 1's
    rep = mismatch_stats(lp, lp, mask, weight_lag=np.array([1, 0]), sampler_routes=sampler, trainer_routes=trainer)
    assert rep.route_agreement == pytest.approx(10 / 12) and rep.route_pairs == 12
    assert rep.by_lag[1].route_agreement == pytest.approx(5 / 6) and rep.by_lag[0].route_agreement == pytest.approx(5 / 6)
    mask[0, 0] = 0  # off the loss mask: not compared
    only = mismatch_stats(lp, lp, mask, sampler_routes=sampler, trainer_routes=trainer, route_rows=np.array([True, False]))
    assert only.route_agreement == 1.0 and only.route_pairs == 4  # row 0's other two tokens
    assert mismatch_stats(lp, lp, mask).route_agreement is None


@pytest.mark.parametrize("k", [1, 3, 8, 20])
def test_route_agreement_matches_a_sorted_set_oracle(k):
    """Random top-k sets, some reordered and some changed, stored narrower than the
    trainer's ids (uint8 against int64): agreement as a per-pair ``np.sort`` says."""
    rng = np.random.default_rng(k)
    B, T, L = 3, 40, 4
    sampler = np.argsort(rng.random((B, T, L, 64)), axis=-1)[..., :k].astype(np.uint8)  # k distinct experts
    trainer = sampler.astype(np.int64)
    swap = rng.random((B, T, L)) < 0.5
    trainer[swap] = trainer[swap][:, ::-1]
    change = rng.random((B, T, L)) < 0.1
    trainer[change, 0] = 64 + rng.integers(0, 8, int(change.sum()))  # an expert the sampler never picked
    mask = (rng.random((B, T)) < 0.8).astype(np.float32)
    lp = np.zeros((B, T), np.float32)
    rep = mismatch_stats(lp, lp, mask, sampler_routes=sampler, trainer_routes=trainer)
    want = (np.sort(sampler.astype(np.int64), -1) == np.sort(trainer, -1)).all(-1)[mask > 0]
    assert rep.route_agreement == pytest.approx(float(want.mean())) and rep.route_pairs == want.size
    assert rep.route_agreement < 1.0


@pytest.mark.parametrize("change, field", [
    (dict(trainer_logprobs=np.zeros((2, 4))), "trainer_logprobs"),
    (dict(loss_mask=np.ones((3, 5))), "loss_mask"),
    (dict(trainer_logprobs="nan"), "trainer_logprobs"),
    (dict(weight_lag=np.zeros(3, np.int64)), "weight_lag"),
    (dict(weight_lag=np.zeros(2, np.float32)), "weight_lag"),
    (dict(trainer_routes=np.zeros((2, 5, 1, 2), np.int64)), "sampler_routes"),
    (dict(sampler_routes=np.zeros((2, 5, 1, 2), np.int64), trainer_routes=np.zeros((2, 5, 1, 3), np.int64)), "trainer_routes"),
    (dict(sampler_routes=np.zeros((2, 4, 1, 2), np.int64), trainer_routes=np.zeros((2, 4, 1, 2), np.int64)), "sampler_routes"),
    (dict(eps=(0.1, -0.2)), "eps"),
    (dict(eps=()), "eps"),
])
def test_bad_input_names_the_field(change, field):
    args = dict(old_logprobs=np.zeros((2, 5)), trainer_logprobs=np.zeros((2, 5)), loss_mask=np.ones((2, 5)))
    args.update(change)
    if isinstance(args["trainer_logprobs"], str):
        args["trainer_logprobs"] = np.zeros((2, 5))
        args["trainer_logprobs"][1, 3] = np.inf
    with pytest.raises(InvalidInput, match=field):
        mismatch_stats(args.pop("old_logprobs"), args.pop("trainer_logprobs"), args.pop("loss_mask"), **args)


def scrape(client) -> dict:
    _, text = http_get(f"{dashboard_base(client)}/metrics")
    return {s.name + str(sorted(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) if f.name.startswith("token_capture_") for s in f.samples}


@pytest.mark.timeout(120)
def test_one_report_reaches_the_state_metrics_and_page(inprocess_client, tmp_path):
    client = inprocess_client
    rng = np.random.default_rng(11)
    routes = (2, 2, 8)
    builts = [make_rollout(rng, f"mm-r{i}", n_calls=2, group_id="mm", routes=routes, weight_version=[v, 4])
              for i, v in enumerate((4, 3, 1))]
    with store_maker(client, tmp_path / "spill") as make:
        store = make(n_units=2)
        assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=routes[2])
        fin.with_settings(max_staleness=2, mismatch_eps=(0.05, 0.5))
        step = fin.submit_step({"mm": [b.receipt for b in builts]}, step_id="mm-step", trainer_version=4).result(timeout=60)
    assert step.groups["mm"].status == [R.OK, R.OK, R.STALE]  # lags 0, 1, 3
    b = step.to_batch(trainer_version=4)
    trainer_lp = b["old_logprobs"] + 0.3 * b["loss_mask"] * (torch.arange(b["old_logprobs"].shape[1]) % 2)
    trainer_routes = b["routed_experts"].to(torch.int64).flip(-1)  # the same sets: agreement 1
    with pytest.raises(InvalidInput, match="trainer_logprobs"):
        step.report_mismatch(trainer_lp[:, :-1], weight_version=4)
    rep = step.report_mismatch(trainer_lp, weight_version=4, trainer_routes=trainer_routes)
    assert sorted(rep.by_lag) == [0, 1] and rep.tokens == int((b["loss_mask"] > 0).sum())  # the stale row is masked
    assert set(rep.frac_outside) == {0.05, 0.5} and rep.route_agreement == 1.0

    sched = client.cluster.scheduler
    agg = sched.plugins["token-capture-aggregator"].state
    wait_until(lambda: agg.trainer.mismatch_reports == 1 and agg.totals["steps"] == 1, what="the step and mismatch events")
    last = agg.trainer.latest
    assert last["step_id"] == "mm-step" and last["k3_mean"] == pytest.approx(rep.k3_mean)
    assert set(last["by_lag"]) == {"0", "1"} and last["route_agreement"] == 1.0

    m = scrape(client)
    assert m["token_capture_mismatch_reports_total[]"] == 1.0
    assert m["token_capture_mismatch_k3_mean[]"] == pytest.approx(rep.k3_mean)
    assert m["token_capture_mismatch_max_abs_delta[]"] == pytest.approx(rep.max_abs_delta)
    assert m["token_capture_mismatch_frac_outside[('eps', '0.05')]"] == pytest.approx(rep.frac_outside[0.05])
    assert m["token_capture_mismatch_route_agreement[]"] == 1.0
    assert m["token_capture_mismatch_k3_count[]"] == 1.0
    assert m["token_capture_staleness_rollouts_total[('bucket', '<1k')]"] == 3.0
    assert m["token_capture_staleness_dropped_total[('bucket', '<1k')]"] == 1.0
    assert m["token_capture_staleness_dropped_total[('bucket', '>=16k')]"] == 0.0  # every bucket served
    assert m["token_capture_staleness_lag_versions_total[('bucket', '<1k')]"] == 4.0
    assert m["token_capture_rollouts_rejected_total[('reason', 'stale')]"] == 1.0

    page = TokenCapturePage(sched, lambda s: s.plugins["token-capture-aggregator"].state)
    page.update()
    assert page.trainer_panels.staleness.data["bucket"][0] == "<1k"
    assert page.trainer_panels.staleness.data["stale"][0] == 1 and page.trainer_panels.staleness.data["kept"][0] == 2
    mm = page.trainer_panels.mismatch.data
    assert mm["step"] == ["mm-step"] and mm["k3_mean"] == [pytest.approx(rep.k3_mean)]
    assert page.trainer_panels.mismatch_frac.data["eps"] == ["0.05", "0.5"]
    assert not page.notes["mismatch"].visible and not page.notes["staleness"].visible

    # The batch the trainer already holds (made with any trainer_version) gives the same
    # report without building it again; a batch without a field the monitor reads is named.
    again = step.report_mismatch(trainer_lp, weight_version=4, trainer_routes=trainer_routes, batch=step.to_batch())
    assert again.figures() == rep.figures() and {k: v.figures() for k, v in again.by_lag.items()} == {
        k: v.figures() for k, v in rep.by_lag.items()}
    without = {k: v for k, v in b.items() if k != "weight_version_oldest"}
    with pytest.raises(InvalidInput, match="batch lacks weight_version_oldest"):
        step.report_mismatch(trainer_lp, weight_version=4, batch=without)
