"""Receipt defects, each through the public API, each held to the reference.

1. a reward finite in float64 but not in float32 (training's dtype) is ``invalid_receipt``;
7. a receipt naming another group than the one it is submitted in is ``wrong_group``;
8. a terminal call with a staged child in the same receipt is ``terminal_not_leaf``;
11. every rejected row keeps its detail (``FinalizedGroup.details``), and group events
   carry a bounded ``{reason: detail}`` sample the dashboard keeps.
"""
from __future__ import annotations

import math
import time

import dask
import numpy as np
import pytest
import torch

from pipeline import events
from pipeline.dashboard.state import DETAIL_REASONS, TokenCaptureState
from pipeline.finalize import Finalizer
from pipeline.finalize.timing import DETAIL_CHARS, detail_sample
from rollout_factory import VOCAB, fetch, make_rollout, receipt_dict
from tasks import reasons as R
from tasks.finalize.assemble import assemble_group
from tasks.finalize.plan import plan_group, plan_step
from tasks.finalize.reference import reference_receipt_reason
from tasks.finalize.verify import merge_results, verify_many
from tasks.packed import pack_rows

F32_MAX = float(np.finfo(np.float32).max)
F32_EDGE = 2.0**128 - 2.0**103  # the smallest float64 that rounds to inf in float32

OVERFLOWING = [1e300, -1e39, 3.5e38, -F32_EDGE, F32_EDGE, 10**400, -(10**39)]
FINITE = [F32_MAX, -F32_MAX, math.nextafter(F32_EDGE, 0.0), 1e38, 2**65, -3, 0.0]


def _d(seed: int, rid: str = "r", **kw) -> dict:
    return receipt_dict(make_rollout(np.random.default_rng(seed), rid, n_calls=3, **kw))


def _reason(d: dict, group: str | None = None) -> tuple[str, str] | None:
    step = plan_step([d] if group is None else {group: [d]})
    want = reference_receipt_reason(d, group)
    got = next(iter(step.rejected.values()), None)
    assert (got[0] if got else None) == want, (got, want)
    return got


# ---- 1. rewards that overflow float32 ---------------------------------------------------------


@pytest.mark.parametrize("reward", OVERFLOWING, ids=repr)
def test_reward_overflowing_float32_is_invalid_receipt(reward):
    d = _d(1)
    d["reward"] = reward
    reason, detail = _reason(d)
    assert reason == R.INVALID_RECEIPT and "reward" in detail and "float32" in detail


@pytest.mark.parametrize("reward", FINITE, ids=repr)
def test_reward_finite_in_float32_is_kept(reward):
    d = _d(2)
    d["reward"] = reward
    assert _reason(d) is None
    step = plan_step([d])
    assert step.rewards == [float(reward)] and math.isfinite(float(np.float32(step.rewards[0])))


def test_overflowing_reward_never_reaches_the_rewards_tensor():
    """The rejected row reads reward 0.0, so the group's rewards (and a group-normalized
    advantage over the accepted rows) stay finite."""
    rng = np.random.default_rng(3)
    builts = [make_rollout(rng, f"g-r{i}", n_calls=2, reward=float(i)) for i in range(3)]
    ds = [receipt_dict(b) for b in builts]
    ds[1]["reward"] = 1e300
    step = plan_step(ds)
    assert step.rejected["g-r1"][0] == R.INVALID_RECEIPT
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    results = merge_results(step, verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=None))
    group = assemble_group(results, step.rewards)
    assert group.status == [R.OK, R.INVALID_RECEIPT, R.OK]
    assert torch.isfinite(group.rewards).all() and group.rewards.tolist() == [0.0, 0.0, 2.0]
    r = group.rewards[group.sample_mask > 0]
    assert torch.isfinite((r - r.mean()) / (r.std() + 1e-6)).all()


def test_int_reward_past_float64_does_not_raise():
    d = _d(4)
    d["reward"] = 10**400
    step = plan_step([d, _d(5, "other")])  # before: OverflowError out of plan_step
    assert step.rejected["r"][0] == R.INVALID_RECEIPT and step.rewards == [0.0, step.rewards[1]]


