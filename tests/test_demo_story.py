"""The demo's whole story: tampered rollouts rejected with their reasons, and the
scale phase's reading of the scheduler's scaling decisions.

Pure: every helper of ``tasks.toy.tamper`` applied to toy-policy rollouts, planned and
verified as the finalizer does (``plan_step`` with the submitted group, ``verify_many``),
is rejected with the reason its kind names, and the untouched rollouts are accepted.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipeline.capture import policy_from_config
from pipeline.demo import describe_decision, scaling_since, tamper_specs
from rollout_factory import fetch
from tasks import reasons as R
from tasks.finalize.plan import plan_step
from tasks.finalize.verify import merge_results, verify_many
from tasks.toy.rollouts import generate_rollouts, make_group_specs
from tasks.toy.tamper import TAMPER_KINDS, tamper, tamper_kind, tampered_rollout_id

VOCAB = 512
GROUP = "tampered"


def verdicts(rollouts, receipts, group=GROUP):
    """Statuses of ``receipts`` submitted in ``group``, their rows as staged."""
    plan = plan_step({group: receipts})
    rows, routes = fetch(rollouts, plan.staging_keys, plan.routes_keys)
    results = verify_many(plan.rollouts, rows, routes, vocab_size=VOCAB, num_experts=8)
    return {r.rollout_id: r.status for r in merge_results(plan, results)}


@pytest.fixture(scope="module")
def generated():
    args = SimpleNamespace(turns=3, tokens_per_turn=6)
    specs = tamper_specs(args)
    honest = make_group_specs(GROUP, 2, turns=3, tokens_per_turn=6, tool_tokens=2, prompt_tokens=4, vocab_size=VOCAB)
    return generate_rollouts(policy_from_config(), [*specs, *honest])


def test_ids_name_their_kind():
    for kind in TAMPER_KINDS:
        assert tamper_kind(tampered_rollout_id(kind, 3)) == kind
    assert tamper_kind("tampered-ok-0") is None and tamper_kind("s0p0-1") is None
    with pytest.raises(ValueError):
        tampered_rollout_id("not_a_reason")


def test_each_tamper_kind_is_rejected_with_its_reason_and_the_rest_accepted(generated):
    staged, receipts = [], []
    for ro in generated:
        kind = tamper_kind(ro.spec.rollout_id)
        if kind is None:
            staged.append(ro)
            receipts.append(ro.receipt)
            continue
        t = tamper(kind, ro.rows, ro.receipt, other_group="s0p0")
        assert t.kind == kind
        staged.append(SimpleNamespace(rows=t.rows))
        receipts.append(t.receipt)
    got = verdicts(staged, receipts)
    want = {ro.spec.rollout_id: tamper_kind(ro.spec.rollout_id) or R.OK for ro in generated}
    assert got == want
    assert set(want.values()) == {R.OK, *TAMPER_KINDS}


def test_untampered_inputs_are_accepted_and_not_modified(generated):
    ro = generated[0]
    before = [r.token_ids.copy() for r in ro.rows]
    for kind in TAMPER_KINDS:
        tamper(kind, ro.rows, ro.receipt, other_group="s0p0")
    assert all((a == r.token_ids).all() for a, r in zip(before, ro.rows))
    assert verdicts([ro], [ro.receipt]) == {ro.spec.rollout_id: R.OK}


def test_scale_phase_reads_only_decisions_since_it_started():
    ds = [
        {"t": 1.0, "action": "down", "current": 3, "target": 2, "reason": "idle: old"},
        {"t": 5.0, "action": "hold", "current": 2, "target": 2, "reason": "balanced: x"},
        {"t": 6.0, "action": "up", "current": 2, "target": 3, "reason": "verify-bound: verify 60%"},
        {"t": 9.0, "action": "down", "current": 3, "target": 2, "reason": "idle: no finalize event for 5.1s"},
    ]
    got = scaling_since(ds, 5.0)
    assert [d["action"] for d in got] == ["hold", "up", "down"]
    assert describe_decision(got[1]) == "up 2 -> 3 (verify-bound: verify 60%)"
    assert describe_decision(got[2]) == "down 3 -> 2 (idle: no finalize event for 5.1s)"
