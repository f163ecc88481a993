"""Staging-store throughput: one row per call vs 256 rows per call, side by side.

Puts and gets of 1,024- and 16,384-token rows (ids, mask, logprobs and int16 routed
experts [T, L, K], plus the scalar, id and hash fields of a staged row) on a LocalCluster
of 2 workers with one storage unit each. Both call sizes run in the same process against
the same store, so the ratios compare like with like. ``--memory`` adds the memory mode:
stage ``--memory-gb`` of rows into units limited to ``--unit-memory-limit`` each, sample
each storage worker's peak RSS (psutil, in the worker process) and read every row back.
``replication_1024`` puts the 1,024-token rows/s with ``store.replicas`` 2 next to 1.

    python -m pipeline bench store --json
    python -m pipeline.bench.store --json --memory
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import numpy as np

from tasks.gate import CaptureGate
from tasks.packed import PackedBatch, pack_rows

from .common import add_cluster_arguments, bench_client, main

TARGET_RATIO = 20.0  # 256-row calls vs one-row calls at 1,024 tokens (rows/s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench store``."""
    from ..cli_args import byte_size, positive_float, positive_int

    p.add_argument("--batch-size", type=positive_int, default=256, help="rows per call in the batched runs (default 256)")
    p.add_argument("--rows-1024", type=positive_int, default=4096, help="rows moved by batched calls at 1,024 tokens")
    p.add_argument("--rows-16384", type=positive_int, default=512, help="rows moved by batched calls at 16,384 tokens")
    p.add_argument("--single-rows-1024", type=positive_int, default=400, help="rows moved one per call at 1,024 tokens")
    p.add_argument("--single-rows-16384", type=positive_int, default=100, help="rows moved one per call at 16,384 tokens")
    p.add_argument("--layers", type=positive_int, default=4, help="routed-experts L (default 4)")
    p.add_argument("--top-k", type=positive_int, default=2, help="routed-experts K (default 2)")
    p.add_argument("--no-routes", action="store_true", help="rows without routed experts")
    p.add_argument("--memory", action="store_true", help="also run the memory mode (spill under a memory limit)")
    p.add_argument("--memory-gb", type=positive_float, default=2.0, help="GB of rows staged in memory mode (default 2)")
    p.add_argument("--unit-memory-limit", type=byte_size, default="256MiB", help="per-unit memory limit in memory mode")
    p.add_argument("--memory-row-tokens", type=positive_int, default=16384, help="tokens per row in memory mode")
    add_cluster_arguments(p, n_workers=2)


# ---- row material ------------------------------------------------------------------


def template_batch(n: int, tokens: int, *, layers: int, top_k: int, routes: bool, seed: int = 0) -> PackedBatch:
    """``n`` real staged rows (capture gate, one call each) packed; keys are renamed per use."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        gate = CaptureGate(f"t{i}", vocab_size=512, num_experts=8)
        mask = np.ones(tokens, np.float32)
        lp = -rng.random(tokens, dtype=np.float32) - 0.01
        re = rng.integers(0, 8, (tokens, layers, top_k)).astype(np.int16) if routes else None
        rows.append(gate.stage_call("c0", None, rng.integers(0, 512, tokens), mask, lp, routed_experts=re))
    return pack_rows(rows)


def with_keys(template: PackedBatch, tag: str, start: int, n: int) -> PackedBatch:
    """Rows ``0..n`` of ``template`` under fresh keys ``{tag}{start + i}/c0`` (write-once
    means every put needs new keys; the payload is what is being moved)."""
    base = template if n == len(template) else template.take(np.arange(n))
    return PackedBatch([f"{tag}{start + i}/c0" for i in range(n)], base.fields)


def _progress(label: str, total: int, quiet: bool):
    from ..progress import Progress

    return Progress(label, total=total, quiet=quiet)


# ---- throughput ----------------------------------------------------------------------


def _throughput(store, tokens: int, single_rows: int, batched_rows: int, args) -> dict[str, Any]:
    bs = args.batch_size
    template = template_batch(bs, tokens, layers=args.layers, top_k=args.top_k, routes=not args.no_routes)
    row_bytes = template.nbytes / len(template)
    tag = f"s{tokens}-"
    out: dict[str, Any] = {"tokens_per_row": tokens, "row_bytes": int(row_bytes), "batch_size": bs}
    with _progress(f"store {tokens} tok", 4, args.quiet) as prog:
        # Warm the connections and code paths so neither side pays first-call costs.
        store.put_many(with_keys(template, f"w{tokens}-", 0, 2))
        store.get_many([f"w{tokens}-0/c0"])

        t0 = time.perf_counter()
        for i in range(single_rows):
            res = store.put_many(with_keys(template, tag + "a", i, 1))
            assert not res.failed, res.failed
        put1 = time.perf_counter() - t0
        prog.advance(1, "put bs1")

        n_batches = max(1, batched_rows // bs)
        t0 = time.perf_counter()
        for j in range(n_batches):
            res = store.put_many(with_keys(template, tag + "b", j * bs, bs))
            assert not res.failed, next(iter(res.failed.items()))
        putb = time.perf_counter() - t0
        prog.advance(1, f"put bs{bs}")

        t0 = time.perf_counter()
        for i in range(single_rows):
            got = store.get_many([f"{tag}a{i}/c0"])
            assert len(got.batch) == 1 and not got.failed
        get1 = time.perf_counter() - t0
        prog.advance(1, "get bs1")

        t0 = time.perf_counter()
        for j in range(n_batches):
            got = store.get_many([f"{tag}b{j * bs + i}/c0" for i in range(bs)])
            assert len(got.batch) == bs and not got.failed
        getb = time.perf_counter() - t0
        prog.advance(1, f"get bs{bs}")

    rows_b = n_batches * bs
    for op, t1, tb in (("put", put1, putb), ("get", get1, getb)):
        r1, rb = single_rows / t1, rows_b / tb
        out[f"{op}_rows_per_s_bs1"] = round(r1, 1)
        out[f"{op}_rows_per_s_bs{bs}"] = round(rb, 1)
        out[f"{op}_mb_per_s_bs1"] = round(r1 * row_bytes / 1e6, 2)
        out[f"{op}_mb_per_s_bs{bs}"] = round(rb * row_bytes / 1e6, 2)
        out[f"{op}_ratio"] = round(rb / r1, 2)
    out["rows_bs1"] = single_rows
    out[f"rows_bs{bs}"] = rows_b
    return out


# ---- memory mode ----------------------------------------------------------------------

_SAMPLER: dict[str, Any] = {}


def _start_rss_sampler(interval_s: float = 0.02) -> int:
    """Runs in each worker (``client.run``): sample this process's RSS until stopped."""
    import psutil

    # State lives in the importable module, not in this function's globals: run as
    # ``__main__`` this function is pickled by value and its globals are a copy per call.
    from pipeline.bench import store as here

    proc = psutil.Process()
    state = {"peak": proc.memory_info().rss, "stop": threading.Event()}

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

    from pipeline.bench import store as here

    here._SAMPLER["stop"].set()
    here._SAMPLER["thread"].join()
    return max(here._SAMPLER["peak"], psutil.Process().memory_info().rss)


