"""Restore reads: per-request gets vs coalescing PrefixReadBatcher cores, side by side.

Scenarios (mass resume, 4-chunk mass resume, arrivals every 5/20 ms, light load every
10/50 ms) run against a real StagingStore of 2 units holding pre-staged cut rows; both
modes read the same fields through the same ``get_many_async``. Latency runs from a
restore's scheduled start to its rows in hand (ms). See docs/design.md, "Benchmarks".

Each scenario runs ``--repeats`` times per mode (default 3; light load ``--light-repeats``);
``wall_s`` is the slowest run, ``wall_s_median`` the median. A run fails on any restore
that errs or comes back short, or on a sampled restore whose rows are not bit-exact the
staged rows (``np.array_equal`` per field read); then ``ok`` is false, ``failures`` says
what failed, no speedup or ratio is reported and the command exits 1 (:func:`exit_status`).

    python -m pipeline bench restore --json
    python -m pipeline.bench.restore --json --workers 64 --restores 32 --tokens 4096
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from typing import Any

import numpy as np

from tasks.keys import CUT_PARTITION

from .common import add_cluster_arguments, bench_client, main, notes

TARGETS = {"mass_resume_speedup": 7.0, "light_50ms_p50_ratio": 1.1}
MODES = ("per-request", "coalesced")
CONTEXT_TOKENS = 16
TEMPLATES = 8  # distinct payload rows, reused under many keys
SAMPLE_RESTORES = 3  # restores per run whose rows are compared bit-exact with what was staged


def _restore_fields() -> list[str]:
    # Every field verify_prefix checks; cut rows without routes need no routed_experts.
    from tasks.schema import STAGING_FIELDS

    return list(STAGING_FIELDS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench restore``."""
    from ..cli_args import byte_size, positive_int

    names = [s["name"] for s in scenarios(argparse.Namespace(workers=1, restores=1, light_workers=1, light_restores=1, light_repeats=1, scenarios="all"))]

    def scenario_list(text: str) -> str:
        wanted = {t.strip() for t in text.split(",") if t.strip()}
        if text.strip() != "all" and (not wanted or wanted - set(names)):
            raise argparse.ArgumentTypeError(f"must be 'all' or comma-separated names from {', '.join(names)}; got {text!r}")
        return text

    p.add_argument("--workers", type=positive_int, default=16, help="simulated generation workers W (reference 128)")
    p.add_argument("--restores", type=positive_int, default=64, help="restores per worker R (reference 64)")
    p.add_argument("--tokens", type=positive_int, default=16384, help="prefix tokens T (reference 16,384)")
    p.add_argument("--light-workers", type=positive_int, default=8, help="workers in the light-load scenarios (default 8)")
    p.add_argument("--light-restores", type=positive_int, default=32, help="restores per worker under light load (default 32)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per scenario and mode, alternating order (default 3)")
    p.add_argument(
        "--light-repeats", type=positive_int, default=4,
        help="runs per mode of the light-load scenarios (default 4: their p50s differ by less than the machine's drift, so they alternate more)",
    )
    p.add_argument("--scenarios", type=scenario_list, default="all", help=f"comma-separated subset of {', '.join(names)}, or 'all'")
    p.add_argument("--unit-memory-limit", type=byte_size, default="4GiB", help="per storage unit memory before spilling")
    p.add_argument("--gc", choices=("collect", "freeze", "none"), default="collect", help="garbage collector between runs (see module docstring; default collect)")
    add_cluster_arguments(p, n_workers=2)


# ---- scenarios and staged rows --------------------------------------------------------


def scenarios(args) -> list[dict[str, Any]]:
    """Each: name, workers, restores per worker, chunks per restore, period (s; 0 = all at once),
    and optionally its own number of runs per mode."""
    W, R, LW, LR = args.workers, args.restores, args.light_workers, args.light_restores
    out = [
        dict(name="mass_resume", workers=W, restores=R, chunks=1, period_s=0.0),
        dict(name="mass_resume_4chunks", workers=W, restores=R, chunks=4, period_s=0.0),
        dict(name="every_5ms", workers=W, restores=R, chunks=1, period_s=0.005),
        dict(name="every_20ms", workers=W, restores=R, chunks=1, period_s=0.020),
        dict(name="light_10ms", workers=LW, restores=LR, chunks=1, period_s=0.010, repeats=args.light_repeats),
        dict(name="light_50ms", workers=LW, restores=LR, chunks=1, period_s=0.050, repeats=args.light_repeats),
    ]
    if args.scenarios != "all":
        wanted = {s.strip() for s in args.scenarios.split(",")}
        unknown = wanted - {s["name"] for s in out}
        if unknown:
            raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {[s['name'] for s in out]}")
        out = [s for s in out if s["name"] in wanted]
    return out


