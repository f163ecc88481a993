"""Route replay over a real step batch (tiny HF Qwen2-MoE and Mixtral): captured logprobs
and routes reproduced with the experts forced, the captured routes kept when the router
moved, gradients through router and experts, the model untouched after the context (even
after an error), bad input named, and the transformers internals replay relies on.
Skipped without the ``hf`` extra."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from rollout_factory import fetch  # noqa: E402
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter  # noqa: E402

from tasks import reasons  # noqa: E402
from tasks.engines.hf_moe import LOGPROB_TOLERANCE, HFMoEConfig, HFMoEEngine, generate_rollouts  # noqa: E402
from tasks.engines.route_replay import (  # noqa: E402
    _ROUTERS,
    RoutedForward,
    batch_logprobs,
    forced_routes,
    input_routes,
    replay_logprobs,
    route_shape,
    routers,
)
from tasks.errors import InvalidInput  # noqa: E402
from tasks.finalize.assemble import FinalizedGroup, assemble_group  # noqa: E402
from tasks.finalize.plan import plan_group  # noqa: E402
from tasks.finalize.step_batch import step_batch  # noqa: E402
from tasks.finalize.verify import verify_many  # noqa: E402
from tasks.toy.rollouts import make_group_specs  # noqa: E402

CONFIGS = {
    "qwen2_moe": HFMoEConfig(arch="qwen2_moe", layers=2, hidden=32, experts=8, top_k=2, seed=1),
    "mixtral": HFMoEConfig(arch="mixtral", layers=2, hidden=32, experts=4, top_k=2, seed=3),
}
SHAPE = dict(tokens_per_turn=6, tool_tokens=3, prompt_tokens=6, vocab_size=512)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as the engine runs (tiny matmuls: threads only contend)."""
    from tasks.engines.threads import torch_threads

    with torch_threads(1):
        yield


def _finalized(engine: HFMoEEngine, rollouts) -> FinalizedGroup:
    """One group through the real plan, verify and assemble (no cluster)."""
    step = plan_group([r.receipt for r in rollouts])
    rows, routes = fetch(rollouts, step.staging_keys, step.routes_keys)
    results = verify_many(step.rollouts, rows, routes, vocab_size=engine.vocab_size, num_experts=engine.num_experts)
    return assemble_group(results, step.rewards)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def captured(request) -> tuple[HFMoEEngine, dict[str, torch.Tensor]]:
    """(engine, step batch): a group of two 3-turn rollouts (30 tokens), the second
    tampered so the verifier rejects it (an all-padding row without routes), and a group
    of two 1-turn rollouts (12 tokens, right-padded)."""
    engine = HFMoEEngine(CONFIGS[request.param])
    specs = make_group_specs("rrlong", 2, turns=3, **SHAPE) + make_group_specs("rrshort", 2, turns=1, **SHAPE)
    rollouts = generate_rollouts(engine, specs)
    row = rollouts[1].rows[1]
    row.routed_experts[-1, 0, 0] = (row.routed_experts[-1, 0, 0] + 1) % engine.num_experts  # after staging: bad digest
    groups = [_finalized(engine, rollouts[:2]), _finalized(engine, rollouts[2:])]
    assert groups[0].status == [reasons.OK, reasons.CORRUPT_DIGEST] and groups[1].status == [reasons.OK] * 2
    batch = step_batch(groups)
    assert batch["input_lengths"].tolist() == [30, 0, 12, 12] and batch["has_routes"].tolist() == [True, False, True, True]
    return engine, batch


def _model(engine: HFMoEEngine, mode: str = "train") -> torch.nn.Module:
    m = copy.deepcopy(engine.model)
    return m.train() if mode == "train" else m.eval()


def _masks(batch):
    loss = batch["loss_mask"] > 0
    real = batch["attention_mask"] > 0
    return loss, real


