"""The generation engine: tasks.toy.policy, tasks.toy.sampling, tasks.toy.environment, tasks.toy.rollouts.

The properties cut/restore relies on: bit-identical regeneration from the same keys,
independence from batch composition, and resume_state continuing a saved prefix exactly
as the uninterrupted call would have (also in another process).
"""
from __future__ import annotations

import numpy as np
import pytest

from tasks.toy.environment import ToolEnvironment, synthetic_prompt
from tasks.errors import TokenCaptureError
from tasks.hashing import row_digest
from tasks.toy.policy import InvalidPolicyConfig, MoEPolicy, PolicyConfig
from tasks.toy.rollouts import (
    CallState,
    InvalidCall,
    RolloutSpec,
    advance,
    call_id,
    generate_rollouts,
    make_group_specs,
    make_step_specs,
    resume_state,
    start_calls,
    start_turns,
    toy_reward,
)
from tasks.toy.sampling import STREAM_SAMPLE, integers, rollout_key, uniforms

from pipeline.actors import workers_now

CFG = PolicyConfig(vocab_size=97, hidden=16, layers=3, experts=6, top_k=2, seed=11, window=5)


@pytest.fixture(scope="module")
def policy() -> MoEPolicy:
    return MoEPolicy(CFG)


def bits(a) -> bytes:
    return np.ascontiguousarray(a).tobytes() if a is not None else b"<none>"


def same_state(a: CallState, b: CallState) -> bool:
    da, db = a.delta(0), b.delta(0)
    return all(bits(x) == bits(y) for x, y in zip(
        (da.token_ids, da.token_mask, da.logprobs, da.routed_experts),
        (db.token_ids, db.token_mask, db.logprobs, db.routed_experts),
    ))


# ---- config and weights --------------------------------------------------------------------------


def test_config_from_mapping_accepts_yaml_spelling_and_rejects_unknown():
    cfg = PolicyConfig.from_mapping({"vocab-size": 97, "hidden": 16, "layers": 3, "experts": 6, "top-k": 2, "seed": 11, "window": 5})
    assert cfg == CFG
    assert PolicyConfig.from_mapping({"top_k": 3}).top_k == 3
    with pytest.raises(InvalidPolicyConfig, match="unknown policy setting 'topk'"):
        PolicyConfig.from_mapping({"topk": 2})
    for bad in ({"top-k": 9, "experts": 8}, {"vocab-size": 1}, {"window": 0}, {"hidden": "32"}, {"layers": True}):
        with pytest.raises(InvalidPolicyConfig):
            PolicyConfig.from_mapping(bad)


def test_config_from_project_defaults():
    from pipeline import config

    cfg = PolicyConfig.from_mapping(config.get("policy"))
    p = MoEPolicy(cfg)
    assert p.routes_shape == (cfg.layers, cfg.top_k) and p.vocab_size == cfg.vocab_size


def test_weights_are_a_function_of_the_seed(policy):
    again = MoEPolicy(CFG)
    other = MoEPolicy(PolicyConfig(**{**CFG.__dict__, "seed": 12}))
    for name in ("embedding", "router", "w_in", "w_out", "unembed", "position", "slot_weight"):
        assert getattr(policy, name).equal(getattr(again, name)), name
    assert not policy.unembed.equal(other.unembed)


def test_thread_setting_never_changes_tokens_and_is_restored(policy):
    import torch

    before = torch.get_num_threads()
    win = np.arange(4 * CFG.window).reshape(4, CFG.window) % CFG.vocab_size
    args = (win, np.array([0, 9, 99, 999]), np.arange(4, dtype=np.uint64), 12)
    one = policy.decode(*args)
    assert torch.get_num_threads() == before
    torch.set_num_threads(2)
    try:
        two = MoEPolicy(PolicyConfig(**{**CFG.__dict__, "threads": 0})).decode(*args)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert bits(one.tokens) == bits(two.tokens) and bits(one.logprobs) == bits(two.logprobs)
    assert bits(one.routes) == bits(two.routes)


# ---- sampling primitives -----------------------------------------------------------------------


