"""Property tests: the vectorized verifier and the per-token reference agree everywhere.

Hypothesis draws valid rollouts (calls, delta lengths, routes, branches) and one
corruption of many kinds; the two implementations must give the same verdict for every
rollout and bitwise-identical training rows, whichever digest version (1: SHA-256, 2:
BLAKE3, 3: BLAKE3 over field digests) hashed the rollouts. Receipt parsing is held to the reference receipt rules the
same way.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tasks import reasons as R
from tasks.finalize.plan import plan_step
from tasks.finalize.verify import verify_many
from tasks.finalize.reference import reference_chain, reference_receipt_reason, reference_verify_rollout
from rollout_factory import (
    VOCAB,
    drop_key,
    drop_routes,
    fetch,
    flip_byte,
    make_rollout,
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
from test_verify import same_rows

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DIGEST_VERSIONS = st.sampled_from([1, 2, 3])

ROW_FIELDS = (
    "rollout_id", "model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
    "routes_encoding", "schema_version", "digest_version", "digest", "chain_hash", "cumulative_hash",
    "token_ids", "token_mask", "logprobs",
)
CORRUPTIONS = ("none", "flip", "flip_routes", "drop", "drop_routes", "swap", "shorten", "absent",
               "forge_content", "forge_lineage", "forge_hash")


@st.composite
def scenario(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    routed = draw(st.booleans())
    n = draw(st.integers(1, 3))
    kw = dict(
        n_calls=draw(st.integers(1, 4)),
        n_branches=draw(st.integers(0, 2)),
        gen_len=(1, draw(st.integers(1, 10))),
        ctx_len=(0, draw(st.integers(0, 4))),
        routes=(draw(st.integers(1, 3)), draw(st.integers(1, 2)), 6) if routed else None,
        digest_version=draw(DIGEST_VERSIONS),
        routes_encoding=draw(st.sampled_from([None, 1])),  # None: the gate's uint8; 1: int16
    )
    corruption = draw(st.sampled_from(CORRUPTIONS))
    pick = draw(st.integers(0, 10**6))
    byte = draw(st.integers(0, 10**6))
    bit = 1 << draw(st.integers(0, 7))
    field = draw(st.sampled_from(ROW_FIELDS))
    return seed, n, kw, corruption, pick, byte, bit, field


def _forge(rng, b, kind, pick):
    call = b.chain_ids[pick % len(b.chain_ids)]
    row = b.row(call)
    d = row.delta_len
    if kind == "forge_content":
        options = [
            set_tokens(call, pick, VOCAB + pick % 3),
            set_tokens(call, pick, -1),
            set_logprob(call, pick, float("nan")),
            set_logprob(call, pick, float(pick % 5) * 0.1),
            set_logprob(call, 0, -2.0),
            set_mask(call, [1.0] * (d - 1) + [0.0], [-0.5] * (d - 1) + [0.0]),
            set_mask(call, [0.0] * d, [0.0] * d),
            set_mask(call, [0.25] * d, [-0.1] * d),
        ]
        if row.routed_experts is not None:
            options += [set_expert(call, 6 + pick % 4), set_expert(call, -1), drop_routes(call)]
        return resign(b, options[pick % len(options)])
    if kind == "forge_lineage":
        return resign(b, shift_lengths(call, 1 + pick % 3))
    # forge_hash: content changed, one of the hashes left stale
    new = int(row.token_ids[pick % d] + 1) % VOCAB
    stale = ("chain", "cumulative", "digest")[pick % 3]
    return resign(b, set_tokens(call, pick, new), **{stale: False})


def _corrupt(rng, builts, rows, routes, corruption, pick, byte, bit, field):
    """Apply one corruption; returns (builts, rows, routes)."""
    if corruption == "none" or not len(rows):
        return builts, rows, routes
    i = pick % len(rows)
    if corruption == "flip":
        out = flip_byte(rows, field, i, byte, bit)
        return builts, (rows if out is None else out), routes
    if corruption == "flip_routes":
        if routes is None or not len(routes):
            return builts, rows, routes
        out = flip_byte(routes, next(iter(routes.fields)), pick % len(routes), byte, bit)  # its encoding's field
        return builts, rows, (routes if out is None else out)
    if corruption == "drop":
        return builts, drop_key(rows, rows.keys[i]), routes
    if corruption == "drop_routes":
        return builts, rows, (None if routes is None or pick % 2 else drop_key(routes, routes.keys[pick % len(routes)]))
    if corruption == "swap":
        return builts, swap_keys(rows, i, (i + 1 + byte) % len(rows)), routes
    if corruption == "shorten":
        name = ("token_ids", "token_mask", "logprobs")[pick % 3]
        v = rows.fields[name].row(i)
        return builts, replace_field(rows, name, i, v[: max(len(v) - 1 - byte % 3, 0)]), routes
    if corruption == "absent":
        return builts, replace_field(rows, field, i, None), routes
    j = pick % len(builts)
    builts = list(builts)
    builts[j] = _forge(rng, builts[j], corruption, byte)
    return builts, None, None


@SETTINGS
@given(scenario())
def test_vectorized_and_reference_agree(sc):
    seed, n, kw, corruption, pick, byte, bit, field = sc
    rng = np.random.default_rng(seed)
    builts = [make_rollout(rng, f"r{k}", **kw) for k in range(n)]
    step = plan_step([b.receipt for b in builts])
    assert step.rejected == {}
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    builts, rows2, routes2 = _corrupt(rng, builts, rows, routes, corruption, pick, byte, bit, field)
    if rows2 is None:  # forged: the receipt changed too, so re-plan and re-fetch
        step = plan_step([b.receipt for b in builts])
        assert step.rejected == {}
        rows2, routes2 = fetch(builts, step.staging_keys, step.routes_keys)
    num_experts = 6 if kw["routes"] else None
    got = verify_many(step.rollouts, rows2, routes2, vocab_size=VOCAB, num_experts=num_experts)
    for plan, res in zip(step.rollouts, got):
        ref = reference_verify_rollout(plan, rows2, routes2, vocab_size=VOCAB, num_experts=num_experts)
        assert res.status == ref.status, (corruption, res.detail)
        assert res.status == R.OK or R.is_reason(res.status)
        assert "internal error" not in res.detail
        assert same_rows(res.linearized, ref.linearized)
    if corruption == "none":
        assert all(r.ok for r in got)


# ---- receipts ---------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 2**65), st.floats(allow_nan=True), st.text(max_size=4),
    st.binary(max_size=40), st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
RECEIPT_FIELDS = ("rollout_id", "reward", "terminal_model_call_id", "calls", "poisoned", "failure_reason", "group_id", "version")
# Rewards around float32's range: finite in float64, some overflowing float32.
REWARDS = st.sampled_from([1e300, -1e300, 1e39, -1e39, 3.4028235e38, -3.4028235e38, 3.4028236e38, 2.0**128 - 2.0**103,
                           float(np.nextafter(2.0**128 - 2.0**103, 0)), 10**400, -(10**39), 10**38, 0.5])
GROUPS = st.sampled_from([None, "", "g", "h"])
RECORD_FIELDS = ("model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
                 "digest", "chain_hash", "cumulative_hash", "routes_encoding", "staging_key", "digest_version")


@st.composite
def receipt_scenario(draw):
    """(receipt dict, the group it is submitted in: None for a flat list)."""
    seed = draw(st.integers(0, 2**32 - 1))
    b = make_rollout(np.random.default_rng(seed), "rr", n_calls=draw(st.integers(1, 4)), n_branches=draw(st.integers(0, 2)),
                     group_id=draw(GROUPS), digest_version=draw(DIGEST_VERSIONS))
    d = receipt_dict(b)
    submitted = draw(st.sampled_from([None, "g", "h"]))
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["top", "record", "reorder", "parent", "terminal", "dup", "drop_field", "cycle",
                                     "reward", "group", "inner_terminal", "inner_terminal", "version"]))
        calls = d.get("calls")
        has_calls = isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls)
        if kind == "top":
            d[draw(st.sampled_from(RECEIPT_FIELDS))] = draw(JUNK)
        elif kind == "drop_field":
            d.pop(draw(st.sampled_from(RECEIPT_FIELDS)), None)
        elif kind == "reward":
            d["reward"] = draw(REWARDS)
        elif kind == "group":
            d["group_id"] = draw(GROUPS)
        elif not has_calls:
            continue
        elif kind == "record":
            calls[draw(st.integers(0, len(calls) - 1))][draw(st.sampled_from(RECORD_FIELDS))] = draw(JUNK)
        elif kind == "reorder":
            d["calls"] = draw(st.permutations(calls))
        elif kind == "parent":
            c = calls[draw(st.integers(0, len(calls) - 1))]
            c["parent_call_id"] = draw(st.sampled_from([None, "ghost"] + [x.get("model_call_id") for x in calls]))
        elif kind == "terminal":
            d["terminal_model_call_id"] = draw(st.sampled_from([None, "ghost"] + [x.get("model_call_id") for x in calls]))
        elif kind == "version":  # another (or no: SHA-256, or an unknown: 4) digest version on one call
            c = calls[draw(st.integers(0, len(calls) - 1))]
            v = draw(st.sampled_from([None, 1, 2, 3, 4]))
            if v is None:
                c.pop("digest_version", None)
            else:
                c["digest_version"] = v
        elif kind == "dup":
            calls.append(dict(calls[draw(st.integers(0, len(calls) - 1))]))
        elif kind == "cycle":
            calls[0]["parent_call_id"] = calls[-1].get("model_call_id")
        elif kind == "inner_terminal":  # a call that is some call's parent: not a leaf
            parents = [x.get("parent_call_id") for x in calls if x.get("parent_call_id") is not None]
            if parents:
                d["terminal_model_call_id"] = draw(st.sampled_from(parents))
    return d, submitted


@settings(max_examples=300, deadline=None)
@given(receipt_scenario())
def test_receipt_verdicts_match_reference(sc):
    d, submitted = sc
    step = plan_step([d] if submitted is None else {submitted: [d]})
    want = reference_receipt_reason(d, submitted)
    event(f"reason: {want}")
    if want is None:
        assert step.rejected == {}
        (p,) = step.rollouts
        assert [c.model_call_id for c in p.chain] == reference_chain(d)
        assert p.keys == [f"{d['rollout_id']}/{c}" for c in reference_chain(d)]
    else:
        assert step.rollouts == []
        ((reason, detail),) = step.rejected.values()
        assert reason == want, detail
