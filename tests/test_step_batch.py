"""One training batch per step: padding, masks, GRPO advantages, routes, TensorDict, and
``StepResult.to_batch`` through a real Finalizer on a LocalCluster."""
from __future__ import annotations

import dataclasses
import math
import sys
import types

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rollout_factory import VOCAB, fetch, make_group

from pipeline.finalize import Finalizer, StepResult
from tasks import reasons as R
from tasks.errors import InvalidInput
from tasks.finalize.assemble import FinalizedGroup, assemble_group
from tasks.finalize.plan import plan_group
from tasks.finalize.step_batch import group_advantages, step_batch
from tasks.finalize.verify import RolloutResult, rejected_result, verify_many
from tasks.packed import pack_rows

L, K, E = 2, 2, 8
F32_MAX = float(np.finfo(np.float32).max)

DTYPES = {
    "input_ids": torch.int64, "attention_mask": torch.int64, "position_ids": torch.int64,
    "loss_mask": torch.float32, "old_logprobs": torch.float32, "token_advantages": torch.float32,
    "rewards": torch.float32, "advantages": torch.float32, "sample_mask": torch.float32,
    "group_index": torch.int64, "input_lengths": torch.int64, "prompt_lengths": torch.int64,
    "has_routes": torch.bool,
}


def verified(seed: int = 0, n: int = 4, routes=None, **kw) -> list[RolloutResult]:
    """``n`` real verify results (rows staged through the capture gate, then verified)."""
    builts = make_group(np.random.default_rng(seed), f"s{seed}", n, routes=routes, **kw)
    step = plan_group([b.receipt for b in builts])
    rows, rt = fetch(builts, step.staging_keys, step.routes_keys)
    res = verify_many(step.rollouts, rows, rt, vocab_size=VOCAB, num_experts=None if routes is None else routes[2])
    assert all(r.ok for r in res)
    return res


def group(results, rewards, reject=(), pad_id: int = 0) -> FinalizedGroup:
    """assemble_group over ``results`` with rows in ``reject`` turned into rejections."""
    res = [rejected_result(r.rollout_id, R.CORRUPT_DIGEST, "test", n_calls=r.n_calls) if i in reject else r for i, r in enumerate(results)]
    return assemble_group(res, rewards, pad_id=pad_id)


def grpo_reference(rewards, accepted, eps: float = 1e-6, normalize_std: bool = True) -> list[float]:
    """verl's compute_grpo_outcome_advantage restricted to accepted rows, in float64; a
    group with fewer than two accepted rows gets 0 (verl gives a lone row r / (1 + eps))."""
    idx = [i for i, a in enumerate(accepted) if a]
    out = [0.0] * len(rewards)
    if len(idx) < 2:
        return out
    r = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
    mean, std = r.mean(), r.std()  # torch.std: unbiased, as verl
    adv = (r - mean) / (std + eps) if normalize_std else r - mean
    for i, a in zip(idx, adv.tolist()):
        out[i] = a
    return out


def assert_all_finite(batch: dict) -> None:
    for name, x in batch.items():
        if x.is_floating_point():
            assert torch.isfinite(x).all(), name


# ---- layout --------------------------------------------------------------------------------


