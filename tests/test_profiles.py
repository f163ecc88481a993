"""MoE profiles: the routing shapes benchmarks take with ``--profile``."""
import argparse
import dataclasses

import pytest

from pipeline.bench.profile_args import add_profile_argument, payload_figures, profile_from_args, rounded_gb_s
from pipeline.store.protocol import StoreResult
from tasks.profiles import PROFILES, UnknownProfileError, profile


def parse(argv, layers=False):
    p = argparse.ArgumentParser()
    add_profile_argument(p)
    if layers:
        p.add_argument("--layers", type=int, default=None)
        p.add_argument("--top-k", type=int, default=None)
    return p.parse_args(argv)


def test_real_profiles_carry_hundreds_of_expert_ids_per_token():
    assert profile("qwen3-moe").ids_per_token == 384
    assert profile("deepseek-v3").ids_per_token == 464
    # Routes dominate: with one byte per id, 384 of qwen3's 400 bytes per token.
    assert profile("qwen3-moe").bytes_per_token(1) == 400
    assert profile("qwen3-moe").bytes_per_token(2) == 784
    assert all(p.experts <= 256 for p in PROFILES.values())  # all fit one-byte ids


def test_unknown_profile_names_the_choices():
    with pytest.raises(UnknownProfileError, match="qwen3-moe"):
        profile("mixtral")
    with pytest.raises(SystemExit):
        parse(["--profile", "mixtral"])


def test_layers_and_top_k_flags_override_the_profile():
    assert profile_from_args(parse([], layers=True)) == profile("toy")
    custom = profile_from_args(parse(["--profile", "qwen3-moe", "--top-k", "2"], layers=True))
    assert (custom.layers, custom.top_k, custom.experts) == (48, 2, 128)
    assert custom.name == "qwen3-moe+custom"


def test_payload_figures_report_bytes_per_token_and_gb_s():
    fig = payload_figures(profile("deepseek-v3"), route_id_bytes=1, tokens_per_s=2e6)
    assert fig["bytes_per_token"] == 16 + 464
    assert fig["gb_s"] == pytest.approx(2e6 * 480 / 1e9)
    assert "gb_s" not in payload_figures(profile("toy"), route_id_bytes=2)
    # Reports give GB/s to 4 significant digits (one helper for every benchmark).
    assert rounded_gb_s(2e6 * 481 / 1e9) == 0.962 and rounded_gb_s(1 / 3000) == 0.0003333


def bench_args(module, *argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(list(argv))


def test_cut_bench_calls_carry_the_profile_routes():
    from pipeline.bench.call_buffers import client_calls

    routes = client_calls(0, 1, 64, "t", profile("qwen3-moe"))[0].output()["routed_experts"]
    assert routes.shape == (64, 48, 8)
    assert 8 <= int(routes.max()) < 128 and int(routes.min()) >= 0  # the profile's experts, not toy's
    assert "routed_experts" not in client_calls(0, 1, 64, "t", None)[0].output()


def test_bigger_profiles_keep_the_bytes_of_the_toy_tables():
    from pipeline.bench import cut, restore, restore_stage

    def rows(*argv):
        args = bench_args(cut, *argv)
        return cut.row_counts(args, profile_from_args(args))

    assert rows() == {1024: 8192, 16384: 2048}
    assert rows("--profile", "qwen3-moe") == {1024: round(8192 * 32 / 784), 16384: round(2048 * 32 / 784)}
    assert rows("--profile", "qwen3-moe", "--rows", "100", "--tokens", "1024") == {1024: 100}
    tokens = lambda *argv: restore_stage.restore_tokens(bench_args(restore, *argv))  # noqa: E731
    assert tokens() == tokens("--no-routes") == 16384
    assert tokens("--profile", "deepseek-v3") == 16384 * 32 // (16 + 464 * 2)
    assert tokens("--profile", "deepseek-v3", "--tokens", "100") == 100


def test_restore_bench_rows_read_their_routes_field():
    from pipeline.bench.profile_args import route_id_bytes
    from pipeline.bench.restore_stage import restore_fields, templates
    from tasks.schema import STAGING_FIELDS

    tmpl = templates(32, profile("deepseek-v3"), n=2)
    extra = [f for f in restore_fields(tmpl) if f not in STAGING_FIELDS]
    assert len(extra) == 1 and tmpl.fields[extra[0]].values.shape[1:] == (58, 8)
    # The benchmarks' nominal bytes per id are what the gate packed for the profile's experts.
    assert route_id_bytes(profile("deepseek-v3")) == tmpl.fields[extra[0]].values.itemsize == 1
    assert route_id_bytes(dataclasses.replace(profile("deepseek-v3"), experts=300)) == 2
    bare = templates(32, None, n=2)
    assert restore_fields(bare) == list(STAGING_FIELDS) and route_id_bytes(None) == 0


def test_soak_runs_the_toy_policy_at_the_profile_shape():
    from pipeline.bench import soak
    from pipeline.capture import policy_from_config

    overrides = soak.policy_overrides(bench_args(soak, "--profile", "qwen3-moe"))
    assert overrides == {"layers": 48, "top-k": 8, "experts": 128, "hidden": 4}
    policy = policy_from_config(overrides)
    assert (policy.config.layers, policy.config.top_k, policy.config.experts) == (48, 8, 128)
    assert "hidden" not in soak.policy_overrides(bench_args(soak))
    assert soak.policy_overrides(bench_args(soak, "--profile", "qwen3-moe", "--hidden", "8"))["hidden"] == 8


def test_capture_bench_deltas_carry_the_profile_routes_and_keep_the_layer_overrides():
    from pipeline.bench import capture

    args = bench_args(capture, "--profile", "deepseek-v3", "--rollouts", "1", "--calls", "1", "--tokens", "4")
    routes = capture.make_deltas(args)[0][0]["routed_experts"]
    assert routes.shape == (4, 58, 8) and 0 <= int(routes.min()) and int(routes.max()) < 256
    args = bench_args(capture, "--profile", "deepseek-v3", "--layers", "3", "--rollouts", "1", "--calls", "1", "--tokens", "4")
    assert capture.make_deltas(args)[0][0]["routed_experts"].shape == (4, 3, 8)
    assert capture._payload(args, rows_per_s=None)["bytes_per_token"] == 16 + 3 * 8  # one byte per id: the gate's choice


def test_scale_bench_stages_the_profile_routes():
    import numpy as np

    from pipeline.bench import scale
    from tasks.packed import unpack_rows

    class Recorder:
        def __init__(self):
            self.batches = []

        def put_many(self, batch, *a, **kw):
            self.batches.append(batch)
            return StoreResult(ok=list(batch.keys))

    store = Recorder()
    scale._stage(store, "p", 3, np.random.default_rng(0), profile("qwen3-moe"))
    rows = [r for b in store.batches for r in unpack_rows(b)]
    assert len(rows) == 3 * scale.CALLS
    assert all(r.routed_experts.shape[1:] == (48, 8) and int(r.routed_experts.max()) < 128 for r in rows)
