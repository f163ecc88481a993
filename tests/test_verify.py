"""Verify + linearize: one explicit test per bad-input case.

Every case corrupts ONE rollout of a group of four and asserts (a) the exact reason,
(b) that the per-token reference reaches the same verdict and rows, and (c) that the
other three rollouts still finalize ok into a group of unchanged shape.
"""
from __future__ import annotations

import numpy as np
import pytest

from tasks import reasons as R
from tasks.digests import DEFAULT_VERSION, SUPPORTED_VERSIONS
from tasks.finalize.assemble import assemble_group
from tasks.finalize.chain import CallRules
from tasks.finalize.plan import plan_group
from tasks.finalize.verify import merge_results, verify_many, verify_rollout
from tasks.finalize.reference import reference_verify_rollout
from tasks.finalize.tables import routes_tables
from tasks.schema import ROUTES_INT16, ROUTES_UINT8, routes_field
from rollout_factory import (
    VOCAB,
    drop_key,
    drop_routes,
    fetch,
    flip_byte,
    make_group,
    receipt_dict,
    replace_field,
    resign,
    set_expert,
    set_logprob,
    set_mask,
    set_tokens,
    shift_lengths,
    swap_keys,
)

E = 8
ROUTES = (2, 3, E)
BAD = 1  # index of the corrupted rollout in its group


def group(seed: int = 0, routes=None, enc=None):
    """Four rollouts; routed ones staged in routes encoding ``enc`` (None: the gate's
    choice, uint8 for these few experts; 1: int16)."""
    rng = np.random.default_rng(seed)
    return make_group(rng, "g", 4, n_calls=3, n_branches=1, gen_len=(2, 8), prompt_len=(1, 6), routes=routes, routes_encoding=enc)


ENCODINGS = [ROUTES_UINT8, ROUTES_INT16]


def same_rows(a, b) -> bool:
    if (a is None) != (b is None):
        return False
    if a is None:
        return True
    arrays = [(a.input_ids, b.input_ids), (a.token_mask, b.token_mask), (a.logprobs, b.logprobs)]
    if (a.routed_experts is None) != (b.routed_experts is None):
        return False
    if a.routed_experts is not None:
        arrays.append((a.routed_experts, b.routed_experts))
    return (
        all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in arrays)
        and a.prompt_length == b.prompt_length
        and a.spans == b.spans
    )


