"""tasks.gate.CaptureGate: good calls are hashed and recorded; bad ones are refused with
the right SPEC section 4 reason and leave no trace (the same call id can then be staged,
its id cannot serve as a parent, the chain's running hash is undisturbed)."""
from __future__ import annotations

import numpy as np
import pytest

from tasks import hashing as H
from tasks.errors import InvalidKey, InvalidRecord
from tasks.gate import CaptureGate, record_of

VOCAB, EXPERTS, L, K = 100, 8, 3, 2


def good(n_ctx: int = 2, n_gen: int = 3, seed: int = 0, routes: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    n = n_ctx + n_gen
    return dict(
        token_ids=rng.integers(0, VOCAB, n).astype(np.int64),
        token_mask=np.concatenate([np.zeros(n_ctx, np.float32), np.ones(n_gen, np.float32)]),
        logprobs=np.concatenate([np.zeros(n_ctx, np.float32), -rng.random(n_gen).astype(np.float32) - 0.01]),
        routed_experts=rng.integers(0, EXPERTS, (n, L, K)).astype(np.int16) if routes else None,
    )


def new_gate() -> CaptureGate:
    return CaptureGate("r0", vocab_size=VOCAB, num_experts=EXPERTS, group_id="g0")


def stage(gate, call="c0", parent=None, **fields):
    kw = good()
    kw.update(fields)
    routes = kw.pop("routed_experts")
    return gate.stage_call(call, parent, kw["token_ids"], kw["token_mask"], kw["logprobs"], routed_experts=routes, weight_version=7)


# ---- accepted calls -------------------------------------------------------------------------


@pytest.mark.parametrize("experts,encoding,dtype", [(EXPERTS, 2, np.uint8), (300, 1, np.int16)])
def test_good_chain_hashes_and_receipt(experts, encoding, dtype):
    # The routes encoding follows the expert count: one byte per id up to 256 experts.
    gate = CaptureGate("r0", vocab_size=VOCAB, num_experts=experts, group_id="g0")
    a = good(2, 3, seed=1)
    b = good(4, 2, seed=2)
    r0 = stage(gate, "c0", None, **a)
    r1 = stage(gate, "c1", "c0", **b)
    assert (r0.prev_len, r0.delta_len, r0.cum_len) == (0, 5, 5)
    assert (r1.prev_len, r1.delta_len, r1.cum_len) == (5, 6, 11)
    assert r0.chain_hash == H.chain_hash(None, a["token_ids"])
    assert r1.chain_hash == H.chain_hash(r0.chain_hash, b["token_ids"])
    assert r1.cumulative_hash == H.cumulative_hash(np.concatenate([a["token_ids"], b["token_ids"]]))
    for r in (r0, r1):
        assert r.digest == H.row_digest(r) and r.routes_encoding == encoding and r.weight_version == 7
        assert r.routed_experts.dtype == dtype
    np.testing.assert_array_equal(r0.routed_experts, a["routed_experts"])  # same ids, whatever the width
    rec = gate.receipt(0.25)
    assert rec.calls == [record_of(r0), record_of(r1)]
    assert rec.terminal_model_call_id == "c1" and rec.staging_keys == ["r0/c0", "r0/c1"]
    assert rec.group_id == "g0" and rec.reward == 0.25 and not rec.poisoned


def test_call_without_routes_has_encoding_zero():
    row = stage(new_gate(), **good(routes=False))
    assert row.routes_encoding == 0 and row.routed_experts is None
    assert row.digest == H.row_digest(row)


def test_tampering_with_a_staged_row_breaks_its_digest():
    row = stage(new_gate())
    assert H.row_digest(row) == row.digest
    row.token_ids = row.token_ids.copy()
    row.token_ids[0] = (row.token_ids[0] + 1) % VOCAB
    assert H.row_digest(row) != row.digest


# ---- refusals ----------------------------------------------------------------------------------

N = 5  # good() rows have 2 context + 3 generated tokens

BAD_FIELDS = {
    # wrong lengths / shapes
    "mask_short": (dict(token_mask=np.array([0, 0, 1, 1], np.float32)), "invalid_staging_row", "token_mask shape"),
    "logprobs_long": (dict(logprobs=np.array([0, 0, -1, -1, -1, -1], np.float32)), "invalid_staging_row", "logprobs shape"),
    "ids_2d": (dict(token_ids=np.zeros((5, 1), np.int64)), "invalid_staging_row", "delta_len"),
    "empty_delta": (
        dict(token_ids=np.zeros(0, np.int64), token_mask=np.zeros(0, np.float32), logprobs=np.zeros(0, np.float32),
             routed_experts=np.zeros((0, L, K), np.int16)),
        "invalid_staging_row",
        "delta_len 0",
    ),
    "routes_short": (dict(routed_experts=np.zeros((4, L, K), np.int16)), "invalid_routes", "shape"),
    "routes_2d": (dict(routed_experts=np.zeros((N, L * K), np.int16)), "invalid_routes", "shape"),
    # wrong dtypes
    "ids_int32": (dict(token_ids=np.arange(N, dtype=np.int32)), "invalid_staging_row", "token_ids dtype"),
    "ids_float": (dict(token_ids=np.arange(N, dtype=np.float64)), "invalid_staging_row", "token_ids dtype"),
    "mask_float64": (dict(token_mask=np.array([0, 0, 1, 1, 1], np.float64)), "invalid_staging_row", "token_mask dtype"),
    "logprobs_float64": (dict(logprobs=np.array([0, 0, -1, -1, -1], np.float64)), "invalid_staging_row", "logprobs dtype"),
    "mask_list": (dict(token_mask=[0.0, 0.0, 1.0, 1.0, 1.0]), "invalid_staging_row", "token_mask dtype"),
    "routes_float": (dict(routed_experts=np.zeros((N, L, K), np.float32)), "invalid_routes", "integer expert ids"),
    # mask order
    "mask_ones_first": (dict(token_mask=np.array([1, 1, 1, 0, 0], np.float32),
                             logprobs=np.array([-1, -1, -1, 0, 0], np.float32)), "invalid_mask_order", "zeros-then-ones"),
    "mask_interleaved": (dict(token_mask=np.array([0, 1, 0, 1, 1], np.float32),
                              logprobs=np.array([0, -1, 0, -1, -1], np.float32)), "invalid_mask_order", "zeros-then-ones"),
    "mask_half": (dict(token_mask=np.array([0, 0, 0.5, 1, 1], np.float32)), "invalid_mask_order", "other than"),
    "mask_all_zero": (dict(token_mask=np.zeros(N, np.float32), logprobs=np.zeros(N, np.float32)), "empty_generation", "no generated"),
    # logprobs
    "logprob_nan": (dict(logprobs=np.array([0, 0, -1, np.nan, -1], np.float32)), "invalid_logprob", "NaN or inf"),
    "logprob_neg_inf": (dict(logprobs=np.array([0, 0, -1, -np.inf, -1], np.float32)), "invalid_logprob", "NaN or inf"),
    "logprob_pos_inf": (dict(logprobs=np.array([0, 0, -1, np.inf, -1], np.float32)), "invalid_logprob", "NaN or inf"),
    "logprob_positive": (dict(logprobs=np.array([0, 0, -1, 0.5, -1], np.float32)), "invalid_logprob", "> 0"),
    "logprob_under_mask0": (dict(logprobs=np.array([0, -0.5, -1, -1, -1], np.float32)), "invalid_logprob", "token_mask is 0"),
    # token and expert ranges
    "token_negative": (dict(token_ids=np.array([0, -1, 2, 3, 4], np.int64)), "invalid_token", "-1"),
    "token_vocab": (dict(token_ids=np.array([0, 1, 2, VOCAB, 4], np.int64)), "invalid_token", str(VOCAB)),
    "expert_negative": (dict(routed_experts=np.full((N, L, K), -1, np.int16)), "invalid_routes", "expert id"),
    "expert_too_big": (
        dict(routed_experts=np.where(np.arange(N * L * K).reshape(N, L, K) == 7, EXPERTS, 0).astype(np.int16)),
        "invalid_routes",
        "expert id",
    ),
    # ids given wider than a byte are range-checked before the cast (256 would wrap to 0)
    "expert_wraps_uint8": (dict(routed_experts=np.full((N, L, K), 256, np.int64)), "invalid_routes", "expert id 256"),
}


@pytest.mark.parametrize("given", [np.int16, np.int32, np.int64, np.uint8, ">i2"])
def test_any_integer_routes_are_converted_to_the_encoding(given):
    ids = good(seed=4)["routed_experts"]
    row = stage(new_gate(), routed_experts=ids.astype(given))
    assert row.routes_encoding == 2 and row.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(row.routed_experts, ids)
    assert row.digest == H.row_digest(row)


def test_explicit_int16_encoding_and_unknown_experts():
    # Staged "the old way" (int16) on request, and by default when the expert count is unknown.
    for gate in (CaptureGate("r0", vocab_size=VOCAB, num_experts=EXPERTS, routes_encoding=1),
                 CaptureGate("r0", vocab_size=VOCAB)):
        row = stage(gate)
        assert row.routes_encoding == 1 and row.routed_experts.dtype == np.int16
    with pytest.raises(ValueError, match="num_experts <= 256"):
        CaptureGate("r0", vocab_size=VOCAB, num_experts=300, routes_encoding=2)
    with pytest.raises(ValueError, match="routes_encoding"):
        CaptureGate("r0", vocab_size=VOCAB, routes_encoding=3)
    gate = CaptureGate("r0", vocab_size=VOCAB)  # experts unknown: ids must still fit int16
    with pytest.raises(InvalidRecord, match="does not fit routes_encoding 1"):
        stage(gate, routed_experts=np.full((N, L, K), 40000, np.int64))


def assert_nothing_kept(gate: CaptureGate, n_calls_before: int, call: str, parent):
    rec = gate.receipt(0.0)
    assert len(rec.calls) == n_calls_before and not rec.poisoned
    # The refused id is free: the same call, now well-formed, stages fine ...
    row = stage(gate, call, parent)
    assert row.digest == H.row_digest(row)


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_field_refused_with_reason_and_nothing_kept(case):
    fields, reason, detail = BAD_FIELDS[case]
    gate = new_gate()
    root_ids = good(seed=9)["token_ids"]
    stage(gate, "c0", None, **good(seed=9))
    with pytest.raises(InvalidRecord) as e:
        stage(gate, "c1", "c0", **fields)
    assert e.value.reason == reason, e.value
    assert detail in e.value.detail, e.value
    assert_nothing_kept(gate, 1, "c1", "c0")
    # ... and the chain's running hash was not advanced by the refused delta.
    child = gate.receipt(0.0).calls[-1]
    assert child.cumulative_hash == H.cumulative_hash(np.concatenate([root_ids, good()["token_ids"]]))
    assert child.prev_len == 5


def test_refused_root_leaves_gate_empty():
    gate = new_gate()
    with pytest.raises(InvalidRecord):
        stage(gate, "c0", None, token_ids=np.array([0, 1, 2, 3, VOCAB], np.int64))
    assert gate.receipt(0.0).calls == [] and gate.receipt(0.0).terminal_model_call_id is None
    assert_nothing_kept(gate, 0, "c0", None)


def test_duplicate_call_id_refused():
    gate = new_gate()
    first = stage(gate, "c0")
    with pytest.raises(InvalidRecord) as e:
        stage(gate, "c0", **good(seed=3))
    assert e.value.reason == "duplicate_call_id"
    # A duplicate is refused even with identical content, and the first record stands.
    with pytest.raises(InvalidRecord):
        stage(gate, "c0")
    assert gate.receipt(0.0).calls == [record_of(first)]


def test_missing_parent_refused_and_refused_call_cannot_be_a_parent():
    gate = new_gate()
    with pytest.raises(InvalidRecord) as e:
        stage(gate, "c1", "nope")
    assert e.value.reason == "missing_parent"
    stage(gate, "c0")
    with pytest.raises(InvalidRecord):
        stage(gate, "c1", "c0", token_mask=np.zeros(N, np.float32), logprobs=np.zeros(N, np.float32))
    with pytest.raises(InvalidRecord) as e:
        stage(gate, "c2", "c1")
    assert e.value.reason == "missing_parent"
    assert [c.model_call_id for c in gate.receipt(0.0).calls] == ["c0"]


@pytest.mark.parametrize(
    "call,parent,detail",
    [
        ("a/b", None, "contains '/'"),
        ("", None, "empty"),
        ("c1", "x/y", "contains '/'"),
        ("c1", "", "empty"),
        (7, None, "must be str"),
        ("__cut__", None, "reserved"),
        ("x" * 600, None, "limit"),
    ],
)
def test_bad_ids_refused(call, parent, detail):
    gate = new_gate()
    with pytest.raises(InvalidRecord) as e:
        stage(gate, call, parent)
    assert e.value.reason == "invalid_staging_row" and detail in e.value.detail
    assert gate.receipt(0.0).calls == []


@pytest.mark.parametrize("rid", ["a/b", "", None, "__cut__"])
def test_bad_rollout_id_refused_at_construction(rid):
    with pytest.raises(InvalidKey):
        CaptureGate(rid, vocab_size=VOCAB)


def test_one_bad_rollout_does_not_affect_another_gate():
    a, b = new_gate(), CaptureGate("r1", vocab_size=VOCAB, num_experts=EXPERTS)
    stage(a, "c0")
    with pytest.raises(InvalidRecord):
        stage(b, "c0", token_ids=np.full(N, -3, np.int64))
    a.poison("generation_failed")
    stage(b, "c0")
    assert a.receipt(0.0).poisoned and a.receipt(0.0).failure_reason == "generation_failed"
    assert not b.receipt(0.0).poisoned and len(b.receipt(0.0).calls) == 1


def test_receipt_roundtrips_through_msgpack():
    from tasks.receipts import Receipt

    gate = new_gate()
    stage(gate, "c0")
    stage(gate, "c1", "c0", **good(seed=5))
    rec = gate.receipt(0.5)
    assert Receipt.from_msgpack(rec.to_msgpack()) == rec


def test_mixed_routes_within_a_rollout_refused():
    """The verifier rejects a chain mixing routed and unrouted calls, so the gate refuses it."""
    gate = new_gate()
    stage(gate, "c0")
    with pytest.raises(InvalidRecord) as e:
        stage(gate, "c1", "c0", **good(seed=5, routes=False))
    assert e.value.reason == "invalid_routes"


def test_gate_copies_caller_buffers():
    gate = new_gate()
    kw = good(seed=3)
    row = gate.stage_call("c0", None, kw["token_ids"], kw["token_mask"], kw["logprobs"], routed_experts=kw["routed_experts"])
    before = row.token_ids.copy()
    kw["token_ids"][:] = 0
    assert np.array_equal(row.token_ids, before)


def test_a_negative_expert_id_is_refused_when_the_expert_count_is_unknown():
    # No expert is numbered below 0: with num_experts unknown the gate still refuses -1,
    # which a route replay would read as the last expert.
    gate = CaptureGate("r0", vocab_size=VOCAB)
    bad = good()["routed_experts"].astype(np.int64)
    bad[-1, 0, 0] = -1
    with pytest.raises(InvalidRecord, match="expert id -1") as err:
        stage(gate, routed_experts=bad)
    assert err.value.reason == "invalid_routes"
    assert_nothing_kept(gate, 0, "c0", None)
