"""Bad input through the finalization graph: each case rejects only its own rollout.

Tampered rows are put directly into the real store (write-once keys: the tampered row is
staged instead of the good one); bad receipts are submitted as dicts. All cases share
ONE step (two groups) with clean rollouts beside them, so the test also shows that one
bad row never takes down its verify task, its group or the step.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from rollout_factory import (
    make_rollout,
    receipt_dict,
    resign,
    set_expert,
    set_logprob,
    set_tokens,
    shift_lengths,
)

from pipeline.finalize import Finalizer
from tasks.packed import PackedBatch, pack_rows
from tasks.schema import ALL_FIELDS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("keep_staged_rows")]



VOCAB, L, K, E = 64, 2, 2, 8


@pytest.fixture
def store(store_factory):
    # A small memory limit so rows really spill through zict to tmp_path.
    return store_factory(n_units=2, memory_limit="16KiB")


def put(store, rows, keys=None):
    batch = pack_rows(rows)
    if keys is not None:
        batch = PackedBatch(list(keys), batch.fields)
    res = store.put_many(batch)
    assert not res.failed, res.failed


def flip_logprob_bit(row):
    """The row with one bit of one logprob flipped, hashes left as the writer made them."""
    lps = row.logprobs.copy()
    lps.view(np.uint8)[-1] ^= 0x01
    row.logprobs = lps
    return row


def _built(rng, rid, **kw):
    return make_rollout(rng, rid, n_calls=3, routes=(L, K, E), vocab_size=VOCAB, **kw)


def build_cases(rng, store):
    """{rollout position: (receipt to submit, expected status)}; stages every row."""
    cases = []

    def clean(rid):
        b = _built(rng, rid)
        put(store, b.rows)
        cases.append((b.receipt, "ok"))

    clean("ok-a")

    b = _built(rng, "corrupt-byte")
    rows = list(b.rows)
    rows[1] = flip_logprob_bit(copy.deepcopy(rows[1]))
    put(store, rows)
    cases.append((b.receipt, "corrupt_digest"))

    b = _built(rng, "deleted-row")
    put(store, b.rows)
    store.delete([b.rows[2].staging_key])
    cases.append((b.receipt, "missing_staging_row"))

    b = _built(rng, "swapped-keys")
    keys = [r.staging_key for r in b.rows]
    keys[0], keys[1] = keys[1], keys[0]
    put(store, b.rows, keys)
    cases.append((b.receipt, "identity_mismatch"))

    # Reordered lineage: the receipt claims c2 follows c0 and c1 follows c2.
    b = _built(rng, "reordered")
    put(store, b.rows)
    d = receipt_dict(b)
    by_id = {c["model_call_id"]: c for c in d["calls"]}
    by_id["c2"]["parent_call_id"], by_id["c1"]["parent_call_id"] = "c0", "c2"
    d["terminal_model_call_id"] = "c1"  # the claimed tree's leaf (a non-leaf terminal is terminal_not_leaf)
    cases.append((d, "wrong_parent_call_id"))

    b = resign(_built(rng, "parent-length"), shift_lengths("c2", 3))
    put(store, b.rows)
    cases.append((b.receipt, "parent_length_mismatch"))

    b = _built(rng, "cycle")
    put(store, b.rows)
    d = receipt_dict(b)
    d["calls"][0]["parent_call_id"] = "c2"
    cases.append((d, "lineage_cycle"))

    b = resign(_built(rng, "nan-logprob"), set_logprob("c1", -1, math.nan))
    put(store, b.rows)
    cases.append((b.receipt, "invalid_logprob"))

    b = resign(_built(rng, "bad-token"), set_tokens("c2", 0, VOCAB))
    put(store, b.rows)
    cases.append((b.receipt, "invalid_token"))

    b = resign(_built(rng, "bad-expert"), set_expert("c1", E))
    put(store, b.rows)
    cases.append((b.receipt, "invalid_routes"))

    b = _built(rng, "malformed")
    put(store, b.rows)
    d = receipt_dict(b)
    d["calls"] = "not a list"
    cases.append((d, "invalid_receipt"))
    cases.append((42, "invalid_receipt"))

    b = _built(rng, "poisoned")
    d = receipt_dict(b)
    d["poisoned"], d["failure_reason"] = True, "generation crashed"
    cases.append((d, "capture_poisoned"))

    clean("ok-b")
    return cases


def test_each_bad_input_rejects_only_its_rollout(cluster_client, store):
    rng = np.random.default_rng(7)
    cases = build_cases(rng, store)
    other = [_built(rng, f"other-{i}") for i in range(3)]
    for b in other:
        put(store, b.rows)
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"bad": [r for r, _ in cases], "clean": [b.receipt for b in other]}).result()

    group = step.groups["bad"]
    expected = [s for _, s in cases]
    assert group.status == expected
    assert len(group) == len(cases)  # the group keeps its shape
    for i, want in enumerate(expected):
        if want == "ok":
            assert group.sample_mask[i] == 1.0 and group.input_lengths[i] > 0
        else:
            assert group.sample_mask[i] == 0.0 and group.input_lengths[i] == 0
            assert not group.input_ids[i].any()
    # Clean rows of the bad group are intact: compare with a read-back of their chain.
    for i, (receipt, status) in enumerate(cases):
        if status != "ok":
            continue
        keys = receipt.staging_keys
        got = store.get_many(keys, list(ALL_FIELDS)).batch
        ids = np.concatenate([got.fields["token_ids"].row(j) for j in range(len(got))])
        n = int(group.input_lengths[i])
        np.testing.assert_array_equal(group.input_ids[i, :n].numpy(), ids)
    assert step.groups["clean"].status == ["ok"] * 3
    assert step.groups["clean"].sample_mask.tolist() == [1.0] * 3

    rejected = {s: expected.count(s) for s in expected if s != "ok"}
    assert step.metrics["rejected"] == rejected
    assert group.metrics["rejected"] == rejected
    assert step.metrics["accepted"] == 2 + 3
    assert fin.queue_depth == 0


def test_reversed_receipt_call_list_is_not_a_rejection(cluster_client, store):
    """Receipts describe lineage by parent links: listing the calls in another order
    yields the same training row (the chain is rebuilt from the links)."""
    rng = np.random.default_rng(8)
    b = _built(rng, "reversed")
    put(store, b.rows)
    d = receipt_dict(b)
    d["calls"] = d["calls"][::-1]
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step([[b.receipt, d]]).result()
    g = step.groups["g0"]
    # Same rollout twice in one step: the planner rejects both (their keys collide) ...
    assert g.status == ["duplicate_staging_key", "duplicate_staging_key"]
    # ... so submit the reversed one alone.
    g = fin.submit_step([[d]]).result().groups["g0"]
    assert g.status == ["ok"]
    n = int(g.input_lengths[0])
    want = np.concatenate([b.row(c).token_ids for c in b.chain_ids])
    np.testing.assert_array_equal(g.input_ids[0, :n].numpy(), want)


def test_step_of_only_unusable_receipts_fetches_nothing(cluster_client, store):
    rng = np.random.default_rng(9)
    b = _built(rng, "lonely")
    d = receipt_dict(b)
    d["terminal_model_call_id"] = "nope"
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g": [d, {"rollout_id": "x"}]}).result()
    assert step.groups["g"].status == ["missing_terminal", "invalid_receipt"]
    assert step.groups["g"].sample_mask.tolist() == [0.0, 0.0]
    assert step.metrics["fetch_calls"] == 0 and step.metrics["bytes_fetched"] == 0
    assert step.metrics["rejected"] == {"invalid_receipt": 1, "missing_terminal": 1}


class _Int(int):
    pass


class _Str(str):
    pass


@pytest.mark.parametrize(
    "field, value",
    [
        (None, None),  # the record as made: the fast path takes it
        ("prev_len", True), ("delta_len", _Int(4)), ("cum_len", np.int64(8)), ("weight_version", 2**63),
        ("prev_len", -1), ("delta_len", 0), ("cum_len", 7), ("weight_version", -(2**63)),
        ("routes_encoding", 2), ("routes_encoding", True), ("routes_encoding", 1),
        ("digest", bytearray(32)), ("chain_hash", b"\x00" * 31), ("cumulative_hash", "x" * 32),
        ("model_call_id", _Str("c9")), ("model_call_id", ""), ("model_call_id", "a/b"), ("model_call_id", "__cut__"),
        ("model_call_id", "x" * 600), ("model_call_id", "\ud800"), ("parent_call_id", ""), ("parent_call_id", "p0"),
        ("staging_key", b"k"), ("staging_key", _Str("k")),
    ],
)
def test_call_record_fast_path_agrees_with_the_field_by_field_checks(field, value):
    """Receipts parse their call records on a fast path when every field has its exact type;
    any record gives the same record, or the same rejection, as the named checks."""
    import dataclasses

    from tasks.finalize import plan as P
    from tasks.receipts import CallRecord

    base = CallRecord("c1", None, 4, 4, 8, 3, b"d" * 32, b"c" * 32, b"u" * 32, 0, "r/c1")
    raw = base if field is None else dataclasses.replace(base, **{field: value})

    def outcome(r):
        try:
            return ("ok", P._record(r, 0))
        except P._Bad as e:
            return (e.reason, e.detail)

    got, want = outcome(raw), outcome(dataclasses.asdict(raw))  # a dict takes the named checks
    assert got == want
    if got[0] == "ok":
        assert all(type(getattr(got[1], f.name)) is type(getattr(want[1], f.name)) for f in dataclasses.fields(CallRecord))
