"""This machine's physical limits, the figures every path is judged against.

- ``loopback``: raw TCP over 127.0.0.1 between two processes (:mod:`.loopback`), 64 MiB
  messages, both directions, bytes/s;
- ``memcpy``: one numpy copy of 64 MiB into memory this process already touched;
- ``first_touch``: filling 64 MiB chunks of fresh memory this process keeps (page faults:
  what a store pays for memory that was not recycled), bytes/s;
- ``sha256`` / ``blake3``: the two digest algorithms (``capture.digest``) over one 64 MiB
  buffer on one core, bytes/s; ``sha256_4k`` / ``blake3_4k``: the same 64 MiB as 4 KiB
  messages, each hashed on its own (a short row's cost); ``blake3_vs_sha256``: the ratio
  of the large-buffer medians;
- ``row_digest_<profile>_<version>``: :func:`tasks.hashing.digest` of 1,024-token rows
  (``toy`` and ``qwen3-moe`` profiles' one-byte routes) per :data:`ROW_VERSIONS` entry,
  every field hashed from scratch as a verifier does, bytes/s of payload; of
  ``blake3_fields`` (version 3) a cut makes only the small outer hash (the field digests
  are fed as tokens arrive: ``bench cut``'s ``fill_cpu_s``).

Each figure is the median of ``--repeats`` runs (default 3).

    python -m pipeline bench limits --json
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from typing import Any, Callable

import blake3
import numpy as np

from tasks import hashing
from tasks.digests import DIGEST_BLAKE3, DIGEST_BLAKE3_FIELDS, DIGEST_SHA256
from tasks.profiles import profile

from . import loopback
from .common import main, notes

CHUNK = 64 << 20  # bytes per measured operation
MESSAGE = 4 << 10  # bytes per small message (the *_4k figures)
HASHES = {"sha256": hashlib.sha256, "blake3": blake3.blake3}  # single-threaded, as the pipeline hashes
ROW_TOKENS = 1024  # tokens per row of the row_digest figures
ROW_PROFILES = ("toy", "qwen3-moe")
# The digest versions of the row_digest figures, by the name their keys carry.
ROW_VERSIONS = {"sha256": DIGEST_SHA256, "blake3": DIGEST_BLAKE3, "blake3_fields": DIGEST_BLAKE3_FIELDS}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench limits``."""
    from ..cli_args import positive_int

    p.add_argument("--repeats", type=positive_int, default=3, help="runs per figure; medians reported (default 3)")
    p.add_argument("--messages", type=positive_int, default=8, help="64 MiB loopback messages per run and direction (default 8)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _rate(op: Callable[[], None], nbytes: int) -> float:
    t0 = time.perf_counter()
    op()
    return nbytes / (time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every figure ``args.repeats`` times; bytes/s medians and every run."""
    say = notes("limits", args.quiet)
    src = np.ones(CHUNK, np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # touched once: the copies below measure memcpy, not page faults
    names = ["loopback_send", "loopback_recv", "memcpy", "first_touch", "sha256", "blake3", "sha256_4k", "blake3_4k"]
    names += [f"row_digest_{p}_{a}" for p in ROW_PROFILES for a in ROW_VERSIONS]
    rows = {p: _row(p) for p in ROW_PROFILES}
    runs: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.repeats):
        wire = loopback.measure(CHUNK, args.messages)
        runs["loopback_send"].append(wire["send_bytes_per_s"])
        runs["loopback_recv"].append(wire["recv_bytes_per_s"])
        runs["memcpy"].append(_rate(lambda: np.copyto(dst, src), CHUNK))
        kept: list[np.ndarray] = []

        def touch() -> None:
            for _ in range(4):
                a = np.empty(CHUNK, np.uint8)
                a[:] = 1
                kept.append(a)

        runs["first_touch"].append(_rate(touch, 4 * CHUNK))
        del kept
        for name, new in HASHES.items():
            runs[name].append(_rate(lambda: new(memoryview(src)).digest(), CHUNK))
            runs[f"{name}_4k"].append(_rate(lambda: _messages(new, src), CHUNK))
        for prof, (kw, nbytes) in rows.items():
            n = max(1, CHUNK // nbytes)  # rows per measurement: about 64 MiB of payload
            for name, version in ROW_VERSIONS.items():
                runs[f"row_digest_{prof}_{name}"].append(_rate(lambda: _digests(kw, version, n), n * nbytes))
        say(f"run {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] / 1e9:.2f} GB/s" for k, v in runs.items()))
    out: dict[str, Any] = {"benchmark": "limits", "repeats": args.repeats, "chunk_bytes": CHUNK}
    for name, values in runs.items():
        out[f"{name}_gb_per_s"] = round(statistics.median(values) / 1e9, 3)
        out[f"{name}_gb_per_s_runs"] = [round(v / 1e9, 3) for v in values]
    out["blake3_vs_sha256"] = round(statistics.median(runs["blake3"]) / statistics.median(runs["sha256"]), 2)
    return out


def _row(name: str) -> tuple[dict[str, Any], int]:
    """The :func:`tasks.hashing.digest` arguments of one :data:`ROW_TOKENS`-token row with
    profile ``name``'s routes (one byte per id), and its payload bytes."""
    p = profile(name)
    rng = np.random.default_rng(0)
    n = ROW_TOKENS
    kw: dict[str, Any] = dict(
        rollout_id="bench-r0", model_call_id="c1", parent_call_id="c0", prev_len=n, delta_len=n, cum_len=2 * n,
        weight_version=0, token_ids=rng.integers(0, 512, n), token_mask=np.ones(n, np.float32),
        logprobs=-rng.random(n, dtype=np.float32), routes_encoding=2,
        routed_experts=rng.integers(0, p.experts, (n, p.layers, p.top_k), dtype=np.uint8),
        chain_hash=bytes(32), cumulative_hash=bytes(32),
    )
    return kw, n * p.bytes_per_token(1)


def _digests(kw: dict[str, Any], version: int, n: int) -> None:
    """``n`` digests of one row (each a fresh hash of every field, as a verifier does;
    version 3: every field digest, then the outer hash)."""
    for _ in range(n):
        hashing.digest(**kw, digest_version=version)


def _messages(new: Callable[..., Any], buf: np.ndarray) -> None:
    """Hash ``buf`` as :data:`MESSAGE`-byte messages, one fresh state each."""
    mv = memoryview(buf)
    for a in range(0, len(mv), MESSAGE):
        new(mv[a : a + MESSAGE]).digest()


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
