"""Receipt parsing: keys, chains, early rejections, packing of verify tasks."""
from __future__ import annotations

import numpy as np
import pytest

from tasks import reasons as R
from tasks.finalize.plan import pack_verify_tasks, plan_group, plan_step
from tasks.receipts import Receipt
from rollout_factory import make_group, make_rollout, receipt_dict


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_keys_chain_and_routes_keys_from_receipts(rng):
    plain = make_rollout(rng, "plain", n_calls=3, n_branches=2)
    routed = make_rollout(rng, "routed", n_calls=2, routes=(2, 2, 8))
    step = plan_step([plain.receipt, routed.receipt.to_dict()])
    assert step.rejected == {}
    assert [p.rollout_id for p in step.rollouts] == ["plain", "routed"]
    p0 = step.rollouts[0]
    assert [c.model_call_id for c in p0.chain] == ["c0", "c1", "c2"]
    # Off-chain branch calls are known (for clearing) but not fetched.
    assert p0.keys == ["plain/c0", "plain/c1", "plain/c2"]
    assert set(p0.all_keys) == {r.staging_key for r in plain.rows} and len(p0.all_keys) == 5
    assert step.staging_keys == p0.keys + ["routed/c0", "routed/c1"]
    assert step.routes_keys == ["routed/c0", "routed/c1"]
    assert p0.n_tokens == plain.row("c2").cum_len
    assert step.order == ["plain", "routed"] and step.rewards == [plain.receipt.reward, routed.receipt.reward]


def test_msgpack_round_trip_plans_identically(rng):
    b = make_rollout(rng, "mp", n_calls=4, n_branches=1, routes=(1, 2, 4))
    a = plan_step([b.receipt]).rollouts[0]
    c = plan_step([Receipt.from_msgpack(b.receipt.to_msgpack()).to_dict()]).rollouts[0]
    assert a.chain == c.chain and a.keys == c.keys and a.routes_keys == c.routes_keys


def test_reordered_receipt_calls_same_chain(rng):
    b = make_rollout(rng, "ro", n_calls=4, n_branches=2)
    d = receipt_dict(b)
    d["calls"] = d["calls"][::-1]
    p = plan_step([d]).rollouts[0]
    assert [c.model_call_id for c in p.chain] == b.chain_ids


def _reject(d) -> tuple[str, str]:
    step = plan_step([d])
    assert step.rollouts == []
    (reason, detail), = step.rejected.values()
    return reason, detail


def _mutated(rng, fn, **kw):
    d = receipt_dict(make_rollout(rng, "x", n_calls=3, **kw))
    fn(d)
    return d


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d.update(poisoned=True, failure_reason="engine crashed"), R.CAPTURE_POISONED),
        (lambda d: d.update(calls=[]), R.EMPTY_MANIFEST),
        (lambda d: d["calls"].append(dict(d["calls"][0])), R.DUPLICATE_CALL_ID),
        (lambda d: d["calls"][1].update(staging_key=d["calls"][0]["staging_key"]), R.DUPLICATE_STAGING_KEY),
        (lambda d: d.update(terminal_model_call_id="nope"), R.MISSING_TERMINAL),
        (lambda d: d.update(terminal_model_call_id=None), R.MISSING_TERMINAL),
        (lambda d: d["calls"][1].update(parent_call_id="ghost"), R.MISSING_PARENT),
        (lambda d: d["calls"][0].update(parent_call_id="c2"), R.LINEAGE_CYCLE),
        (lambda d: d["calls"][1].update(staging_key="x/other"), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(digest=b"\x00" * 31), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(chain_hash="a" * 32), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(prev_len=-1, cum_len=d["calls"][1]["delta_len"] - 1), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(delta_len=0), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(cum_len=d["calls"][1]["cum_len"] + 1), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(prev_len=True), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(weight_version=2**64), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(routes_encoding=3), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(model_call_id="a/b"), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].update(extra=1), R.INVALID_RECEIPT),
        (lambda d: d["calls"][1].pop("digest"), R.INVALID_RECEIPT),
        (lambda d: d.update(calls="c0"), R.INVALID_RECEIPT),
        (lambda d: d.update(reward=float("nan")), R.INVALID_RECEIPT),
        (lambda d: d.update(reward="1.0"), R.INVALID_RECEIPT),
        (lambda d: d.update(rollout_id=7), R.INVALID_RECEIPT),
        (lambda d: d.update(version=99), R.INVALID_RECEIPT),
        (lambda d: d.update(surprise=True), R.INVALID_RECEIPT),
        (lambda d: d.pop("calls"), R.INVALID_RECEIPT),
    ],
)
def test_each_receipt_rejection(rng, mutate, reason):
    got, detail = _reject(_mutated(rng, mutate))
    assert got == reason, detail
    assert detail


