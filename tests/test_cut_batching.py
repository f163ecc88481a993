"""Pure tests of the cut batch planner and the cut receipt (no Dask)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import hashing
from tasks.cut_batching import (
    BatchLimitError,
    BatchLimits,
    BatchPlanner,
    plan_batches,
    plan_rows,
    row_nbytes,
    row_signature,
)
from tasks.cut_receipt import (
    COMPLETED,
    DURABLE_FAILURE,
    DURABLE_PREFIX,
    CallAck,
    CutReceipt,
    InvalidInventory,
    inventory_digest,
    normalize_inventory,
    prefix_digest,
)
from tasks.schema import ROUTES_INT16, ROUTES_NONE, StagedRow


def _row(i: int, n: int, routes: tuple[int, int] | None = None) -> StagedRow:
    ids = np.arange(n, dtype=np.int64) % 97
    r = StagedRow(
        rollout_id=f"r{i}", model_call_id="call-0", parent_call_id=None, prev_len=0, delta_len=n, cum_len=n,
        weight_version=0, token_ids=ids, token_mask=np.ones(n, np.float32), logprobs=np.zeros(n, np.float32),
        routes_encoding=ROUTES_NONE if routes is None else ROUTES_INT16,
        routed_experts=None if routes is None else np.zeros((n,) + routes, np.int16),
        digest=b"", chain_hash=hashing.chain_hash(None, ids), cumulative_hash=hashing.cumulative_hash(ids),
    )
    return r


def _check_invariants(batches, tokens, nbytes, limits, sigs=None):
    seen = [i for b in batches for i in b.rows]
    assert sorted(seen) == list(range(len(tokens))), "every row in exactly one batch"
    for b in batches:
        assert b.rows == sorted(b.rows), "rows keep their order inside a batch"
        assert b.tokens == sum(tokens[i] for i in b.rows)
        assert b.nbytes == sum(nbytes[i] for i in b.rows)
        if sigs is not None:
            assert len({sigs[i] for i in b.rows}) == 1, "one dtype/shape signature per batch"
        if b.oversized:
            assert len(b) == 1
            assert tokens[b.rows[0]] > limits.max_tokens or nbytes[b.rows[0]] > limits.max_bytes
        else:
            assert len(b) <= limits.max_rows
            assert b.tokens <= limits.max_tokens and b.nbytes <= limits.max_bytes


def test_thousand_prefixes_batch_by_rows_tokens_and_bytes():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 4096, size=1000).tolist()
    nbytes = [t * 16 + 200 for t in tokens]
    limits = BatchLimits(max_rows=256, max_tokens=4_194_304, max_bytes=268_435_456)
    batches = plan_batches(tokens, nbytes, limits=limits)
    _check_invariants(batches, tokens, nbytes, limits)
    assert [len(b) for b in batches] == [256, 256, 256, 232]  # row limit binds
    # Tighter token limit: more batches, each under it.
    tight = BatchLimits(max_rows=256, max_tokens=50_000, max_bytes=268_435_456)
    tb = plan_batches(tokens, nbytes, limits=tight)
    _check_invariants(tb, tokens, nbytes, tight)
    assert len(tb) >= sum(tokens) // 50_000 + 1
    assert all(b.tokens > 50_000 - 4096 for b in tb[:-1]), "greedy: a batch closes only when the next row overflows"


def test_ragged_and_oversized_rows_under_token_limit():
    tokens = [10, 20, 5000, 30, 4096, 1, 9000]
    nbytes = [1] * len(tokens)
    limits = BatchLimits(max_rows=8, max_tokens=4096, max_bytes=1 << 30)
    batches = plan_batches(tokens, nbytes, limits=limits)
    _check_invariants(batches, tokens, nbytes, limits)
    alone = [b.rows for b in batches if b.oversized]
    assert alone == [[2], [6]], "rows above the token limit are written alone, never split"
    # The open batch is not flushed by an oversized row: 0, 1, 3 share one put.
    assert [0, 1, 3] in [b.rows for b in batches]
    # Exactly at the limit is not oversized; it closes the open batch by itself.
    assert [4] in [b.rows for b in batches if not b.oversized]


def test_byte_limit_counts_routed_experts():
    plain = [_row(i, 1000) for i in range(8)]
    routed = [_row(i, 1000, routes=(48, 8)) for i in range(8)]  # 768 route bytes per token
    limits = BatchLimits(max_rows=256, max_tokens=1_000_000, max_bytes=4 * 1024 * 1024)
    assert len(plan_rows(plain, limits=limits)) == 1
    assert row_nbytes(routed[0]) > 1000 * 768
    rb = plan_rows(routed, limits=limits)
    assert len(rb) == 2, "the same tokens with routes need two puts under a 4 MiB cap"
    _check_invariants(rb, [r.delta_len for r in routed], [row_nbytes(r) for r in routed], limits)
    # One routed row bigger than the byte cap alone is oversized (written alone).
    big = _row(99, 20_000, routes=(48, 8))
    ob = plan_rows([plain[0], big, plain[1]], limits=limits)
    assert [b.rows for b in ob if b.oversized] == [[1]]


def test_rows_grouped_by_dtype_and_trailing_shape():
    rows = [_row(0, 5), _row(1, 5, (4, 2)), _row(2, 5), _row(3, 5, (2, 2)), _row(4, 5, (4, 2))]
    sigs = [row_signature(r) for r in rows]
    assert len(set(sigs)) == 3
    batches = plan_rows(rows, limits=BatchLimits(256, 1 << 20, 1 << 30))
    assert sorted(b.rows for b in batches) == [[0, 2], [1, 4], [3]]
    _check_invariants(batches, [5] * 5, [row_nbytes(r) for r in rows], BatchLimits(256, 1 << 20, 1 << 30), sigs)


def test_batch_size_one_is_one_batch_per_row():
    batches = plan_batches([3, 1, 4, 1, 5], [1] * 5, limits=BatchLimits(1, 100, 100))
    assert [b.rows for b in batches] == [[0], [1], [2], [3], [4]]


def test_incremental_planner_emits_full_batches_and_discards_pending():
    p = BatchPlanner(BatchLimits(max_rows=2, max_tokens=100, max_bytes=100))
    assert p.add(0, 10, 1) == []
    ready = p.add(1, 10, 1)
    assert [b.rows for b in ready] == [[0, 1]], "a full batch is ready at once"
    assert p.add(2, 95, 1) == []
    ready = p.add(3, 10, 1)  # 95 + 10 > 100: closes [2]
    assert [b.rows for b in ready] == [[2]]
    assert p.pending_rows == [3]
    assert p.discard() == [3]
    assert p.flush() == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, None, True])
def test_invalid_limits_are_refused(bad):
    with pytest.raises(BatchLimitError, match="max_rows"):
        BatchLimits(max_rows=bad, max_tokens=1, max_bytes=1)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 3000), st.integers(0, 2)), min_size=0, max_size=60),
    st.integers(1, 8), st.integers(1, 400), st.integers(1, 4000),
)
def test_planner_invariants_hold_for_any_rows(rows, max_rows, max_tokens, max_bytes):
    tokens = [r[0] for r in rows]
    nbytes = [r[1] for r in rows]
    sigs = [r[2] for r in rows]
    limits = BatchLimits(max_rows, max_tokens, max_bytes)
    batches = plan_batches(tokens, nbytes, sigs, limits=limits)
    _check_invariants(batches, tokens, nbytes, limits, sigs)
    assert [b.rows[0] for b in batches] == sorted(b.rows[0] for b in batches)


# ---- receipt ---------------------------------------------------------------------------


def test_inventory_digest_is_order_free_and_dedupes():
    a = inventory_digest([("r1", "c0"), ("r0", "c1"), ("r1", "c0")])
    assert a == inventory_digest(["r0/c1", ("r1", "c0")])
    assert a != inventory_digest([("r0", "c1")])
    assert inventory_digest(None) != inventory_digest([])
    assert normalize_inventory([("b", "x"), "a/y", ("b", "x")]) == [("b", "x"), ("a", "y")]


@pytest.mark.parametrize("bad", [["r0"], [("r0",)], [("r/0", "c")], [(1, "c")], "r0/c0", [("", "c")]])
def test_invalid_inventory_is_named(bad):
    with pytest.raises(InvalidInventory):
        normalize_inventory(bad)


def test_prefix_digest_over_chunks_equals_whole():
    ids = np.arange(1000, dtype=np.int64)
    whole = prefix_digest(ids)
    assert prefix_digest([ids[:10], ids[10:400], ids[400:]]) == whole
    assert prefix_digest(ids[:-1]) != whole
    assert whole != hashing.cumulative_hash(ids), "own domain tag"


def test_receipt_round_trip_and_lookup():
    d = prefix_digest(np.arange(5))
    acks = (
        CallAck("r0", "c", DURABLE_PREFIX, ("k0", "k1"), 5, d),
        CallAck.failure(("r1", "c"), "control_deadline", "late"),
        CallAck("r2", "c", COMPLETED, total_tokens=9),
    )
    r = CutReceipt("ck", inventory_digest([a.call for a in acks]), acks, put_calls=3)
    assert CutReceipt.from_dict(r.to_dict()) == r
    assert r.ack("r1", "c").status == DURABLE_FAILURE
    assert r.counts() == {"durable_prefix": 1, "control_deadline": 1, "completed": 1}
    assert r.advertised_keys == ["k0", "k1"]
    with pytest.raises(ValueError):
        CallAck.failure(("r", "c"), "no_such_reason")
    with pytest.raises(ValueError):
        CallAck("r", "c", DURABLE_PREFIX, ("k",), 1, None)