def test_replay_reproduces_captured_logprobs_and_routes(captured):
    engine, batch = captured
    model = _model(engine)
    out = batch_logprobs(model, batch, replay=True)
    assert isinstance(out, RoutedForward)
    B, T = batch["input_ids"].shape
    L, K = engine.routes_shape
    assert out.token_logprobs.dtype == torch.float32 and tuple(out.token_logprobs.shape) == (B, T)
    assert out.routes.dtype == torch.int64 and tuple(out.routes.shape) == (B, T, L, K)
    assert out.token_logprobs.requires_grad
    loss, real = _masks(batch)
    assert int(loss.sum()) == 18 + 6 + 6 and bool((~real).any())
    lp = out.token_logprobs.detach()
    diff = (lp - batch["old_logprobs"])[loss].abs()
    assert float(diff.max()) <= LOGPROB_TOLERANCE, float(diff.max())
    captured_routes = batch["routed_experts"].long()
    assert torch.equal(out.routes[loss], captured_routes[loss])
    # Context tokens past position 0 of routed rows are replayed (and reported) too.
    ctx = real & ~loss & batch["has_routes"][:, None]
    ctx[:, 0] = False
    assert int(ctx.sum()) > 0 and torch.equal(out.routes[ctx], captured_routes[ctx])
    # The step batch's alignment: 0 at t = 0, on padding and on the empty (rejected) row.
    assert bool((lp[:, 0] == 0).all()) and bool((lp[~real] == 0).all()) and bool((out.routes[~real] == 0).all())
    assert bool((lp[loss] < 0).all())
    # The weights did not move: the model's own routing is the captured one as well.
    own = batch_logprobs(model, batch, replay=False)
    assert torch.equal(own.routes[loss], captured_routes[loss])
    assert float((own.token_logprobs.detach() - batch["old_logprobs"])[loss].abs().max()) <= LOGPROB_TOLERANCE


def test_replaying_the_models_own_routes_changes_nothing_bit_for_bit(captured):
    # The forced weights are the router's own at those experts, normalized as the
    # architecture does: forcing the model's own choice gives the same logprobs, every bit.
    engine, batch = captured
    model = _model(engine, "eval")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        own = replay_logprobs(model, ids, mask)
        forced = replay_logprobs(model, ids, mask, own.routes.to(torch.int16))
    assert torch.equal(forced.routes, own.routes)
    assert torch.equal(forced.token_logprobs, own.token_logprobs)


def test_a_replay_walks_the_model_for_its_routers_once(captured):
    # The routers found once per call serve the checks, the shape and the hooks alike
    # (without grad: with it, transformers walks the model once more for checkpointing).
    engine, batch = captured
    model = _model(engine, "eval")
    own_modules, walks = model.modules, []

    def counted():
        walks.append(1)
        return own_modules()

    model.modules = counted  # an instance attribute: the model's own walk, counted
    with torch.no_grad():
        for replay in (True, False):
            walks.clear()
            batch_logprobs(model, batch, replay=replay)
            assert len(walks) == 1, (replay, len(walks))


def _moved(engine: HFMoEEngine) -> torch.nn.Module:
    """A copy of the model whose routers took a step (noise of the init scale)."""
    model = _model(engine)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in routers(model):
            r.weight.add_(0.1 * torch.randn(r.weight.shape, generator=gen))
    return model


def test_replay_keeps_the_captured_routes_when_the_router_moved(captured):
    engine, batch = captured
    model = _moved(engine)
    loss, _ = _masks(batch)
    captured_routes = batch["routed_experts"].long()
    own = batch_logprobs(model, batch, replay=False)
    rep = batch_logprobs(model, batch, replay=True)
    own_differs = (own.routes != captured_routes).flatten(2).any(-1) & loss
    assert int(own_differs.sum()) > 0  # the moved router picks other experts somewhere
    assert torch.equal(rep.routes[loss], captured_routes[loss])  # replay: 100% captured
    # And the forced experts are the ones computed with: the logprobs follow the routes.
    gap = (rep.token_logprobs - own.token_logprobs).detach().abs()
    assert float(gap[own_differs].max()) > 0