def test_shapes_dtypes_padding_masks_and_positions():
    routed = verified(1, n=3, routes=(L, K, E), n_calls=3)
    plain = verified(2, n=4, n_calls=2, gen_len=(5, 20))
    # The groups are padded with their own pad_id (7); the batch re-pads with its own (-1).
    g0 = group(routed, [1.0, 0.0, 2.0], reject={1}, pad_id=7)
    g1 = group(plain, [0.5, 0.5, 1.5, -1.0], pad_id=7)
    b = step_batch([g0, g1], pad_id=-1)

    B, T = 7, max(g0.input_ids.shape[1], g1.input_ids.shape[1])
    assert g0.input_ids.shape[1] != g1.input_ids.shape[1]  # really pads across groups
    for name, dtype in DTYPES.items():
        assert b[name].dtype == dtype, name
        assert b[name].shape[0] == B, name
    for name in ("input_ids", "attention_mask", "position_ids", "loss_mask", "old_logprobs", "token_advantages"):
        assert b[name].shape == (B, T), name
    # As stored: these few experts were staged as one-byte ids.
    assert b["routed_experts"].dtype == torch.uint8 and b["routed_experts"].shape == (B, T, L, K)
    assert b["group_index"].tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert b["sample_mask"].tolist() == [1, 0, 1, 1, 1, 1, 1]
    assert b["has_routes"].tolist() == [True, False, True, False, False, False, False]

    rows = [(g0, i) for i in range(3)] + [(g1, i) for i in range(4)]
    for r, (g, i) in enumerate(rows):
        n = int(g.input_lengths[i])
        assert int(b["input_lengths"][r]) == n and int(b["prompt_lengths"][r]) == int(g.prompt_lengths[i])
        assert torch.equal(b["input_ids"][r, :n], g.input_ids[i, :n])
        assert (b["input_ids"][r, n:] == -1).all()  # right padding with the batch's pad_id
        assert b["attention_mask"][r].tolist() == [1] * n + [0] * (T - n)
        assert b["position_ids"][r].tolist() == list(range(n)) + [0] * (T - n)
        want_loss = g.token_mask[i, :n] * g.sample_mask[i]
        assert torch.equal(b["loss_mask"][r, :n], want_loss)
        assert not b["loss_mask"][r, n:].any() and not b["old_logprobs"][r, n:].any()
        assert torch.equal(b["old_logprobs"][r, :n], torch.where(want_loss > 0, g.logprobs[i, :n], 0.0))
        if g is g0:
            assert torch.equal(b["routed_experts"][r, :n], g.routed_experts[i, :n])
        assert not b["routed_experts"][r, n:].any()
    # Context tokens (mask 0) of accepted rows are never trained on; they exist.
    ctx = (b["attention_mask"] == 1) & (b["loss_mask"] == 0) & (b["sample_mask"][:, None] == 1)
    assert ctx.any()
    for r in range(B):
        p = int(b["prompt_lengths"][r])
        assert not b["loss_mask"][r, :p].any()
    # The rejected row is all padding: the group keeps its shape.
    assert b["input_lengths"][1] == 0 and not b["attention_mask"][1].any() and not b["loss_mask"][1].any()
    assert (b["input_ids"][1] == -1).all() and b["advantages"][1] == 0 and b["rewards"][1] == 0.0
    # token_advantages is the row advantage on loss tokens, 0 elsewhere.
    assert torch.equal(b["token_advantages"], b["advantages"][:, None] * b["loss_mask"])
    assert (b["token_advantages"][b["loss_mask"] == 0] == 0).all()
    assert_all_finite(b)


def test_a_row_dropped_by_sample_mask_alone_is_not_trained_on():
    # A trainer may zero sample_mask itself (filtering): the row keeps its tokens and
    # attention, but gets no loss, no old logprobs, no advantage, and leaves the statistics.
    g = group(verified(15, n=3), [0.0, 5.0, 2.0])
    g = dataclasses.replace(g, sample_mask=torch.tensor([1.0, 0.0, 1.0]))
    b = step_batch([g])
    assert b["attention_mask"][1].sum() == g.input_lengths[1] > 0
    assert not b["loss_mask"][1].any() and not b["old_logprobs"][1].any() and not b["token_advantages"][1].any()
    assert b["advantages"].tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-6), 0.0, 1 / (math.sqrt(2) + 1e-6)], rel=1e-6)


def test_batch_owns_its_memory():
    g = group(verified(3, n=2), [0.0, 1.0])
    b = step_batch([g])
    b["input_ids"].fill_(5)
    b["rewards"].fill_(9.0)
    assert not (g.input_ids == 5).all() and g.rewards.tolist() == [0.0, 1.0]


def test_routes_absent_means_no_key_and_a_mismatch_between_groups_rejects_the_later_rows():
    b = step_batch([group(verified(4, n=2), [0.0, 1.0])])
    assert "routed_experts" not in b and not b["has_routes"].any()
    a = group(verified(5, n=2, routes=(L, K, E)), [0.0, 1.0])
    c = group(verified(6, n=2, routes=(3, K, E)), [0.0, 1.0])
    # a tie: the first routed row's [L, K] is the step's (tests/test_step_batch_rejections.py)
    b = step_batch([a, c])
    assert b["routed_experts"].shape[2:] == (L, K) and b["sample_mask"].tolist() == [1, 1, 0, 0]


def test_empty_step_and_all_rejected_step():
    b = step_batch([])
    assert b["input_ids"].shape == (0, 0) and b["advantages"].shape == (0,)
    g = group(verified(7, n=3), [1.0, 2.0, 3.0], reject={0, 1, 2})
    b = step_batch([g])
    assert b["input_ids"].shape == (3, 0) and b["advantages"].tolist() == [0.0, 0.0, 0.0]
    assert b["rewards"].tolist() == [1.0, 2.0, 3.0]  # kept as given; sample_mask drops them