def test_counter_based_draws_are_pure_and_spread():
    k = rollout_key(3, "r-1")
    assert k == rollout_key(3, "r-1") and k != rollout_key(4, "r-1") and k != rollout_key(3, "r-2")
    pos = np.arange(20000)
    u = uniforms(k, STREAM_SAMPLE, pos)
    # Any subset of counters gives the same draws as the whole range: no hidden state.
    assert np.array_equal(u[[5, 17, 19999]], uniforms(k, STREAM_SAMPLE, np.array([5, 17, 19999])))
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01
    r = integers(k, STREAM_SAMPLE, pos, 10)
    assert r.min() == 0 and r.max() == 9 and np.bincount(r).min() > 1800
    with pytest.raises(ValueError):
        integers(k, 1, pos, 0)


# ---- single steps: row-local, batch-invariant ------------------------------------------------


@pytest.mark.parametrize("cfg", [CFG, PolicyConfig(), PolicyConfig(vocab_size=4099, hidden=96, experts=16, top_k=4, window=3)],
                         ids=["small", "default", "wide"])
def test_step_rows_do_not_depend_on_batch_composition(cfg):
    policy = MoEPolicy(cfg)
    rng = np.random.default_rng(0)
    B = 9
    win = rng.integers(-1, cfg.vocab_size, (B, cfg.window))
    pos = rng.integers(0, 5000, B)
    keys = np.array([rollout_key(cfg.seed, f"r{i}") for i in range(B)], dtype=np.uint64)
    full = policy.step(win, pos, keys)
    for i in range(B):
        for others in ([], [j for j in range(B) if j != i][:7], list(rng.permutation(B))):
            idx = [i] + [j for j in others if j != i]
            s = policy.step(win[idx], pos[idx], keys[idx])
            assert bits(s.tokens[0]) == bits(full.tokens[i])
            assert bits(s.logprobs[0]) == bits(full.logprobs[i])
            assert bits(s.routes[0]) == bits(full.routes[i])


def test_step_outputs_are_valid(policy):
    rng = np.random.default_rng(1)
    B = 64
    win = rng.integers(0, CFG.vocab_size, (B, CFG.window))
    s = policy.decode(win, np.arange(B) * 7, np.arange(B, dtype=np.uint64), 20)
    # Routes in the engine's compact dtype: one byte per id for these 6 experts.
    assert s.tokens.dtype == np.int64 and s.logprobs.dtype == np.float32 and s.routes.dtype == np.uint8 == policy.routes_dtype
    assert s.routes.shape == (B, 20, CFG.layers, CFG.top_k)
    assert s.tokens.min() >= 0 and s.tokens.max() < CFG.vocab_size
    assert np.isfinite(s.logprobs).all() and (s.logprobs <= 0).all()
    assert s.routes.min() >= 0 and s.routes.max() < CFG.experts
    # top-k experts of a layer are distinct.
    assert (s.routes[..., 0] != s.routes[..., 1]).all()
    # Not degenerate: many distinct tokens, most logprobs well below 0.
    assert len(np.unique(s.tokens)) > CFG.vocab_size // 2
    assert (s.logprobs < -1e-3).mean() > 0.5


def test_routes_dtype_follows_the_expert_count():
    wide = MoEPolicy(PolicyConfig(vocab_size=97, hidden=4, layers=1, experts=300, top_k=2, seed=1, window=2))
    s = wide.decode(np.zeros((1, 2), np.int64), np.array([3]), np.array([1], np.uint64), 1)
    assert wide.routes_dtype == s.routes.dtype == np.int16 and s.routes.max() < 300
    assert MoEPolicy(PolicyConfig(experts=256, top_k=2)).routes_dtype == np.uint8


def test_decode_equals_repeated_steps(policy):
    win = np.arange(3 * CFG.window).reshape(3, CFG.window) % CFG.vocab_size
    pos = np.array([5, 50, 500])
    keys = np.array([1, 2, 3], dtype=np.uint64)
    d = policy.decode(win, pos, keys, 6)
    w = win.copy()
    for t in range(6):
        s = policy.step(w, pos + t, keys)
        assert bits(s.tokens) == bits(d.tokens[:, t]) and bits(s.logprobs) == bits(d.logprobs[:, t])
        w = np.concatenate([w[:, 1:], s.tokens[:, None]], axis=1)