def _templates(tokens: int, seed: int = 0):
    """Real cut rows (CallBuffer freeze) of ``tokens`` tokens: the payload to replicate."""
    from tasks.packed import pack_rows

    from ..generation.call_buffer import CallBuffer

    rng = np.random.default_rng(seed)
    ctx = min(CONTEXT_TOKENS, tokens - 1)
    rows = []
    for i in range(TEMPLATES):
        b = CallBuffer(f"tmpl{i}", "c0", rng.integers(0, 512, ctx))
        b.append(rng.integers(0, 512, tokens - ctx), -rng.random(tokens - ctx, dtype=np.float32))
        rows.append(b.freeze("bench").row)
    return pack_rows(rows)


def restore_keys(sc: dict[str, Any]) -> list[list[str]]:
    """Cut keys of every restore of a scenario, chain order; restore ``w * R + r``."""
    from tasks.keys import cut_key

    ck = f"{sc['chunks']}x"  # one checkpoint per chunking: rows differ in size
    return [
        [cut_key(ck, f"w{w}r{r}", "c0", s) for s in range(sc["chunks"])]
        for w in range(sc["workers"])
        for r in range(sc["restores"])
    ]


def stage(store, scs: list[dict[str, Any]], tokens: int, args, expect: dict | None = None) -> dict[str, int]:
    """Put every key the scenarios (and the warm-up) read, once per chunking, in puts of <= 64 MB.
    With ``expect``, record for every key the (template batch, row) it was written from."""
    from tasks.packed import PackedBatch

    need: dict[int, set] = {1: set()}
    warm = dict(workers=args.workers, restores=args.restores, chunks=1)
    for sc in scs + [warm]:
        need.setdefault(sc["chunks"], set()).update(k for ks in restore_keys(sc) for k in ks)
    staged = {}
    for chunks, keys in need.items():
        chunk_tokens = max(1, tokens // chunks)
        tmpl = _templates(chunk_tokens, seed=chunks)
        keys = sorted(keys)
        per_put = max(1, min(256, (64 << 20) // max(1, tmpl.nbytes // len(tmpl))))
        notes("restore", args.quiet)(f"staging {len(keys)} cut rows of {chunk_tokens} tokens ({tmpl.nbytes // len(tmpl) * len(keys) / 1e6:.0f} MB)")
        for i in range(0, len(keys), per_put):
            part = keys[i : i + per_put]
            rows = np.arange(len(part)) % len(tmpl)
            batch = tmpl.take(rows)
            if expect is not None:
                expect.update((k, (tmpl, int(r))) for k, r in zip(part, rows))
            res = store.put_many(PackedBatch(part, batch.fields), partition=CUT_PARTITION)
            if res.failed:
                raise RuntimeError(f"staging failed: {next(iter(res.failed.items()))}")
        staged[chunks] = chunk_tokens
    return staged


# ---- one run ---------------------------------------------------------------------------


async def _run_once(store, sc: dict[str, Any], mode: str, chunk_tokens: int, expect: dict | None = None) -> dict[str, Any]:
    """One scenario in one mode, inside the client's event loop. ``problems`` names the
    first read errors and, with ``expect``, every field of a sampled restore's rows that is
    not bit-exact what was staged (checked after the timed part)."""
    from ..restore.batcher import unit_grouping
    from ..restore.coalescer import PrefixReadCoalescer

    keys = restore_keys(sc)
    W, R, period = sc["workers"], sc["restores"], sc["period_s"]
    fields = _restore_fields()
    gets = 0

    async def get(ks: list[str]) -> Any:
        # The one read path of both modes: same store, same fields.
        nonlocal gets
        gets += 1
        return await store.get_many_async(ks, fields, partition=CUT_PARTITION)

    group = unit_grouping(store)  # as the PrefixReadBatcher does: one unit per get
    coalescers = [PrefixReadCoalescer(get, group=group) for _ in range(W)] if mode == "coalesced" else None
    latencies = np.zeros(W * R, dtype=np.float64)
    errors = 0
    problems: list[str] = []
    sample = sorted({0, (W * R) // 2, W * R - 1})[:SAMPLE_RESTORES]
    sampled: dict[int, Any] = {}
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 0.01  # every start is scheduled on this common origin

    async def one(w: int, r: int) -> None:
        nonlocal errors
        # Workers are staggered evenly over the period, so arrivals are spread, not bunched.
        start = t0 + (r * period + w * period / W if period else 0.0)
        delay = start - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        ks = keys[w * R + r]
        rows = None
        try:
            if coalescers is None:
                res = await get(ks)
                rows = res.batch
                ok = not res.failed and len(res.batch) == len(ks)
                if not ok and len(problems) < 3:
                    problems.append(f"read {ks[0]}..: " + (f"{len(res.failed)} key(s) failed, e.g. {next(iter(res.failed.items()))}"
                                                           if res.failed else f"{len(res.batch)} of {len(ks)} rows"))
            else:
                rows = await coalescers[w].read(ks, chunk_tokens * len(ks))
                ok = rows.keys == ks
                if not ok and len(problems) < 3:
                    problems.append(f"read {ks[0]}..: rows for keys {rows.keys[:2]}..")
        except Exception as e:  # noqa: BLE001 - counted, reported; a benchmark must finish
            ok = False
            if len(problems) < 3:
                problems.append(f"read {ks[0]}..: {type(e).__name__}: {e}")
        errors += not ok
        if ok and w * R + r in sample:
            sampled[w * R + r] = rows
        latencies[w * R + r] = (loop.time() - start) * 1000.0

    await asyncio.sleep(max(0.0, t0 - loop.time()))
    with _GcTimer() as gc_time:
        t_start = time.perf_counter()
        await asyncio.gather(*(one(w, r) for w in range(W) for r in range(R)))
        wall = time.perf_counter() - t_start
    n_keys = W * R * sc["chunks"]
    if expect is not None:
        problems += _check_content(sampled, keys, fields, expect)
    return {"gets": gets, "keys": n_keys, "wall_s": wall, "latencies_ms": latencies, "errors": errors, "gc_ms": gc_time.ms,
            "problems": problems}


def _check_content(sampled: dict[int, Any], keys: list[list[str]], fields: list[str], expect: dict) -> list[str]:
    """Each sampled restore's rows, bit-exact (every field read) against the staged rows."""
    from tasks.packed import PackedBatch

    from .common import compare_rows

    problems: list[str] = []
    for i, rows in sorted(sampled.items()):
        for j, k in enumerate(keys[i]):
            tmpl, r = expect[k]
            want = PackedBatch([k], tmpl.take([r]).fields)
            problems += compare_rows(want, rows.take([j]), fields=fields, what="read back ")
    return problems


class _GcTimer:
    """Milliseconds the garbage collector ran in this process while the block ran."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t = 0.0

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t) * 1000.0

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._cb)


def _row(sc: dict[str, Any], mode: str, runs: list[dict[str, Any]], chunk_tokens: int) -> dict[str, Any]:
    slow = max(runs, key=lambda r: r["wall_s"])
    lat = np.concatenate([r["latencies_ms"] for r in runs])
    return {
        "scenario": sc["name"],
        "mode": mode,
        "workers": sc["workers"],
        "restores": sc["workers"] * sc["restores"],
        "chunks_per_restore": sc["chunks"],
        "chunk_tokens": chunk_tokens,
        "gets": slow["gets"],
        "keys_per_get": round(slow["keys"] / slow["gets"], 2) if slow["gets"] else 0.0,
        "wall_s": round(slow["wall_s"], 3),
        "wall_s_runs": [round(r["wall_s"], 3) for r in runs],  # every run, in order: the spread behind wall_s
        "wall_s_median": round(float(np.median([r["wall_s"] for r in runs])), 3),
        "runs": len(runs),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "errors": int(sum(r["errors"] for r in runs)),
        "gc_ms": round(slow["gc_ms"], 1),
    }


# ---- entry points ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark; returns one JSON-able dict (see module docstring)."""
    scs = scenarios(args)
    with bench_client(args) as client:
        result = _run_scenarios(client, scs, args)
    failures = result.setdefault("failures", [])
    result["ok"] = not failures
    if failures:
        notes("restore", args.quiet)(f"FAILED ({len(failures)}): {failures[:3]}")
        return result
    by = {(r["scenario"], r["mode"]): r for r in result["rows"]}
    if ("mass_resume", "coalesced") in by:
        result["mass_resume_speedup"] = round(by["mass_resume", "per-request"]["wall_s"] / by["mass_resume", "coalesced"]["wall_s"], 2)
    if ("light_50ms", "coalesced") in by:
        result["light_50ms_p50_ratio"] = round(by["light_50ms", "coalesced"]["p50_ms"] / by["light_50ms", "per-request"]["p50_ms"], 3)
    result["targets"] = TARGETS
    result["meets_targets"] = {
        "mass_resume_speedup": result.get("mass_resume_speedup", 0.0) >= TARGETS["mass_resume_speedup"],
        "light_50ms_p50_ratio": result.get("light_50ms_p50_ratio", float("inf")) <= TARGETS["light_50ms_p50_ratio"],
    }
    return result


def _run_scenarios(client: Any, scs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Stage once, warm up, then run every scenario in both modes, alternating order."""
    from .. import config
    from ..store import StagingStore

    say = notes("restore", args.quiet)
    result: dict[str, Any] = {
        "benchmark": "restore",
        "scale": {
            "workers": args.workers,
            "restores_per_worker": args.restores,
            "tokens": args.tokens,
            "light_workers": args.light_workers,
            "light_restores_per_worker": args.light_restores,
            "repeats": args.repeats,
            "light_repeats": args.light_repeats,
            "reference": {"workers": 128, "restores_per_worker": 64, "tokens": 16384, "light_restores_per_worker": 64},
            "cluster_workers": len(client.scheduler_info(n_workers=-1)["workers"]),
            "storage_units": 2,
            "gc": args.gc,
            "fields": _restore_fields(),
        },
        "knobs": {k: config.get(f"restore.{k}") for k in ("window-ms", "batch-size", "max-tokens", "max-concurrent-gets", "get-timeout-s")},
        "rows": [],
        "failures": [],
    }
    failures = result["failures"]
    expect: dict[str, Any] = {}
    store = StagingStore.start(client, n_units=2, memory_limit=args.unit_memory_limit)
    try:
        staged = stage(store, scs, args.tokens, args, expect)
        # Open the client's connections to the units before measuring anything: the first
        # burst of concurrent gets pays connection setup, which is no mode's cost.
        warm = dict(name="warm-up", workers=args.workers, restores=args.restores, chunks=1, period_s=0.0)
        for mode in MODES:
            out = client.sync(_run_once, store, warm, mode, staged.get(1, args.tokens), expect)
            failures += [f"warm-up {mode}: {p}" for p in out["problems"]]
        if args.gc == "freeze":
            # Setup's long-lived objects (scheduler, client, imports) out of every later
            # full collection.
            gc.collect()
            gc.freeze()
        say("warmed up")
        for sc in scs:
            chunk_tokens = staged[sc["chunks"]]
            runs: dict[str, list] = {m: [] for m in MODES}
            for rep in range(sc.get("repeats", args.repeats)):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    if args.gc == "collect":
                        gc.collect()  # no run pays for the previous run's survivors
                    # The coroutine runs on the client's own event loop, where the store's
                    # actor futures resolve.
                    out = client.sync(_run_once, store, sc, mode, chunk_tokens, expect)
                    runs[mode].append(out)
                    if out["errors"] and not out["problems"]:
                        out["problems"].append(f"{out['errors']} restore(s) failed")
                    failures += [f"{sc['name']} {mode} run {rep + 1}: {p}" for p in out["problems"]]
                    say(f"{sc['name']:<20} {mode:<12} run {rep + 1}: {out['wall_s']:.3f} s, {out['gets']} gets")
            for mode in MODES:
                result["rows"].append(_row(sc, mode, runs[mode], chunk_tokens))
    finally:
        gc.unfreeze()
        store.close()
    return result


def exit_status(result: dict[str, Any]) -> int:
    """The CLI's exit status: 0 when every restore of every run read its rows intact, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
