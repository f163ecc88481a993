"""Staging-store throughput: one row per call vs 256 rows per call, side by side.

Puts and gets of 1,024- and 16,384-token rows (ids, mask, logprobs, int16 routed experts
[T, L, K], and a staged row's scalar, id and hash fields) on a LocalCluster of 2 workers
with one storage unit each, both call sizes against the same store. ``--memory`` adds the
memory mode: stage ``--memory-gb`` of rows into units limited to ``--unit-memory-limit``,
sample each storage worker's peak RSS and read every row back. ``replication_1024``: the
1,024-token rows/s with ``store.replicas`` 2 next to 1. After each run the same bytes go
over raw loopback TCP (:mod:`.loopback`; ``put_vs_loopback``, ``get_vs_loopback``) and
through bare Dask actors on the same workers (:mod:`.actor_ceiling`; ``put_vs_dask``,
``get_vs_dask``: the store's share of what Dask moves; ``dask_*_vs_loopback``: Dask's).
``--elastic``: the block of :mod:`.store_elastic` (rows/s while a unit is added, rebalance s).

Each call size runs ``--repeats`` times (default 3), each on a fresh store; figures are
medians (every run in ``*_runs``). A run fails on any key a put or get refuses or on a
sampled row read back that is not bit-exact what was put; then ``ok`` is false,
``failures`` says what failed, no ratio is reported and the command exits 1.

    python -m pipeline bench store --json
    python -m pipeline.bench.store --json --memory
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Container, Mapping

import numpy as np

from tasks.packed import PackedBatch

from .. import config
from ..progress import Progress
from . import actor_ceiling, loopback, store_elastic
from .common import add_cluster_arguments, bench_client, compare_rows, main, notes
from .store_memory import memory_mode
from .store_rows import template_batch, with_keys

if TYPE_CHECKING:
    from distributed import Client

    from ..store import StagingStore
    from ..store.protocol import GetResult

TARGET_RATIO = 20.0  # 256-row calls vs one-row calls at 1,024 tokens (rows/s)
# Batched put/get bytes/s over raw loopback TCP's for the same bytes, per row size (tokens).
LOOPBACK_TARGET = {1024: 0.25, 16384: 0.7}
# One row size's figures (:func:`_throughput`): rates, ratios and counts, verdicts, and
# every run's rate in ``*_runs``; the keys name the batch size.
Figures = dict[str, float | bool | list[float]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench store``."""
    from ..cli_args import byte_size, positive_float, positive_int

    p.add_argument("--batch-size", type=positive_int, default=256, help="rows per call in the batched runs (default 256)")
    p.add_argument("--rows-1024", type=positive_int, default=4096, help="rows moved by batched calls at 1,024 tokens")
    p.add_argument("--rows-16384", type=positive_int, default=2048, help="rows moved by batched calls at 16,384 tokens (default 2048: 8 timed calls each way)")
    p.add_argument("--single-rows-1024", type=positive_int, default=400, help="rows moved one per call at 1,024 tokens")
    p.add_argument("--single-rows-16384", type=positive_int, default=100, help="rows moved one per call at 16,384 tokens")
    p.add_argument("--layers", type=positive_int, default=4, help="routed-experts L (default 4)")
    p.add_argument("--top-k", type=positive_int, default=2, help="routed-experts K (default 2)")
    p.add_argument("--no-routes", action="store_true", help="rows without routed experts")
    p.add_argument("--memory", action="store_true", help="also run the memory mode (spill under a memory limit)")
    p.add_argument("--memory-gb", type=positive_float, default=2.0, help="GB of rows staged in memory mode (default 2)")
    p.add_argument("--unit-memory-limit", type=byte_size, default="256MiB", help="per-unit memory limit in memory mode")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per mode, each on a fresh store; medians reported (default 3)")
    p.add_argument("--memory-row-tokens", type=positive_int, default=16384, help="tokens per row in memory mode")
    store_elastic.add_flags(p)
    add_cluster_arguments(p, n_workers=2)


# ---- throughput ----------------------------------------------------------------------

SAMPLE_ROWS = 4  # rows per sampled read compared bit-exact with what was written
WARM_CALLS = 2  # untimed full calls each way on a fresh store before the timed loops (+1 get)


def _refused(what: str, failed: Mapping[str, tuple[str, str]]) -> str:
    key, why = next(iter(failed.items()))
    return f"{what}: {len(failed)} key(s) failed, e.g. {key}: {why}"


@dataclass
class _TimedGets:
    """What a timed loop of gets saw: its wall time, the keys refused, the calls that came
    back short of rows, and the sampled answers ``(call index, answer)`` to compare."""

    seconds: float
    failed: dict[str, tuple[str, str]]
    short: int
    samples: list[tuple[int, GetResult]]