# ---- 7. a receipt submitted under another group ------------------------------------------------


def test_receipt_of_another_group_is_wrong_group():
    d = _d(6, group_id="g2")
    reason, detail = _reason(d, "g1")
    assert reason == R.WRONG_GROUP and "'g2'" in detail and "'g1'" in detail
    assert _reason(d, "g2") is None
    assert plan_group([d], "g1").rejected["r"][0] == R.WRONG_GROUP
    assert plan_group([d]).rejected == {}  # a flat list names no group: nothing to compare


@pytest.mark.parametrize("claimed", [None, ""])
def test_receipt_without_a_group_fits_any_group(claimed):
    d = _d(7, group_id=claimed)
    d["group_id"] = claimed
    assert _reason(d, "g1") is None
    assert plan_step({"g1": [d]}).group_ids == ["g1"]


def test_wrong_group_rule_order():
    """invalid_receipt (top-level types) -> wrong_group -> capture_poisoned."""
    d = _d(8, group_id="g2")
    d["poisoned"], d["calls"] = True, [{"junk": 1}]
    assert _reason(d, "g1")[0] == R.WRONG_GROUP
    d["failure_reason"] = 7  # a top-level type error wins
    assert _reason(d, "g1")[0] == R.INVALID_RECEIPT


def test_plan_step_groups_keep_submission_order_and_ids():
    a, b, c = _d(9, "a", group_id="g1"), _d(10, "b", group_id="g2"), _d(11, "c", group_id="g1")
    step = plan_step({"g1": [a], "g2": [b, c]})
    assert step.order == ["a", "b", "c"] and step.group_ids == ["g1", "g2", "g2"]
    assert step.rejected == {"c": (R.WRONG_GROUP, step.rejected["c"][1])}
    assert [p.rollout_id for p in step.rollouts] == ["a", "b"]


# ---- 8. a terminal that is not a leaf ----------------------------------------------------------


def test_terminal_with_a_staged_child_is_terminal_not_leaf():
    d = _d(12)
    d["terminal_model_call_id"] = "c1"  # c2 is c1's child: the row would stop short of it
    reason, detail = _reason(d)
    assert reason == R.TERMINAL_NOT_LEAF and "'c1'" in detail and "'c2'" in detail


def test_branch_off_the_terminal_is_terminal_not_leaf():
    b = make_rollout(np.random.default_rng(13), "br", n_calls=2)
    d = receipt_dict(b)
    extra = dict(d["calls"][-1])
    extra.update(model_call_id="x", parent_call_id="c1", staging_key="br/x")
    d["calls"].append(extra)
    assert _reason(d)[0] == R.TERMINAL_NOT_LEAF
    d["terminal_model_call_id"] = "x"  # the leaf as terminal is fine
    assert _reason(d) is None


def test_terminal_not_leaf_comes_after_lineage_rules():
    d = _d(14)
    d["terminal_model_call_id"] = "c1"
    d["calls"][0]["parent_call_id"] = "ghost"
    assert _reason(d)[0] == R.MISSING_PARENT
    d["calls"][0]["parent_call_id"] = "c2"
    assert _reason(d)[0] == R.LINEAGE_CYCLE


# ---- 11. rejection details ---------------------------------------------------------------------


def test_finalized_group_keeps_a_detail_per_row():
    rng = np.random.default_rng(15)
    builts = [make_rollout(rng, f"d{i}", n_calls=2) for i in range(3)]
    ds = [receipt_dict(b) for b in builts]
    ds[2]["terminal_model_call_id"] = "c0"
    step = plan_step(ds)
    rows, routes = fetch(builts[:1], step.staging_keys, step.routes_keys)  # d1's rows are missing
    results = merge_results(step, verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=None))
    group = assemble_group(results, step.rewards)
    assert group.status == [R.OK, R.MISSING_STAGING_ROW, R.TERMINAL_NOT_LEAF]
    assert group.details[0] == ""
    assert "d1/c0" in group.details[1]
    assert "'c0'" in group.details[2] and "'c1'" in group.details[2]
    assert len(group.details) == len(group)