# ---- calls: regeneration, batch independence, resume -----------------------------------------


def open_call(policy, rid="q-0", hist_len=13, ctx_len=6, max_new=40, with_routes=True):
    rng = np.random.default_rng(abs(hash(rid)) % 2**32)
    hist = rng.integers(0, CFG.vocab_size, hist_len)
    ctx = rng.integers(0, CFG.vocab_size, ctx_len)
    return start_calls(policy, [rid], [hist], [ctx], max_new, with_routes=with_routes)[0], hist


def test_same_keys_regenerate_bit_identically(policy):
    a, _ = open_call(policy)
    b, _ = open_call(policy)
    advance(policy, [a], 40)
    for chunk in (1, 3, 7, 100):  # chunking never matters
        advance(policy, [b], chunk)
    assert b.done and same_state(a, b)
    c, _ = open_call(policy, rid="q-1")
    advance(policy, [c], 40)
    assert not np.array_equal(a.tokens, c.tokens)  # the rollout id keys the draws


def test_call_alone_equals_call_in_batch_of_seven_others(policy):
    alone, _ = open_call(policy, "solo", max_new=40)
    advance(policy, [alone], 40)
    target, _ = open_call(policy, "solo", max_new=40)
    others = [open_call(policy, f"o{i}", hist_len=3 * i, ctx_len=i + 1, max_new=10 + 7 * i)[0] for i in range(7)]
    batch = others[:3] + [target] + others[3:]
    added = advance(policy, batch, 17)
    assert added == [min(17, s.max_new_tokens) for s in batch]
    advance(policy, batch, 100)
    assert all(s.done for s in batch)
    assert same_state(alone, target)
    # Each of the others also equals its own solo run.
    for s in others:
        solo = open_call(policy, s.rollout_id, hist_len=s.prev_len, ctx_len=len(s.context), max_new=s.max_new_tokens)[0]
        advance(policy, [solo], solo.max_new_tokens)
        assert same_state(solo, s)


def test_context_routes_are_the_decoding_pass_routes(policy):
    # A context token's route is what the pass at its position routes to: the same
    # pass that would have sampled it. Check via a call whose context is a generated run.
    gen, hist = open_call(policy, "ctx", hist_len=9, ctx_len=0, max_new=12)
    advance(policy, [gen], 12)
    as_ctx = start_calls(policy, ["ctx"], [hist], [gen.tokens], 1)[0]
    assert bits(as_ctx.context_routes) == bits(gen.routes)


@pytest.mark.parametrize("with_routes", [True, False])
@pytest.mark.parametrize("n_done", [0, 1, 14, 39, 40])  # generated tokens at the cut: none, some, all
def test_resume_from_prefix_equals_uninterrupted(policy, with_routes, n_done):
    full, hist = open_call(policy, "cut-me", with_routes=with_routes)
    advance(policy, [full], 40)
    live, _ = open_call(policy, "cut-me", with_routes=with_routes)
    advance(policy, [live], n_done)
    saved = live.delta(0)  # a first cut: the whole context + what was generated so far
    assert len(saved) == len(live.context) + n_done
    resumed = resume_state(
        policy, "cut-me", hist, saved.token_ids, saved.token_mask, saved.logprobs, saved.routed_experts, 40, verify=True
    )
    assert resumed.n_generated == n_done and resumed.remaining == 40 - n_done
    # Continue in a different batch, in odd chunks.
    others = [open_call(policy, f"z{i}", max_new=30)[0] for i in range(3)]
    while not resumed.done:
        advance(policy, others + [resumed], 5)
    assert same_state(full, resumed)


def test_resume_from_history_tail_and_multi_chunk_prefix(policy):
    full, hist = open_call(policy, "tail", hist_len=50, max_new=30)
    advance(policy, [full], 30)
    live, _ = open_call(policy, "tail", hist_len=50, max_new=30)
    advance(policy, [live], 10)
    chunk1 = live.delta(0)  # first cut: context + 10 generated
    advance(policy, [live], 8)
    chunk2 = live.delta(len(chunk1))  # later cut: the new 8 generated
    assert (chunk2.token_mask == 1).all() and len(chunk2) == 8
    cat = lambda f: np.concatenate([getattr(chunk1, f), getattr(chunk2, f)])
    resumed = resume_state(
        policy, "tail", hist[-CFG.window :], cat("token_ids"), cat("token_mask"), cat("logprobs"), cat("routed_experts"), 30,
        prev_len=len(hist),
    )
    assert resumed.n_generated == 18 and resumed.position == full.prev_len + len(full.context) + 18
    advance(policy, [resumed], 30)
    assert same_state(full, resumed)