def test_gradients_reach_router_and_expert_weights_with_replay(captured):
    engine, batch = captured
    model = _moved(engine)
    out = batch_logprobs(model, batch, replay=True)
    loss = -(out.token_logprobs * batch["loss_mask"]).sum()
    loss.backward()
    rs = routers(model)
    assert len(rs) == engine.config.layers
    for r in rs:
        assert r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0
    experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
    assert experts
    for name, p in experts:
        assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


def _distinct_routes(B: int, T: int, L: int, K: int, E: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * T * L)]).view(B, T, L, K)


def test_model_is_restored_after_the_context_even_on_error(captured):
    engine, batch = captured
    model = _model(engine, "eval")
    ids = batch["input_ids"][:1, :30]
    L, K, E = route_shape(model)
    experts = _distinct_routes(1, 30, L, K, E)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with pytest.raises(RuntimeError, match="inside"):
            with forced_routes(model, experts):
                inside = model(input_ids=ids).logits
                assert not torch.equal(inside, before)  # forcing was in effect
                raise RuntimeError("an error inside the context")
        assert torch.equal(model(input_ids=ids).logits, before)
        # An error raised by the hooks themselves, mid-forward (routes for other shapes).
        with pytest.raises(InvalidInput, match="tokens"):
            with forced_routes(model, experts):
                model(input_ids=ids[:, :10])
        assert torch.equal(model(input_ids=ids).logits, before)
        replay_logprobs(model, ids, torch.ones_like(ids), experts)
        assert torch.equal(model(input_ids=ids).logits, before)
        with forced_routes(model, experts):  # one context per model at a time
            with pytest.raises(InvalidInput, match="already active"):
                with forced_routes(model):
                    pass
        assert torch.equal(model(input_ids=ids).logits, before)


def _bad(batch, **changes):
    return {**batch, **changes}


def test_bad_input_names_the_field(captured):
    engine, batch = captured
    model = _model(engine, "eval")
    r = batch["routed_experts"]
    E = engine.num_experts
    gen_pos = (batch["loss_mask"] > 0).nonzero()[0].tolist()
    out_of_range = r.clone().long()
    out_of_range[gen_pos[0], gen_pos[1], 0, 0] = E
    negative = r.clone().to(torch.int16)
    negative[gen_pos[0], gen_pos[1], 1, 0] = -1
    dup = r.clone()
    dup[gen_pos[0], gen_pos[1], 0, 1] = dup[gen_pos[0], gen_pos[1], 0, 0]
    left = batch["attention_mask"].flip(1)
    cases = {
        "routed_experts": [
            _bad(batch, routed_experts=r[:, :, :1]),  # one layer short
            _bad(batch, routed_experts=r[..., :1]),  # top-1 instead of top-2
            _bad(batch, routed_experts=out_of_range),
            _bad(batch, routed_experts=negative),
            _bad(batch, routed_experts=r.float()),
            _bad(batch, routed_experts=dup),
            {k: v for k, v in batch.items() if k != "routed_experts"},
        ],
        "has_routes": [_bad(batch, has_routes=torch.tensor([True, False, False, True]))],
        "attention_mask": [_bad(batch, attention_mask=left), _bad(batch, attention_mask=batch["attention_mask"] * 2)],
        "input_ids": [_bad(batch, input_ids=batch["input_ids"].float()), _bad(batch, input_ids=batch["input_ids"] + 10_000)],
    }
    for field, bads in cases.items():
        for bad in bads:
            with pytest.raises(InvalidInput, match=field):
                batch_logprobs(model, bad, replay=True)
    # Without replay, routes are not read; a row without routes then trains as it routes.
    batch_logprobs(model, _bad(batch, routed_experts=r.float()), replay=False)
    with pytest.raises(InvalidInput, match="input_ids"):
        replay_logprobs(model, batch["input_ids"][0], batch["attention_mask"][0])
    with pytest.raises(InvalidInput, match="model"):
        replay_logprobs(torch.nn.Linear(2, 2), batch["input_ids"], batch["attention_mask"])
    for bad in (r[..., :1].long(), out_of_range, r.float()):
        with pytest.raises(InvalidInput, match="experts"):
            with forced_routes(model, bad):
                pass