def _warm_up(store: StagingStore, template: PackedBatch, tag: str, where: str, failures: list[str]) -> None:
    """Warm the connections, the code paths and the pooled buffers of a fresh store (the
    units' answer slabs, the client's gather and merge slabs: a timed get holds the
    previous answer while the next one is packed, so pools hold a few slabs): WARM_CALLS
    full calls each way (+1 get), untimed. What is timed is a long-lived store's steady
    state. A refused warm-up put goes to ``failures``."""
    for w in range(WARM_CALLS):
        warm = with_keys(template, f"w{w}{tag}", 0, len(template))
        res = store.put_many(warm)
        if res.failed:
            failures.append(_refused(where + "warm-up put", res.failed))
        store.get_many(warm.keys)
    store.get_many(warm.keys)


def _timed_puts(store: StagingStore, template: PackedBatch, prefix: str, calls: int, rows_per_call: int
                ) -> tuple[float, dict[str, tuple[str, str]]]:
    """Wall seconds of ``calls`` puts of ``rows_per_call`` rows each, under the fresh keys
    ``{prefix}{n}/c0`` (n = 0, 1, ...), and every key a put refused."""
    failed: dict[str, tuple[str, str]] = {}
    t0 = time.perf_counter()
    for j in range(calls):
        res = store.put_many(with_keys(template, prefix, j * rows_per_call, rows_per_call))
        if res.failed:
            failed.update(res.failed)
    return time.perf_counter() - t0, failed


def _timed_gets(store: StagingStore, prefix: str, calls: int, rows_per_call: int, sampled: Container[int]) -> _TimedGets:
    """Wall seconds of ``calls`` gets of ``rows_per_call`` keys each (``{prefix}{n}/c0``,
    as :func:`_timed_puts` wrote them), keeping the answers of the ``sampled`` calls."""
    failed: dict[str, tuple[str, str]] = {}
    short = 0
    samples: list[tuple[int, GetResult]] = []
    t0 = time.perf_counter()
    for j in range(calls):
        got = store.get_many([f"{prefix}{j * rows_per_call + i}/c0" for i in range(rows_per_call)])
        if got.failed or len(got.batch) != rows_per_call:
            failed.update(got.failed)
            short += len(got.batch) != rows_per_call
        if j in sampled:
            samples.append((j, got))
    return _TimedGets(time.perf_counter() - t0, failed, short, samples)


def _check_read_back(template: PackedBatch, prefix: str, rows_per_call: int, gets: _TimedGets, what: str,
                     failures: list[str]) -> None:
    """The first SAMPLE_ROWS rows of each sampled get, bit-exact against what was put
    (a get short of them was already reported); problems go to ``failures``."""
    k = min(SAMPLE_ROWS, rows_per_call)
    for j, got in gets.samples:
        if len(got.batch) >= k:
            want = with_keys(template, prefix, j * rows_per_call, rows_per_call).take(np.arange(k))
            failures.extend(compare_rows(want, got.batch.take(np.arange(k)), what=what))


def _throughput_once(store: StagingStore, template: PackedBatch, tokens: int, single_rows: int, n_batches: int,
                     args: argparse.Namespace, tag: str, prog: Progress, failures: list[str]) -> dict[str, float]:
    """One run of the four timed loops on fresh keys: wall seconds of ``single_rows``
    one-row puts (``put1``), ``n_batches`` puts of ``args.batch_size`` rows (``putb``), and
    the same gets (``get1``, ``getb``). Per-key failures and content mismatches (on a
    sample of the rows read back, compared after the timed loops) go to ``failures``."""
    bs = args.batch_size
    where = f"{tokens} tokens {tag}: "
    single, batched = tag + "a", tag + "b"
    _warm_up(store, template, tag, where, failures)

    put1, failed = _timed_puts(store, template, single, single_rows, 1)
    if failed:
        failures.append(_refused(where + "put bs1", failed))
    prog.advance(1, "put bs1")

    putb, failed = _timed_puts(store, template, batched, n_batches, bs)
    if failed:
        failures.append(_refused(where + f"put bs{bs}", failed))
    prog.advance(1, f"put bs{bs}")

    get1 = _timed_gets(store, single, single_rows, 1, range(SAMPLE_ROWS))
    if get1.failed or get1.short:
        failures.append(_refused(where + "get bs1", get1.failed) if get1.failed else f"{where}get bs1: {get1.short} get(s) returned no row")
    prog.advance(1, "get bs1")

    getb = _timed_gets(store, batched, n_batches, bs, (0, n_batches - 1))
    if getb.failed or getb.short:
        failures.append(_refused(where + f"get bs{bs}", getb.failed) if getb.failed else f"{where}get bs{bs}: {getb.short} get(s) short of rows")
    prog.advance(1, f"get bs{bs}")

    _check_read_back(template, single, 1, get1, where + "get bs1 ", failures)
    _check_read_back(template, batched, bs, getb, where + f"get bs{bs} ", failures)
    return {"put1": put1, "putb": putb, "get1": get1.seconds, "getb": getb.seconds}


