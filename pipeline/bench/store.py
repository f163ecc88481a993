"""Staging-store throughput: one row per call vs 256 rows per call, side by side.

Puts and gets of 1,024- and 16,384-token rows (routed experts of ``--profile``'s shape) on
a LocalCluster of 2 workers, one storage unit each: the grow-only mode (every row stays);
``--steady`` adds the steady mode (:mod:`.store_steady`: put -> get -> delete of one step's
rows, round after round); ``--memory`` the memory mode (:mod:`.store_memory`); ``--elastic``
the block of :mod:`.store_elastic`. ``replication_1024``: replicas 2 next to 1. After each
run the same bytes go over raw loopback TCP (:mod:`.loopback`, ``*_vs_loopback``) and bare
Dask actors (:mod:`.actor_ceiling`, ``*_vs_dask``). Every size reports bytes per token and
GB/s next to rows/s. Each mode runs ``--repeats`` times (default 3) on fresh stores;
figures are medians (every run in ``*_runs``). A refused key or a row read back that is
not bit-exact fails the run: ``ok`` false, ``failures`` say what, no ratio, exit 1.
docs/performance.md lists the JSON keys.

    python -m pipeline bench store --json --steady
    python -m pipeline bench store --json --steady --profile qwen3-moe --batch-size 64
    python -m pipeline.bench.store --json --memory --profile qwen3-moe
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Container, Iterator, Mapping

import numpy as np

from tasks.packed import PackedBatch

from tasks.profiles import MoeProfile

from .. import config
from ..actors import workers_now
from ..progress import Progress
from . import actor_ceiling, loopback, store_elastic, store_steady
from .common import add_cluster_arguments, bench_client, compare_rows, main, notes, refused
from .profile_args import add_profile_argument, payload_figures, profile_from_args, route_id_bytes
from .store_memory import memory_mode
from .store_rows import template_batch, with_keys

if TYPE_CHECKING:
    from distributed import Client

    from ..store import StagingStore
    from ..store.protocol import GetResult

TARGET_RATIO = 20.0  # 256-row calls vs one-row calls at 1,024 tokens (rows/s)
# Batched put/get bytes/s over raw loopback TCP's for the same bytes, per row size (tokens).
LOOPBACK_TARGET = {1024: 0.25, 16384: 0.7}
# Steady mode: put/get bytes/s over loopback's, rows without routes and rows of a real MoE
# profile; toy-profile rows at 16,384 tokens (at 1,024 they carry too few bytes to say).
STEADY_TARGET_NO_ROUTES = 0.3
STEADY_TARGET = 0.5
ROWS_BYTES = 5e8  # default rows moved per timed loop: at most this many bytes' worth ...
MIN_CALLS = 4  # ... in at least this many calls
CEILING_BYTES = 2e9  # bytes moved by each ceiling (loopback, bare actors) per run, at most
# One row size's figures (:func:`_throughput`): rates, ratios and counts, verdicts, and
# every run's rate in ``*_runs``; the keys name the batch size.
Figures = dict[str, float | bool | list[float]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench store``."""
    from ..cli_args import byte_size, positive_float, positive_int

    p.add_argument("--batch-size", type=positive_int, default=256, help="rows per call in the batched runs (default 256)")
    p.add_argument("--rows-1024", type=positive_int, default=None,
                   help="rows moved by batched calls at 1,024 tokens (default: 4096, at most 0.5 GB's worth, at least 4 calls)")
    p.add_argument("--rows-16384", type=positive_int, default=None,
                   help="rows moved by batched calls at 16,384 tokens (default: 2048, at most 0.5 GB's worth, at least 4 calls)")
    p.add_argument("--single-rows-1024", type=positive_int, default=400, help="rows moved one per call at 1,024 tokens")
    p.add_argument("--single-rows-16384", type=positive_int, default=100, help="rows moved one per call at 16,384 tokens")
    add_profile_argument(p)
    p.add_argument("--layers", type=positive_int, default=None, help="routed-experts L (default: the profile's)")
    p.add_argument("--top-k", type=positive_int, default=None, help="routed-experts K (default: the profile's)")
    p.add_argument("--no-routes", action="store_true", help="rows without routed experts")
    p.add_argument("--steady", action="store_true", help="also run the steady mode: rounds of put -> get -> delete of one step's rows")
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
            failures.append(refused(where + "warm-up put", res.failed))
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
        failures.append(refused(where + "put bs1", failed))
    prog.advance(1, "put bs1")

    putb, failed = _timed_puts(store, template, batched, n_batches, bs)
    if failed:
        failures.append(refused(where + f"put bs{bs}", failed))
    prog.advance(1, f"put bs{bs}")

    get1 = _timed_gets(store, single, single_rows, 1, range(SAMPLE_ROWS))
    if get1.failed or get1.short:
        failures.append(refused(where + "get bs1", get1.failed) if get1.failed else f"{where}get bs1: {get1.short} get(s) returned no row")
    prog.advance(1, "get bs1")

    getb = _timed_gets(store, batched, n_batches, bs, (0, n_batches - 1))
    if getb.failed or getb.short:
        failures.append(refused(where + f"get bs{bs}", getb.failed) if getb.failed else f"{where}get bs{bs}: {getb.short} get(s) short of rows")
    prog.advance(1, f"get bs{bs}")

    _check_read_back(template, single, 1, get1, where + "get bs1 ", failures)
    _check_read_back(template, batched, bs, getb, where + f"get bs{bs} ", failures)
    return {"put1": put1, "putb": putb, "get1": get1.seconds, "getb": getb.seconds}