def finalize(builts, *, receipts=None, rows_fn=None, routes_fn=None, num_experts=E):
    """Plan, fetch, (corrupt), verify, cross-check with the reference, assemble."""
    step = plan_group(receipts if receipts is not None else [b.receipt for b in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    if rows_fn:
        rows = rows_fn(rows)
    if routes_fn:
        routes = routes_fn(routes)
    results = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=num_experts)
    for plan, res in zip(step.rollouts, results):
        ref = reference_verify_rollout(plan, rows, routes, vocab_size=VOCAB, num_experts=num_experts)
        assert (res.status, res.rollout_id) == (ref.status, ref.rollout_id), res.detail
        assert same_rows(res.linearized, ref.linearized)
        assert "internal error" not in res.detail
    merged = merge_results(step, results)
    return merged, assemble_group(merged, step.rewards)


def assert_only_bad(merged, fg, reason):
    assert [r.status for r in merged] == [R.OK, reason, R.OK, R.OK], merged[BAD].detail
    assert merged[BAD].detail  # the reason comes with a human-readable detail
    assert fg.sample_mask.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert fg.input_lengths[BAD] == 0 and not fg.input_ids[BAD].any() and not fg.token_mask[BAD].any()
    assert fg.status[BAD] == reason and fg.metrics["rejected_by_reason"] == {reason: 1}
    assert len(fg) == 4 and fg.metrics["accepted"] == 3


def key(builts, call="c1", i=BAD):
    return f"{builts[i].rollout_id}/{call}"


def at(rows, k):
    return rows.keys.index(k)


# ---- the good path -------------------------------------------------------------------------


@pytest.mark.parametrize("routes,enc", [(None, None), (ROUTES, ROUTES_UINT8), (ROUTES, ROUTES_INT16)])
def test_linearizes_the_chain_only(routes, enc):
    builts = group(1, routes, enc)
    merged, fg = finalize(builts)
    assert all(r.ok for r in merged)
    for b, r, row_i in zip(builts, merged, range(4)):
        chain = [b.row(c) for c in b.chain_ids]
        lin = r.linearized
        np.testing.assert_array_equal(lin.input_ids, np.concatenate([c.token_ids for c in chain]))
        np.testing.assert_array_equal(lin.logprobs, np.concatenate([c.logprobs for c in chain]))
        assert lin.spans == [(c.model_call_id, c.prev_len, c.cum_len) for c in chain]
        assert lin.prompt_length == int((chain[0].token_mask == 0).sum())
        assert lin.length == chain[-1].cum_len and r.n_calls == 3
        if routes:
            np.testing.assert_array_equal(lin.routed_experts, np.concatenate([c.routed_experts for c in chain]))
        else:
            assert lin.routed_experts is None
        t = lin.length
        assert fg.input_ids[row_i, :t].numpy().tobytes() == lin.input_ids.tobytes()
        assert fg.prompt_lengths[row_i] == lin.prompt_length
    assert fg.metrics["calls_per_rollout"] == 3.0


def test_verify_rollout_equals_verify_many_and_tolerates_extra_rows():
    builts = group(2)
    step = plan_group([b.receipt for b in builts])
    # A batch holding every staged row (branches included) in shuffled order.
    everything = [r.staging_key for b in builts for r in b.rows][::-1]
    rows, _ = fetch(builts, everything, [])
    many = verify_many(step.rollouts, rows, None, vocab_size=VOCAB, num_experts=None)
    for p, m in zip(step.rollouts, many):
        one = verify_rollout(p, rows, None, vocab_size=VOCAB, num_experts=None)
        assert one.status == m.status == R.OK and same_rows(one.linearized, m.linearized)


# ---- row rules -----------------------------------------------------------------------------


def test_missing_staging_row():
    b = group()
    assert_only_bad(*finalize(b, rows_fn=lambda rows: drop_key(rows, key(b))), R.MISSING_STAGING_ROW)


@pytest.mark.parametrize(
    "field, value",
    [
        ("rollout_id", np.frombuffer(b"\xff\xfe", np.uint8)),  # undecodable id
        ("digest", np.zeros(31, np.uint8)),  # short hash
        ("prev_len", np.zeros(2, np.int64)),  # two values for a scalar
        ("token_ids", np.zeros(1, np.int64)),  # length != delta_len
        ("logprobs", None),  # field absent for this row
        ("schema_version", np.array([2], np.int64)),  # unsupported version
        ("digest_version", np.array([4], np.int64)),  # digest version this build cannot recompute
        ("token_mask", np.ones(40, np.float32)),  # length != delta_len
    ],
)
def test_invalid_staging_row(field, value):
    b = group()
    fn = lambda rows: replace_field(rows, field, at(rows, key(b)), value)  # noqa: E731
    assert_only_bad(*finalize(b, rows_fn=fn), R.INVALID_STAGING_ROW)


def test_identity_mismatch_swapped_keys():
    b = group()
    fn = lambda rows: swap_keys(rows, at(rows, key(b, "c0")), at(rows, key(b, "c2")))  # noqa: E731
    assert_only_bad(*finalize(b, rows_fn=fn), R.IDENTITY_MISMATCH)


@pytest.mark.parametrize("field", R.RECEIPT_COMPARED_FIELDS)
def test_wrong_field(field):
    b = group(3, ROUTES)
    # The rows' (default) digest version flipped to another supported one: 3 <-> 2.
    mask = DEFAULT_VERSION ^ next(v for v in SUPPORTED_VERSIONS if v != DEFAULT_VERSION) if field == "digest_version" else 0x01
    fn = lambda rows: flip_byte(rows, field, at(rows, key(b)), 0, mask)  # noqa: E731
    assert_only_bad(*finalize(b, rows_fn=fn), R.wrong(field))


@pytest.mark.parametrize("field", ["token_ids", "token_mask", "logprobs"])
def test_corrupt_digest_on_content_byte_flip(field):
    b = group(4)
    fn = lambda rows: flip_byte(rows, field, at(rows, key(b)), 5, mask=0x10)  # noqa: E731
    assert_only_bad(*finalize(b, rows_fn=fn), R.CORRUPT_DIGEST)


@pytest.mark.parametrize("enc", ENCODINGS)
def test_corrupt_digest_on_routes_byte_flip(enc):
    b = group(4, ROUTES, enc)
    fn = lambda routes: flip_byte(routes, routes_field(enc), at(routes, key(b)), 1, mask=0x02)  # noqa: E731
    assert_only_bad(*finalize(b, routes_fn=fn), R.CORRUPT_DIGEST)


# ---- lineage rules (forged: hashes recomputed by the writer) --------------------------------


def forged(mutate, routes=None, enc=None, **kw):
    b = group(5, routes, enc)
    b[BAD] = resign(b[BAD], mutate, **kw)
    return b


def test_parent_length_mismatch():
    assert_only_bad(*finalize(forged(shift_lengths("c1", 1))), R.PARENT_LENGTH_MISMATCH)


def test_chain_hash_mismatch():
    b = group(5)
    new = int(b[BAD].row("c1").token_ids[0] + 1) % VOCAB
    b[BAD] = resign(b[BAD], set_tokens("c1", 0, new), chain=False)
    assert_only_bad(*finalize(b), R.CHAIN_HASH_MISMATCH)


def test_cumulative_hash_mismatch():
    b = group(5)
    new = int(b[BAD].row("c2").token_ids[-1] + 1) % VOCAB
    b[BAD] = resign(b[BAD], set_tokens("c2", -1, new), cumulative=False)
    assert_only_bad(*finalize(b), R.CUMULATIVE_HASH_MISMATCH)


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda d: d["calls"][1].update(parent_call_id="ghost"), R.MISSING_PARENT),
        (lambda d: d["calls"][0].update(parent_call_id="c2"), R.LINEAGE_CYCLE),
        (lambda d: d.update(poisoned=True, failure_reason="tool crashed"), R.CAPTURE_POISONED),
        (lambda d: d.update(terminal_model_call_id="c9"), R.MISSING_TERMINAL),
        (lambda d: d["calls"][0].update(digest=None), R.INVALID_RECEIPT),
    ],
)
def test_receipt_rejections_keep_group_shape(mutate, reason):
    b = group(6)
    receipts = [receipt_dict(x) for x in b]
    mutate(receipts[BAD])
    assert_only_bad(*finalize(b, receipts=receipts), reason)


