"""A real MoE architecture (tiny Hugging Face Qwen2-MoE / Mixtral) as an engine: rollouts
generated and staged on Dask workers, finalized through the graph, and every finalized
row teacher-forced: routes equal, logprobs within the float32 tolerance. Skipped without
the ``hf`` extra."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from pipeline.capture import stage_rollouts  # noqa: E402
from pipeline.engines import hf  # noqa: E402
from pipeline.finalize.controller import Finalizer  # noqa: E402
from tasks import reasons  # noqa: E402
from tasks.engines.hf_moe import (  # noqa: E402
    LOGPROB_TOLERANCE,
    FidelityReport,
    HFMoEConfig,
    HFMoEEngine,
    check_row,
    generate_rollouts,
    teacher_forced,
)
from tasks.errors import InvalidPolicyConfig  # noqa: E402
from tasks.toy.rollouts import make_group_specs, make_step_specs  # noqa: E402

# Tiny and fast: 2 layers x 8 experts, top-2, hidden 64, vocab 512 (policy.vocab-size).
OVERRIDES = {"layers": 2, "hidden": 64}
SHAPE = dict(turns=3, tokens_per_turn=8, tool_tokens=4, prompt_tokens=8, vocab_size=512)


@pytest.fixture(scope="module")
def engine() -> HFMoEEngine:
    return hf.engine_from_config(OVERRIDES)


def _row(rollout):
    """A rollout's linearized row (what the finalizer builds from its chain's deltas)."""
    cat = lambda f: np.concatenate([getattr(r, f) for r in rollout.rows])  # noqa: E731
    return cat("token_ids"), cat("token_mask"), cat("logprobs"), cat("routed_experts")


def test_finalized_hf_rollouts_are_faithful_end_to_end(cluster_client, store_factory, engine):
    client = cluster_client
    store = store_factory()
    groups = make_step_specs("hf-", 2, 3, **SHAPE)
    receipts = client.gather(hf.submit_generation(client, store, groups, overrides=OVERRIDES))
    assert all(not r.poisoned for rs in receipts for r in rs)
    finalizer = Finalizer(client, store, **hf.finalizer_ranges(OVERRIDES))
    handle = finalizer.submit_step({g[0].group_id: rs for g, rs in zip(groups, receipts)})
    fidelity = hf.submit_fidelity(client, handle.group_futures, OVERRIDES)
    result = handle.result(timeout=120)
    reports = client.gather(fidelity)

    assert result.metrics["accepted"] == result.metrics["rollouts"] == 6, result.metrics
    L, K = engine.routes_shape
    n_tokens = 3 * SHAPE["tokens_per_turn"]
    for gid, group in result.groups.items():
        assert group.status == [reasons.OK] * 3
        assert group.routed_experts is not None and tuple(group.routed_experts.shape[2:]) == (L, K)
        assert int(group.token_mask.sum()) == 3 * n_tokens
        # Captured logprobs are real sampling logprobs, not placeholders.
        gen = group.logprobs[group.token_mask > 0]
        assert bool((gen < 0).all()) and float(gen.min()) > -30.0
    total = sum(reports.values(), FidelityReport())
    assert total.rows == 6 and total.tokens == 6 * n_tokens and total.unrouted_rows == 0
    assert total.route_entries == 6 * n_tokens * L * K
    assert total.route_agreement == 100.0 and total.context_route_agreement == 100.0, total.summary()
    assert total.max_abs_logprob_diff <= LOGPROB_TOLERANCE, total.summary()
    assert total.ok()


def test_a_route_changed_after_capture_is_rejected_by_the_verifier(cluster_client, store_factory, engine):
    store = store_factory()
    specs = make_group_specs("hfbad", 2, **SHAPE)
    rollouts = generate_rollouts(engine, specs)
    row = rollouts[1].rows[1]
    p = int(np.flatnonzero(row.token_mask > 0)[0])
    row.routed_experts[p, 0, 0] = (row.routed_experts[p, 0, 0] + 1) % engine.num_experts  # still in range
    receipts = stage_rollouts(store, rollouts)
    finalizer = Finalizer(cluster_client, store, **hf.finalizer_ranges(OVERRIDES))
    group = finalizer.submit_step({"hfbad": receipts}).result(timeout=120).groups["hfbad"]
    assert group.status == [reasons.OK, reasons.CORRUPT_DIGEST]


def test_fidelity_check_catches_a_wrong_route_or_logprob(engine):
    # What the digest cannot catch: an engine that records wrong routes or logprobs and
    # signs them. The teacher-forced check must.
    (ro,) = generate_rollouts(engine, make_group_specs("hfunit", 1, **SHAPE))
    ids, mask, lps, routes = _row(ro)
    clean = check_row(engine, ids, mask, lps, routes)
    assert clean.ok() and clean.route_agreement == 100.0 and clean.tokens == int(mask.sum())
    assert clean.ordered_matches == clean.route_entries  # top-k order is kept too

    gen = np.flatnonzero(mask > 0)
    bad_routes = routes.copy()
    taken = set(bad_routes[gen[3], 1].tolist())
    bad_routes[gen[3], 1, 0] = next(e for e in range(engine.num_experts) if e not in taken)
    r = check_row(engine, ids, mask, lps, bad_routes)
    assert not r.ok() and r.route_matches == r.route_entries - 1 and r.route_agreement < 100.0

    swapped = routes.copy()
    swapped[gen[2]] = swapped[gen[2], :, ::-1]  # same experts, other order: the same set
    r = check_row(engine, ids, mask, lps, swapped)
    assert r.ok() and r.ordered_matches < r.route_entries

    bad_ctx = routes.copy()
    ctx = np.flatnonzero(mask == 0)[1]
    bad_ctx[ctx, 0] = (bad_ctx[ctx, 0] + 1) % engine.num_experts
    assert not check_row(engine, ids, mask, lps, bad_ctx).ok()

    bad_lps = lps.copy()
    bad_lps[gen[5]] -= 10 * LOGPROB_TOLERANCE
    r = check_row(engine, ids, mask, bad_lps, routes)
    assert not r.ok() and r.route_agreement == 100.0 and r.max_abs_logprob_diff > LOGPROB_TOLERANCE


def test_routes_convention_is_the_pass_that_predicted_the_token(engine):
    # routes[p] come from the pass over position p - 1; the per-input-token routes (the
    # pass over p itself) are a different, shifted array, and the check tells them apart.
    (ro,) = generate_rollouts(engine, make_group_specs("hfconv", 1, **SHAPE))
    ids, mask, lps, routes = _row(ro)
    _, ref = teacher_forced(engine, ids)
    assert np.array_equal(np.sort(ref, -1), np.sort(routes, -1))
    per_input = np.concatenate([ref[1:], ref[-1:]])
    assert not check_row(engine, ids, mask, lps, per_input).ok()


def test_generation_is_reproducible_and_rows_follow_the_staging_rules(engine):
    specs = make_step_specs("hfrep", 2, 2, **SHAPE)
    flat = [s for g in specs for s in g]
    a = generate_rollouts(engine, flat)
    b = generate_rollouts(HFMoEEngine(engine.config), flat)
    assert HFMoEEngine(engine.config).fingerprint == engine.fingerprint
    for x, y in zip(a, b):
        assert not x.receipt.poisoned and len(x.rows) == SHAPE["turns"]
        assert all(rx.same_content(ry) for rx, ry in zip(x.rows, y.rows))
        assert x.receipt.to_msgpack() == y.receipt.to_msgpack()
        for r in x.rows:
            # The engine's experts fit a byte: routes are staged compact (encoding 2, uint8).
            assert r.routes_encoding == 2 and r.routed_experts.dtype == np.uint8 == engine.routes_dtype
            assert r.routed_experts.shape[1:] == engine.routes_shape
            assert 0 <= r.routed_experts.min() and r.routed_experts.max() < engine.num_experts
            m = r.token_mask > 0
            assert np.all(r.logprobs[~m] == 0) and np.all(r.logprobs[m] < 0)
            assert 0 <= r.token_ids.min() and r.token_ids.max() < engine.vocab_size
    # Different rollouts of a group sample different tokens from the same prompt.
    assert not np.array_equal(a[0].tokens, a[1].tokens)


def test_mixtral_architecture_is_faithful_too():
    eng = HFMoEEngine(HFMoEConfig(arch="mixtral", layers=2, hidden=32, experts=4, top_k=2, seed=3))
    rollouts = generate_rollouts(eng, make_group_specs("hfmix", 2, **SHAPE))
    total = sum((check_row(eng, *_row(ro)) for ro in rollouts), FidelityReport())
    assert total.rows == 2 and total.ok(), total.summary()


def test_config_rejects_bad_settings():
    with pytest.raises(InvalidPolicyConfig):
        HFMoEConfig(arch="llama")
    with pytest.raises(InvalidPolicyConfig):
        HFMoEConfig(top_k=9, experts=8)
    with pytest.raises(InvalidPolicyConfig):
        HFMoEConfig.from_mapping({"vocab-size": 512, "no-such-key": 1})
    cfg = hf.engine_config({"hidden": 32})
    assert (cfg.vocab_size, cfg.hidden) == (512, 32)
    assert hf.finalizer_ranges() == {"vocab_size": cfg.vocab_size, "num_experts": cfg.experts}