def test_handed_out_arrays_are_frozen_snapshots(policy):
    s, _ = open_call(policy, "snap", max_new=300)
    advance(policy, [s], 10)
    tok, lp, rt = s.tokens, s.logprobs, s.routes
    before = (bits(tok), bits(lp), bits(rt))
    advance(policy, [s], 290)  # grows past the first buffer several times
    assert (bits(tok), bits(lp), bits(rt)) == before and len(tok) == 10
    assert bits(s.tokens[:10]) == before[0]
    with pytest.raises(ValueError):
        tok[0] = 1  # read-only view


def test_resume_rejects_bad_prefixes(policy):
    full, hist = open_call(policy, "bad", max_new=10)
    advance(policy, [full], 10)
    d = full.delta(0)
    ok = dict(history=hist, prefix_ids=d.token_ids, prefix_mask=d.token_mask, prefix_logprobs=d.logprobs,
              prefix_routes=d.routed_experts, max_new_tokens=10)

    def reason(**over):
        with pytest.raises(InvalidCall) as e:
            resume_state(policy, "bad", **{**ok, **over})
        return e.value.reason

    assert reason(prefix_mask=d.token_mask[::-1].copy()) == "invalid_prefix"
    assert reason(prefix_logprobs=d.logprobs.astype(np.float64)) == "invalid_prefix"
    assert reason(prefix_logprobs=np.abs(d.logprobs)) == "invalid_prefix"
    assert reason(prefix_routes=d.routed_experts.astype(np.int32)) == "invalid_prefix"
    assert reason(prefix_routes=np.full_like(d.routed_experts, CFG.experts)) == "invalid_prefix"
    assert reason(max_new_tokens=9) == "invalid_prefix"
    assert reason(prefix_ids=np.where(np.arange(len(d)) == 3, CFG.vocab_size, d.token_ids)) == "invalid_token"
    assert reason(history=hist[-2:], prev_len=len(hist)) == "short_history"
    tampered = d.token_ids.copy()
    tampered[-1] = (tampered[-1] + 1) % CFG.vocab_size
    with pytest.raises(InvalidCall) as e:
        resume_state(policy, "bad", **{**ok, "prefix_ids": tampered}, verify=True)
    assert e.value.reason == "prefix_mismatch"


def test_short_history_is_refused_when_length_is_known(policy):
    with pytest.raises(InvalidCall) as e:
        start_calls(policy, ["r"], [np.arange(3)], [np.arange(2)], 4, prev_lens=[40])
    assert e.value.reason == "short_history"
    with pytest.raises(InvalidCall) as e:
        start_calls(policy, ["r"], [np.arange(3)], [np.array([CFG.vocab_size])], 4)
    assert e.value.reason == "invalid_token"
    with pytest.raises(InvalidCall) as e:
        start_calls(policy, ["a/b"], [np.arange(3)], [np.arange(2)], 4)
    assert e.value.reason == "invalid_argument"
    s = start_calls(policy, ["r"], [np.arange(3)], [np.arange(2)], 4)[0]
    with pytest.raises(InvalidCall) as e:
        advance(policy, [s, s], 1)
    assert e.value.reason == "invalid_argument"
    with pytest.raises(InvalidCall) as e:
        advance(MoEPolicy(PolicyConfig(**{**CFG.__dict__, "seed": 1})), [s], 1)
    assert e.value.reason == "policy_mismatch"
    assert isinstance(e.value, TokenCaptureError)


# ---- environment and rollouts ----------------------------------------------------------------