def test_detail_sample_is_bounded():
    long = "x" * 1000
    sample = detail_sample(
        [R.OK, R.CORRUPT_DIGEST, R.CORRUPT_DIGEST, R.INTERNAL_ERROR, R.WRONG_GROUP],
        ["", long, "second", "bug", "g"],
    )
    assert sample == {R.CORRUPT_DIGEST: "x" * DETAIL_CHARS, R.WRONG_GROUP: "g"}


def test_dashboard_state_keeps_the_latest_detail_per_reason():
    s = TokenCaptureState(history=8)
    base = dict(kind="group", fetch_ms=1.0, verify_ms=1.0, assemble_ms=1.0, rollouts=2, accepted=1)
    assert s.ingest(events.FINALIZE, dict(base, rejected={"corrupt_digest": 1}, rejected_details={"corrupt_digest": "first"}))
    assert s.ingest(events.FINALIZE, dict(base, rejected={"corrupt_digest": 1}, rejected_details={"corrupt_digest": "y" * 500}))
    assert s.ingest(events.FINALIZE, dict(base, rejected={"wrong_group": 1}))  # older producers: no details
    assert s.snapshot()["rejected_details"] == {"corrupt_digest": "y" * 200}
    for i in range(DETAIL_REASONS + 5):
        s.ingest(events.FINALIZE, dict(base, rejected={f"r{i}": 1}, rejected_details={f"r{i}": str(i)}))
    assert len(s.rejected_details) == DETAIL_REASONS and list(s.rejected_details)[-1] == f"r{DETAIL_REASONS + 4}"
    assert not s.ingest(events.FINALIZE, dict(base, rejected_details=["not", "a", "mapping"]))
    assert s.malformed == {(events.FINALIZE, "rejected_details"): 1}


# ---- all four through the Finalizer on a cluster -----------------------------------------------


def test_defects_through_the_finalizer(cluster_client, store_factory):
    store = store_factory(n_units=2)
    rng = np.random.default_rng(16)
    builts = [make_rollout(rng, f"fin-{i}", n_calls=3, group_id="g1", vocab_size=VOCAB) for i in range(5)]
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed
    ds = [receipt_dict(b) for b in builts]
    ds[1]["reward"] = 1e300
    ds[2]["group_id"] = "g2"
    ds[3]["terminal_model_call_id"] = "c1"
    store.delete(["fin-4/c2"])
    with dask.config.set({"token-capture.finalize.clear-staged": False}):
        fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=None)
        step = fin.submit_step({"g1": ds}, step_id="issue-11").result(timeout=60)
        listed = fin.submit_step([[ds[2]]]).result(timeout=60)  # list form: no group to compare
    g = step.groups["g1"]
    assert g.status == [R.OK, R.INVALID_RECEIPT, R.WRONG_GROUP, R.TERMINAL_NOT_LEAF, R.MISSING_STAGING_ROW]
    assert g.details[0] == "" and all(g.details[1:])
    assert "reward" in g.details[1] and "'g2'" in g.details[2] and "'c1'" in g.details[3] and "fin-4/c2" in g.details[4]
    assert torch.isfinite(g.rewards).all()
    sample = g.metrics["rejected_details"]
    assert set(sample) == set(g.metrics["rejected"]) and sample[R.WRONG_GROUP] == g.details[2][:DETAIL_CHARS]
    assert listed.groups["g0"].status == [R.OK]
    for _ in range(200):  # group events come from a worker: poll, bounded
        got = [m for _, m in cluster_client.get_events(events.FINALIZE)
               if m.get("step_id") == "issue-11" and m.get("kind") == "group"]
        if got:
            break
        time.sleep(0.05)
    assert got and got[0]["rejected_details"] == sample
