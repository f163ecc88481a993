"""Group assembly: padded tensors, kept shape, rejected rows zeroed, metrics."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks import reasons as R
from tasks.finalize.assemble import assemble_group
from tasks.finalize.linearize import Linearized
from tasks.finalize.plan import plan_group
from tasks.finalize.verify import RolloutResult, rejected_result, verify_many
from rollout_factory import VOCAB, fetch, make_group


def verified(seed=0, n=4, routes=None, **kw):
    builts = make_group(np.random.default_rng(seed), "g", n, routes=routes, **kw)
    step = plan_group([b.receipt for b in builts])
    rows, rt = fetch(builts, step.staging_keys, step.routes_keys)
    res = verify_many(step.rollouts, rows, rt, vocab_size=VOCAB, num_experts=None if routes is None else routes[2])
    assert all(r.ok for r in res)
    return res, [b.receipt.reward for b in builts]


def lin(n_tokens: int, routes=None) -> Linearized:
    mask = np.r_[np.zeros(2, np.float32), np.ones(n_tokens - 2, np.float32)]
    re = None if routes is None else np.ones((n_tokens,) + routes, np.int16)
    return Linearized(np.arange(n_tokens, dtype=np.int64) + 1, mask, -mask * 0.5, re, 2, [("c0", 0, n_tokens)])


def test_dtypes_shapes_padding():
    res, rewards = verified(routes=(2, 2, 8), n_calls=3, n_branches=1)
    fg = assemble_group(res, rewards)
    n, lengths = 4, [r.linearized.length for r in res]
    T = max(lengths)
    assert fg.input_ids.dtype == torch.int64 and fg.input_ids.shape == (n, T)
    assert fg.logprobs.dtype == fg.token_mask.dtype == fg.sample_mask.dtype == fg.rewards.dtype == torch.float32
    assert fg.routed_experts.dtype == torch.uint8 and fg.routed_experts.shape == (n, T, 2, 2)  # 8 experts: one byte
    assert fg.input_lengths.tolist() == lengths
    assert fg.rewards.tolist() == pytest.approx(rewards)
    assert fg.sample_mask.tolist() == [1.0] * n and fg.has_routes.all()
    for i, r in enumerate(res):
        t = lengths[i]
        assert torch.equal(fg.input_ids[i, :t], torch.from_numpy(r.linearized.input_ids))
        assert torch.equal(fg.token_mask[i, :t], torch.from_numpy(r.linearized.token_mask))
        assert torch.equal(fg.routed_experts[i, :t], torch.from_numpy(r.linearized.routed_experts))
        # Padding is zeros everywhere past the row's length.
        assert not fg.input_ids[i, t:].any() and not fg.token_mask[i, t:].any() and not fg.logprobs[i, t:].any()
        assert not fg.routed_experts[i, t:].any()
    assert fg.metrics["tokens"] == sum(lengths) and fg.metrics["accepted"] == n
    assert fg.metrics["calls_per_rollout"] == 3.0 and fg.metrics["rejected_by_reason"] == {}


def test_rejected_rows_keep_shape_and_are_zero():
    res, rewards = verified(n=3)
    res[1] = rejected_result(res[1].rollout_id, R.CORRUPT_DIGEST, "flipped", n_calls=3)
    fg = assemble_group(res, rewards)
    assert fg.input_ids.shape[0] == 3 and fg.status == [R.OK, R.CORRUPT_DIGEST, R.OK]
    assert fg.sample_mask.tolist() == [1.0, 0.0, 1.0]
    assert fg.input_lengths[1] == 0 and fg.prompt_lengths[1] == 0 and not fg.input_ids[1].any()
    assert fg.rewards[1] == pytest.approx(rewards[1])  # kept as given; sample_mask drops it
    assert fg.routed_experts is None
    assert fg.metrics["rejected_by_reason"] == {R.CORRUPT_DIGEST: 1} and fg.metrics["rejected"] == 1


def test_all_rejected_group():
    res = [rejected_result(f"r{i}", R.CAPTURE_POISONED) for i in range(3)]
    fg = assemble_group(res, [0.0, 1.0, 2.0])
    assert fg.input_ids.shape == (3, 0) and fg.sample_mask.sum() == 0
    assert fg.metrics == {**fg.metrics, "accepted": 0, "tokens": 0, "calls_per_rollout": 0.0}
    assert fg.metrics["rejected_by_reason"] == {R.CAPTURE_POISONED: 3}


def test_routes_shape_disagreement_rejects_the_odd_row_only():
    res = [RolloutResult(f"r{i}", R.OK, "", lin(5 + i, (2, 2) if i != 2 else (3, 2)), 1) for i in range(3)]
    fg = assemble_group(res, [1.0, 1.0, 1.0])
    assert fg.status == [R.OK, R.OK, R.INVALID_ROUTES]
    assert fg.routed_experts.shape == (3, 6, 2, 2) and fg.sample_mask.tolist() == [1.0, 1.0, 0.0]


def test_mixed_routed_and_unrouted_rows():
    res = [RolloutResult("a", R.OK, "", lin(4, (1, 2)), 1), RolloutResult("b", R.OK, "", lin(6), 1)]
    fg = assemble_group(res, [0.5, -0.5])
    assert fg.has_routes.tolist() == [True, False]
    assert fg.routed_experts.shape == (2, 6, 1, 2) and not fg.routed_experts[1].any()


def test_ok_without_row_is_not_trained_on():
    fg = assemble_group([RolloutResult("a", R.OK, "", None, 1)], [1.0])
    assert fg.status == [R.EMPTY_TRAINING_ROW] and fg.sample_mask.tolist() == [0.0]


def test_pad_id_and_reward_count():
    res, rewards = verified(n=2)
    fg = assemble_group(res, rewards, pad_id=-1)
    short = int(fg.input_lengths.argmin())
    if fg.input_lengths[short] < fg.input_ids.shape[1]:
        assert fg.input_ids[short, -1] == -1
    with pytest.raises(ValueError, match="rewards"):
        assemble_group(res, rewards[:1])