def _throughput(
    client: Client, tokens: int, single_rows: int, batched_rows: int, args: argparse.Namespace, failures: list[str],
    with_loopback: bool = True,
) -> Figures:
    """``args.repeats`` runs, each on a fresh store; every figure is the median over the runs.
    ``with_loopback``: after each run, the same bytes over raw loopback TCP (``*_vs_loopback``)."""
    from ..store import StagingStore

    bs = args.batch_size
    template = template_batch(bs, tokens, layers=args.layers, top_k=args.top_k, routes=not args.no_routes)
    row_bytes = template.nbytes / len(template)
    n_batches = max(1, batched_rows // bs)
    rows_b = n_batches * bs
    out: Figures = {"tokens_per_row": tokens, "row_bytes": int(row_bytes), "batch_size": bs, "repeats": args.repeats}
    runs: list[dict[str, float]] = []
    wire: list[dict[str, float]] = []
    bare: list[dict[str, float]] = []
    with Progress(f"store {tokens} tok", total=(6 if with_loopback else 4) * args.repeats, quiet=args.quiet) as prog:
        for rep in range(args.repeats):
            store = StagingStore.start(client, n_units=2, memory_limit="4GiB")
            try:
                runs.append(_throughput_once(store, template, tokens, single_rows, n_batches, args, f"s{tokens}r{rep}-", prog, failures))
            except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
                failures.append(f"{tokens} tokens run {rep}: {type(e).__name__}: {e}")
            finally:
                store.close()
            if with_loopback:
                # The same bytes in the same call sizes over raw loopback TCP, right after, so
                # machine load hits the store and its ceiling alike.
                wire.append(loopback.measure(int(template.nbytes), n_batches))
                prog.advance(1, "loopback")
                # And through bare Dask actors on the same workers, shaped like the store's
                # calls: what Dask itself moves when the receiver keeps the bytes.
                try:
                    bare.append(actor_ceiling.measure(client, template, n_batches, config.get_bytes("store.max-call-bytes")))
                except Exception as e:  # noqa: BLE001 - reported, then fails the command
                    failures.append(f"{tokens} tokens run {rep} bare Dask actors: {type(e).__name__}: {e}")
                prog.advance(1, "bare Dask actors")
    if not runs:
        return out
    for op in ("put", "get"):
        r1s = [single_rows / r[f"{op}1"] for r in runs]
        rbs = [rows_b / r[f"{op}b"] for r in runs]
        r1, rb = statistics.median(r1s), statistics.median(rbs)
        out[f"{op}_rows_per_s_bs1"] = round(r1, 1)
        out[f"{op}_rows_per_s_bs{bs}"] = round(rb, 1)
        out[f"{op}_rows_per_s_bs1_median"] = round(r1, 1)
        out[f"{op}_rows_per_s_bs{bs}_median"] = round(rb, 1)
        out[f"{op}_rows_per_s_bs1_runs"] = [round(x, 1) for x in r1s]
        out[f"{op}_rows_per_s_bs{bs}_runs"] = [round(x, 1) for x in rbs]
        out[f"{op}_mb_per_s_bs1"] = round(r1 * row_bytes / 1e6, 2)
        out[f"{op}_mb_per_s_bs{bs}"] = round(rb * row_bytes / 1e6, 2)
        out[f"{op}_ratio"] = round(rb / r1, 2)
        if not wire:
            continue
        # The store's batched bytes/s over raw loopback TCP's for the same call bytes.
        side = "send" if op == "put" else "recv"
        wire_bps = statistics.median(w[f"{side}_bytes_per_s"] for w in wire)
        out[f"loopback_{side}_mb_per_s"] = round(wire_bps / 1e6, 1)
        out[f"loopback_{side}_mb_per_s_runs"] = [round(w[f"{side}_bytes_per_s"] / 1e6, 1) for w in wire]
        out[f"{op}_vs_loopback"] = round(rb * row_bytes / wire_bps, 3)
        if not bare:
            continue
        # Dask's own ceiling for the same calls, and how far the store is from it.
        dask_bps = statistics.median(b[f"{op}_bytes_per_s"] for b in bare)
        out[f"dask_{op}_mb_per_s"] = round(dask_bps / 1e6, 1)
        out[f"dask_{op}_mb_per_s_runs"] = [round(b[f"{op}_bytes_per_s"] / 1e6, 1) for b in bare]
        out[f"dask_{op}_vs_loopback"] = round(dask_bps / wire_bps, 3)
        out[f"{op}_vs_dask"] = round(rb * row_bytes / dask_bps, 3)
    if wire:
        out["loopback_target"] = LOOPBACK_TARGET[tokens]
        out["meets_loopback_target"] = bool(min(out["put_vs_loopback"], out["get_vs_loopback"]) >= LOOPBACK_TARGET[tokens])
    out["rows_bs1"] = single_rows
    out[f"rows_bs{bs}"] = rows_b
    return out


# ---- entry points -------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run the benchmark; returns one JSON-able dict (see module docstring)."""
    import dask

    failures: list[str] = []
    with bench_client(args) as client:
        n_workers = len(client.scheduler_info(n_workers=-1)["workers"])
        result: dict[str, object] = {"benchmark": "store", "workers": n_workers, "repeats": args.repeats}
        by_size: dict[str, Figures] = {}
        for tokens, single, batched in (
            (1024, args.single_rows_1024, args.rows_1024),
            (16384, args.single_rows_16384, args.rows_16384),
        ):
            result[str(tokens)] = by_size[str(tokens)] = _throughput(client, tokens, single, batched, args, failures)
        r = by_size["1024"]
        bs = args.batch_size
        result["target_ratio"] = TARGET_RATIO
        parts = [by_size[str(t)] for t in LOOPBACK_TARGET if "meets_loopback_target" in by_size[str(t)]]
        if len(parts) == len(LOOPBACK_TARGET):
            result["meets_loopback_targets"] = all(p["meets_loopback_target"] for p in parts)
        if "put_ratio" in r:
            result["meets_target_1024"] = bool(r["put_ratio"] >= TARGET_RATIO and r["get_ratio"] >= TARGET_RATIO)
        # Replication cost, same run: the batched rows at 1,024 tokens with replicas=1 (above)
        # next to replicas=2 (every put writes two units; healthy gets read primaries only).
        if n_workers >= 2:
            rep_failures: list[str] = []
            with dask.config.set({"token-capture.store.replicas": 2}):
                r2 = _throughput(client, 1024, args.single_rows_1024, args.rows_1024, args, rep_failures, with_loopback=False)
            failures.extend(f"replicas=2: {f}" for f in rep_failures)
            if "put_ratio" in r and "put_ratio" in r2:
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
                result["replication_1024"] = {"skipped": "a run failed"}
        else:
            result["replication_1024"] = {"skipped": "replicas=2 needs at least 2 workers"}
        if args.memory:
            try:
                result["memory"] = memory = memory_mode(client, args)
                if not memory["all_rows_read_back"]:
                    failures.append(f"memory mode: {memory['rows_read_back']} of {memory['rows']} rows read back")
            except RuntimeError as e:
                failures.append(f"memory mode: {e}")
        result["note"] = f"rows/s of {bs}-row calls vs one-row calls, same store, same run; medians of {args.repeats} run(s)"
    if args.elastic:  # after the cluster above is closed: the block starts its own
        result["elastic"] = store_elastic.block(args, failures)
    result["failures"] = failures
    result["ok"] = not failures
    if failures:
        _drop_ratios(result)
        notes("store", args.quiet)(f"FAILED ({len(failures)}): {failures[:3]}")
    return result


def _drop_ratios(result: dict[str, object]) -> None:
    """No ratio or target verdict computed over failed runs."""
    for key in ("target_ratio", "meets_target_1024", "meets_loopback_targets"):
        result.pop(key, None)
    for part in ("1024", "16384"):
        figures = result.get(part)
        if not isinstance(figures, dict):  # not measured
            continue
        for op in ("put", "get"):
            figures.pop(f"{op}_ratio", None)
            for key in (f"{op}_vs_loopback", f"{op}_vs_dask", f"dask_{op}_vs_loopback"):
                figures.pop(key, None)
        figures.pop("meets_loopback_target", None)
    if isinstance(result.get("elastic"), dict):
        store_elastic.drop_ratios(result["elastic"])
    rep = result.get("replication_1024")
    if isinstance(rep, dict):
        for key in [k for k in rep if "ratio" in k]:
            rep.pop(key)


def exit_status(result: Mapping[str, object]) -> int:
    """The CLI's exit status: 0 when no put, get or read-back check failed, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
