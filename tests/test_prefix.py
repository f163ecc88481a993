"""tasks/prefix.py: a restored cut prefix is verified before a call resumes from it.

Good prefixes are built by the real cut code (pipeline.generation.cut.CallBuffer: freeze,
seal), so this also pins the verifier to the cut side's row format. Every bad case is a
rejection with a reason, never an exception.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipeline.generation.call_buffer import CallBuffer
from tasks import hashing
from tasks.cut.receipt import prefix_digest
from tasks.packed import PackedBatch, pack_rows
from tasks.cut.prefix import (
    EMPTY_PREFIX,
    INVALID_CONTINUATION,
    PREFIX_DIGEST_MISMATCH,
    PREFIX_LENGTH_MISMATCH,
    PREFIX_OUT_OF_ORDER,
    Continuation,
    parse_cut_key,
    verify_prefix,
)

VOCAB = 512
L, K, E = 2, 2, 8


def cut_prefix(rollout="r0", call="c0", *, chunks=(5, 3, 4), context=6, routes=False, seed=0, big_token=None,
               digest_version=hashing.DIGEST_VERSION, routes_dtype=np.int16):
    """Cut a call ``len(chunks)`` times (chunk i adds chunks[i] generated tokens), hashed
    with ``digest_version``; routes (int16 ids handed over) kept as ``routes_dtype``.

    Returns (rows in chain order as a PackedBatch, the last CallAck, the buffer).
    """
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, VOCAB, context)
    kw = {}
    if routes:
        kw = dict(routes_shape=(L, K), context_routes=rng.integers(0, E, (context, L, K)).astype(np.int16), routes_dtype=routes_dtype)
    buf = CallBuffer(rollout, call, ctx, parent_call_id="p0", weight_version=3, digest_version=digest_version, **kw)
    rows, ack = [], None
    for i, n in enumerate(chunks):
        ids = rng.integers(0, VOCAB, n)
        if big_token is not None and i == 1:
            ids[0] = big_token
        lps = -rng.random(n).astype(np.float32)
        r = rng.integers(0, E, (n, L, K)).astype(np.int16) if routes else None
        buf.append(ids, lps, r)
        frozen = buf.freeze(f"ckpt-{i}")
        ack = buf.seal(frozen)
        rows.append(frozen.row)
    batch = pack_rows(rows)
    batch.keys = list(ack.staging_keys)
    return batch, ack, buf


def rebuild(batch: PackedBatch, i: int, **changes) -> PackedBatch:
    """Row i replaced by a modified copy (token arrays may be swapped), re-packed."""
    from tasks.packed import unpack_rows

    rows = unpack_rows(batch)
    rows[i] = dataclasses.replace(rows[i], **changes)
    out = pack_rows(rows)
    out.keys = list(batch.keys)
    return out


def test_good_prefix_is_usable_and_resumable():
    batch, ack, buf = cut_prefix()
    v = verify_prefix(batch, ack, vocab_size=VOCAB)
    assert v.usable and v.reason is None, v
    p = v.prefix
    out = buf.output()
    np.testing.assert_array_equal(p.token_ids, out["token_ids"])
    np.testing.assert_array_equal(p.token_mask, out["token_mask"])
    np.testing.assert_array_equal(p.logprobs, out["logprobs"])
    assert p.tokens == ack.prefix_tokens == 6 + 12
    assert p.context_tokens == 6
    assert p.chunk_lengths == (11, 3, 4)
    assert p.keys == ack.staging_keys and p.prefix_digest == ack.prefix_digest
    assert p.parent_call_id == "p0" and p.weight_version == 3
    kw = p.resume_kwargs()
    assert kw["chunk_lengths"] == [11, 3, 4] and kw["expected_digest"] == ack.prefix_digest
    # The cut side accepts exactly what we hand back.
    fresh = CallBuffer("r0", "c0", p.token_ids[: p.context_tokens], parent_call_id="p0")
    fresh.restore_prefix(p.token_ids[p.context_tokens :], p.logprobs[p.context_tokens :], None,
                         kw["prefix_keys"], kw["chunk_lengths"], kw["expected_digest"])
    assert fresh.cut_keys == list(ack.staging_keys)


@pytest.mark.parametrize("dtype,field,encoding", [(np.int16, "routed_experts", 1), (np.uint8, "routed_experts_u8", 2)])
def test_good_prefix_with_routes(dtype, field, encoding):
    batch, ack, buf = cut_prefix(routes=True, routes_dtype=dtype)
    assert set(batch.fields["routes_encoding"].values.tolist()) == {encoding} and field in batch.fields
    v = verify_prefix(batch, ack, vocab_size=VOCAB, num_experts=E, routes_shape=(L, K))
    assert v.usable, v
    np.testing.assert_array_equal(v.prefix.routed_experts, buf.output()["routed_experts"])
    assert v.prefix.routed_experts.dtype == dtype and "routed_experts" in v.prefix.arrays()
    # A call resumed from it keeps the prefix's routes dtype, and refuses ids it cannot hold.
    p = v.prefix
    fresh = CallBuffer("r0", "c0", p.token_ids[: p.context_tokens], parent_call_id="p0", routes_shape=(L, K),
                       context_routes=p.routed_experts[: p.context_tokens], routes_dtype=p.routed_experts.dtype)
    fresh.restore_prefix(p.token_ids[p.context_tokens :], p.logprobs[p.context_tokens :], p.routed_experts[p.context_tokens :],
                         list(p.keys), list(p.chunk_lengths), p.prefix_digest)
    fresh.append(np.array([1]), np.array([-0.5], np.float32), np.zeros((1, L, K), np.int64))
    assert fresh.output()["routed_experts"].dtype == dtype
    if dtype == np.uint8:
        from tasks.errors import InvalidCall

        with pytest.raises(InvalidCall, match="expert ids outside uint8"):
            fresh.append(np.array([1]), np.array([-0.5], np.float32), np.full((1, L, K), 256, np.int16))


def test_a_prefix_mixing_routes_encodings_is_refused():
    # Chunks of one call share a routes encoding: an int16 chunk after uint8 ones is refused.
    a, ack, _ = cut_prefix(routes=True, routes_dtype=np.uint8)
    b, _, _ = cut_prefix(routes=True, routes_dtype=np.int16)  # the same tokens and ids, as int16
    from tasks.packed import unpack_rows

    mixed = pack_rows(unpack_rows(a)[:2] + unpack_rows(b)[2:])  # every row's own digest holds
    mixed.keys = list(a.keys)
    v = verify_prefix(mixed, ack)
    assert v.reason == "invalid_routes" and "chunk 0's is 2" in v.detail, v


def test_continuation_from_dict_and_single_chunk():
    batch, ack, _ = cut_prefix(chunks=(4,))
    d = {"staging_keys": list(ack.staging_keys), "prefix_tokens": ack.prefix_tokens, "prefix_digest": ack.prefix_digest}
    assert verify_prefix(batch, d).usable
    assert Continuation.of(d) == Continuation(ack.staging_keys, ack.prefix_tokens, ack.prefix_digest)


@pytest.mark.parametrize("v", [1, 2, 3])
def test_prefix_of_every_digest_version_verifies_and_a_resumed_call_keeps_it(v):
    batch, ack, _ = cut_prefix(digest_version=v)
    assert ack.digest_version == v and set(batch.fields["digest_version"].values.tolist()) == {v}
    verdict = verify_prefix(batch, ack, vocab_size=VOCAB)
    assert verdict.usable and verdict.prefix.digest_version == v, verdict
    p = verdict.prefix
    # Resumed (as GenerationWorker.resume_call does it): the next chunk continues in version v.
    buf = CallBuffer("r0", "c0", p.token_ids[: p.context_tokens], parent_call_id=p.parent_call_id,
                     weight_version=p.weight_version, digest_version=p.digest_version)
    n = p.context_tokens
    buf.restore_prefix(p.token_ids[n:], p.logprobs[n:], None, p.keys, p.chunk_lengths, p.prefix_digest)
    buf.append(np.arange(4), np.full(4, -0.5, np.float32))
    frozen = buf.freeze("ckpt-resumed")
    ack2 = buf.seal(frozen)
    from tasks.packed import unpack_rows

    both = pack_rows(unpack_rows(batch) + [frozen.row])
    both.keys = list(ack2.staging_keys)
    again = verify_prefix(both, ack2, vocab_size=VOCAB)
    assert again.usable and again.prefix.digest_version == ack2.digest_version == v, again


def test_a_prefix_mixing_digest_versions_is_refused():
    from tasks.packed import unpack_rows

    sha, ack, _ = cut_prefix(digest_version=1)
    blake, _, _ = cut_prefix(digest_version=2)  # same seed: the same tokens, hashed with BLAKE3
    rows = unpack_rows(sha)
    rows[1] = unpack_rows(blake)[1]
    mixed = pack_rows(rows)
    mixed.keys = list(sha.keys)
    v = verify_prefix(mixed, ack)
    assert (v.usable, v.reason) == (False, "invalid_staging_row") and "one algorithm" in v.detail
    # The continuation names its version: SHA-256 rows under a BLAKE3 continuation are refused.
    v = verify_prefix(sha, dataclasses.replace(ack, digest_version=2))
    assert (v.usable, v.reason) == (False, "invalid_staging_row") and "continuation" in v.detail
    d = dict(staging_keys=list(ack.staging_keys), prefix_tokens=ack.prefix_tokens, prefix_digest=ack.prefix_digest)
    assert verify_prefix(sha, dict(d, digest_version=7)).reason == INVALID_CONTINUATION
    # An ack that names no version (written before BLAKE3) takes the rows'.
    assert verify_prefix(sha, d).usable and verify_prefix(sha, dataclasses.replace(ack, digest_version=None)).usable


def test_tampered_token_is_corrupt_digest():
    batch, ack, _ = cut_prefix()
    batch.fields["token_ids"].values[12] ^= 1  # chunk 1 (tokens 11..13), digest left as written
    v = verify_prefix(batch, ack)
    assert (v.usable, v.reason) == (False, "corrupt_digest")
    assert ack.staging_keys[1] in v.detail


def test_tampered_and_redigested_row_breaks_the_chain():
    batch, ack, _ = cut_prefix()
    from tasks.packed import unpack_rows

    r1 = unpack_rows(batch)[1]
    ids = r1.token_ids.copy()
    ids[0] = (ids[0] + 1) % VOCAB
    forged = dataclasses.replace(r1, token_ids=ids)
    forged.digest = hashing.row_digest(forged)  # a forger can recompute the digest...
    v = verify_prefix(rebuild(batch, 1, token_ids=ids, digest=forged.digest), ack)
    assert (v.usable, v.reason) == (False, "chain_hash_mismatch")  # ...not the chain


def test_tampered_logprob_and_mask():
    batch, ack, _ = cut_prefix()
    batch.fields["logprobs"].values[-1] = 0.5
    assert verify_prefix(batch, ack).reason == "corrupt_digest"
    from tasks.packed import unpack_rows

    r2 = unpack_rows(batch)[2]
    lps = r2.logprobs.copy()
    lps[-1] = 0.5
    bad = dataclasses.replace(r2, logprobs=lps)
    bad.digest = hashing.row_digest(bad)
    good_rows, _, _ = cut_prefix()
    v = verify_prefix(rebuild(good_rows, 2, logprobs=lps, digest=bad.digest), ack)
    assert (v.usable, v.reason) == (False, "invalid_logprob")


def test_missing_row():
    batch, ack, _ = cut_prefix()
    v = verify_prefix(batch.take([0, 2]), ack)
    assert (v.usable, v.reason) == (False, "missing_staging_row")
    assert ack.staging_keys[1] in v.detail


def test_reordered_rows_and_keys():
    batch, ack, _ = cut_prefix()
    v = verify_prefix(batch.take([0, 2, 1]), ack)
    assert (v.usable, v.reason) == (False, PREFIX_OUT_OF_ORDER)
    keys = list(ack.staging_keys)
    swapped = dataclasses.replace(ack, staging_keys=(keys[0], keys[2], keys[1]))
    v = verify_prefix(batch.take([0, 2, 1]), swapped)
    assert (v.usable, v.reason) == (False, PREFIX_OUT_OF_ORDER)


def test_short_prefix_and_wrong_count():
    batch, ack, _ = cut_prefix()
    # A truncated chain (the last chunk dropped from the continuation) is short.
    short = dataclasses.replace(ack, staging_keys=ack.staging_keys[:2])
    v = verify_prefix(batch.take([0, 1]), short)
    assert (v.usable, v.reason) == (False, PREFIX_LENGTH_MISMATCH)
    v = verify_prefix(batch, dataclasses.replace(ack, prefix_tokens=ack.prefix_tokens + 1))
    assert (v.usable, v.reason) == (False, PREFIX_LENGTH_MISMATCH)


def test_wrong_prefix_digest():
    batch, ack, _ = cut_prefix()
    other = prefix_digest(np.zeros(3, dtype=np.int64))
    v = verify_prefix(batch, dataclasses.replace(ack, prefix_digest=other))
    assert (v.usable, v.reason) == (False, PREFIX_DIGEST_MISMATCH)


def test_row_of_another_call_under_this_key():
    batch, ack, _ = cut_prefix()
    theirs, _, _ = cut_prefix(rollout="r9", seed=1)
    mixed = PackedBatch.concat([batch.take([0]), theirs.take([1]), batch.take([2])])
    mixed.keys = list(ack.staging_keys)
    v = verify_prefix(mixed, ack)
    assert (v.usable, v.reason) == (False, "identity_mismatch")


def test_empty_and_malformed_continuations():
    batch, ack, _ = cut_prefix()
    assert verify_prefix(PackedBatch([], {}), {"keys": [], "prefix_tokens": 0, "prefix_digest": bytes(32)}).reason == EMPTY_PREFIX
    assert verify_prefix(batch, {"keys": list(ack.staging_keys), "prefix_tokens": 1}).reason == INVALID_CONTINUATION
    assert verify_prefix(batch, {"keys": "abc", "prefix_tokens": 1, "prefix_digest": bytes(32)}).reason == INVALID_CONTINUATION
    bad_key = dataclasses.replace(ack, staging_keys=("r0/c0",) + ack.staging_keys[1:])
    assert verify_prefix(batch, bad_key).reason == INVALID_CONTINUATION


def test_out_of_range_token_and_routes():
    batch, ack, _ = cut_prefix(big_token=VOCAB + 5)
    assert verify_prefix(batch, ack).usable  # no vocabulary given: not checked
    v = verify_prefix(batch, ack, vocab_size=VOCAB)
    assert (v.usable, v.reason) == (False, "invalid_token")
    for dtype in (np.int16, np.uint8):
        rbatch, rack, _ = cut_prefix(routes=True, routes_dtype=dtype)
        v = verify_prefix(rbatch, rack, num_experts=2)
        assert v.reason == "invalid_routes" and "outside [0, 2)" in v.detail
        no_routes = rbatch.select([n for n in rbatch.fields if not n.startswith("routed_experts")])
        assert verify_prefix(no_routes, rack).reason == "missing_routes"
    plain, pack, _ = cut_prefix()
    assert verify_prefix(plain, pack, routes_shape=(L, K)).reason == "missing_routes"


def test_absent_field_and_wrong_prev_len():
    batch, ack, _ = cut_prefix()
    v = verify_prefix(batch.select([n for n in batch.fields if n != "cumulative_hash"]), ack)
    assert (v.usable, v.reason) == (False, "invalid_staging_row")
    from tasks.packed import unpack_rows

    r2 = unpack_rows(batch)[2]
    moved = dataclasses.replace(r2, prev_len=r2.prev_len + 1, cum_len=r2.cum_len + 1)
    moved.digest = hashing.row_digest(moved)
    v = verify_prefix(rebuild(batch, 2, prev_len=moved.prev_len, cum_len=moved.cum_len, digest=moved.digest), ack)
    assert (v.usable, v.reason) == (False, "parent_length_mismatch")


def test_parse_cut_key():
    assert parse_cut_key("__cut__/k/r/c/12") == ("k", "r", "c", 12)
    for bad in ("r/c", "__cut__/k/r/c/-1", "__cut__/k/r/c/01", "__cut__/k//c/1", "__cut__/k/r/c/x"):
        with pytest.raises(ValueError):
            parse_cut_key(bad)
