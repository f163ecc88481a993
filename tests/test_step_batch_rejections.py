"""Rows the step batch rejects itself, and only those: a rollout whose lag behind the
trainer leaves int64 (``stale``) and routes of another ``[L, K]`` than the step's
(``invalid_routes``); the rest of the step is assembled as it would be without them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from rollout_factory import VOCAB, fetch, make_group, make_rollout

from tasks import reasons as R
from tasks.finalize.assemble import assemble_group
from tasks.finalize.plan import plan_group
from tasks.finalize.step_batch import batch_rejections, group_advantages, step_batch, weight_lag
from tasks.finalize.verify import verify_many

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
ROW_FIELDS = ("input_ids", "attention_mask", "position_ids", "loss_mask", "old_logprobs", "input_lengths", "prompt_lengths")


def versioned(seed: int, versions: list[int], routes=None):
    """A group of one rollout per entry of ``versions`` (each call at that weight version)."""
    rng = np.random.default_rng(seed)
    builts = [make_rollout(rng, f"v{seed}-r{i}", n_calls=2, weight_version=v, routes=routes) for i, v in enumerate(versions)]
    step = plan_group([b.receipt for b in builts])
    rows, rt = fetch(builts, step.staging_keys, step.routes_keys)
    res = verify_many(step.rollouts, rows, rt, vocab_size=VOCAB, num_experts=None if routes is None else routes[2])
    assert all(r.ok for r in res)
    return assemble_group(res, [float(i) for i in range(len(versions))])


def routed(seed: int, n: int, routes):
    builts = make_group(np.random.default_rng(seed), f"s{seed}", n, routes=routes, n_calls=2)
    step = plan_group([b.receipt for b in builts])
    rows, rt = fetch(builts, step.staging_keys, step.routes_keys)
    res = verify_many(step.rollouts, rows, rt, vocab_size=VOCAB, num_experts=routes[2])
    assert all(r.ok for r in res)
    return assemble_group(res, [float(i % 3) for i in range(n)])


def assert_rejected_row(b: dict, r: int) -> None:
    assert b["sample_mask"][r] == 0 and b["input_lengths"][r] == 0 and b["prompt_lengths"][r] == 0
    assert not b["attention_mask"][r].any() and not b["loss_mask"][r].any() and not b["old_logprobs"][r].any()
    assert b["advantages"][r] == 0 and not b["has_routes"][r]


@pytest.mark.parametrize(
    ("absurd", "trainer_version", "lag", "words"),
    [(I64_MIN, 7, I64_MAX, f"{2**63 + 7} versions behind trainer_version 7"),
     (I64_MAX, -2, I64_MIN, f"{2**63 + 1} versions ahead of trainer_version -2")],
)
def test_one_rollout_whose_lag_leaves_int64_is_rejected_stale_alone(absurd, trainer_version, lag, words):
    good, odd = versioned(1, [3, 5, 4]), versioned(2, [4, absurd, 6])
    before = [(g.status[:], g.sample_mask.clone(), g.weight_version_oldest.clone()) for g in (good, odd)]
    b = step_batch([good, odd], trainer_version=trainer_version)
    plain = step_batch([good, odd])  # without a trainer version nothing is rejected
    (rej,) = batch_rejections([good, odd], trainer_version=trainer_version)
    assert (rej.group, rej.row, rej.rollout_id, rej.reason) == (1, 1, odd.rollout_ids[1], R.STALE)
    assert str(absurd) in rej.detail and words in rej.detail and "leaves int64" in rej.detail
    assert_rejected_row(b, 4)
    # the acknowledged versions as captured; the lag saturated, never wrapped
    assert b["weight_version_oldest"].tolist() == [3, 5, 4, 4, absurd, 6]
    assert b["weight_lag"].tolist() == [trainer_version - v for v in (3, 5, 4, 4)] + [lag, trainer_version - 6]
    # every other row is as it was; the odd group's statistics leave the rejected row out
    others = [0, 1, 2, 3, 5]
    for name in ROW_FIELDS + ("rewards", "sample_mask", "group_index"):
        assert torch.equal(b[name][others], plain[name][others]), name
    accepted = torch.tensor([True] * 4 + [False, True])
    assert torch.equal(b["advantages"], group_advantages(b["rewards"], accepted, b["group_index"], 2))
    assert torch.equal(b["advantages"][:3], plain["advantages"][:3])
    # the groups are not modified
    for g, (status, mask, oldest) in zip((good, odd), before):
        assert g.status == status and torch.equal(g.sample_mask, mask) and torch.equal(g.weight_version_oldest, oldest)


def test_a_lag_exactly_at_int64s_bound_is_kept():
    g = versioned(3, [I64_MIN, 0])
    b = step_batch([g], trainer_version=-1)  # -1 - (-2**63) = 2**63 - 1: fits
    assert b["weight_lag"].tolist() == [I64_MAX, -1] and b["sample_mask"].tolist() == [1, 1]
    assert batch_rejections([g], trainer_version=-1) == []
    assert batch_rejections([g], trainer_version=0)[0].reason == R.STALE


def test_weight_lag_saturates_both_ways():
    oldest = torch.tensor([I64_MIN, -1, 0, I64_MAX], dtype=torch.int64)
    assert weight_lag(5, oldest).tolist() == [I64_MAX, 6, 5, 5 - I64_MAX]
    assert weight_lag(-5, oldest).tolist() == [I64_MAX - 4, -4, -5, I64_MIN]
    assert weight_lag(I64_MIN, oldest).tolist() == [0, I64_MIN + 1, I64_MIN, I64_MIN]


@pytest.mark.parametrize("odd_first", [False, True])
def test_groups_of_other_routes_dimensions_are_rejected_not_the_step(odd_first):
    # three routed rows of [2, 2] in two groups, two of [3, 2] in one: [2, 2] is the step's
    a, c, odd = routed(10, 2, (2, 2, 8)), routed(11, 1, (2, 2, 8)), routed(12, 2, (3, 2, 8))
    groups = [odd, a, c] if odd_first else [a, c, odd]
    b = step_batch(groups)
    rejs = batch_rejections(groups)
    oi = groups.index(odd)
    assert [(r.group, r.row, r.reason) for r in rejs] == [(oi, 0, R.INVALID_ROUTES), (oi, 1, R.INVALID_ROUTES)]
    assert all("[3, 2]" in r.detail and "[2, 2]" in r.detail for r in rejs)
    assert b["routed_experts"].shape[2:] == (2, 2) and b["routed_experts"].dtype == torch.uint8
    odd_rows = [i for i, gi in enumerate(b["group_index"].tolist()) if gi == oi]
    for r in odd_rows:
        assert_rejected_row(b, r)
        assert not b["routed_experts"][r].any()
    # the others are exactly the batch of the step without the odd group
    alone = step_batch([a, c])
    keep = [i for i in range(b["input_ids"].shape[0]) if i not in odd_rows]
    T = alone["input_ids"].shape[1]
    for name in ROW_FIELDS + ("advantages", "rewards", "routed_experts"):
        assert torch.equal(b[name][keep][:, :T] if b[name].dim() > 1 else b[name][keep], alone[name]), name
    assert odd.sample_mask.tolist() == [1, 1] and odd.has_routes.tolist() == [True, True]  # not modified


def test_the_step_shape_counts_rows_not_groups_and_a_tie_keeps_the_first():
    many = routed(20, 3, (3, 2, 8))
    one, two = routed(21, 1, (2, 2, 8)), routed(22, 1, (2, 2, 8))
    rejs = batch_rejections([one, two, many])  # 3 rows of [3, 2] against 2 rows of [2, 2]
    assert {(r.group, r.reason) for r in rejs} == {(0, R.INVALID_ROUTES), (1, R.INVALID_ROUTES)}
    assert step_batch([one, two, many])["routed_experts"].shape[2:] == (3, 2)
    x, y = routed(23, 2, (3, 2, 8)), routed(24, 2, (2, 2, 8))
    assert [r.group for r in batch_rejections([x, y])] == [1, 1]
    assert [r.group for r in batch_rejections([y, x])] == [1, 1]


def test_routes_decide_before_the_lag():
    ok = versioned(30, [1, 2], routes=(2, 2, 8))
    odd = versioned(31, [I64_MIN, 3], routes=(3, 2, 8))
    rejs = batch_rejections([ok, routed(32, 1, (2, 2, 8)), odd], trainer_version=9)
    assert [(r.group, r.row, r.reason) for r in rejs] == [(2, 0, R.INVALID_ROUTES), (2, 1, R.INVALID_ROUTES)]
