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


def _quick_in_flight(monkeypatch):
    """Sustained runs of 3 steps, and a made-up loopback rate (the probe spawns a process)."""
    monkeypatch.setattr(bench, "IN_FLIGHT_STEPS", 3)
    monkeypatch.setattr(bench, "loopback_recv", lambda: {"recv_bytes_per_s": 2e9, "recv_cpu_s_per_byte": 1e-9})


def test_run_reports_every_mode(monkeypatch):
    monkeypatch.setattr(bench, "WORKLOADS", TINY)
    _quick_in_flight(monkeypatch)
    result = bench.run(_args("--repeats", "3", "--in-flight", "2"))
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
        # What a token weighs, beside the rates: the toy profile, its ids stored one byte each.
        assert w["profile"] == "toy" and w["route_id_bytes"] == (1 if TINY[name][3] else 0)
        assert w["bytes_per_token"] == (24 if TINY[name][3] else 16) and w["gb_s"] > 0
        assert w["hash_streams_ms"] > 0 and w["hash_streams_vs_hash"] > 0  # the verifier's hashing, its pattern
        assert w["hash_streams_layout_ms"] > 0 and w["hash_streams_layout_vs_hash"] > 0  # ... with the layout's headers
    agentic = result["agentic"]
    assert agentic["verify_target_out_of_reach"] is (agentic["hash_streams_vs_hash"] > bench.TARGETS["agentic"]["graph_verify_vs_hash"])
    assert "verify_target_out_of_reach" not in result["short"]  # no verify target there
    sustained = result["agentic"]["in_flight"]
    assert sustained["in_flight"] == 2 and sustained["steps"] == 3 and len(sustained["tokens_per_s_runs"]) == 3
    assert sustained["cores"] >= 1 and sustained["loopback_gb_s"] == 2.0
    assert 0 < sustained["vs_hashing_floor"] and 0 < sustained["vs_transfer_floor"] and 0 < sustained["vs_cpu_floor"]
    assert set(sustained["cpu_ms_per_step"]) == {"controller", "worker-0", "worker-1"}
    assert sustained["hashing_floor_tokens_per_s"] > 0 and sustained["hashed_bytes_per_token"] > 16
    # The mandatory floor is made of this run's hash streams and the (made-up) wire's CPU.
    streams_ms = result["agentic"]["hash_streams_ms"]
    assert abs(sustained["mandatory_hash_cpu_ms_per_step"] - streams_ms) <= 0.005 * streams_ms  # 3 significant digits
    assert sustained["mandatory_floor_tokens_per_s"] > 0 and sustained["vs_mandatory_floor"] > 0
    assert isinstance(sustained["target_out_of_reach"], bool)
    assert "in_flight" not in result["short"]


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
    _quick_in_flight(monkeypatch)
    result = bench.run(_args("--repeats", "3", "--in-flight", "2"))
    assert result["ok"] is False
    assert bench.exit_status(result) == 1
    assert any("baseline" in f and "rejected" in f and R.CORRUPT_DIGEST in f for f in result["failures"])
    assert any("graph" in f and "rejected" in f for f in result["failures"])
    assert any("in-flight" in f and "rejected" in f for f in result["failures"])
    for name in ("short", "agentic"):
        w = result[name]
        assert not [k for k in w if k.startswith("speedup") or k.endswith("vs_hash")]
    assert not [k for k in result["agentic"]["in_flight"] if k.startswith("vs_")]


# ---- profiles and floors (no cluster) ---------------------------------------------------


def test_a_profile_sets_the_routed_workloads_routes_and_scales_their_default_groups():
    from pipeline.bench.finalize_profile import default_groups, workload_shape
    from tasks.profiles import profile

    qwen, toy = profile("qwen3-moe"), profile("toy")
    assert workload_shape(bench.WORKLOADS["agentic"], qwen) == (8, 16, 1024, (48, 8))
    assert workload_shape(bench.WORKLOADS["short"], qwen) == bench.WORKLOADS["short"]  # unrouted stays so
    assert bench.WORKLOADS["long"][1] * bench.WORKLOADS["long"][2] == 32768  # 8 turns, 32,768 tokens a rollout
    assert default_groups(None, 8, bench.WORKLOADS["agentic"], toy) == 8
    assert default_groups(None, 8, bench.WORKLOADS["agentic"], qwen) == 1  # about toy's bytes, at least one
    assert default_groups(None, 32, bench.WORKLOADS["short"], qwen) == 32
    assert default_groups(3, 8, bench.WORKLOADS["agentic"], qwen) == 3  # given: kept
    args = _args("--profile", "qwen3-moe", "--in-flight", "0")
    assert args.profile == "qwen3-moe" and args.in_flight == 0 and args.agentic_groups == 1 and args.long_groups is None
    assert args.graph_assembly == "controller" and _args("--graph-assembly", "cluster").graph_assembly == "cluster"


