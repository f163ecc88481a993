"""``bench store --memory``: stage gigabytes into memory-limited storage units (they spill),
sample each storage worker's peak RSS while doing so, and read every row back; and what a
staged row costs a unit against its raw bytes (the packed fields it was put as):
``unit_bytes_per_row`` (the unit's own accounting: row weights, keys, bookkeeping and the
received buffers' bytes it pins), ``resident_bytes_per_row`` (of the rows in memory) and
``disk_bytes_per_row`` (of the spilled ones), target raw + :data:`OVERHEAD_TARGET`."""
from __future__ import annotations

import argparse
import threading
import time
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from .. import config
from ..progress import Progress
from .profile_args import profile_from_args
from .store_rows import template_batch, with_keys

OVERHEAD_TARGET = 0.05  # a staged row costs a unit at most its raw bytes plus this share

if TYPE_CHECKING:
    from distributed import Client


class _Sampler(TypedDict, total=False):
    peak: int  # bytes
    stop: threading.Event
    thread: threading.Thread


class MemoryFigures(TypedDict):
    """What :func:`memory_mode` measured (seconds, MB/s, bytes; RSS by worker address)."""

    rows: int
    tokens_per_row: int
    staged_bytes: int
    unit_memory_limit: int
    rows_per_call: int
    put_s: float
    get_s: float
    put_mb_per_s: float
    get_mb_per_s: float
    spilled_bytes_after_put: int
    memory_bytes_after_put: int
    peak_rss_bytes: dict[str, int]
    worker_pids: dict[str, int]
    max_peak_rss_mb: float
    rss_under_1gb: bool
    rows_read_back: int
    all_rows_read_back: bool
    raw_bytes_per_row: float
    unit_bytes_per_row: float
    resident_bytes_per_row: float | None
    disk_bytes_per_row: float | None
    unit_overhead: float
    meets_overhead_target: bool


_SAMPLER: _Sampler = {}


def _start_rss_sampler(interval_s: float = 0.02) -> int:
    """Runs in each worker (``client.run``): sample this process's RSS until stopped."""
    import psutil

    # State lives in the importable module, not in this function's globals: a function
    # pickled by value (defined in ``__main__``) gets a copy of its globals per call.
    from pipeline.bench import store_memory as here

    proc = psutil.Process()
    state: _Sampler = {"peak": proc.memory_info().rss, "stop": threading.Event()}

    def loop() -> None:
        while not state["stop"].wait(interval_s):
            state["peak"] = max(state["peak"], proc.memory_info().rss)

    thread = threading.Thread(target=loop, name="bench-rss-sampler", daemon=True)
    thread.start()
    here._SAMPLER.update(state, thread=thread)
    return proc.pid


def _stop_rss_sampler() -> int:
    """Runs in each worker: stop sampling, return the peak RSS in bytes."""
    import psutil

    from pipeline.bench import store_memory as here

    here._SAMPLER["stop"].set()
    here._SAMPLER["thread"].join()
    return max(here._SAMPLER["peak"], psutil.Process().memory_info().rss)


