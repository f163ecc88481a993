"""The verifier's fast paths give the verdicts and rows of its checked paths.

- the whole-buffer content pre-scan (reductions + 1 -> 0 steps) against the per-row rules;
- training rows carved from one output arena: right values, never a view of the batch,
  writable, independent of each other;
- ``views=True`` (the finalize graph): the same verdicts and rows, as views of the batch.
"""
from __future__ import annotations

import contextlib

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import reasons as R
from tasks.finalize import tables as verify
from tasks.finalize.linearize import OutputArena, row_bytes
from tasks.finalize.plan import plan_step
from tasks.validation import check_logprobs, check_mask, check_tokens
from tasks.finalize.tables import _scan_all_valid, _zeros_then_ones
from tasks.finalize.verify import verify_many
from tasks.finalize.reference import reference_verify_rollout
from rollout_factory import VOCAB, fetch, make_rollout
from test_verify import same_rows


@contextlib.contextmanager
def scan_chunk(n: int):
    old = verify._SCAN_CHUNK
    verify._SCAN_CHUNK = n
    try:
        yield
    finally:
        verify._SCAN_CHUNK = old


def _rows_reference(off, ids, mask, lps, vocab):
    """Per row: do the mask, token and logprob rules hold (the named checks)?"""
    out = []
    for s, e in zip(off[:-1], off[1:]):
        m, t, lp = mask[s:e], ids[s:e], lps[s:e]
        out.append(e > s and not (check_mask(m) or check_tokens(t, vocab) or check_logprobs(lp, m)))
    return np.array(out, dtype=bool)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=8),
    st.lists(st.integers(0, 10**6), max_size=3),
    st.integers(0, 3),
    st.sampled_from([1, 2, 3, 7, 1 << 15]),
)
def test_zeros_then_ones_matches_per_row_rule(shapes, flips, gap, chunk):
    # Rows of zeros-then-ones (some empty, some all-zero), a few mask values flipped to
    # break the order, optional unused elements after the last row.
    mask = np.concatenate([np.r_[np.zeros(z), np.ones(o)] for z, o in shapes] + [np.ones(gap)]).astype(np.float32)
    for f in flips:
        if mask.size:
            mask[f % mask.size] = 1.0 - mask[f % mask.size]
    lengths = [z + o for z, o in shapes]
    off = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    ids = np.zeros(mask.size, np.int64)
    lps = np.where(mask == 1.0, -0.5, 0.0).astype(np.float32)
    with scan_chunk(chunk):  # small chunks: steps across chunk edges are found too
        drops = _scan_all_valid(ids, mask, lps, 10)
    assert drops is not None
    got = _zeros_then_ones(off, mask, drops)
    assert got.tolist() == _rows_reference(off, ids, mask, lps, 10).tolist()


