"""Checkpoint-cut writes: one put per call vs batched puts, side by side.

32 writer clients (threads) cut their in-flight calls through the real cut transaction
against a real StagingStore, at 1,024- and 16,384-token prefixes, one row per put vs 256.
``wall_s`` runs until the last cut returns its receipt; ``cpu_s`` is the CPU seconds of the
controller and each worker meanwhile. Figures: docs/design.md, "Benchmarks".

Each mode runs ``--repeats`` times (default 3, alternating which goes first, each on a
fresh store); ``wall_s`` and ``rows_per_s`` are the medians (also ``*_median``; every run
in ``wall_s_runs``). A run fails on a cut that raises, any ``durable_failure`` ack, or a
sampled prefix row read back that is not bit-exact the row frozen (``np.array_equal`` per
field); then ``ok`` is false, ``failures`` says what failed, no speedup is reported and
the command exits 1 (:func:`exit_status`).

    python -m pipeline bench cut --json
    python -m pipeline.bench.cut --json --rows 2048 --rows-16384 512
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from .common import add_cluster_arguments, bench_client, main, notes

TARGETS = {"speedup_1024": 25.0, "speedup_16384": 3.0}
CONTEXT_TOKENS = 16
SAMPLE_ROWS = 4  # cut rows read back and compared bit-exact per run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench cut``."""
    from ..cli_args import byte_size, positive_int, positive_int_list

    p.add_argument("--rows", type=positive_int, default=8192, help="prefix rows at 1,024 tokens (default 8,192)")
    p.add_argument("--rows-16384", type=positive_int, default=2048,
                   help="prefix rows at 16,384 tokens (default 2,048: 512 MB; the reference used 8,192)")
    p.add_argument("--clients", type=positive_int, default=32, help="concurrent writer clients (default 32)")
    p.add_argument("--batch-size", type=positive_int, default=256, help="rows per put in the batched mode (default 256)")
    p.add_argument("--tokens", type=positive_int_list, default="1024,16384", help="prefix token counts to run (comma-separated)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per mode, alternating order; medians reported (default 3)")
    p.add_argument("--unit-memory-limit", type=byte_size, default="2GiB", help="per storage unit memory before spilling")
    add_cluster_arguments(p, n_workers=2)


def _client_calls(client_idx: int, n_calls: int, tokens: int, tag: str) -> list:
    """One writer client's in-flight calls: ``tokens``-token prefixes (context + generated)."""
    from ..generation.call_buffer import CallBuffer

    rng = np.random.default_rng(client_idx)
    gen_n = tokens - CONTEXT_TOKENS
    calls = []
    for i in range(n_calls):
        b = CallBuffer(f"{tag}c{client_idx}r{i}", "call-0", rng.integers(0, 512, CONTEXT_TOKENS),
                       max_new_tokens=gen_n + 1)
        b.append(rng.integers(0, 512, gen_n), -rng.random(gen_n, dtype=np.float32))
        calls.append(b)
    return calls


def _one_config(store, tokens: int, rows: int, rows_per_put: int, args, tag: str, client=None) -> dict[str, Any]:
    from tasks.cut.batching import BatchLimits
    from tasks.cut.receipt import inventory_digest

    from .. import config
    from ..generation.cut import run_cut

    n_clients = min(args.clients, rows)
    shares = [rows // n_clients + (1 if c < rows % n_clients else 0) for c in range(n_clients)]
    per_client = [_client_calls(c, shares[c], tokens, tag) for c in range(n_clients)]
    limits = BatchLimits(
        max_rows=rows_per_put,
        max_tokens=int(config.get("cut.generation-prefix-batch-max-tokens")),
        max_bytes=int(config.get_bytes("cut.generation-prefix-batch-max-bytes")),
    )
    barrier = threading.Barrier(n_clients + 1)
    results: list[Any] = [None] * n_clients

    def writer(c: int) -> None:
        calls = [(b.call, b) for b in per_client[c]]
        barrier.wait()
        try:
            results[c] = run_cut(calls, store, checkpoint_id=f"{tag}ck", inventory_digest=inventory_digest([k for k, _ in calls]),
                                 deadline=time.time() + 3600, limits=limits, worker=f"client-{c}")
        except BaseException as e:  # reported, not raised from a thread
            results[c] = e

    threads = [threading.Thread(target=writer, args=(c,), daemon=True) for c in range(n_clients)]
    for t in threads:
        t.start()
    cpu0 = _cpu_seconds(client)
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = _cpu_seconds(client)
    problems = [f"cut raised in client {c}: {r!r}" for c, r in enumerate(results) if isinstance(r, BaseException)][:3]
    done = [r for r in results if not isinstance(r, BaseException)]
    receipts = [r[0] for r in done]
    waits = [w for r in done for w in r[1].row_wait_ms]
    durable = sum(len(r.durable) for r in receipts)
    acks_failed = [a for r in receipts for a in r.failures]
    if acks_failed:
        a = acks_failed[0]
        problems.append(f"{len(acks_failed)} durable_failure ack(s), e.g. {a.rollout_id}/{a.model_call_id}: {a.reason} {a.detail}".rstrip())
    if not problems and durable != rows:
        problems.append(f"{durable} durable acks for {rows} rows")
    if not isinstance(results[0], BaseException):
        problems += _check_content(store, results[0][0], tokens, tag)
    return {
        "prefix_tokens": tokens,
        "rows_per_put": rows_per_put,
        "rows": rows,
        "clients": n_clients,
        "put_calls": sum(r.put_calls for r in receipts),
        "wall_s": round(wall, 4),
        "rows_per_s": round(rows / wall, 1),
        "mean_row_wait_ms": round(float(np.mean(waits)) if waits else 0.0, 2),
        "durable": durable,
        "failed": rows - durable,
        "bytes_written": sum(r.bytes_written for r in receipts),
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 3) for k in cpu0 if k in cpu1},
        "problems": problems,
    }