# ---- advantages ------------------------------------------------------------------------------


def test_hand_computed_advantages_over_accepted_rows_only():
    res = verified(8, n=5)
    # Accepted rewards 1, 2, 3, 2: mean 2, unbiased std sqrt(2/3); the rejected 100 is ignored.
    g = group(res, [1.0, 100.0, 2.0, 3.0, 2.0], reject={1})
    b = step_batch([g])
    s = math.sqrt(2 / 3)
    want = [-1 / (s + 1e-6), 0.0, 0.0, 1 / (s + 1e-6), 0.0]
    assert b["advantages"].tolist() == pytest.approx(want, rel=1e-6)
    assert b["advantages"][1] == 0.0
    b = step_batch([group(res[:4], [1.0, 100.0, 2.0, 3.0], reject={1})], eps=0.0)
    assert b["advantages"].tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.0], abs=1e-7)
    b = step_batch([group(res[:4], [1.0, 100.0, 2.0, 3.0], reject={1})], normalize_std=False)
    assert b["advantages"].tolist() == pytest.approx([-1.0, 0.0, 0.0, 1.0], abs=1e-7)
    b = step_batch([group(res[:4], [1.0, 100.0, 3.0, 5.0], reject={1})], eps=0.5)
    assert b["advantages"].tolist() == pytest.approx([-2 / 2.5, 0.0, 0.0, 2 / 2.5], rel=1e-6)  # mean 3, std 2


def test_groups_are_normalized_separately():
    res = verified(9, n=4)
    b = step_batch([group(res[:2], [0.0, 1.0]), group(res[2:], [10.0, 30.0])])
    s0, s1 = math.sqrt(0.5) + 1e-6, math.sqrt(200) + 1e-6  # unbiased std + eps of each group
    assert b["advantages"].tolist() == pytest.approx([-0.5 / s0, 0.5 / s0, -10 / s1, 10 / s1], rel=1e-6)


@pytest.mark.parametrize(
    "rewards, reject",
    [
        ([5.0, 1.0, 2.0], {1, 2}),  # one accepted row
        ([5.0, 1.0, 2.0], {0, 1, 2}),  # none accepted
        ([1e30, 1e30, 1e30], set()),  # zero variance, huge
        ([0.1, 0.1, 0.1], set()),  # zero variance, inexact in binary
        ([-3e38, -3e38, 7.0], {2}),  # zero variance among the accepted, near float32's limit
    ],
)
@pytest.mark.parametrize("eps", [1e-6, 0.0])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_degenerate_groups_get_exactly_zero(rewards, reject, eps, normalize_std):
    b = step_batch([group(verified(10, n=3), rewards, reject=reject)], eps=eps, normalize_std=normalize_std)
    assert b["advantages"].tolist() == [0.0, 0.0, 0.0]
    assert not b["token_advantages"].any()
    assert_all_finite(b)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_huge_finite_rewards_never_overflow(normalize_std):
    rewards = [3.4e38, -3.4e38, -3.4e38, 1e30]  # mean -8.5e37: r0 - mean = 4.25e38 > float32 max
    b = step_batch([group(verified(11, n=4), rewards)], normalize_std=normalize_std)
    assert_all_finite(b)
    want = grpo_reference(np.float32(rewards).tolist(), [True] * 4, normalize_std=normalize_std)
    got = b["advantages"].tolist()
    if normalize_std:
        assert got == pytest.approx(want, rel=1e-5)
    else:  # r - mean exceeds float32 for the extremes: clamped to float32's range, sign kept
        assert want[0] > F32_MAX and got[0] == F32_MAX
        assert got[1:] == pytest.approx(want[1:], rel=1e-5)


def test_overflowed_or_nan_rewards_are_refused_not_propagated():
    res = verified(12, n=2)
    with np.errstate(over="ignore"):
        g = group(res, [1e39, 0.0])  # beyond float32: assemble stores inf
    assert math.isinf(float(g.rewards[0]))
    with pytest.raises(InvalidInput, match=r"group 0: reward of row 0 is inf"):
        step_batch([g])
    g = group(res, [0.0, 1.0])
    g.rewards[1] = float("nan")
    with pytest.raises(InvalidInput, match="reward of row 1 is nan"):
        step_batch([g])