def test_poisoned_wins_over_broken_calls(rng):
    d = _mutated(rng, lambda d: d.update(poisoned=True, failure_reason="oom", calls=[{"junk": 1}]))
    assert _reject(d)[0] == R.CAPTURE_POISONED


def test_not_a_receipt_never_raises():
    step = plan_step([None, 42, "receipt", {"rollout_id": "r"}, [1, 2]])
    assert step.rollouts == []
    assert step.order == [f"<receipt #{i}/>" for i in (0, 1, 2)] + ["r", "<receipt #4/>"]
    assert {reason for reason, _ in step.rejected.values()} == {R.INVALID_RECEIPT}
    assert len(step.rejected) == 5


def test_unreadable_receipt_never_collides_with_a_rollout_id(rng):
    """An unreadable receipt's placeholder id is no usable rollout id: a valid receipt whose
    rollout_id reads like one plans as usual, and each keeps its own verdict."""
    placeholder = plan_step([{"rollout_id": 5}]).order[0]
    good = make_rollout(rng, "<receipt #0>")  # the placeholder's old spelling: a usable id
    step = plan_step([{"rollout_id": 5}, {"rollout_id": ""}, good.receipt])
    assert step.order == [placeholder, step.order[1], "<receipt #0>"]
    assert len(set(step.order)) == 3
    assert [p.rollout_id for p in step.rollouts] == ["<receipt #0>"]
    assert "<receipt #0>" not in step.rejected
    assert {step.rejected[rid][0] for rid in step.order[:2]} == {R.INVALID_RECEIPT}


def test_bad_receipt_rejects_only_itself(rng):
    group = make_group(rng, "g", 4, n_calls=2)
    dicts = [receipt_dict(b) for b in group]
    dicts[2]["calls"][0]["digest"] = b"short"
    step = plan_group(dicts)
    assert list(step.rejected) == ["g-r2"] and step.rejected["g-r2"][0] == R.INVALID_RECEIPT
    assert [p.rollout_id for p in step.rollouts] == ["g-r0", "g-r1", "g-r3"]
    assert "g-r2/c0" not in step.staging_keys
    assert step.group_ids == ["g"] * 4


def test_duplicate_rollout_across_step_rejects_both(rng):
    a = make_rollout(rng, "dup", n_calls=2, group_id="g1")
    b = make_rollout(rng, "dup", n_calls=3, group_id="g2")
    c = make_rollout(rng, "fine", n_calls=2, group_id="g2")
    step = plan_step([a.receipt, b.receipt, c.receipt])
    assert step.rejected == {"dup": (R.DUPLICATE_STAGING_KEY, step.rejected["dup"][1])}
    assert [p.rollout_id for p in step.rollouts] == ["fine"]
    assert step.order == ["dup", "dup", "fine"]
    assert step.groups() == {"g1": [0], "g2": [1, 2]}
    assert all(not k.startswith("dup/") for k in step.staging_keys)


def test_pack_verify_tasks_budget(rng):
    plans = plan_step([make_rollout(rng, f"r{i}", n_calls=1, prompt_len=(n, n), gen_len=(1, 1)).receipt
                       for i, n in enumerate([9, 9, 30, 9, 5, 100, 2])]).rollouts
    sizes = [p.n_tokens for p in plans]
    assert sizes == [10, 10, 31, 10, 6, 101, 3]
    tasks = pack_verify_tasks(plans, 25)
    # Every plan exactly once, long ones (>= budget) alone, packed ones within the budget.
    flat = [p.rollout_id for t in tasks for p in t]
    assert sorted(flat) == sorted(p.rollout_id for p in plans)
    for t in tasks:
        total = sum(p.n_tokens for p in t)
        assert len(t) == 1 or total <= 25
        if any(p.n_tokens >= 25 for p in t):
            assert len(t) == 1
    # Consecutive runs in submission order (the layout cuts a site's rollouts by these sizes).
    assert flat == [p.rollout_id for p in plans]
    assert [[p.n_tokens for p in t] for t in tasks] == [[10, 10], [31], [10, 6], [101], [3]]
    assert pack_verify_tasks([], 25) == []
    with pytest.raises(ValueError):
        pack_verify_tasks(plans, 0)
