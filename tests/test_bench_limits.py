"""``bench limits`` measures this machine's ceilings with real sockets and buffers."""
from __future__ import annotations

import argparse

from pipeline.bench import limits, loopback
from tasks.digests import SUPPORTED_VERSIONS


def test_limits_reports_every_figure_from_real_runs():
    out = limits.run(argparse.Namespace(repeats=1, messages=1, quiet=True))
    for name in ("loopback_send", "loopback_recv", "memcpy", "first_touch", "sha256", "blake3", "sha256_4k", "blake3_4k"):
        assert out[f"{name}_gb_per_s"] > 0
        assert len(out[f"{name}_gb_per_s_runs"]) == 1
    assert out["blake3_vs_sha256"] > 0
    for prof in ("toy", "qwen3-moe"):
        for version in ("sha256", "blake3", "blake3_fields"):
            assert out[f"row_digest_{prof}_{version}_gb_per_s"] > 0


def test_every_digest_version_this_build_computes_has_a_row_digest_figure():
    # A version added to tasks.digests without a figure here would go unmeasured.
    assert sorted(limits.ROW_VERSIONS.values()) == sorted(SUPPORTED_VERSIONS)


def test_loopback_moves_every_byte_both_ways():
    # 3 MiB messages: several recv_into calls each, so a short read would hang or fail.
    out = loopback.measure(3 << 20, 2)
    assert out["send_bytes_per_s"] > 0 and out["recv_bytes_per_s"] > 0
    # Both ends' CPU: a copy in and a copy out of the kernel cost more than nothing a byte,
    # and less than a second a kilobyte.
    for way in ("send", "recv"):
        assert 0 < out[f"{way}_cpu_s_per_byte"] < 1e-3