def memory_mode(client: Client, args: argparse.Namespace) -> MemoryFigures:
    """Stage ``args.memory_gb`` GB of ``args.memory_row_tokens``-token rows (at most ~64 MB
    per put) into units limited to ``args.unit_memory_limit``, sampling each storage
    worker's peak RSS (bytes), then read every row back and compare it bit for bit.
    Seconds and MB/s of each pass, spilled and in-memory bytes after the puts, peak RSS
    per worker. Raises RuntimeError on a refused put or a read-back that differs."""
    from ..store import StagingStore

    bs = args.batch_size
    tokens = args.memory_row_tokens
    # Rows per batch bounded so one call moves at most ~64 MB.
    prof = profile_from_args(args)
    template = template_batch(bs, tokens, layers=prof.layers, top_k=prof.top_k, experts=prof.experts,
                              routes=not args.no_routes, seed=1)
    row_bytes = template.nbytes / len(template)
    per_call = max(1, min(bs, int(64e6 // row_bytes)))
    target = int(args.memory_gb * 1e9)
    n_rows = max(per_call, int(target // row_bytes) // per_call * per_call)
    limit = config.parse_bytes(args.unit_memory_limit)
    store = StagingStore.start(client, memory_limit=limit)
    hosts = sorted(set(store.unit_workers))
    pids = client.run(_start_rss_sampler, workers=hosts)
    keys: list[str] = []
    t0 = time.perf_counter()
    try:
        with Progress("store memory: put", total=n_rows // per_call, quiet=args.quiet) as prog:
            for j in range(0, n_rows, per_call):
                b = with_keys(template, "m", j, per_call)
                res = store.put_many(b)
                if res.failed:
                    raise RuntimeError(f"memory mode put failed: {next(iter(res.failed.items()))}")
                keys.extend(b.keys)
                prog.advance(1)
        put_s = time.perf_counter() - t0
        stats_after_put = store.stats()
        t0 = time.perf_counter()
        ok_rows = 0
        want = template.take(np.arange(per_call))
        with Progress("store memory: get", total=n_rows // per_call, quiet=args.quiet) as prog:
            for j in range(0, n_rows, per_call):
                ks = keys[j : j + per_call]
                got = store.get_many(ks)
                if got.failed or got.batch.keys != ks:
                    raise RuntimeError(f"memory mode read-back failed: {list(got.failed.items())[:3]}")
                for name, f in want.fields.items():
                    g = got.batch.fields[name]
                    if g.values.tobytes() != f.values.tobytes() or not np.array_equal(g.offsets, f.offsets):
                        raise RuntimeError(f"memory mode read-back differs in {name} for {ks[0]}..")
                ok_rows += len(ks)
                prog.advance(1)
        get_s = time.perf_counter() - t0
    finally:
        peaks = client.run(_stop_rss_sampler, workers=hosts)
        store.close()
    peak = {addr: int(v) for addr, v in peaks.items()}
    return {**_row_costs(stats_after_put, row_bytes, n_rows),  # type: ignore[typeddict-item]
        "rows": n_rows,
        "tokens_per_row": tokens,
        "staged_bytes": int(n_rows * row_bytes),
        "unit_memory_limit": limit,
        "rows_per_call": per_call,
        "put_s": round(put_s, 2),
        "get_s": round(get_s, 2),
        "put_mb_per_s": round(n_rows * row_bytes / put_s / 1e6, 1),
        "get_mb_per_s": round(n_rows * row_bytes / get_s / 1e6, 1),
        "spilled_bytes_after_put": sum(s["spilled_bytes"] for s in stats_after_put),
        "memory_bytes_after_put": sum(s["memory_bytes"] for s in stats_after_put),
        "peak_rss_bytes": peak,
        "worker_pids": pids,
        "max_peak_rss_mb": round(max(peak.values()) / 2**20, 1),
        "rss_under_1gb": max(peak.values()) < 2**30,
        "rows_read_back": ok_rows,
        "all_rows_read_back": ok_rows == n_rows,
    }


def _row_costs(stats: list[dict], raw: float, rows: int) -> dict[str, object]:
    """Bytes a staged row costs the units (their stats right after the puts) against
    ``raw``, its packed bytes: by their accounting (row weights with keys and bookkeeping,
    plus the pinned bytes of received buffers), of the rows in memory, of the spilled."""
    used = sum(s["used_bytes"] + s["pinned_bytes"] for s in stats)
    in_memory = sum(s["rows"] - s["spilled_rows"] for s in stats)
    spilled = sum(s["spilled_rows"] for s in stats)
    resident = sum(s["resident_bytes"] for s in stats)
    unit = used / rows
    return {
        "raw_bytes_per_row": round(raw, 1),
        "unit_bytes_per_row": round(unit, 1),
        "resident_bytes_per_row": round(resident / in_memory, 1) if in_memory else None,
        "disk_bytes_per_row": round(sum(s["spilled_bytes"] for s in stats) / spilled, 1) if spilled else None,
        "unit_overhead": round(unit / raw - 1, 4),
        "meets_overhead_target": bool(unit <= raw * (1 + OVERHEAD_TARGET)),
    }