def test_group_advantages_matches_verl_on_a_whole_step():
    rewards = torch.tensor([1.0, 2.0, 4.0, -1.0, -1.0, 3.0, 0.5], dtype=torch.float32)
    accepted = torch.tensor([True, True, True, True, False, True, True])
    gi = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    got = group_advantages(rewards, accepted, gi, 3).tolist()
    want = grpo_reference(rewards[:3], [True] * 3) + [0.0, 0.0] + grpo_reference(rewards[5:], [True, True])
    assert got == pytest.approx(want, rel=1e-6)


# ---- property test ---------------------------------------------------------------------------

POOL = verified(20, n=6, routes=(L, K, E), n_calls=2) + verified(21, n=6, routes=(L, K, E), n_calls=1, gen_len=(1, 3))

reward = st.one_of(
    st.floats(-10, 10, width=32),
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, 1.0, -1.0, 1e30, -1e30, 3.4e38]),
)
row = st.tuples(st.integers(0, len(POOL) - 1), st.booleans(), reward)  # (pool index, accepted, reward)
step_spec = st.lists(st.lists(row, min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=step_spec, eps=st.sampled_from([1e-6, 0.0, 0.1]), normalize_std=st.booleans())
def test_property_random_step_compositions(spec, eps, normalize_std):
    groups = []
    for rows in spec:
        res = [POOL[i] for i, _, _ in rows]
        groups.append(group(res, [r for _, _, r in rows], reject={j for j, (_, ok, _) in enumerate(rows) if not ok}))
    b = step_batch(groups, eps=eps, normalize_std=normalize_std)

    accepted = [ok for rows in spec for _, ok, _ in rows]
    lengths = [POOL[i].linearized.length if ok else 0 for rows in spec for i, ok, _ in rows]
    B, T = len(accepted), max(lengths)
    assert b["input_ids"].shape == (B, T) and b["input_lengths"].tolist() == lengths
    assert b["attention_mask"].sum(1).tolist() == lengths
    assert b["sample_mask"].tolist() == [float(a) for a in accepted]
    assert_all_finite(b)
    rej = ~torch.tensor(accepted, dtype=torch.bool)
    assert not b["loss_mask"][rej].any() and not b["advantages"][rej].any() and not b["attention_mask"][rej].any()
    assert ((b["loss_mask"] == 0) | (b["attention_mask"] == 1)).all()  # no loss on padding

    start = 0
    for gi, rows in enumerate(spec):
        n = len(rows)
        sl = slice(start, start + n)
        start += n
        assert (b["group_index"][sl] == gi).all()
        acc = [ok for _, ok, _ in rows]
        got = b["advantages"][sl].tolist()
        want = grpo_reference(b["rewards"][sl].tolist(), acc, eps=eps, normalize_std=normalize_std)
        want = [min(max(w, -F32_MAX), F32_MAX) for w in want]
        if sum(acc) < 2:
            assert got == [0.0] * n
            continue
        rs = [r for r, ok in zip(b["rewards"][sl].tolist(), acc) if ok]  # as float32, like the batch
        if max(rs) == min(rs):  # equal rewards: exactly zero, whatever their size
            assert got == [0.0] * n
            continue
        # float64 reference vs the shifted float64 computation: close, not bit-equal.
        scale = max(abs(w) for w in want)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-5 * scale)
        if normalize_std:
            a = torch.tensor([g for g, ok in zip(got, acc) if ok], dtype=torch.float64)
            assert abs(float(a.mean())) <= 1e-5 * max(1.0, float(a.abs().max()))
            assert a.abs().max() <= math.sqrt(sum(acc)) + 1e-5  # |z| <= (k-1)/sqrt(k) for unbiased std


# ---- routes encodings --------------------------------------------------------------------------


@pytest.mark.parametrize("asked", [None, torch.int64, torch.int16, torch.uint8])
def test_routes_in_the_asked_dtype_whichever_encoding_staged_them(asked):
    # The same rollouts staged with one-byte ids and as int16 (rows staged before uint8
    # existed), and a group mixing both, give the same batch values; the dtype is the
    # trainer's choice, by default the widest stored.
    u8 = verified(30, n=3, routes=(L, K, E), n_calls=2)
    i16 = verified(30, n=3, routes=(L, K, E), n_calls=2, routes_encoding=1)
    assert u8[0].linearized.routed_experts.dtype == np.uint8 and i16[0].linearized.routed_experts.dtype == np.int16
    rewards = [0.0, 1.0, 0.5]
    batches = [step_batch([group(res, rewards)], routes_dtype=asked) for res in (u8, i16, u8[:1] + i16[1:])]
    default = [torch.uint8, torch.int16, torch.int16]
    for b, dtype in zip(batches, default):
        assert b["routed_experts"].dtype == (dtype if asked is None else asked)
    first = batches[0]
    for b in batches[1:]:
        assert b.keys() == first.keys()
        for name in first:
            want = first[name] if asked is not None or name != "routed_experts" else first[name].to(b[name].dtype)
            assert torch.equal(b[name], want), name