def test_tool_tokens_are_pure_in_seed_rollout_turn():
    env = ToolEnvironment(seed=5, vocab_size=97, tool_tokens=6)
    a = env.tool_output("r1", 2)
    assert a.dtype == np.int64 and len(a) == 6 and a.min() >= 0 and a.max() < 97
    assert np.array_equal(a, env.tool_output("r1", 2))
    assert not np.array_equal(a, env.tool_output("r1", 3))
    assert not np.array_equal(a, env.tool_output("r2", 2))
    assert not np.array_equal(a, ToolEnvironment(seed=6, vocab_size=97).tool_output("r1", 2, 6))
    many = env.tool_outputs(["r2", "r1", "r1"], [2, 2, 3], [4, 6, 0])
    assert np.array_equal(many[0], env.tool_output("r2", 2, 4))
    assert np.array_equal(many[1], a) and len(many[2]) == 0


def test_grpo_group_shape_and_rollout_structure(policy):
    specs = make_group_specs("pr7", 4, turns=3, tokens_per_turn=9, tool_tokens=4, prompt_tokens=11, vocab_size=CFG.vocab_size, seed=2)
    assert [s.rollout_id for s in specs] == ["pr7-0", "pr7-1", "pr7-2", "pr7-3"]
    assert {s.group_id for s in specs} == {"pr7"}
    assert all(np.array_equal(s.prompt_tokens, synthetic_prompt(2, "pr7", 11, CFG.vocab_size)) for s in specs)
    env = ToolEnvironment(seed=CFG.seed, vocab_size=CFG.vocab_size)
    out = generate_rollouts(policy, specs, weight_version=4)
    assert len(out) == 4
    for g, spec in zip(out, specs):
        rows, rec = g.rows, g.receipt
        assert [r.model_call_id for r in rows] == [call_id(t) for t in range(3)]
        assert [r.parent_call_id for r in rows] == [None, "call-0", "call-1"]
        assert [r.delta_len for r in rows] == [11 + 9, 4 + 9, 4 + 9]
        assert [r.prev_len for r in rows] == [0, 20, 33] and rows[-1].cum_len == 46
        assert np.array_equal(rows[0].token_ids[:11], spec.prompt_tokens)
        for t, r in enumerate(rows):
            n_ctx = 11 if t == 0 else 4
            assert (r.token_mask[:n_ctx] == 0).all() and (r.token_mask[n_ctx:] == 1).all()
            assert (r.logprobs[:n_ctx] == 0).all() and (r.logprobs[n_ctx:] < 0).all()
            assert r.routed_experts.shape == (r.delta_len, CFG.layers, CFG.top_k)
            assert r.weight_version == 4 and r.digest == row_digest(r) and r.routes_encoding == 2  # uint8: 6 experts
            if t:
                assert np.array_equal(r.token_ids[:4], env.tool_output(spec.rollout_id, t, 4))
        assert rec.rollout_id == spec.rollout_id and rec.group_id == "pr7" and not rec.poisoned
        assert [c.digest for c in rec.calls] == [r.digest for r in rows]
        assert rec.terminal_model_call_id == "call-2"
        gen = np.concatenate([r.token_ids[r.token_mask == 1] for r in rows])
        assert rec.reward == toy_reward(gen)
        assert np.array_equal(g.tokens, np.concatenate([r.token_ids for r in rows]))
    # Same prompt, different rollouts: different generations.
    assert len({g.tokens.tobytes() for g in out}) == 4


def test_rollouts_regenerate_identically_and_independently_of_the_step(policy):
    kw = dict(turns=2, tokens_per_turn=7, tool_tokens=3, prompt_tokens=5, vocab_size=CFG.vocab_size)
    step = [s for g in make_step_specs("s", 3, 3, **kw) for s in g]
    a = generate_rollouts(policy, step)
    b = generate_rollouts(policy, step[::-1])[::-1]
    c = generate_rollouts(policy, [step[4]])  # alone
    for x, y in zip(a, b):
        assert [r.digest for r in x.rows] == [r.digest for r in y.rows]
        assert all(r.same_content(s) for r, s in zip(x.rows, y.rows))
    assert [r.digest for r in c[0].rows] == [r.digest for r in a[4].rows]


