"""``python -m pipeline bench finalize``: its baseline verify agrees with the reference
oracle, and ``run()`` reports (or fails) honestly. Structure only: no timing asserts."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench import finalize as bench
from pipeline.cli_args import ArgumentParser
from tasks import reasons as R
from tasks.finalize.plan import plan_step
from tasks.finalize.reference import reference_verify_rollout
from tasks.packed import pack_rows
from tasks.toy.tamper import flip_token_byte, tamper

# Tiny workloads: (rollouts per group, calls per rollout, tokens per delta, routes).
TINY = {"short": (2, 1, 32, None), "agentic": (2, 3, 64, (4, 2))}


def _args(*argv: str):
    p = ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--short-groups", "1", "--agentic-groups", "1", "--quiet", *argv])


# ---- the baseline's per-token verify: the reference oracle (no cluster) --------------------


@pytest.mark.parametrize("routes", [None, (4, 2)])
@pytest.mark.parametrize("kind", [None, R.CORRUPT_DIGEST, R.MISSING_STAGING_ROW, R.CHAIN_HASH_MISMATCH, R.wrong("delta_len")])
def test_baseline_verify_is_the_reference_and_names_each_tamper(kind, routes):
    rng = np.random.default_rng(7)
    rows, receipt = bench.make_rollout(rng, "t-r0", "t-g0", 3, 48, routes)
    if kind is not None:
        t = tamper(kind, rows, receipt, other_group="elsewhere")
        rows, receipt = t.rows, t.receipt
    plan = plan_step([receipt])
    rp = plan.rollouts[0]
    batch = pack_rows(rows)
    routes_batch = batch if routes else None
    # the baseline IS the reference oracle (one implementation of the per-token path)
    assert bench.per_token_verify_rollout is reference_verify_rollout
    got = bench.per_token_verify_rollout(rp, batch, routes_batch, vocab_size=bench.VOCAB, num_experts=bench.EXPERTS)
    assert got.status == (kind or R.OK)


def test_repeats_flag_is_validated():
    with pytest.raises(SystemExit):
        _args("--repeats", "0")
    assert _args().repeats == 3


# ---- run() on an embedded cluster ------------------------------------------------------


def test_run_reports_every_mode(monkeypatch):
    monkeypatch.setattr(bench, "WORKLOADS", TINY)
    result = bench.run(_args("--repeats", "3"))
    assert result["ok"] is True, result["failures"]
    assert result["failures"] == []
    assert bench.exit_status(result) == 0
    for name in ("short", "agentic"):
        w = result[name]
        assert set(w["modes"]) == set(bench.MODES)
        for mode, st in w["modes"].items():
            runs = st["wall_s_runs"]
            assert len(runs) == 3, mode
            assert st["wall_s_min"] == min(runs)
            assert min(runs) <= st["wall_s_median"] <= max(runs)
        for key in ("speedup_median", "speedup_min", "speedup_median_rollout_fetch_vec", "speedup_median_union_fetch_token",
                    "speedup_median_graph_sha256", "graph_sha256_vs_graph", "verify_vs_hash", "graph_verify_vs_hash",
                    "graph_sha256_verify_vs_hash"):
            assert key in w, key
        assert w["hash_algorithm"] == "blake3" and w["hash_ms"] > 0 and w["hash_sha256_ms"] > 0
        rollouts = TINY[name][0]
        assert w["modes"]["baseline"]["fetch_calls_per_group"] == rollouts  # one get per rollout
        assert w["modes"]["rollout_fetch_vec"]["fetch_calls_per_group"] == rollouts
        assert w["modes"]["union_fetch_token"]["fetch_calls_per_group"] == 1  # one step of one group


def test_run_with_a_corrupt_row_fails(monkeypatch):
    monkeypatch.setattr(bench, "WORKLOADS", TINY)
    honest = bench.make_rollout

    def corrupt_first(rng, rid, gid, calls, delta, routes, **kw):
        rows, receipt = honest(rng, rid, gid, calls, delta, routes, **kw)
        if rid.endswith("-g0-r0"):
            t = flip_token_byte(rows, receipt)
            rows, receipt = t.rows, t.receipt
        return rows, receipt

    monkeypatch.setattr(bench, "make_rollout", corrupt_first)
    result = bench.run(_args("--repeats", "3"))
    assert result["ok"] is False
    assert bench.exit_status(result) == 1
    assert any("baseline" in f and "rejected" in f and R.CORRUPT_DIGEST in f for f in result["failures"])
    assert any("graph" in f and "rejected" in f for f in result["failures"])
    for name in ("short", "agentic"):
        w = result[name]
        assert not [k for k in w if k.startswith("speedup") or k.endswith("vs_hash")]