def test_arena_rows_are_values_not_views():
    rng = np.random.default_rng(3)
    builts = [make_rollout(rng, f"r{k}", n_calls=3, n_branches=0, gen_len=(2, 9), ctx_len=(0, 3), routes=(2, 2, 6)) for k in range(4)]
    step = plan_step([b.receipt for b in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    got = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=6)
    assert all(r.status == R.OK for r in got)
    arrays = [a for r in got for a in (r.linearized.input_ids, r.linearized.token_mask, r.linearized.logprobs, r.linearized.routed_experts)]
    for a in arrays:
        assert a.flags.writeable and a.flags.c_contiguous
        for f in list(rows.fields.values()) + list(routes.fields.values()):
            assert not np.shares_memory(a, f.values)
    for k, a in enumerate(arrays):
        for b in arrays[k + 1 :]:
            assert not np.shares_memory(a, b)
    # Writing one row leaves the others and the batch as they were.
    before = [a.copy() for a in arrays]
    arrays[0][:] = 0
    assert all(np.array_equal(a, b) for a, b in zip(arrays[1:], before[1:]))
    for plan, res in zip(step.rollouts[1:], got[1:]):
        assert same_rows(res.linearized, reference_verify_rollout(plan, rows, routes, vocab_size=VOCAB, num_experts=6).linearized)


def test_rows_as_views_give_the_same_verdicts_and_rows():
    """``views=True`` (the finalize graph owns its fetched rows): the same verdicts and bit-
    identical rows as the copying path, the rows of back-to-back calls views of the batch."""
    from dataclasses import replace

    from tasks.toy.tamper import TAMPER_KINDS, tamper

    rng = np.random.default_rng(4)
    builts = [make_rollout(rng, f"v{k}", n_calls=3, n_branches=1, routes=(2, 2, 6)) for k in range(6)]
    for k, kind in enumerate(k for k in TAMPER_KINDS if k != R.WRONG_GROUP):
        b = make_rollout(rng, f"t{k}", n_calls=3, n_branches=0, routes=(2, 2, 6))
        t = tamper(kind, b.rows, b.receipt, other_group="elsewhere")
        builts.append(replace(b, rows=list(t.rows), receipt=t.receipt))
    step = plan_step([b.receipt for b in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    copied = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=6)
    viewed = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=6, views=True)
    assert [(r.status, r.detail) for r in copied] == [(r.status, r.detail) for r in viewed]
    assert any(r.status != R.OK for r in viewed) and any(r.status == R.OK for r in viewed)
    for a, b in zip(copied, viewed):
        assert same_rows(a.linearized, b.linearized)
        if b.status == R.OK:
            assert np.shares_memory(b.linearized.input_ids, rows.fields["token_ids"].values)
            assert not np.shares_memory(a.linearized.input_ids, rows.fields["token_ids"].values)


def test_arena_slot_overflow_falls_back():
    arena = OutputArena([row_bytes(4), 0])
    take = arena.alloc(0)
    a = take((4,), np.int64)
    assert np.shares_memory(a, arena.buf)
    big = take((1000,), np.int64)  # past the slot: its own allocation
    assert big.shape == (1000,) and not np.shares_memory(big, arena.buf)
    empty_slot = arena.alloc(1)((3,), np.float32)
    assert empty_slot.shape == (3,) and not np.shares_memory(empty_slot, arena.buf)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(0, 10**6),
    st.sampled_from(["none", "id_neg", "id_vocab", "mask_half", "mask_neg_zero", "lp_nan", "lp_inf", "lp_ninf", "lp_pos", "lp_ctx"]),
    st.sampled_from([1, 4, 1 << 15]),
)
def test_whole_buffer_scan_clears_only_valid_buffers(n, at, bad, chunk):
    rng = np.random.default_rng(at)
    ids = rng.integers(0, 10, n).astype(np.int64)
    mask = (rng.random(n) < 0.5).astype(np.float32)
    lps = np.where(mask == 1.0, -rng.random(n), 0.0).astype(np.float32)
    k = at % n
    if bad == "id_neg":
        ids[k] = -1
    elif bad == "id_vocab":
        ids[k] = 10
    elif bad == "mask_half":
        mask[k] = 0.5
    elif bad == "mask_neg_zero":  # -0.0 == 0.0: still a valid context position
        mask[k], lps[k] = -0.0, 0.0
    elif bad.startswith("lp_"):
        value = {"lp_nan": np.nan, "lp_inf": np.inf, "lp_ninf": -np.inf, "lp_pos": 0.25, "lp_ctx": -0.5}[bad]
        if bad == "lp_ctx":
            mask[k] = 0.0
        lps[k] = value
    per_element_ok = bool(
        np.all((ids >= 0) & (ids < 10))
        and np.all((mask == 0.0) | (mask == 1.0))
        and np.all(np.isfinite(lps) & (lps <= 0.0))
        and not np.any((mask == 0.0) & (lps != 0.0))
    )
    with scan_chunk(chunk):
        got = _scan_all_valid(ids, mask, lps, 10)
    assert (got is not None) == per_element_ok
    if got is not None:  # exactly the 1 -> 0 steps
        assert got.tolist() == [p for p in range(n - 1) if mask[p] == 1.0 and mask[p + 1] == 0.0]
