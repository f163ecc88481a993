"""This machine's physical limits, the figures every path is judged against.

- ``loopback``: raw TCP over 127.0.0.1 between two processes (:mod:`.loopback`), 64 MiB
  messages, both directions, bytes/s;
- ``memcpy``: one numpy copy of 64 MiB into memory this process already touched;
- ``first_touch``: filling 64 MiB chunks of fresh memory this process keeps (page faults:
  what a store pays for memory that was not recycled), bytes/s;
- ``sha256`` / ``blake3``: the two digest algorithms (``capture.digest``) over one 64 MiB
  buffer on one core, bytes/s; ``sha256_4k`` / ``blake3_4k``: the same 64 MiB as 4 KiB
  messages, each hashed on its own (a short row's cost); ``blake3_vs_sha256``: the ratio
  of the large-buffer medians.

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

from . import loopback
from .common import main, notes

CHUNK = 64 << 20  # bytes per measured operation
MESSAGE = 4 << 10  # bytes per small message (the *_4k figures)
HASHES = {"sha256": hashlib.sha256, "blake3": blake3.blake3}  # single-threaded, as the pipeline hashes


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
    names = ("loopback_send", "loopback_recv", "memcpy", "first_touch", "sha256", "blake3", "sha256_4k", "blake3_4k")
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
        say(f"run {rep + 1}/{args.repeats}: " + ", ".join(f"{k} {v[-1] / 1e9:.2f} GB/s" for k, v in runs.items()))
    out: dict[str, Any] = {"benchmark": "limits", "repeats": args.repeats, "chunk_bytes": CHUNK}
    for name, values in runs.items():
        out[f"{name}_gb_per_s"] = round(statistics.median(values) / 1e9, 3)
        out[f"{name}_gb_per_s_runs"] = [round(v / 1e9, 3) for v in values]
    out["blake3_vs_sha256"] = round(statistics.median(runs["blake3"]) / statistics.median(runs["sha256"]), 2)
    return out


def _messages(new: Callable[..., Any], buf: np.ndarray) -> None:
    """Hash ``buf`` as :data:`MESSAGE`-byte messages, one fresh state each."""
    mv = memoryview(buf)
    for a in range(0, len(mv), MESSAGE):
        new(mv[a : a + MESSAGE]).digest()


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
