"""MoE profiles: the routing shapes benchmarks take with ``--profile``."""
import argparse

import pytest

from pipeline.bench.profile_args import add_profile_argument, payload_figures, profile_from_args
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