# ---- bad input -------------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_typed_error():
    g = group(verified(13, n=2), [0.0, 1.0])
    with pytest.raises(InvalidInput, match=r"list\(step.groups.values\(\)\)"):
        step_batch({"g0": g})
    with pytest.raises(InvalidInput, match="sequence of FinalizedGroup"):
        step_batch(g)
    with pytest.raises(InvalidInput, match="group 1: expected a FinalizedGroup, got dict"):
        step_batch([g, {"input_ids": g.input_ids}])
    with pytest.raises(InvalidInput, match=r"group 0: logprobs must be torch.float32"):
        step_batch([dataclasses.replace(g, logprobs=g.logprobs.double())])
    with pytest.raises(InvalidInput, match=r"group 0: rewards must be torch.float32 \[2\]"):
        step_batch([dataclasses.replace(g, rewards=g.rewards[:1])])
    with pytest.raises(InvalidInput, match="lengths out of range"):
        step_batch([dataclasses.replace(g, input_lengths=g.input_lengths + 1000)])
    with pytest.raises(InvalidInput, match="sample_mask must hold only 0 and 1"):
        step_batch([dataclasses.replace(g, sample_mask=g.sample_mask * 0.5)])
    with pytest.raises(InvalidInput, match="routed_experts must be None or uint8/int16"):
        step_batch([dataclasses.replace(g, routed_experts=torch.zeros(2, 3, dtype=torch.int16))])
    with pytest.raises(InvalidInput, match="routed_experts must be None or uint8/int16"):
        step_batch([dataclasses.replace(g, routed_experts=torch.zeros(2, g.input_ids.shape[1], 1, 1, dtype=torch.int64))])
    with pytest.raises(InvalidInput, match="routes_dtype must be"):
        step_batch([g], routes_dtype=torch.float32)
    wide = dataclasses.replace(g, routed_experts=torch.full((2, g.input_ids.shape[1], 1, 1), 300, dtype=torch.int16),
                               has_routes=torch.ones(2, dtype=torch.bool))
    with pytest.raises(InvalidInput, match="above 255"):
        step_batch([wide], routes_dtype=torch.uint8)
    assert step_batch([wide], routes_dtype=torch.int64)["routed_experts"].max() == 300
    for eps in (-1e-6, float("nan"), float("inf"), "1e-6", True):
        with pytest.raises(InvalidInput, match="eps must be"):
            step_batch([g], eps=eps)
    for pad in (True, 1.0, 2**63):
        with pytest.raises(InvalidInput, match="pad_id must be"):
            step_batch([g], pad_id=pad)
    bad = dataclasses.replace(g, logprobs=g.logprobs.clone())
    bad.logprobs[0, 0] = float("-inf")
    with pytest.raises(InvalidInput, match="logprobs hold NaN or inf"):
        step_batch([bad])


# ---- StepResult.to_batch -------------------------------------------------------------------


def local_step() -> StepResult:
    res = verified(14, n=3, routes=(L, K, E))
    return StepResult("s", {"a": group(res, [0.0, 1.0, 3.0]), "b": group(res[:2], [2.0, 2.0], reject={0})}, {})


def test_to_batch_is_step_batch_over_the_groups_in_order():
    step = local_step()
    got = step.to_batch(eps=0.1, pad_id=-3)
    want = step_batch([step.groups["a"], step.groups["b"]], eps=0.1, pad_id=-3)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["group_index"].tolist() == [0, 0, 0, 1, 1]


def test_to_batch_tensordict_missing_package_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensordict", None)  # import tensordict -> ImportError
    with pytest.raises(ModuleNotFoundError, match="needs the 'tensordict' package") as info:
        local_step().to_batch(as_tensordict=True)
    assert info.value.name == "tensordict"


