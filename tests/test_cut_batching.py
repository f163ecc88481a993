"""Pure tests of the cut batch planner and the cut receipt (no Dask)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import hashing
from tasks.cut.batching import (
    BatchLimitError,
    BatchLimits,
    BatchPlanner,
    plan_batches,
    plan_rows,
    put_nbytes,
    row_signature,
)
from tasks.cut.receipt import (
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
    assert put_nbytes(routed[0]) > 1000 * 768
    rb = plan_rows(routed, limits=limits)
    assert len(rb) == 2, "the same tokens with routes need two puts under a 4 MiB cap"
    _check_invariants(rb, [r.delta_len for r in routed], [put_nbytes(r) for r in routed], limits)
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
    _check_invariants(batches, [5] * 5, [put_nbytes(r) for r in rows], BatchLimits(256, 1 << 20, 1 << 30), sigs)


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


# ---- pack_chunks: frozen chunks straight into batch buffers ------------------------------
#
# A chunk is described by its pieces; pack_chunks must give exactly the batch pack_rows
# gives for the concatenated rows (keys aside), hash every digest over its own buffers,
# and copy each token once (the output never aliases the caller's pieces).

from tasks.cut.batching import InvalidChunk, PrefixChunk, pack_chunks  # noqa: E402
from tasks.packed import PackedBatch, pack_rows, unpack_rows  # noqa: E402
from tasks.schema import HASH_BYTES, ROUTES_FIELD  # noqa: E402


def _piece(rng, n: int, routes_shape, *, gen: bool = True):
    ids = rng.integers(0, 50_000, n).astype("<i8")
    lps = (-rng.random(n, dtype=np.float32) - 0.01).astype("<f4") if gen else np.zeros(n, "<f4")
    routes = None if routes_shape is None else rng.integers(0, 64, (n,) + tuple(routes_shape)).astype("<i2")
    return ids, lps, routes


def _chunk_and_row(rng, i: int, *, ctx: int, parts: list[int], routes_shape=None, prev_len: int = 0,
                   parent=None, prev_chain=None, weight_version: int = 3, seq: int = 0):
    """A chunk (pieces) and the StagedRow it must pack to, built independently."""
    cids, _, croutes = _piece(rng, ctx, routes_shape, gen=False) if ctx else (None, None, None)
    pieces = [_piece(rng, n, routes_shape) for n in parts]
    ids = np.concatenate(([cids] if ctx else []) + [p[0] for p in pieces] + [np.zeros(0, "<i8")])
    lps = np.concatenate([np.zeros(ctx, "<f4")] + [p[1] for p in pieces])
    mask = np.concatenate([np.zeros(ctx, "<f4"), np.ones(sum(parts), "<f4")])
    routes = None
    if routes_shape is not None:
        routes = np.concatenate(([croutes] if ctx else []) + [p[2] for p in pieces]
                                + [np.zeros((0,) + tuple(routes_shape), "<i2")])
    chain = hashing.chain_hash(prev_chain, ids)
    cum = hashing.cumulative_hash(ids)  # any 32 bytes are passed through; keep them meaningful
    rid, mid = f"roll-{i}", f"call-{i % 3}"
    chunk = PrefixChunk(
        key=f"__cut__/ck/{rid}/{mid}/{seq}", rollout_id=rid, model_call_id=mid, parent_call_id=parent,
        prev_len=prev_len, weight_version=weight_version, context_ids=cids, context_routes=croutes,
        parts=pieces, routes_shape=routes_shape, chain_hash=chain, cumulative_hash=cum,
    )
    row = StagedRow(
        rollout_id=rid, model_call_id=mid, parent_call_id=parent, prev_len=prev_len, delta_len=len(ids),
        cum_len=prev_len + len(ids), weight_version=weight_version, token_ids=ids, token_mask=mask, logprobs=lps,
        routes_encoding=ROUTES_NONE if routes_shape is None else ROUTES_INT16, routed_experts=routes,
        digest=b"", chain_hash=chain, cumulative_hash=cum,
    )
    row.digest = hashing.row_digest(row)
    return chunk, row


def _assert_byte_identical(got: PackedBatch, want: PackedBatch) -> None:
    assert sorted(got.fields) == sorted(want.fields)
    for name, w in want.fields.items():
        g = got.fields[name]
        assert g.values.dtype == w.values.dtype, name
        assert g.values.shape == w.values.shape, name
        assert g.values.tobytes() == w.values.tobytes(), name
        assert g.offsets.dtype == w.offsets.dtype and np.array_equal(g.offsets, w.offsets), name
        assert (g.present is None) == (w.present is None), name
        if w.present is not None:
            assert np.array_equal(g.present, w.present), name


def _pack_both(pairs):
    chunks, rows = [c for c, _ in pairs], [r for _, r in pairs]
    return chunks, rows, pack_chunks(chunks), pack_rows(rows)


@pytest.mark.parametrize("routes_shape", [None, (4, 2)], ids=["no-routes", "routes"])
def test_pack_chunks_byte_identical_to_pack_rows(routes_shape):
    rng = np.random.default_rng(7)
    pairs = [
        _chunk_and_row(rng, 0, ctx=12, parts=[5], routes_shape=routes_shape),  # first chunk: context + one piece
        _chunk_and_row(rng, 1, ctx=3, parts=[1, 7, 2], routes_shape=routes_shape, parent="call-0"),  # multi-part
        _chunk_and_row(rng, 2, ctx=0, parts=[4, 4], routes_shape=routes_shape, prev_len=15, seq=1,
                       prev_chain=b"\x11" * 32),  # later chunk: only new tokens
        _chunk_and_row(rng, 3, ctx=9, parts=[], routes_shape=routes_shape),  # cut before any generation
        _chunk_and_row(rng, 4, ctx=0, parts=[1], routes_shape=routes_shape, prev_len=40, seq=3,
                       parent="p\u00e9re", prev_chain=b"\x22" * 32),  # one token, non-ASCII parent id
    ]
    chunks, rows, got, want = _pack_both(pairs)
    assert got.keys == [c.key for c in chunks], "keyed by chunk.key, in chunk order"
    _assert_byte_identical(got, want)
    assert (ROUTES_FIELD in got.fields) == (routes_shape is not None)
    # Digests are hashed over the batch buffer's row slices: recomputed from the unpacked
    # rows they agree, and equal the digest of the independently concatenated row.
    for back, row, chunk in zip(unpack_rows(got), rows, chunks):
        assert hashing.row_digest(back) == back.digest == row.digest
        assert back.same_content(row)
        assert back.delta_len == chunk.delta_len
        # The planner's cheap estimates are those of the row the chunk packs to.
        assert chunk.nbytes == put_nbytes(back) and chunk.signature == row_signature(back)
    assert [c.to_row().digest for c in chunks] == [r.digest for r in rows]


def test_pack_chunks_single_chunk_and_empty_batch():
    rng = np.random.default_rng(1)
    for spec in (dict(ctx=0, parts=[6]), dict(ctx=6, parts=[])):  # the one-piece copy path
        chunk, row = _chunk_and_row(rng, 0, **spec)
        _assert_byte_identical(pack_chunks([chunk]), pack_rows([row]))
    empty = pack_chunks([])
    assert len(empty) == 0 and empty.keys == []
    _assert_byte_identical(empty, pack_rows([]))


_chunk_specs = st.lists(
    st.tuples(
        st.integers(0, 9),  # context tokens (0: a later chunk or an empty context)
        st.lists(st.integers(1, 12), min_size=0, max_size=4),  # generated pieces
        st.integers(0, 500),  # prev_len
        st.booleans(),  # has a parent
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None)
@given(_chunk_specs, st.sampled_from([None, (1, 1), (3, 2)]), st.integers(0, 2**32 - 1))
def test_pack_chunks_matches_pack_rows_for_any_chunks(specs, routes_shape, seed):
    rng = np.random.default_rng(seed)
    # A row holds at least one token (SPEC: delta_len > 0): an empty chunk gets one piece.
    specs = [(ctx, parts if ctx or parts else [1], prev, has_parent) for ctx, parts, prev, has_parent in specs]
    pairs = [
        _chunk_and_row(rng, i, ctx=ctx, parts=parts, routes_shape=routes_shape, prev_len=prev,
                       parent=f"c{i}" if has_parent else None, prev_chain=None if prev == 0 else bytes(32), seq=i)
        for i, (ctx, parts, prev, has_parent) in enumerate(specs)
    ]
    chunks, rows, got, want = _pack_both(pairs)
    _assert_byte_identical(got, want)
    for back, row in zip(unpack_rows(got), rows):
        assert hashing.row_digest(back) == row.digest == back.digest
    # Each token copied once, into buffers nobody else holds.
    _assert_no_aliasing(got, chunks)


def _inputs(chunk: PrefixChunk) -> list[np.ndarray]:
    arrays = [a for a in (chunk.context_ids, chunk.context_routes) if a is not None]
    for p in chunk.parts:
        arrays += [a for a in p if a is not None]
    return arrays


def _assert_no_aliasing(batch: PackedBatch, chunks) -> None:
    for name, f in batch.fields.items():
        for c in chunks:
            for a in _inputs(c):
                assert not np.shares_memory(f.values, a), f"{name} aliases an input piece of {c.key}"


@pytest.mark.parametrize("routes_shape", [None, (2, 2)])
def test_pack_chunks_copies_each_token_once(routes_shape):
    for n_chunks in (1, 2):  # one chunk of one piece: the out[...] = piece path
        rng = np.random.default_rng(3)
        pairs = [_chunk_and_row(rng, 0, ctx=0, parts=[8], routes_shape=routes_shape),
                 _chunk_and_row(rng, 1, ctx=4, parts=[2, 3], routes_shape=routes_shape)][:n_chunks]
        chunks, rows, got, _ = _pack_both(pairs)
        _assert_no_aliasing(got, chunks)
        # So the decoder may reuse (or the cut roll back into) its pieces: the batch is unchanged.
        before = {n: f.values.copy() for n, f in got.fields.items()}
        for c in chunks:
            for a in _inputs(c):
                a[...] = 0
        for n, f in got.fields.items():
            assert f.values.tobytes() == before[n].tobytes(), n
        assert [hashing.row_digest(r) for r in unpack_rows(got)] == [r.digest for r in rows]


def _bad_chunk(**over):
    """A valid one-piece chunk with fields replaced by ``over``."""
    ids, lps = np.arange(5, dtype="<i8"), np.full(5, -0.5, "<f4")
    kw = dict(key="__cut__/ck/r/c/0", rollout_id="r", model_call_id="c", parent_call_id=None, prev_len=0,
              weight_version=0, context_ids=None, context_routes=None, parts=[(ids, lps, None)], routes_shape=None,
              chain_hash=bytes(HASH_BYTES), cumulative_hash=bytes(HASH_BYTES))
    kw.update(over)
    return PrefixChunk(**kw)


_I8, _F4 = np.arange(5, dtype="<i8"), np.full(5, -0.5, "<f4")
_R = np.zeros((5, 2, 2), "<i2")


@pytest.mark.parametrize(
    "over, match",
    [
        (dict(parts=[(_I8, _F4[:4], None)]), r"parts\[0\] logprobs has 4 tokens, its ids 5"),
        (dict(parts=[(_I8[:2], _F4[:2], None), (_I8, _F4[:3], None)]), r"parts\[1\] logprobs has 3 tokens"),
        (dict(parts=[(_I8.astype("<i4"), _F4, None)]), r"parts\[0\] ids must be 1-d <i8, got <i4\[5\]"),
        (dict(parts=[(_I8.astype("<f8"), _F4, None)]), r"ids must be 1-d <i8, got <f8"),
        (dict(parts=[(_I8, _F4.astype("<f8"), None)]), r"logprobs must be 1-d <f4, got <f8"),
        (dict(parts=[(_I8.reshape(5, 1), _F4, None)]), r"ids must be 1-d <i8, got <i8\[5, 1\]"),
        (dict(parts=[(_I8.tolist(), _F4, None)]), r"ids must be 1-d <i8, got list"),
        (dict(parts=[(_I8, _F4)]), r"parts\[0\] must be an \(ids, logprobs, routes\) tuple"),
        (dict(context_ids=_I8.astype("<i4")), r"context_ids must be 1-d <i8"),
        (dict(parts=[(_I8, _F4, _R)]), r"routes given but routes_shape is None"),
        (dict(routes_shape=(2, 2)), r"parts\[0\] routes must be <i2\[5, 2, 2\], got NoneType"),
        (dict(routes_shape=(2, 3), parts=[(_I8, _F4, _R)]), r"routes must be <i2\[5, 2, 3\], got <i2\[5, 2, 2\]"),
        (dict(routes_shape=(2, 2), parts=[(_I8, _F4, _R.astype("<i4"))]), r"routes must be <i2"),
        (dict(routes_shape=(2, 2), parts=[(_I8, _F4, _R)], context_ids=_I8[:3], context_routes=_R),
         r"context_routes must be <i2\[3, 2, 2\], got <i2\[5, 2, 2\]"),
        (dict(routes_shape=(2,)), r"routes_shape must be \(layers, top_k\)"),
        (dict(chain_hash=bytes(31)), r"chain_hash must be 32 bytes, got bytes of length 31"),
        (dict(cumulative_hash="0" * 32), r"cumulative_hash must be 32 bytes, got str"),
    ],
)
def test_bad_chunk_input_is_a_typed_error_naming_the_piece(over, match):
    with pytest.raises(InvalidChunk, match=match) as info:
        _bad_chunk(**over)
    assert "__cut__/ck/r/c/0" in str(info.value), "the error names the chunk"
    assert isinstance(info.value, ValueError), "a TokenCaptureError (ValueError) like the other bad-input errors"


def test_hash_lengths_are_checked_per_chunk_not_per_batch():
    # 31 + 33 bytes join to 2 x 32: a per-batch length check alone would shift every hash.
    with pytest.raises(InvalidChunk, match="chain_hash"):
        _bad_chunk(chain_hash=bytes(33))
    chunks = [_bad_chunk(key=f"__cut__/ck/r{i}/c/0", rollout_id=f"r{i}") for i in range(2)]
    assert len(pack_chunks(chunks)) == 2
    chunks[0].chain_hash, chunks[1].chain_hash = bytes(31), bytes(33)  # changed after construction
    with pytest.raises(InvalidChunk, match=r"__cut__/ck/r0/c/0: chain_hash and cumulative_hash must be 32 bytes"):
        pack_chunks(chunks)


def test_mixed_routes_shapes_in_one_batch_are_refused():
    rng = np.random.default_rng(0)
    a, _ = _chunk_and_row(rng, 0, ctx=2, parts=[3], routes_shape=(2, 2))
    b, _ = _chunk_and_row(rng, 1, ctx=2, parts=[3], routes_shape=None)
    with pytest.raises(InvalidChunk, match="share a routes shape"):
        pack_chunks([a, b])


def test_chunks_continue_chain_and_cumulative_hashes_across_cuts():
    """Three cuts of one call (multi-piece chunks, a rolled-back freeze in between), then a
    resumed copy of the call: every packed chunk chains onto the previous one, and its
    cumulative hash covers the prefix through it."""
    from pipeline.generation.call_buffer import CallBuffer  # plain Python; the module lives in pipeline/
    from tasks.cut.prefix import verify_prefix

    rng = np.random.default_rng(11)
    rs = (2, 2)
    ctx_ids, _, ctx_routes = _piece(rng, 7, rs, gen=False)
    make = lambda: CallBuffer("roll", "call-1", ctx_ids, parent_call_id="call-0", weight_version=5,  # noqa: E731
                              routes_shape=rs, context_routes=ctx_routes, max_new_tokens=1000)
    buf = make()

    def gen(*sizes):
        for n in sizes:
            buf.append(*_piece(rng, n, rs))

    batches, ack = [], None

    def cut(checkpoint_id: str):
        nonlocal ack
        frozen = buf.freeze(checkpoint_id)
        batches.append(pack_chunks([frozen.chunk]))
        ack = buf.seal(frozen)

    gen(3, 4)
    cut("ck0")  # context + two pieces
    gen(1)
    buf.rollback(buf.freeze("ck1"))  # a failed put: the chunk rolls back, decoding goes on
    gen(2)
    cut("ck1")  # 1 + 2 tokens in one chunk
    gen(5, 1)
    cut("ck2")
    rows = unpack_rows(PackedBatch.concat(batches))
    assert [r.delta_len for r in rows] == [14, 3, 6] and [r.prev_len for r in rows] == [0, 14, 17]
    assert [k.rsplit("/", 1)[1] for k in ack.staging_keys] == ["0", "1", "2"]
    chain = None
    for k, r in enumerate(rows):
        assert r.chain_hash == hashing.chain_hash(chain, r.token_ids), f"chunk {k} chains onto chunk {k - 1}"
        assert r.cumulative_hash == hashing.cumulative_hash(np.concatenate([x.token_ids for x in rows[: k + 1]]))
        assert r.digest == hashing.row_digest(r)
        assert r.parent_call_id == "call-0" and r.weight_version == 5 and r.cum_len == r.prev_len + r.delta_len
        chain = r.chain_hash
    out = buf.output()
    for name in ("token_ids", "token_mask", "logprobs", "routed_experts"):
        joined = np.concatenate([getattr(r, name) for r in rows])
        assert joined.tobytes() == out[name].tobytes(), name
    verdict = verify_prefix(PackedBatch.concat(batches), ack, routes_shape=rs)
    assert verdict.usable, (verdict.reason, verdict.detail)

    # A resumed call (restored from those chunks) continues the same chain: its next chunk
    # packs byte-identical to the uninterrupted call's.
    resumed = make()
    n_ctx = len(ctx_ids)
    resumed.restore_prefix(out["token_ids"][n_ctx:], out["logprobs"][n_ctx:], out["routed_experts"][n_ctx:],
                           ack.staging_keys, [r.delta_len for r in rows], expected_digest=ack.prefix_digest)
    new = _piece(rng, 4, rs)
    buf.append(*new)
    resumed.append(*new)
    a, b = pack_chunks([buf.freeze("ck3").chunk]), pack_chunks([resumed.freeze("ck3").chunk])
    _assert_byte_identical(a, b)
    (nxt,) = unpack_rows(a)
    assert nxt.prev_len == 23 and nxt.chain_hash == hashing.chain_hash(chain, new[0])
    assert nxt.cumulative_hash == hashing.cumulative_hash(np.concatenate([out["token_ids"], new[0]]))


def test_a_trusted_durable_ack_is_the_one_the_constructor_makes():
    # CallAck.durable_prefix skips the constructor's checks (a cut makes one per call):
    # every field, equality, hash and pickling must still be the constructor's.
    import dataclasses
    import pickle

    from tasks.cut.receipt import DURABLE_PREFIX, CallAck

    fast = CallAck.durable_prefix("r", "c", ("__cut__/ck/r/c/0",), 5, b"d" * 32, 3)
    made = CallAck("r", "c", DURABLE_PREFIX, ("__cut__/ck/r/c/0",), 5, b"d" * 32, digest_version=3)
    assert set(vars(fast)) == {f.name for f in dataclasses.fields(CallAck)}
    assert dataclasses.asdict(fast) == dataclasses.asdict(made) and fast == made and hash(fast) == hash(made)
    assert pickle.loads(pickle.dumps(fast)) == made and fast.durable
