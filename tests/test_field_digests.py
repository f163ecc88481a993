"""Digest version 3 end to end through a call buffer: field digests fed as tokens arrive.

A :class:`CallBuffer` of version 3 feeds each token field's keyed digest on every append
and hands them to its frozen chunk; :func:`pack_chunks` then hashes only the small outer
layout. Every packed row must carry the digest recomputed from its own bytes
(:func:`tasks.hashing.row_digest`) and be accepted by the per-token reference verifier
(:mod:`tasks.finalize.reference`) and the cut verifier, after appends of uneven sizes,
with and without routes (int16 and uint8), across seals, rollbacks and a resumed call. A
wrong streamed field digest makes a row that fails verification, and packing a chunk that
brings its field digests reads no token byte again.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.generation.call_buffer import CallBuffer
from tasks import hashing
from tasks.cut.batching import PrefixChunk, pack_chunks
from tasks.cut.prefix import verify_prefix
from tasks.finalize.plan import RolloutPlan
from tasks.finalize.reference import reference_verify_rollout
from tasks.packed import PackedBatch, unpack_rows
from tasks.receipts import CallRecord, Receipt

VOCAB, RS = 50_000, (3, 2)
# routes: None (unrouted) or the routes dtype (int16 ids above 255, so both bytes count; uint8).
ROUTES = pytest.mark.parametrize("routes", [None, np.int16, np.uint8], ids=["no-routes", "int16", "uint8"])
EXPERTS = {np.int16: 1000, np.uint8: 256}


def make(routes, rng, ctx: int = 5, digest_version: int = 3, **kw) -> CallBuffer:
    ids = rng.integers(0, VOCAB, ctx)
    extra = {} if routes is None else dict(routes_shape=RS, routes_dtype=routes,
                                           context_routes=rng.integers(0, EXPERTS[routes], (ctx, *RS)))
    return CallBuffer("roll-fd", "call-1", ids, parent_call_id="call-0", weight_version=4,
                      digest_version=digest_version, **extra, **kw)


def piece(buf: CallBuffer, rng, n: int):
    ids = rng.integers(0, VOCAB, n)
    lps = (-rng.random(n) - 0.01).astype(np.float32)
    routes = None if buf.routes_shape is None else rng.integers(0, EXPERTS[buf.routes_dtype.type], (n, *RS))
    return ids, lps, routes


def gen(buf: CallBuffer, rng, *sizes: int) -> None:
    for n in sizes:
        buf.append(*piece(buf, rng, n))


def cut(buf: CallBuffer, checkpoint_id: str):
    """Freeze, pack and seal one chunk: (its packed batch, the ack)."""
    frozen = buf.freeze(checkpoint_id)
    assert frozen.chunk.field_digests is not None, "a version-3 buffer streams its field digests"
    batch = pack_chunks([frozen.chunk])
    return batch, buf.seal(frozen)


def reference_status(batch: PackedBatch) -> str:
    """The per-token reference's verdict on a call's chunks (in chain order) read as one
    rollout chain: each chunk's digest recomputed by hand, chained onto the previous one,
    the cumulative hash over all of them."""
    rows = unpack_rows(batch)
    records = [CallRecord(r.model_call_id, r.parent_call_id, r.prev_len, r.delta_len, r.cum_len, r.weight_version,
                          r.digest, r.chain_hash, r.cumulative_hash, r.routes_encoding, key, r.digest_version)
               for r, key in zip(rows, batch.keys)]
    receipt = Receipt(rows[0].rollout_id, 0.0, rows[-1].model_call_id, records)
    routes_keys = [k for r, k in zip(rows, batch.keys) if r.routes_encoding]
    plan = RolloutPlan(receipt, records, list(batch.keys), routes_keys, list(batch.keys))
    num_experts = None if not routes_keys else 1000
    return reference_verify_rollout(plan, batch, batch, vocab_size=VOCAB, num_experts=num_experts).status


def assert_rows_verify(batches: list[PackedBatch], ack, buf: CallBuffer) -> None:
    """Every row's stored digest is the one recomputed from its data (version 3); the
    rows join to the call's output; the reference and the cut verifier accept them."""
    batch = PackedBatch.concat(batches)
    rows = unpack_rows(batch)
    for r in rows:
        assert r.digest_version == 3
        assert r.digest == hashing.row_digest(r), f"chunk at {r.prev_len}: stored digest is not the recomputed one"
    out = buf.output()
    fields = ["token_ids", "token_mask", "logprobs"] + ([] if buf.routes_shape is None else ["routed_experts"])
    for name in fields:
        joined = np.concatenate([getattr(r, name) for r in rows])
        assert joined.tobytes() == out[name][: len(joined)].tobytes(), name
    assert reference_status(batch) == "ok"
    verdict = verify_prefix(batch, ack, routes_shape=buf.routes_shape)
    assert verdict.usable, (verdict.reason, verdict.detail)


