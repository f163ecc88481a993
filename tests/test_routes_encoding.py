"""Routes encodings: int16 ids (encoding 1, the rows staged before uint8 existed) and
one-byte ids (encoding 2, up to 256 experts), side by side.

The writers pick the encoding from the expert count; each encoding hashes its own bytes
behind its own encoding byte (a row relabelled from one to the other fails); rows of
both verify, pack, resume and cut alike; the vectorized verifier and the per-token
reference agree on a group mixing them. Pure and cheap: the cluster-side checks (a store
and its checkpoint holding both) live in tests/test_tamper.py, the trainer's dtype in
tests/test_step_batch.py.
"""
from __future__ import annotations

import numpy as np
import pytest
from rollout_factory import VOCAB, fetch, make_group, make_rollout, resign

from pipeline.generation.call_buffer import CallBuffer
from pipeline.store.registry import PartitionRegistry
from tasks import hashing as H
from tasks import reasons as R
from tasks.cut.row_cost import row_signature
from tasks.engines.shapes import ConfigShapes
from tasks.finalize.plan import plan_group
from tasks.finalize.reference import reference_verify_rollout
from tasks.finalize.verify import verify_many
from tasks.gate import CaptureGate
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows, unpack_rows
from tasks.schema import (
    ROUTES_FIELD,
    ROUTES_INT16,
    ROUTES_U8_FIELD,
    ROUTES_UINT8,
    routes_dtype_for,
    routes_encoding_for,
)
from tasks.toy.policy import MoEPolicy, PolicyConfig
from tasks.toy.rollouts import generate_rollouts, make_step_specs

L, K, E = 2, 2, 8


@pytest.mark.parametrize("experts,encoding,dtype", [
    (1, ROUTES_UINT8, np.uint8), (128, ROUTES_UINT8, np.uint8), (256, ROUTES_UINT8, np.uint8),
    (257, ROUTES_INT16, np.int16), (300, ROUTES_INT16, np.int16), (None, ROUTES_INT16, np.int16),
])
def test_the_encoding_follows_the_expert_count(experts, encoding, dtype):
    assert routes_encoding_for(experts) == encoding and routes_dtype_for(experts) == dtype
    assert CaptureGate("r", vocab_size=VOCAB, num_experts=experts).routes_encoding == encoding

    class Shapes(ConfigShapes):  # what the HF MoE engine and the toy policy derive it from
        def __init__(self):
            self.config = PolicyConfig(experts=experts or 300, top_k=1)

    assert Shapes().routes_dtype == (dtype if experts else np.int16)


@pytest.mark.parametrize("experts,encoding", [(128, ROUTES_UINT8), (300, ROUTES_INT16)])
def test_the_toy_engine_stages_compact_routes(experts, encoding):
    policy = MoEPolicy(PolicyConfig(vocab_size=64, hidden=4, layers=2, experts=experts, top_k=2, seed=5, window=2))
    specs = [s for g in make_step_specs("te", 1, 2, turns=2, tokens_per_turn=3, tool_tokens=1, prompt_tokens=2, vocab_size=64) for s in g]
    rows = [r for g in generate_rollouts(policy, specs) for r in g.rows]
    assert {r.routes_encoding for r in rows} == {encoding}
    assert {r.routed_experts.dtype for r in rows} == {policy.routes_dtype}
    assert all(H.row_digest(r) == r.digest and int(r.routed_experts.max()) < experts for r in rows)
    batch = pack_rows(rows)
    assert (ROUTES_U8_FIELD if encoding == ROUTES_UINT8 else ROUTES_FIELD) in batch.fields


def test_the_same_ids_hash_differently_under_each_encoding():
    ids = np.arange(6 * L * K).reshape(6, L, K) % E
    gate_a = CaptureGate("r", vocab_size=VOCAB, num_experts=E, routes_encoding=ROUTES_INT16)
    gate_b = CaptureGate("r", vocab_size=VOCAB, num_experts=E, routes_encoding=ROUTES_UINT8)
    delta = (np.arange(6), np.r_[np.zeros(2, np.float32), np.ones(4, np.float32)], np.r_[np.zeros(2, np.float32), -np.ones(4, np.float32)])
    a = gate_a.stage_call("c0", None, *delta, routed_experts=ids)
    b = gate_b.stage_call("c0", None, *delta, routed_experts=ids)
    assert np.array_equal(a.routed_experts, b.routed_experts) and a.chain_hash == b.chain_hash
    assert a.digest != b.digest
    # Relabelling either row's encoding: its ids are never hashed as another width than
    # the label's, and cast to that width they no longer match the row's own digest.
    for row, other, cast in ((a, ROUTES_UINT8, np.uint8), (b, ROUTES_INT16, np.int16)):
        row.routes_encoding = other
        with pytest.raises(ValueError, match=f"needs {np.dtype(cast).name}"):
            H.row_digest(row)
        row.routed_experts = row.routed_experts.astype(cast)
        assert H.row_digest(row) != row.digest
    with pytest.raises(ValueError, match="needs uint8"):  # never hashed as another width than its encoding's
        H.digest(**{**{k: getattr(b, k) for k in ("rollout_id", "model_call_id", "parent_call_id", "prev_len", "delta_len",
                                                 "cum_len", "weight_version", "token_ids", "token_mask", "logprobs",
                                                 "chain_hash", "cumulative_hash")},
                    "routes_encoding": ROUTES_UINT8, "routed_experts": ids.astype(np.int16)})


