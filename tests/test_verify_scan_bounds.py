"""The one-reduction range scans of the verifier's pre-scans give the per-row rules' verdicts.

Token ids and expert ids are range-checked batch-wide with a single ``max`` over the
buffer viewed unsigned (a negative value reads as a huge one); a terminal row the content
pre-scan cleared skips the whole-row mask scan. Each shortcut against the per-token
reference verifier, on rows re-signed so that only the range rule can catch them.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rollout_factory import VOCAB, fetch, make_rollout, resign

from tasks import reasons as R
from tasks.finalize.plan import plan_step
from tasks.finalize.reference import reference_verify_rollout
from tasks.finalize.tables import _all_below, _scan_all_valid
from tasks.finalize.verify import verify_many

E = 6


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(["i1", "i2", "<i4", ">i2", "i8"]),
    st.lists(st.integers(-(2**7), 2**7 - 1), min_size=1, max_size=6),
    st.integers(-3, 2**16),
)
def test_all_below_is_min_max_range(dtype, values, bound):
    v = np.array(values, dtype=dtype)
    assert _all_below(v, bound) == bool(v.min() >= 0 and v.max() < bound)


@pytest.mark.parametrize("bad", [-1, -(2**63), VOCAB, 2**62])
def test_token_scan_rejects_out_of_range_ids(bad):
    ids = np.arange(8, dtype=np.int64) % VOCAB
    mask = np.r_[np.zeros(3), np.ones(5)].astype(np.float32)
    lps = np.where(mask == 1.0, -0.5, 0.0).astype(np.float32)
    assert _scan_all_valid(ids, mask, lps, VOCAB) is not None
    ids[4] = bad
    assert _scan_all_valid(ids, mask, lps, VOCAB) is None


def _verdicts(builts, num_experts):
    step = plan_step([b.receipt for b in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    got = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=num_experts, views=True)
    want = [reference_verify_rollout(p, rows, routes, vocab_size=VOCAB, num_experts=num_experts) for p in step.rollouts]
    assert all(r.detail for r in got if not r.ok)
    return [r.status for r in got], [r.status for r in want]  # the reference gives no details


@pytest.mark.parametrize("enc,bad", [(1, -1), (1, -(2**15)), (1, E), (1, 2**15 - 1), (2, E), (2, 255)])
def test_expert_range_scan_rejects_like_the_reference(enc, bad):
    # int16 routes (encoding 1) span negatives; uint8 routes (2) can only exceed the range.
    rng = np.random.default_rng(7)
    builts = [make_rollout(rng, f"r{k}", n_calls=3, routes=(2, 2, E), routes_encoding=enc) for k in range(3)]

    def poke(rows):
        r = rows[sorted(rows)[1]]
        r.routed_experts = r.routed_experts.copy()
        r.routed_experts[0, 1, 0] = bad

    builts[1] = resign(builts[1], poke)
    got, want = _verdicts(builts, E)
    assert got == want
    assert got == [R.OK, R.INVALID_ROUTES, R.OK]


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_token_range_scan_rejects_like_the_reference(bad):
    rng = np.random.default_rng(8)
    builts = [make_rollout(rng, f"r{k}", n_calls=3) for k in range(3)]

    def poke(rows):
        r = rows[sorted(rows)[0]]
        r.token_ids = r.token_ids.copy()
        r.token_ids[0] = bad

    builts[2] = resign(builts[2], poke)
    got, want = _verdicts(builts, None)
    assert got == want and got[:2] == [R.OK, R.OK] and got[2] != R.OK


def test_terminal_without_generated_token_still_rejected_like_the_reference():
    # The terminal's mask all zeros: the pre-scan does not clear it, so the row's rules run.
    rng = np.random.default_rng(9)
    builts = [make_rollout(rng, f"r{k}", n_calls=2) for k in range(2)]

    def zero(rows):
        for r in rows.values():
            r.token_mask = np.zeros_like(r.token_mask)
            r.logprobs = np.zeros_like(r.logprobs)

    builts[0] = resign(builts[0], zero)
    got, want = _verdicts(builts, None)
    assert got == want and got[0] != R.OK and got[1] == R.OK