def default_rows(given: int | None, fallback: int, row_bytes: float, bs: int) -> int:
    """Rows a batched timed loop moves: ``given``, else ``fallback`` cut to at most
    ``ROWS_BYTES`` bytes' worth, in at least ``MIN_CALLS`` calls of ``bs`` rows."""
    if given is not None:
        return given
    return max(MIN_CALLS * bs, min(fallback, int(ROWS_BYTES // row_bytes) // bs * bs))


def steady_target(tokens: int, prof: MoeProfile | None) -> float | None:
    """The steady mode's loopback target for rows of ``tokens`` (``prof`` None: no routes)."""
    if prof is None:
        return STEADY_TARGET_NO_ROUTES
    if prof.name == "toy" and tokens < 16384:
        return None
    return STEADY_TARGET


def _throughput(
    client: Client, tokens: int, single_rows: int, batched_rows: int | None, args: argparse.Namespace,
    failures: list[str], with_loopback: bool = True, steady: bool = False,
) -> Figures:
    """``args.repeats`` runs, each on a fresh store (and with ``steady`` one more for the
    steady mode); every figure is the median over the runs. ``with_loopback``: after each
    run, the same bytes over raw loopback TCP (``*_vs_loopback``) and bare Dask actors."""
    from ..store import StagingStore

    bs = args.batch_size
    prof = None if args.no_routes else profile_from_args(args)
    template = template_batch(bs, tokens, layers=prof.layers if prof else 1, top_k=prof.top_k if prof else 1,
                              experts=prof.experts if prof else 8, routes=prof is not None)
    row_bytes = template.nbytes / len(template)
    n_batches = max(1, default_rows(batched_rows, 4096 if tokens <= 1024 else 2048, row_bytes, bs) // bs)
    ceiling_calls = max(1, min(n_batches, int(CEILING_BYTES // template.nbytes)))
    out: Figures = {"tokens_per_row": tokens, "row_bytes": int(row_bytes), "batch_size": bs, "repeats": args.repeats,
                    "bytes_per_token": round(row_bytes / tokens, 1)}
    runs: list[dict[str, float]] = []
    steady_runs: list[dict] = []
    wire: list[dict[str, float]] = []
    bare: list[dict[str, float]] = []
    steps = 4 + (2 if with_loopback else 0) + (1 if steady else 0)
    with Progress(f"store {tokens} tok", total=steps * args.repeats, quiet=args.quiet) as prog:
        for rep in range(args.repeats):
            where = f"{tokens} tokens run {rep}: "
            with _fresh_store(StagingStore, client, where, failures) as store:
                runs.append(_throughput_once(store, template, tokens, single_rows, n_batches, args, f"s{tokens}r{rep}-", prog, failures))
            if steady:
                with _fresh_store(StagingStore, client, where + "steady ", failures) as store:
                    steady_runs.append(store_steady.steady_once(store, template, n_batches, f"d{tokens}r{rep}-", where, failures))
                prog.advance(1, "steady")
            if with_loopback:
                # The same bytes in the same call sizes over raw loopback TCP, right after, so
                # machine load hits the store and its ceiling alike.
                wire.append(loopback.measure(int(template.nbytes), ceiling_calls))
                prog.advance(1, "loopback")
                # And through bare Dask actors on the same workers, shaped like the store's
                # calls: what Dask itself moves when the receiver keeps the bytes.
                try:
                    bare.append(actor_ceiling.measure(client, template, ceiling_calls, config.get_bytes("store.max-call-bytes")))
                except Exception as e:  # noqa: BLE001 - reported, then fails the command
                    failures.append(f"{where}bare Dask actors: {type(e).__name__}: {e}")
                prog.advance(1, "bare Dask actors")
    if runs and len(runs) == args.repeats:
        out.update(_figures(runs, single_rows, n_batches * bs, bs, row_bytes, wire, bare))
        if wire:
            out["loopback_target"] = LOOPBACK_TARGET[tokens]
            out["meets_loopback_target"] = bool(min(out["put_vs_loopback"], out["get_vs_loopback"]) >= LOOPBACK_TARGET[tokens])
    if steady_runs and len(steady_runs) == args.repeats:
        out["steady"] = store_steady.steady_figures(steady_runs, bs, n_batches, row_bytes, wire, steady_target(tokens, prof))
    out["rows_bs1"] = single_rows
    out[f"rows_bs{bs}"] = n_batches * bs
    return out


@contextlib.contextmanager
def _fresh_store(cls: type[StagingStore], client: Client, where: str, failures: list[str]) -> Iterator[StagingStore]:
    """A fresh 2-unit store, closed after the block; an exception in the block is a failure."""
    store = cls.start(client, n_units=2, memory_limit="4GiB")
    try:
        yield store
    except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
        failures.append(f"{where}{type(e).__name__}: {e}")
    finally:
        store.close()


def _figures(runs: list[dict[str, float]], single_rows: int, rows_b: int, bs: int, row_bytes: float,
             wire: list[dict[str, float]], bare: list[dict[str, float]]) -> Figures:
    """The grow-only mode's medians: rows/s, MB/s and GB/s per call size, ratios to the
    one-row calls, to loopback TCP and to bare Dask actors."""
    out: Figures = {}
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
        out[f"{op}_gb_s_bs{bs}"] = round(rb * row_bytes / 1e9, 3)
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
    return out


# ---- entry points -------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run the benchmark; returns one JSON-able dict (see module docstring)."""
    import dask

    failures: list[str] = []
    with bench_client(args) as client:
        n_workers = len(workers_now(client))
        result: dict[str, object] = {"benchmark": "store", "workers": n_workers, "repeats": args.repeats, **_payload(args)}
        by_size: dict[str, Figures] = {}
        for tokens, single, batched in (
            (1024, args.single_rows_1024, args.rows_1024),
            (16384, args.single_rows_16384, args.rows_16384),
        ):
            result[str(tokens)] = by_size[str(tokens)] = _throughput(client, tokens, single, batched, args, failures,
                                                                     steady=args.steady)
        r = by_size["1024"]
        bs = args.batch_size
        result["target_ratio"] = TARGET_RATIO
        parts = [by_size[str(t)] for t in LOOPBACK_TARGET if "meets_loopback_target" in by_size[str(t)]]
        if len(parts) == len(LOOPBACK_TARGET):
            result["meets_loopback_targets"] = all(p["meets_loopback_target"] for p in parts)
        verdicts = [f["steady"]["meets_loopback_target"] for f in by_size.values() if "meets_loopback_target" in f.get("steady", {})]
        if verdicts:
            result["meets_steady_targets"] = all(verdicts)
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


def _payload(args: argparse.Namespace) -> dict[str, object]:
    """The rows' MoE profile and nominal bytes per token (``routes: false``: none)."""
    if args.no_routes:
        return {"profile": None, "routes": False}
    prof = profile_from_args(args)
    return {**payload_figures(prof, route_id_bytes=route_id_bytes(prof)), "routes": True}


def _drop_ratios(result: dict[str, object]) -> None:
    """No ratio or target verdict computed over failed runs."""
    for key in ("target_ratio", "meets_target_1024", "meets_loopback_targets", "meets_steady_targets"):
        result.pop(key, None)
    for part in ("1024", "16384"):
        figures = result.get(part)
        if not isinstance(figures, dict):  # not measured
            continue
        if isinstance(figures.get("steady"), dict):
            store_steady.drop_ratios(figures["steady"])
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
