"""GRPO on the tiny HF MoE model (examples/grpo_tiny_moe.py) run as a user runs it, at
its CI size: the reward rises, route replay makes the on-policy step exact, and without
replay stale steps route differently (measured by the monitor). Plus the pieces it ships
weights and rewards with. Skipped without the ``hf`` extra."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tasks.engines.hf_moe import LOGPROB_TOLERANCE, HFMoEConfig, HFMoEEngine, generate_rollouts  # noqa: E402
from tasks.engines.weights import WeightSnapshot, fingerprint, load_engine  # noqa: E402
from tasks.errors import InvalidInput  # noqa: E402
from tasks.toy.rewards import TargetTokensReward  # noqa: E402
from tasks.toy.rollouts import make_group_specs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CFG = HFMoEConfig(layers=2, hidden=32, experts=4, top_k=2, seed=5)
SHAPE = dict(turns=2, tokens_per_turn=6, tool_tokens=2, prompt_tokens=4, vocab_size=CFG.vocab_size)


def _perturbed_model() -> torch.nn.Module:
    """The seed's model after one made-up update (what a trainer publishes)."""
    model = HFMoEEngine(CFG).model
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * torch.sin(torch.arange(p.numel(), dtype=torch.float32) + i).view_as(p))
    return model


def test_a_weight_snapshot_loads_into_an_engine_that_samples_with_it():
    model = _perturbed_model()
    snap = WeightSnapshot.of(model, 3)
    engine = load_engine(CFG, snap)
    seeded = HFMoEEngine(CFG)
    assert engine.fingerprint == snap.fingerprint != seeded.fingerprint
    ids = torch.arange(10)[None] % CFG.vocab_size
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
    got, _, _ = engine.forward(ids, use_cache=False)
    # The same weights (the fingerprint says so); other thread counts reorder float32 sums.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    specs = make_group_specs("wsnap", 2, **SHAPE)
    rows = [r for ro in generate_rollouts(engine, specs, weight_version=snap.version) for r in ro.rows]
    assert {r.weight_version for r in rows} == {3}
    # The loaded weights, not the seed's, sampled: the captured logprobs differ.
    base = [r for ro in generate_rollouts(seeded, specs) for r in ro.rows]
    assert not all(np.array_equal(a.logprobs, b.logprobs) for a, b in zip(rows, base))


def test_an_engine_fingerprints_the_weights_it_was_loaded_with():
    # load_engine builds one engine: the snapshot goes in before the fingerprint is taken.
    model = _perturbed_model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine = HFMoEEngine(CFG, load=lambda m: m.load_state_dict(state))
    assert engine.fingerprint == fingerprint(state) == load_engine(CFG, WeightSnapshot.of(model, 1)).fingerprint
    assert engine.fingerprint != HFMoEEngine(CFG).fingerprint == fingerprint(HFMoEEngine(CFG).model.state_dict())


def test_a_snapshot_of_another_model_or_altered_after_it_was_taken_is_refused():
    snap = WeightSnapshot.of(_perturbed_model(), 1)
    with pytest.raises(InvalidInput, match="does not fit the engine config"):
        load_engine(HFMoEConfig(layers=2, hidden=64, experts=4, top_k=2, seed=5), snap)
    next(iter(snap.tensors.values())).add_(1.0)
    with pytest.raises(InvalidInput, match="fingerprint"):
        load_engine(CFG, snap)
    with pytest.raises(InvalidInput, match="version"):
        WeightSnapshot.of(_perturbed_model(), -1)


def test_target_tokens_reward_is_the_fraction_below_the_bound():
    reward = TargetTokensReward(64)
    assert reward(np.array([0, 63, 64, 511])) == 0.5
    assert reward(np.zeros(0, np.int64)) == 0.0
    specs = make_group_specs("wrew", 2, **SHAPE)
    for ro in generate_rollouts(HFMoEEngine(CFG), specs, reward=reward):
        gen = np.concatenate([r.token_ids[r.token_mask > 0] for r in ro.rows])
        assert ro.receipt.reward == pytest.approx(float(np.mean(gen < 64)))
    with pytest.raises(InvalidInput, match="below"):
        TargetTokensReward(0)


def test_grpo_example_learns_and_replay_matches_the_sampler(tmp_path):
    pytest.importorskip("matplotlib")
    out_json, png = tmp_path / "grpo.json", tmp_path / "grpo.png"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "DASK_TOKEN_CAPTURE__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0",
        # One embedded worker: transformers is imported by two processes, not three.
        "DASK_TOKEN_CAPTURE__CLUSTER__N_WORKERS": "1",
        "DASK_TOKEN_CAPTURE__CLUSTER__ADAPTIVE_MINIMUM": "1",
    }
    cmd = [sys.executable, str(ROOT / "examples" / "grpo_tiny_moe.py"), "--small", "--json", str(out_json), "--plot", str(png)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    doc = json.loads(out_json.read_text())
    runs = doc["runs"]
    assert set(runs) == {"replay", "no_replay"}
    for name, steps in runs.items():
        assert all(s["accepted"] == s["rollouts"] > 0 for s in steps), name
        # Asynchronous one step ahead: the first batch on-policy, every later one lagging by one.
        assert [s["trainer_version"] - s["sampler_version"] for s in steps] == [0] + [1] * (len(steps) - 1), name
        assert [s["weight_lag"] for s in steps] == [0] + [1] * (len(steps) - 1), name
        rewards = [s["mean_reward"] for s in steps]
        q = max(len(rewards) // 4, 1)
        assert np.mean(rewards[-q:]) > np.mean(rewards[:q]) + 0.1, (name, rewards)
    replay, free = runs["replay"], runs["no_replay"]
    # On-policy (step 0: the trainer scores with the sampler's weights) with replay: exact.
    assert replay[0]["route_agreement"] == 1.0
    assert replay[0]["max_abs_delta"] <= LOGPROB_TOLERANCE, replay[0]
    # Replay trains on the captured experts on every step.
    assert all(s["route_agreement"] == 1.0 for s in replay)
    # Without replay, the trainer's newer router picks other experts on stale steps: measured.
    assert min(s["route_agreement"] for s in free[1:]) < 1.0, [s["route_agreement"] for s in free]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_process_builds_the_engine_of_a_version_once_and_keeps_the_newest_two():
    from pipeline.engines.hf_weights import CACHED_VERSIONS, EngineCache

    cache, model = EngineCache(), _perturbed_model()
    snaps = [WeightSnapshot.of(model, 0)]
    for v in range(1, CACHED_VERSIONS + 1):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        snaps.append(WeightSnapshot.of(model, v))
    first = cache.at(CFG, snaps[0])
    assert cache.at(CFG, snaps[0]) is first and first.fingerprint == snaps[0].fingerprint  # built once
    for s in snaps[1:]:
        cache.at(CFG, s)
    assert cache.at(CFG, snaps[-1]) is cache.at(CFG, snaps[-1])
    assert cache.at(CFG, snaps[0]) is not first  # the oldest was dropped, then built again