def test_rollout_driven_call_by_call_with_a_cut_equals_generate_rollouts(policy):
    # What a generation actor does: start a turn, advance a bit, cut, resume, finish.
    spec = make_group_specs("act", 1, turns=2, tokens_per_turn=12, tool_tokens=3, prompt_tokens=4, vocab_size=CFG.vocab_size)[0]
    ref = generate_rollouts(policy, [spec])[0]
    env = ToolEnvironment(seed=CFG.seed, vocab_size=CFG.vocab_size)
    history = np.zeros(0, np.int64)
    for turn in range(2):
        st = start_turns(policy, env, [spec], turn, [history])[0]
        advance(policy, [st], 5)
        saved = st.delta(0)
        st = resume_state(policy, spec.rollout_id, history, saved.token_ids, saved.token_mask, saved.logprobs,
                          saved.routed_experts, spec.tokens_per_turn)
        advance(policy, [st], 100)
        d = st.delta(0)
        r = ref.rows[turn]
        assert bits(d.token_ids) == bits(r.token_ids) and bits(d.logprobs) == bits(r.logprobs)
        assert bits(d.routed_experts) == bits(r.routed_experts)
        history = np.concatenate([history, d.token_ids])


def test_bad_prompt_poisons_only_its_rollout(policy):
    good_specs = make_group_specs("ok", 2, turns=2, tokens_per_turn=4, tool_tokens=2, prompt_tokens=3, vocab_size=CFG.vocab_size)
    bad = RolloutSpec("bad-0", "bad", np.array([1, CFG.vocab_size + 5]), 2, 4, 2)
    out = generate_rollouts(policy, [good_specs[0], bad, good_specs[1]])
    assert out[1].receipt.poisoned and out[1].receipt.failure_reason.startswith("invalid_token")
    assert out[1].rows == []
    assert not out[0].receipt.poisoned and len(out[0].rows) == 2 and len(out[2].rows) == 2
    alone = generate_rollouts(policy, good_specs)
    assert [r.digest for r in alone[1].rows] == [r.digest for r in out[2].rows]


def test_rollouts_without_routes(policy):
    specs = make_group_specs("nr", 2, turns=2, tokens_per_turn=5, tool_tokens=0, prompt_tokens=3, vocab_size=CFG.vocab_size)
    out = generate_rollouts(policy, specs, with_routes=False)
    with_r = generate_rollouts(policy, specs)
    for a, b in zip(out, with_r):
        assert all(r.routes_encoding == 0 and r.routed_experts is None for r in a.rows)
        # tool_tokens=0: later deltas are generation only.
        assert a.rows[1].delta_len == 5 and (a.rows[1].token_mask == 1).all()
        assert [bits(r.token_ids) for r in a.rows] == [bits(r.token_ids) for r in b.rows]


def test_spec_validation():
    with pytest.raises(TokenCaptureError):
        RolloutSpec("a/b", "g", np.arange(3), 1, 1, 0)
    with pytest.raises(InvalidCall):
        RolloutSpec("a", "g", np.arange(3), 0, 1, 0)
    with pytest.raises(InvalidCall):
        RolloutSpec("a", "g", np.zeros(3, np.float32) + 0.5, 1, 1, 0)
    with pytest.raises(InvalidCall):
        make_group_specs("p", 0, turns=1, tokens_per_turn=1, tool_tokens=0, prompt_tokens=2, vocab_size=10)


# ---- across processes: a Dask worker regenerates the same bytes --------------------------------


def _digests_in_worker(cfg_dict, prefix):
    from tasks.toy.policy import MoEPolicy, PolicyConfig
    from tasks.toy.rollouts import generate_rollouts, make_step_specs

    p = MoEPolicy(PolicyConfig(**cfg_dict))
    specs = [s for g in make_step_specs(prefix, 2, 2, turns=2, tokens_per_turn=6, tool_tokens=2, prompt_tokens=4, vocab_size=cfg_dict["vocab_size"]) for s in g]
    return [[r.digest for r in g.rows] for g in generate_rollouts(p, specs)]


def test_worker_process_regenerates_bit_identically(policy):
    from distributed import Client, LocalCluster

    local = _digests_in_worker(CFG.__dict__, "x")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        workers = list(workers_now(client))
        futures = [client.submit(_digests_in_worker, CFG.__dict__, "x", workers=[w], pure=False) for w in workers]
        for remote in client.gather(futures):
            assert remote == local