def test_the_floors_are_cores_times_the_hash_rate_and_the_wire_over_bytes_per_token():
    from pipeline.bench.finalize_inflight import floors, in_flight_figures

    # 1e8 bytes hashed in 20 ms (5 GB/s) for 1e6 tokens: 100 + 16 (ids twice) bytes a token.
    vh = {"bytes": 100_000_000, "hash_ms": 20.0}
    wire = {"recv_bytes_per_s": 2e9, "recv_cpu_s_per_byte": 0.5e-9}
    f = floors(vh, 1_000_000, 32.0, wire, 2)
    assert f["hash_gb_s"] == 5.0 and f["hashed_bytes_per_token"] == 116.0
    assert abs(f["hashing_floor_tokens_per_s"] - 2 * 5e9 / 116) < 1e-3
    assert f["transfer_floor_tokens_per_s"] == 2e9 / 32
    assert "mandatory_floor_tokens_per_s" not in f  # no hash streams measured: no mandatory floor
    # The mandatory work: 40 ms of hash streams a step plus 32 MB received at 0.5 ns of CPU a
    # byte (16 ms): 56 ms of CPU for 1e6 tokens, on 2 cores.
    m = floors(vh, 1_000_000, 32.0, wire, 2, hash_streams_ms=40.0)
    assert m["mandatory_transfer_cpu_ms_per_step"] == 16.0
    assert abs(m["mandatory_floor_tokens_per_s"] - 2e6 / 0.056) < 1e-3
    assert abs(m["mandatory_vs_hashing_floor"] - (2e6 / 0.056) / (2 * 5e9 / 116)) < 1e-12
    run = {"wall_s": 1.0, "steps": 4, "in_flight": 2, "tokens": 4_000_000, "tokens_per_s": 43_103_448.0, "accepted": 8,
           "rollouts": 8, "step_wall_ms_median": 500.0, "collect_ms_median": 10.0, "collected_bytes_per_token": 32.0,
           "cpu_ms_per_step": {"controller": 20.0, "worker-0": 15.0, "worker-1": 15.0}}
    out = in_flight_figures([run, {**run, "tokens_per_s": 1.0}, run], f, 0.5)
    assert out["tokens_per_s_median"] == 43_103_448 and out["vs_hashing_floor"] == 0.5 and out["target_vs_hashing_floor"] == 0.5
    # 50 ms of CPU a step of 1e6 tokens on 2 cores: 4e7 tokens/s if the cores did only this.
    assert out["cpu_ms_per_step"] == {"controller": 20.0, "worker-0": 15.0, "worker-1": 15.0}
    assert out["cpu_floor_tokens_per_s"] == 4e7 and out["vs_cpu_floor"] == round(43_103_448 / 4e7, 2)
    assert "target_out_of_reach" not in out
    # Against the mandatory floor (35.7 M tokens/s: 0.41 of the 86 M hashing floor): 0.5 is out of reach.
    with_m = in_flight_figures([run, run, run], m, 0.5)
    assert with_m["target_out_of_reach"] is True and with_m["vs_mandatory_floor"] == round(43_103_448 / (2e6 / 0.056), 2)
    assert in_flight_figures([run], m, 0.4)["target_out_of_reach"] is False


def test_sampled_groups_are_compared_by_their_prints_bit_for_bit():
    import torch

    from pipeline.bench.finalize_checks import fingerprint, group_diff
    from tasks.finalize.assemble import FinalizedGroup

    def group(flip: bool = False):
        ids = torch.arange(12, dtype=torch.int64).reshape(2, 6)
        if flip:
            ids[1, 5] ^= 1
        lps = torch.zeros(2, 6)
        return FinalizedGroup(["a", "b"], ids, torch.tensor([6, 6]), torch.tensor([1, 1]), lps, torch.ones(2, 6),
                              torch.ones(2), torch.tensor([0.5, 1.0]), None, torch.tensor([False, False]), ["ok", "ok"])

    a = fingerprint(group())
    assert group_diff(a, group()) is None and group_diff(a, fingerprint(group())) is None
    assert group_diff(a, group(flip=True)) == "input_ids differs"
    assert group_diff(a, None) == "group missing"