def _check_content(store, receipt, tokens: int, tag: str) -> list[str]:
    """Read back the first ``SAMPLE_ROWS`` durable prefixes of client 0 and compare them
    bit-exact (every field) with the same calls rebuilt (same seeds) and frozen again."""
    from tasks.keys import CUT_PARTITION
    from tasks.packed import PackedBatch, pack_rows

    from .common import compare_rows

    acks = [a for a in receipt.acks if a.durable][:SAMPLE_ROWS]
    if not acks:
        return []
    # The client's calls are drawn in order from one seeded generator: its first calls again.
    n = max(int(a.rollout_id.rsplit("r", 1)[1]) for a in acks) + 1
    again = {b.call: b for b in _client_calls(0, n, tokens, tag)}
    rows, keys = [], []
    for a in acks:
        frozen = again[a.call].freeze(receipt.checkpoint_id)
        if frozen.key not in a.staging_keys:
            return [f"{a.rollout_id}/{a.model_call_id}: sealed keys {list(a.staging_keys)} lack {frozen.key}"]
        rows.append(frozen.row)
        keys.append(frozen.key)
    want = pack_rows(rows)
    want = PackedBatch(keys, want.fields)
    got = store.get_many(keys, partition=CUT_PARTITION)
    if got.failed:
        key, why = next(iter(got.failed.items()))
        return [f"read-back get: {len(got.failed)} key(s) failed, e.g. {key}: {why}"]
    return compare_rows(want, got.batch, what="read back ")


def _process_cpu_s() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def _cpu_seconds(client) -> dict[str, float]:
    """CPU seconds (user + system) of this process and of every worker process so far."""
    out = {"controller": _process_cpu_s()}
    for addr, cpu in (client.run(_process_cpu_s) if client is not None else {}).items():
        out[addr] = cpu
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the cut table; returns the JSON-able result (see module docstring)."""
    from ..store.client import StagingStore

    token_sizes = [int(t) for t in str(args.tokens).split(",") if t]
    rows_for = {1024: args.rows, 16384: args.rows_16384}
    say = notes("cut", args.quiet)
    table: list[dict[str, Any]] = []
    failures: list[str] = []
    with bench_client(args) as client:
        with tempfile.TemporaryDirectory(prefix="bench-cut-") as spill:
            for tokens in token_sizes:
                rows = rows_for.get(tokens, args.rows)
                runs: dict[int, list[dict[str, Any]]] = {1: [], args.batch_size: []}
                for rep in range(args.repeats):
                    # Alternating which mode goes first; each run on a fresh store of the same shape.
                    order = (1, args.batch_size) if rep % 2 == 0 else (args.batch_size, 1)
                    for rpp in order:
                        store = StagingStore.start(client, n_units=2, memory_limit=args.unit_memory_limit, spill_directory=spill)
                        try:
                            say(f"{tokens} tokens x {rows} rows, {rpp} rows/put, {args.clients} clients, run {rep + 1} ...")
                            row = _one_config(store, tokens, rows, rpp, args, tag=f"t{tokens}b{rpp}r{rep}", client=client)
                        except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
                            failures.append(f"{tokens} tokens, {rpp} rows/put, run {rep + 1}: {type(e).__name__}: {e}")
                            continue
                        finally:
                            store.close()
                        failures += [f"{tokens} tokens, {rpp} rows/put, run {rep + 1}: {p}" for p in row.pop("problems")]
                        say(f"  {row['put_calls']} puts, {row['wall_s']:.2f} s, {row['rows_per_s']:.0f} rows/s, "
                            f"row wait {row['mean_row_wait_ms']:.1f} ms, cpu s {row['cpu_s']}")
                        runs[rpp].append(row)
                for rpp, rs in runs.items():
                    if rs:
                        table.append(_median_row(rs))
    out: dict[str, Any] = {"benchmark": "cut", "clients": args.clients, "repeats": args.repeats, "table": table}
    if failures:
        say(f"FAILED ({len(failures)}): {failures[:3]}")
    else:
        for tokens in token_sizes:
            base = [r for r in table if r["prefix_tokens"] == tokens and r["rows_per_put"] == 1]
            batched = [r for r in table if r["prefix_tokens"] == tokens and r["rows_per_put"] == args.batch_size]
            if base and batched:
                out[f"speedup_{tokens}"] = round(base[0]["wall_s"] / batched[0]["wall_s"], 2)
        out["targets"] = {k: v for k, v in TARGETS.items() if k in out}
        out["meets_targets"] = all(out[k] >= v for k, v in out["targets"].items())
    out["failures"] = failures
    out["ok"] = not failures
    return out


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from a mode's runs: the median-wall run's figures, with every run's
    wall in ``wall_s_runs`` (``wall_s`` and ``rows_per_s`` are the medians)."""
    walls = [r["wall_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]
    row = dict(mid)
    row["wall_s"] = row["wall_s_median"] = round(statistics.median(walls), 4)
    row["rows_per_s"] = row["rows_per_s_median"] = round(statistics.median(r["rows_per_s"] for r in runs), 1)
    row["wall_s_runs"] = walls
    row["runs"] = len(runs)
    row["failed"] = max(r["failed"] for r in runs)
    return row


def exit_status(result: dict[str, Any]) -> int:
    """The CLI's exit status: 0 when every cut of every run sealed every row and read back intact, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