# ---- content rules (forged, so the digest holds and the content rule must catch it) ---------


def _mask_then(values):
    """A call-level mask/logprob pair from a list of mask values."""
    lps = [0.0 if m == 0.0 else -0.5 for m in values]
    return values, lps


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: set_mask("c1", *_mask_then([1.0] * (d - 1) + [0.0])), R.INVALID_MASK_ORDER),
        (lambda d: set_mask("c1", *_mask_then([0.5] + [1.0] * (d - 1))), R.INVALID_MASK_ORDER),
        (lambda d: set_mask("c1", *_mask_then([0.0] * d)), R.EMPTY_GENERATION),
        (lambda d: set_tokens("c1", -1, VOCAB), R.INVALID_TOKEN),
        (lambda d: set_tokens("c1", -1, -3), R.INVALID_TOKEN),
        (lambda d: set_logprob("c1", -1, float("nan")), R.INVALID_LOGPROB),
        (lambda d: set_logprob("c1", -1, float("-inf")), R.INVALID_LOGPROB),
        (lambda d: set_logprob("c1", -1, 0.25), R.INVALID_LOGPROB),
        (lambda d: set_logprob("c0", 0, -1.0), R.INVALID_LOGPROB),  # root pos 0 is prompt (mask 0)
    ],
)
def test_content_rules(make, reason):
    b = group(7)
    d = b[BAD].row("c1").delta_len
    b[BAD] = resign(b[BAD], make(d))
    assert_only_bad(*finalize(b), reason)