def test_to_batch_tensordict_with_a_fake_module(monkeypatch):
    calls = []

    class FakeTensorDict:
        def __init__(self, source, batch_size):
            calls.append((source, batch_size))

    fake = types.ModuleType("tensordict")
    fake.TensorDict = FakeTensorDict
    monkeypatch.setitem(sys.modules, "tensordict", fake)
    td = local_step().to_batch(as_tensordict=True, eps=0.0)
    assert isinstance(td, FakeTensorDict)
    (source, batch_size), = calls
    assert batch_size == [5] and "advantages" in source and source["input_ids"].shape[0] == 5


def test_to_batch_real_tensordict():
    tensordict = pytest.importorskip("tensordict")
    step = local_step()
    td = step.to_batch(as_tensordict=True)
    assert isinstance(td, tensordict.TensorDict) and list(td.batch_size) == [5]
    plain = step.to_batch()
    assert set(td.keys()) == set(plain)
    for k in plain:
        assert torch.equal(td[k], plain[k]), k
    assert td[1:3]["input_ids"].shape[0] == 2  # row-sliceable as a trainer's minibatches


@pytest.mark.timeout(120)
def test_to_batch_through_a_real_finalizer(cluster_client, store_factory):
    store = store_factory(n_units=2, memory_limit="16KiB")
    rng = np.random.default_rng(30)
    g0 = make_group(rng, "tb0", 4, n_calls=3, routes=(L, K, E))
    g1 = make_group(rng, "tb1", 3, n_calls=2, routes=(L, K, E))
    # g0's third rollout loses its terminal row: missing_staging_row, its group keeps its shape.
    lost = g0[2].row(g0[2].chain_ids[-1]).staging_key
    rows = [r for b in g0 + g1 for r in b.rows if r.staging_key != lost]
    assert not store.put_many(pack_rows(rows)).failed
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    # Group ids are the receipts' own (a receipt submitted under another group is rejected).
    step = fin.submit_step({"tb0": [b.receipt for b in g0], "tb1": [b.receipt for b in g1]}, step_id="to-batch").result(timeout=60)
    assert step.groups["tb0"].status == [R.OK, R.OK, R.MISSING_STAGING_ROW, R.OK]
    assert step.groups["tb1"].status == [R.OK] * 3

    b = step.to_batch()
    assert b["input_ids"].shape[0] == 7 and b["routed_experts"].shape[2:] == (L, K)
    assert b["sample_mask"].tolist() == [1, 1, 0, 1, 1, 1, 1]
    assert b["group_index"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    rewards = [bt.receipt.reward for bt in g0 + g1]
    assert b["rewards"].tolist() == pytest.approx(rewards)
    want = grpo_reference(np.float32(rewards[:4]).tolist(), [True, True, False, True]) + grpo_reference(np.float32(rewards[4:]).tolist(), [True] * 3)
    assert b["advantages"].tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert not b["loss_mask"][2].any() and b["advantages"][2] == 0.0
    for r, bt in enumerate(g0 + g1):
        if r == 2:
            continue
        ids = np.concatenate([bt.row(c).token_ids for c in bt.chain_ids])
        mask = np.concatenate([bt.row(c).token_mask for c in bt.chain_ids])
        n = len(ids)
        np.testing.assert_array_equal(b["input_ids"][r, :n].numpy(), ids)
        np.testing.assert_array_equal(b["loss_mask"][r, :n].numpy(), mask)
        assert int(b["attention_mask"][r].sum()) == n and int(b["position_ids"][r, n - 1]) == n - 1
    assert_all_finite(b)


def test_one_rollout_of_other_routes_dimensions_is_the_one_rejected_in_its_group():
    # Whichever position the odd rollout has, the group's [L, K] is the one most rows have:
    # it is rejected invalid_routes, its group-mates are trained on.
    good = verified(40, n=3, routes=(2, 2, 8))
    rogue = verified(41, n=1, routes=(3, 2, 8))
    for rows in (rogue + good, good[:1] + rogue + good[1:]):
        g = group(rows, [0.0, 1.0, 0.5, 0.2])
        want = [R.INVALID_ROUTES if r is rogue[0] else R.OK for r in rows]
        assert g.status == want, g.status
        assert tuple(g.routed_experts.shape[2:]) == (2, 2)
    # A tie keeps the first routed row's dimensions (as before).
    tie = group(verified(42, n=1, routes=(2, 2, 8)) + verified(43, n=1, routes=(3, 2, 8)), [0.0, 1.0])
    assert tie.status == [R.OK, R.INVALID_ROUTES]