@pytest.mark.parametrize("arch, norm_topk_prob", [("mixtral", False), ("qwen2_moe", False), ("qwen2_moe", True)])
def test_transformers_router_contract(arch, norm_topk_prob):
    # What replay relies on in transformers (tasks/engines/route_replay.py, _ROUTERS): each
    # router module returns (logits, weights, indices) = (F.linear, the architecture's
    # weights, torch.topk of the float32 softmax), and our weights function recomputes
    # those weights bit for bit at the same experts. Fails if transformers changes it.
    engine = HFMoEEngine(CONFIGS[arch])
    rs = routers(engine.model)
    assert len(rs) == engine.config.layers and route_shape(engine.model) == (*engine.routes_shape, engine.num_experts)
    if norm_topk_prob:
        cfg = engine.config.hf_config()
        cfg.norm_topk_prob = True
        router = Qwen2MoeTopKRouter(cfg)
        router.weight.data.copy_(rs[0].weight.data)
        rs = [router]
        assert arch == "qwen2_moe"
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, engine.config.hidden, generator=gen)
    for r in rs:
        assert type(r) in _ROUTERS
        out = r(hidden)
        assert isinstance(out, tuple) and len(out) == 3
        logits, scores, idx = out
        assert torch.equal(logits, torch.nn.functional.linear(hidden, r.weight))
        assert torch.equal(idx, torch.topk(torch.softmax(logits.float(), dim=-1), r.top_k, dim=-1).indices)
        assert torch.equal(_ROUTERS[type(r)](r, logits, idx), scores)
        sums = scores.sum(-1)
        renormalized = arch == "mixtral" or norm_topk_prob
        assert bool(torch.allclose(sums, torch.ones_like(sums))) == renormalized


def test_replay_refuses_gradient_checkpointing_outside_a_context(captured):
    # Backward would recompute the forward after the hooks are gone (unforced experts).
    engine, batch = captured
    model = _model(engine)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with pytest.raises(InvalidInput, match="gradient checkpointing"):
        batch_logprobs(model, batch, replay=True)
    with torch.no_grad():  # nothing to recompute without a backward
        out = batch_logprobs(model, batch, replay=True)
    assert torch.equal(out.routes[batch["loss_mask"] > 0], batch["routed_experts"].long()[batch["loss_mask"] > 0])


def test_with_gradient_checkpointing_forward_and_backward_run_inside_forced_routes(captured):
    # The recipe the refusal points to: input_routes shifts the batch's routes to input
    # positions; the recomputed forward in backward is forced too, so the gradients are
    # replay's (the moved router would pick other experts on its own).
    engine, batch = captured
    lm = batch["loss_mask"]
    ref = _moved(engine)
    (-(batch_logprobs(ref, batch, replay=True).token_logprobs * lm).sum()).backward()
    model = _moved(engine)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    ids, mask = batch["input_ids"], batch["attention_mask"]
    experts, where = input_routes(batch["routed_experts"], mask, batch["has_routes"])
    assert torch.equal(experts[:, :-1], batch["routed_experts"][:, 1:].long()) and torch.equal(where[:, -1], torch.zeros_like(where[:, -1]))
    with forced_routes(model, experts, where):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        (-(lp * lm[:, 1:]).sum()).backward()
    for a, b in zip(routers(ref), routers(model)):
        assert b.weight.grad is not None and torch.allclose(a.weight.grad, b.weight.grad, rtol=1e-4, atol=1e-6)


def test_a_tensordict_batch_replays_like_the_dict(captured):
    # StepResult.to_batch(as_tensordict=True) hands the same keys as a TensorDict.
    tensordict = pytest.importorskip("tensordict")
    engine, batch = captured
    model = _model(engine, "eval")
    td = tensordict.TensorDict(batch, batch_size=[int(batch["input_ids"].shape[0])])
    with torch.no_grad():
        a, b = batch_logprobs(model, batch, replay=True), batch_logprobs(model, td, replay=True)
    assert torch.equal(a.token_logprobs, b.token_logprobs) and torch.equal(a.routes, b.routes)