# ---- routes ---------------------------------------------------------------------------------


def test_missing_routes_key():
    b = group(8, ROUTES)
    assert_only_bad(*finalize(b, routes_fn=lambda rt: drop_key(rt, key(b))), R.MISSING_ROUTES)


def test_missing_routes_batch_rejects_routed_rollouts_only():
    rng = np.random.default_rng(9)
    b = make_group(rng, "g", 2, n_calls=2) + make_group(rng, "h", 2, n_calls=2, routes=ROUTES)
    merged, fg = finalize(b, routes_fn=lambda rt: None)
    assert [r.status for r in merged] == [R.OK, R.OK, R.MISSING_ROUTES, R.MISSING_ROUTES]
    assert fg.routed_experts is None  # no accepted row carries routes


@pytest.mark.parametrize("enc,expert", [(ROUTES_UINT8, E), (ROUTES_UINT8, 255), (ROUTES_INT16, E), (ROUTES_INT16, -1)])
def test_invalid_routes_expert_out_of_range(enc, expert):
    merged, fg = finalize(forged(set_expert("c1", expert), ROUTES, enc))
    assert_only_bad(merged, fg, R.INVALID_ROUTES)
    assert f"expert id {expert} outside [0, {E})" in merged[BAD].detail


def test_expert_range_unchecked_without_num_experts():
    merged, _ = finalize(forged(set_expert("c1", E), ROUTES), num_experts=None)
    assert all(r.ok for r in merged)


@pytest.mark.parametrize("path", ["lean", "named"])
def test_negative_expert_rejected_without_num_experts(path, monkeypatch):
    """No upper bound without num_experts, but an int16 id below 0 is still invalid_routes
    (the gate's rule): on the verifier's lean path (routes pre-scan) and its named checks,
    and by the reference (``finalize`` asserts both verdicts agree)."""
    if path == "named":  # every row through its named checks
        monkeypatch.setattr(CallRules, "lean_for", lambda self, encoding: None)
    good, _ = finalize(group(5, ROUTES, ROUTES_INT16), num_experts=None)
    assert all(r.ok for r in good)
    b = forged(set_expert("c1", -1), ROUTES, ROUTES_INT16)
    merged, fg = finalize(b, num_experts=None)
    assert_only_bad(merged, fg, R.INVALID_ROUTES)
    assert "expert id -1 outside [0, ...)" in merged[BAD].detail
    step = plan_group([x.receipt for x in b])
    rows, routes = fetch(b, step.staging_keys, step.routes_keys)
    ref = reference_verify_rollout(step.rollouts[BAD], rows, routes, vocab_size=VOCAB, num_experts=None)
    assert (ref.rollout_id, ref.status) == (b[BAD].rollout_id, R.INVALID_ROUTES)
    table = routes_tables(routes, None)[ROUTES_INT16]  # the pre-scan flags that row alone
    assert [k for k, j in table.index.items() if not table.in_range[j]] == [key(b)]