@ROUTES
def test_chunks_of_uneven_appends_carry_their_recomputed_digest(routes):
    rng = np.random.default_rng(1)
    buf = make(routes, rng)
    gen(buf, rng, 1, 7, 3, 130, 2)
    first, ack = cut(buf, "ck0")  # context + five pieces
    gen(buf, rng, 4, 1, 1, 9)
    second, ack = cut(buf, "ck1")  # a second chunk (after a seal): no context
    gen(buf, rng, 2)
    third, ack = cut(buf, "ck2")
    rows = unpack_rows(PackedBatch.concat([first, second, third]))
    assert [r.delta_len for r in rows] == [5 + 143, 15, 2] and [r.prev_len for r in rows] == [0, 148, 163]
    assert_rows_verify([first, second, third], ack, buf)


@ROUTES
def test_a_rolled_back_freeze_keeps_the_streamed_digests_right(routes):
    rng = np.random.default_rng(2)
    buf = make(routes, rng)
    gen(buf, rng, 3, 5)
    buf.rollback(buf.freeze("ck0"))  # a failed put: the first chunk (with context) rolls back
    gen(buf, rng, 2, 1)
    first, ack = cut(buf, "ck0")
    assert unpack_rows(first)[0].delta_len == 5 + 11
    gen(buf, rng, 4)
    frozen = buf.freeze("ck1")  # a later chunk rolls back, with tokens appended meanwhile
    gen(buf, rng, 6, 2)
    buf.rollback(frozen)
    gen(buf, rng, 1)
    second, ack = cut(buf, "ck1")
    assert unpack_rows(second)[0].delta_len == 13
    assert_rows_verify([first, second], ack, buf)


@ROUTES
def test_a_resumed_call_streams_the_digests_of_its_next_chunk(routes):
    rng = np.random.default_rng(3)
    ctx_rng = np.random.default_rng(30)
    buf = make(routes, ctx_rng)
    gen(buf, rng, 6, 2)
    first, ack = cut(buf, "ck0")
    gen(buf, rng, 3)
    second, ack = cut(buf, "ck1")
    out = buf.output()
    n_ctx = out["context_tokens"]
    resumed = make(routes, np.random.default_rng(30))  # the same context
    gen_routes = None if routes is None else out["routed_experts"][n_ctx:]
    resumed.restore_prefix(out["token_ids"][n_ctx:], out["logprobs"][n_ctx:], gen_routes, ack.staging_keys,
                           [r.delta_len for r in unpack_rows(PackedBatch.concat([first, second]))],
                           expected_digest=ack.prefix_digest)
    gen(resumed, rng, 5, 1)
    third, ack = cut(resumed, "ck2")
    assert unpack_rows(third)[0].prev_len == n_ctx + 11
    assert_rows_verify([first, second, third], ack, resumed)