def _memory_mode(client, args) -> dict[str, Any]:
    from .. import config
    from ..store import StagingStore

    bs = args.batch_size
    tokens = args.memory_row_tokens
    # Rows per batch bounded so one call moves at most ~64 MB.
    template = template_batch(bs, tokens, layers=args.layers, top_k=args.top_k, routes=not args.no_routes, seed=1)
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
        with _progress("store memory: put", n_rows // per_call, args.quiet) as prog:
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
        with _progress("store memory: get", n_rows // per_call, args.quiet) as prog:
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
    return {
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


# ---- entry points -------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns one JSON-able dict (see module docstring)."""
    import dask

    from ..store import StagingStore

    with bench_client(args) as client:
        n_workers = len(client.scheduler_info(n_workers=-1)["workers"])
        result: dict[str, Any] = {"benchmark": "store", "workers": n_workers}
        for tokens, single, batched in (
            (1024, args.single_rows_1024, args.rows_1024),
            (16384, args.single_rows_16384, args.rows_16384),
        ):
            store = StagingStore.start(client, n_units=2, memory_limit="4GiB")
            try:
                result[str(tokens)] = _throughput(store, tokens, single, batched, args)
            finally:
                store.close()
        r = result["1024"]
        bs = args.batch_size
        result["target_ratio"] = TARGET_RATIO
        result["meets_target_1024"] = bool(r["put_ratio"] >= TARGET_RATIO and r["get_ratio"] >= TARGET_RATIO)
        # Replication cost, same run: the batched rows at 1,024 tokens with replicas=1 (above)
        # next to replicas=2 (every put writes two units; healthy gets read primaries only).
        if n_workers >= 2:
            with dask.config.set({"token-capture.store.replicas": 2}):
                store = StagingStore.start(client, n_units=2, memory_limit="4GiB")
                try:
                    r2 = _throughput(store, 1024, args.single_rows_1024, args.rows_1024, args)
                finally:
                    store.close()
            result["replication_1024"] = {
                f"{op}_rows_per_s_bs{bs}_replicas{n}": row[f"{op}_rows_per_s_bs{bs}"]
                for op in ("put", "get") for n, row in ((1, r), (2, r2))
            } | {
                f"{op}_rows_per_s_bs1_replicas{n}": row[f"{op}_rows_per_s_bs1"]
                for op in ("put", "get") for n, row in ((1, r), (2, r2))
            } | {
                f"{op}_cost_ratio_bs{bs}": round(r[f"{op}_rows_per_s_bs{bs}"] / r2[f"{op}_rows_per_s_bs{bs}"], 2)
                for op in ("put", "get")
            }
        else:
            result["replication_1024"] = {"skipped": "replicas=2 needs at least 2 workers"}
        if args.memory:
            result["memory"] = _memory_mode(client, args)
        result["note"] = f"rows/s of {bs}-row calls vs one-row calls, same store, same run"
    return result


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