def test_invalid_routes_mixed_encoding():
    assert_only_bad(*finalize(forged(drop_routes("c1"), ROUTES)), R.INVALID_ROUTES)


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("bad", ["short", "dtype"])
def test_invalid_routes_shape_or_dtype(bad, enc):
    b = group(10, ROUTES, enc)
    name = routes_field(enc)

    def fn(rt):
        i = at(rt, key(b))
        if bad == "short":
            return replace_field(rt, name, i, rt.fields[name].row(i)[:-1])
        f = rt.fields[name]
        from tasks.packed import PackedBatch, PackedField

        # The whole routes buffer in the wrong dtype: every routed row is refused, not the task.
        return PackedBatch(rt.keys, {name: PackedField(f.values.astype(np.int32), f.offsets)})

    merged, fg = finalize(b, routes_fn=fn)
    if bad == "short":
        assert_only_bad(merged, fg, R.INVALID_ROUTES)
    else:
        assert [r.status for r in merged] == [R.INVALID_ROUTES] * 4
        assert fg.input_ids.shape[0] == 4 and fg.sample_mask.sum() == 0


def test_whole_field_in_wrong_dtype_rejects_rows_not_task():
    b = group(11)
    from tasks.packed import PackedField

    def fn(rows):
        f = rows.fields["logprobs"]
        rows.fields["logprobs"] = PackedField(f.values.astype(np.float64), f.offsets)
        return rows

    merged, fg = finalize(b, rows_fn=fn)
    assert [r.status for r in merged] == [R.INVALID_STAGING_ROW] * 4
    assert "logprobs" in merged[0].detail


def test_empty_routes_batch_is_missing_routes_not_a_crash():
    # Regression (found by the property test): a routes batch with zero rows.
    b = group(12, ROUTES)
    merged, _ = finalize(b, routes_fn=lambda rt: rt.take([]))
    assert [r.status for r in merged] == [R.MISSING_ROUTES] * 4
    assert not any("unreadable" in r.detail for r in merged)


# ---- digest versions (1: SHA-256, 2: BLAKE3, 3: BLAKE3 over field digests) ----------------------


def two_versions(seed: int = 40):
    """Four rollouts, hashed with SHA-256 (r0, r2) and BLAKE3 (r1, r3)."""
    rng = np.random.default_rng(seed)
    return [make_group(rng, "g", 1, rollout_prefix=f"g{i}", n_calls=3, routes=ROUTES, digest_version=1 + i % 2)[0]
            for i in range(4)]


def test_rollouts_of_every_digest_version_verify_in_one_step():
    rng = np.random.default_rng(40)
    b = [make_group(rng, "g", 1, rollout_prefix=f"g{i}", n_calls=3, routes=ROUTES, digest_version=SUPPORTED_VERSIONS[i % 3])[0]
         for i in range(6)]
    assert sorted(SUPPORTED_VERSIONS) == [1, 2, 3]
    assert sorted(x.receipt.calls[0].digest_version for x in b) == [1, 1, 2, 2, 3, 3]
    merged, fg = finalize(b)
    assert [r.status for r in merged] == [R.OK] * 6 and fg.metrics["accepted"] == 6


def test_a_receipt_without_digest_versions_is_sha256():
    # Receipts written before BLAKE3 name no version: SHA-256. r0 and r2 are SHA-256 rollouts
    # (ok); r1's rows are BLAKE3, which its stripped receipt no longer says; r3 keeps its own.
    b = two_versions(41)
    receipts = [receipt_dict(x) for x in b]
    for d in receipts[:3]:
        for c in d["calls"]:
            del c["digest_version"]
    assert_only_bad(*finalize(b, receipts=receipts), R.wrong("digest_version"))


@pytest.mark.parametrize("change", ["mixed", "unknown"])
def test_a_receipt_of_mixed_or_unknown_digest_versions_is_invalid(change):
    b = two_versions(42)
    receipts = [receipt_dict(x) for x in b]
    receipts[BAD]["calls"][-1]["digest_version"] = 1 if change == "mixed" else 7
    merged, fg = finalize(b, receipts=receipts)
    assert [r.status for r in merged] == [R.OK, R.INVALID_RECEIPT, R.OK, R.OK]
    assert ("mix digest versions" if change == "mixed" else "digest_version") in merged[BAD].detail