@ROUTES
def test_a_wrong_streamed_field_digest_makes_a_row_that_fails_verification(routes):
    rng = np.random.default_rng(5)
    buf = make(routes, rng)
    gen(buf, rng, 3, 4)
    frozen = buf.freeze("ck0")
    good = frozen.chunk
    fds = good.field_digests
    assert len(fds) == (3 if routes is None else 4)
    assert hashing.row_digest(good.to_row()) == good.to_row().digest
    for i in range(len(fds)):  # ids, mask, logprobs[, routes]
        bad_fds = tuple(bytes([f[0] ^ 0x01]) + f[1:] if j == i else f for j, f in enumerate(fds))
        bad = dataclasses.replace(good, field_digests=bad_fds)
        batch = pack_chunks([bad])
        (row,) = unpack_rows(batch)
        assert row.digest != hashing.row_digest(row), f"field {i}: the stored digest must not match the row's data"
        assert reference_status(batch) == "corrupt_digest"
    # Digests streamed for other tokens (the same context, other generated ones) too.
    other = make(routes, np.random.default_rng(5))
    gen(other, np.random.default_rng(6), 3, 4)
    elsewhere = other.freeze("ck0").chunk.field_digests
    (row,) = unpack_rows(pack_chunks([dataclasses.replace(good, field_digests=elsewhere)]))
    assert row.digest != hashing.row_digest(row)


class _Counted:
    """A hasher that counts the bytes fed to it (constructor data and updates)."""

    def __init__(self, inner, fed: list[int]):
        self._inner, self._fed = inner, fed

    def update(self, data):
        self._fed.append(memoryview(data).nbytes)
        self._inner.update(data)
        return self

    def digest(self):
        return self._inner.digest()

    def hexdigest(self):
        return self._inner.hexdigest()

    def copy(self):
        return _Counted(self._inner.copy(), self._fed)


def _counting(new, fed: list[int]):
    def make_counted(data=b"", **kw):
        fed.append(memoryview(data).nbytes)
        return _Counted(new(data, **kw), fed)

    return make_counted


@ROUTES
def test_packing_streamed_chunks_hashes_only_the_outer_layout(routes):
    rng = np.random.default_rng(7)
    bufs = [make(routes, rng, ctx=300) for _ in range(3)]
    for b in bufs:
        gen(b, rng, 1000, 17, 2000)
    chunks = [b.freeze("ck0").chunk for b in bufs]
    token_bytes = sum(c.delta_len for c in chunks) * (16 + (0 if routes is None else 6 * np.dtype(routes).itemsize))

    def pack_counted(field_digests_kept: bool) -> tuple[PackedBatch, list[int], list[int]]:
        outer, fields = [], []
        counted = []
        for c in chunks:
            ident = dataclasses.replace(c.identity, new=_counting(c.identity.new, outer),
                                        field_new=_counting(c.identity.field_new, fields))
            counted.append(dataclasses.replace(c, identity=ident, field_digests=c.field_digests if field_digests_kept else None))
        return pack_chunks(counted), outer, fields

    batch, outer, fields = pack_counted(True)
    assert fields == [], "no field digest is recomputed for a chunk that brings its own"
    # One small hash per row: the ~100-byte header, three (four) length + digest pairs and
    # the two hashes; nothing near the rows' token bytes.
    assert len(outer) == len(chunks) and max(outer) < 400, outer
    assert sum(outer) < token_bytes // 100
    for r in unpack_rows(batch):
        assert r.digest == hashing.row_digest(r)
    # The counter sees token bytes when they are hashed: the same chunks without their
    # streamed digests are hashed from the packed buffers, to the same digests.
    again, outer2, fields2 = pack_counted(False)
    assert sum(fields2) == token_bytes and sum(outer2) == sum(outer)
    assert again.fields["digest"].values.tobytes() == batch.fields["digest"].values.tobytes()


def test_a_batch_mixing_digest_versions_digests_each_row_with_its_own():
    rng = np.random.default_rng(8)
    bufs = [make(np.uint8, rng, digest_version=v) for v in (3, 2, 1, 3)]
    for b in bufs:
        gen(b, rng, 4, 9)
    frozen = [b.freeze("ck0") for b in bufs]
    assert [f.chunk.field_digests is not None for f in frozen] == [True, False, False, True]
    rows = unpack_rows(pack_chunks([f.chunk for f in frozen]))
    assert [r.digest_version for r in rows] == [3, 2, 1, 3]
    for r in rows:
        assert r.digest == hashing.row_digest(r)