@pytest.mark.parametrize("enc,to", [(ROUTES_INT16, ROUTES_UINT8), (ROUTES_UINT8, ROUTES_INT16)])
def test_a_rollout_relabelled_to_the_other_encoding_is_rejected(enc, to):
    b = make_rollout(np.random.default_rng(3), "rl", n_calls=2, routes=(L, K, E), routes_encoding=enc)

    def relabel(rows):  # every call, receipt included, rewritten in the other encoding
        for r in rows.values():
            r.routes_encoding = to
            r.routed_experts = r.routed_experts.astype(np.uint8 if to == ROUTES_UINT8 else np.int16)

    forged = resign(b, relabel, digest=False)
    step = plan_group([forged.receipt])
    rows, routes = fetch([forged], step.staging_keys, step.routes_keys)
    got = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=E)[0]
    ref = reference_verify_rollout(step.rollouts[0], rows, routes, vocab_size=VOCAB, num_experts=E)
    assert got.status == ref.status == R.CORRUPT_DIGEST, got.detail
    # Only the row's encoding byte flipped (the receipt still says the truth).
    step = plan_group([b.receipt])
    rows, routes = fetch([b], step.staging_keys, step.routes_keys)
    rows.fields["routes_encoding"].values[0] = to
    got = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=E)[0]
    assert got.status == R.wrong("routes_encoding")


def test_a_group_mixing_old_and_new_rows_verifies_to_the_same_values():
    rng_a, rng_b = np.random.default_rng(9), np.random.default_rng(9)
    old = make_group(rng_a, "g", 3, n_calls=2, n_branches=1, routes=(L, K, E), routes_encoding=ROUTES_INT16, rollout_prefix="old")
    new = make_group(rng_b, "g", 3, n_calls=2, n_branches=1, routes=(L, K, E), rollout_prefix="new")
    builts = [x for pair in zip(old, new) for x in pair]
    step = plan_group([x.receipt for x in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    assert {ROUTES_FIELD, ROUTES_U8_FIELD} <= set(routes.fields)  # one batch, both fields
    res = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=E)
    ref = [reference_verify_rollout(p, rows, routes, vocab_size=VOCAB, num_experts=E) for p in step.rollouts]
    assert [r.status for r in res] == [r.status for r in ref] == [R.OK] * 6
    for k in range(0, 6, 2):
        a, b = res[k].linearized.routed_experts, res[k + 1].linearized.routed_experts
        assert (a.dtype, b.dtype) == (np.int16, np.uint8) and np.array_equal(a, b)
        assert np.array_equal(ref[k].linearized.routed_experts, a) and ref[k + 1].linearized.routed_experts.dtype == np.uint8


def test_packed_rows_of_both_encodings_round_trip_and_resume():
    old = make_rollout(np.random.default_rng(4), "o", n_calls=2, routes=(L, K, E), routes_encoding=ROUTES_INT16)
    new = make_rollout(np.random.default_rng(5), "n", n_calls=2, routes=(L, K, E))
    batch = pack_rows(old.rows + new.rows)
    assert batch.fields[ROUTES_FIELD].present.tolist() == [True] * 2 + [False] * 2
    assert batch.fields[ROUTES_U8_FIELD].present.tolist() == [False] * 2 + [True] * 2
    back = unpack_rows(batch)
    assert all(a.same_content(b) and H.row_digest(a) == a.digest for a, b in zip(back, old.rows + new.rows))
    # Each put signature names its encoding's field: int16 and uint8 rows never share one.
    assert row_signature(old.rows[0])[-1][:2] == (ROUTES_FIELD, "<i2")
    assert row_signature(new.rows[0])[-1][:2] == (ROUTES_U8_FIELD, "|u1")
    # A gate resumed from int16 rows keeps staging int16 (even for 8 experts).
    gate = CaptureGate.resume("o", back[:2], vocab_size=VOCAB, num_experts=E, records=old.receipt.calls)
    more = gate.stage_call("c9", "c1", np.arange(3), np.ones(3, np.float32), -np.ones(3, np.float32),
                           routed_experts=np.zeros((3, L, K), np.int64))
    assert more.routes_encoding == ROUTES_INT16 and more.routed_experts.dtype == np.int16


def test_the_store_registry_types_each_encodings_field():
    reg = PartitionRegistry()[STAGING_PARTITION]
    assert reg.mismatch(ROUTES_FIELD, ("<i2", (L, K))) is None
    assert reg.mismatch(ROUTES_U8_FIELD, ("|u1", (L, K))) is None
    assert "expected |u1[L, K]" in reg.mismatch(ROUTES_U8_FIELD, ("<i2", (L, K)))
    assert "expected <i2[L, K]" in reg.mismatch(ROUTES_FIELD, ("|u1", (L, K)))


def test_cut_chunks_pack_in_their_buffers_routes_dtype():
    rows = {}
    for dt in (np.int16, np.uint8):
        buf = CallBuffer("r", "c", np.arange(3), routes_shape=(L, K), context_routes=np.ones((3, L, K), np.int64), routes_dtype=dt)
        buf.append(np.arange(2), -np.ones(2, np.float32), np.full((2, L, K), 7, np.int16))
        frozen = buf.freeze("ck")
        rows[dt] = frozen.row
        assert frozen.signature == row_signature(frozen.row) and frozen.nbytes > 0
    assert (rows[np.int16].routes_encoding, rows[np.uint8].routes_encoding) == (ROUTES_INT16, ROUTES_UINT8)
    assert np.array_equal(rows[np.int16].routed_experts, rows[np.uint8].routed_experts)
    assert rows[np.uint8].routed_experts.dtype == np.uint8 and H.row_digest(rows[np.uint8]) == rows[np.uint8].digest
