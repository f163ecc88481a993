"""Restore reads: per-request gets vs the real PrefixReadBatcher actors, side by side.

W simulated generation workers, placed round-robin on the cluster's workers, read
pre-staged cut rows from a real StagingStore of 2 units. ``per-request``: each restore is
one ``store.get_many_async`` from its worker; ``coalesced``: each restore is one ``read`` on
its worker's PrefixReadBatcher (``start_batchers``, as the real restore path places them;
the call stays in-process). Scenarios: mass resume (1 and 4 chunks), and one restore per
worker every 5/10/20/50 ms. Latency: a restore's scheduled start to its rows in hand (ms).
See docs/design.md, "Restore" and "Benchmarks".

Each mode runs ``--repeats`` times (arrival-gap scenarios ``--gap-repeats``), alternating
which goes first; ``wall_s`` and ``p50_ms`` are medians over runs. A run fails on any
restore that errs or comes back short, or on a sampled restore whose rows are not bit-exact
the staged rows; then ``ok`` is false, ``failures`` says what failed, no speedup or ratio
is reported and the command exits 1 (:func:`exit_status`).

    python -m pipeline bench restore --json
    python -m pipeline.bench.restore --json --workers 64 --restores 32 --tokens 4096
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from tasks.keys import CUT_PARTITION
from tasks.packed import PackedBatch, pack_rows
from tasks.schema import STAGING_FIELDS

from .common import add_cluster_arguments, bench_client, compare_rows, main, notes

if TYPE_CHECKING:
    from distributed import Actor, Client

    from ..restore.batcher import PrefixReadBatcher
    from ..store.protocol import AsyncStoreLike, StoreLike

GAPS_MS = (5, 10, 20, 50)  # arrival gaps of the gap_* scenarios (ms between one worker's restores)
TARGETS = {"mass_resume_speedup": 13.0, "gap_p50_ratio": 1.05}
MODES = ("per-request", "coalesced")
CONTEXT_TOKENS = 16
TEMPLATES = 8  # distinct payload rows, reused under many keys
SAMPLE_RESTORES = 3  # restores per run whose rows are compared bit-exact with what was staged
START_MARGIN_S = 0.05  # every worker's first restore starts this long after the run is sent


def _restore_fields() -> list[str]:
    # Every field verify_prefix checks; cut rows without routes need no routed_experts.
    return list(STAGING_FIELDS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench restore``."""
    from ..cli_args import byte_size, positive_int

    names = scenario_names()

    def scenario_list(text: str) -> str:
        wanted = {t.strip() for t in text.split(",") if t.strip()}
        if text.strip() != "all" and (not wanted or wanted - set(names)):
            raise argparse.ArgumentTypeError(f"must be 'all' or comma-separated names from {', '.join(names)}; got {text!r}")
        return text

    p.add_argument("--workers", type=positive_int, default=16, help="simulated generation workers W in the mass resumes (reference 128)")
    p.add_argument("--restores", type=positive_int, default=64, help="restores per worker R in the mass resumes (reference 64)")
    p.add_argument("--tokens", type=positive_int, default=16384, help="prefix tokens T (reference 16,384)")
    p.add_argument("--gap-workers", type=positive_int, default=8, help="workers in the arrival-gap scenarios (default 8)")
    p.add_argument("--gap-restores", type=positive_int, default=32, help="restores per worker in the arrival-gap scenarios (default 32)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per mass-resume scenario and mode, alternating order (default 3)")
    p.add_argument(
        "--gap-repeats", type=positive_int, default=4,
        help="runs per mode of the arrival-gap scenarios (default 4: their p50s differ by less than the machine's drift, so they alternate more)",
    )
    p.add_argument("--scenarios", type=scenario_list, default="all", help=f"comma-separated subset of {', '.join(names)}, or 'all'")
    p.add_argument("--unit-memory-limit", type=byte_size, default="4GiB", help="per storage unit memory before spilling")
    p.add_argument("--gc", choices=("collect", "freeze", "none"), default="collect",
                   help="garbage collector of the cluster's processes between runs (docs/design.md; default collect)")
    add_cluster_arguments(p, n_workers=2)


# ---- scenarios and staged rows --------------------------------------------------------


# A scenario: ``workers`` simulated workers, ``restores`` each of ``chunks`` cut rows,
# ``period_s`` apart (0 = all at once), run ``repeats`` times per mode.
Scenario = TypedDict("Scenario", {"name": str, "workers": int, "restores": int, "chunks": int, "period_s": float, "repeats": int})
# Staged key -> (template batch, row) it was written from.
Expected = dict[str, tuple[PackedBatch, int]]


def scenario_names() -> list[str]:
    """Every scenario's name, in run order."""
    return ["mass_resume", "mass_resume_4chunks", *(f"gap_{g}ms" for g in GAPS_MS)]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """Each: name, workers, restores per worker, chunks per restore, period (s between one
    worker's restores; 0 = all at once), runs per mode."""
    W, R, GW, GR = args.workers, args.restores, args.gap_workers, args.gap_restores
    out = [
        Scenario(name="mass_resume", workers=W, restores=R, chunks=1, period_s=0.0, repeats=args.repeats),
        Scenario(name="mass_resume_4chunks", workers=W, restores=R, chunks=4, period_s=0.0, repeats=args.repeats),
        *(Scenario(name=f"gap_{g}ms", workers=GW, restores=GR, chunks=1, period_s=g / 1000.0, repeats=args.gap_repeats) for g in GAPS_MS),
    ]
    if args.scenarios != "all":
        wanted = {s.strip() for s in args.scenarios.split(",")}
        unknown = wanted - {s["name"] for s in out}
        if unknown:
            raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {[s['name'] for s in out]}")
        out = [s for s in out if s["name"] in wanted]
    return out


def _templates(tokens: int, seed: int = 0) -> PackedBatch:
    """Real cut rows (CallBuffer freeze) of ``tokens`` tokens: the payload to replicate."""
    from ..generation.call_buffer import CallBuffer

    rng = np.random.default_rng(seed)
    ctx = min(CONTEXT_TOKENS, tokens - 1)
    rows = []
    for i in range(TEMPLATES):
        b = CallBuffer(f"tmpl{i}", "c0", rng.integers(0, 512, ctx))
        b.append(rng.integers(0, 512, tokens - ctx), -rng.random(tokens - ctx, dtype=np.float32))
        rows.append(b.freeze("bench").row)
    return pack_rows(rows)


def restore_keys(sc: Scenario) -> list[list[str]]:
    """Cut keys of every restore of a scenario, chain order; restore ``w * R + r``."""
    from tasks.keys import cut_key

    ck = f"{sc['chunks']}x"  # one checkpoint per chunking: rows differ in size
    return [
        [cut_key(ck, f"w{w}r{r}", "c0", s) for s in range(sc["chunks"])]
        for w in range(sc["workers"])
        for r in range(sc["restores"])
    ]


def stage(store: StoreLike, scs: list[Scenario], tokens: int, args: argparse.Namespace, expect: Expected | None = None) -> dict[int, int]:
    """Put every key the scenarios (and the warm-up) read, once per chunking, in puts of <= 64 MB.
    With ``expect``, record for every key the (template batch, row) it was written from.
    Returns ``{chunks per restore: tokens per chunk}``."""
    need: dict[int, set[str]] = {1: set()}
    for sc in scs + [_warm_up(args)]:
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


def _warm_up(args: argparse.Namespace) -> Scenario:
    return Scenario(name="warm-up", workers=args.workers, restores=args.restores, chunks=1, period_s=0.0, repeats=1)


# ---- the callers: simulated generation workers, on the cluster's workers -----------------


# A caller's restores (RestoreCaller.run), a scenario in one mode (_Rig.run: every caller's):
# latencies by restore index, restores that erred or came back short, the first problems.
CallerRun = TypedDict("CallerRun", {"latencies_ms": dict[int, float], "errors": int, "problems": list[str],
                                    "sampled": dict[int, PackedBatch], "gets": int, "span_s": float, "gc_ms": float})
ModeRun = TypedDict("ModeRun", {"gets": int, "errors": int, "problems": list[str], "wall_s": float, "gc_ms": float, "keys": int,
                                "latencies_ms": np.ndarray})


class RestoreCaller:
    """Bench actor: the simulated generation workers that one cluster worker hosts.

    :meth:`run` starts their restores on schedule on the worker's event loop, as a
    generation worker there would: ``per-request``, one ``store.get_many_async`` per
    restore; ``coalesced``, one ``read`` on the batcher of this worker (an actor here:
    :func:`~pipeline.restore.batcher.local_batcher` calls it in-process).
    """

    def __init__(self, store: AsyncStoreLike) -> None:
        self.store = store

    async def run(self, sc: Scenario, mode: str, sims: list[int], batchers: list[Actor], chunk_tokens: int,
                  start_wall: float, sample: list[int]) -> CallerRun:
        """Restores of simulated workers ``sims`` (``batchers[i]`` is ``sims[i]``'s, unused
        per-request), the first at wall-clock ``start_wall`` (s); ``sampled``: ``sample``'s rows."""
        from ..restore.batcher import local_batcher

        keys = restore_keys(sc)
        W, R, period = sc["workers"], sc["restores"], sc["period_s"]
        fields = _restore_fields()
        local = [local_batcher(b) for b in batchers] if mode == "coalesced" else []
        gets0 = await self._batcher_gets(local)
        gets = 0
        latencies: dict[int, float] = {}
        errors = 0
        problems: list[str] = []
        sampled: dict[int, PackedBatch] = {}
        loop = asyncio.get_running_loop()
        # The common start on this loop's clock; a worker whose clock disagrees with the
        # controller's (another host) starts after the usual margin instead.
        lead = start_wall - time.time()
        t0 = loop.time() + (lead if 0.0 <= lead <= 1.0 else START_MARGIN_S)
        last = t0

        async def one(i: int, w: int, r: int) -> None:
            nonlocal errors, gets, last
            # Workers are staggered evenly over the period, so arrivals are spread, not bunched.
            start = t0 + (r * period + w * period / W if period else 0.0)
            delay = start - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            ks = keys[w * R + r]
            rows, ok = None, False
            try:
                if mode == "per-request":
                    gets += 1
                    res = await self.store.get_many_async(ks, fields, partition=CUT_PARTITION)
                    rows = res.batch
                    ok = not res.failed and rows.keys == ks
                    if not ok and len(problems) < 3:
                        problems.append(f"read {ks[0]}..: " + (f"{len(res.failed)} key(s) failed, e.g. {next(iter(res.failed.items()))}"
                                                               if res.failed else f"{len(rows)} of {len(ks)} rows"))
                else:
                    rows = await local[i].read(ks, chunk_tokens * len(ks))
                    ok = rows.keys == ks
                    if not ok and len(problems) < 3:
                        problems.append(f"read {ks[0]}..: rows for keys {rows.keys[:2]}..")
            except Exception as e:  # noqa: BLE001 - counted, reported; a benchmark must finish
                if len(problems) < 3:
                    problems.append(f"read {ks[0]}..: {type(e).__name__}: {e}")
            end = loop.time()
            last = max(last, end)
            errors += not ok
            if ok and w * R + r in sample:
                sampled[w * R + r] = rows.take(np.arange(len(rows)))  # a copy: not views of a whole get
            latencies[w * R + r] = (end - start) * 1000.0

        with _GcTimer() as gc_time:
            await asyncio.gather(*(one(i, w, r) for i, w in enumerate(sims) for r in range(R)))
        if mode == "coalesced":
            gets = await self._batcher_gets(local) - gets0
        return {"latencies_ms": latencies, "errors": errors, "problems": problems, "sampled": sampled,
                "gets": gets, "span_s": last - t0, "gc_ms": gc_time.ms}

    @staticmethod
    async def _batcher_gets(batchers: list[PrefixReadBatcher | Actor]) -> int:
        # The batchers' own count (a get serves many restores); each batcher once.
        distinct = {id(b): b for b in batchers}.values()
        return sum([(await b.stats())["gets"] for b in distinct])


def _collect_garbage(freeze: bool = False) -> None:
    """On every process of the run: a full collection (and with ``freeze``, setup's
    survivors moved out of every later one)."""
    gc.collect()
    if freeze:
        gc.freeze()


class _GcTimer:
    """Milliseconds the garbage collector ran in this process while the block ran."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._t = 0.0

    def _cb(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t) * 1000.0

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._cb)


# ---- one run ---------------------------------------------------------------------------


class _Rig:
    """What every run uses: one caller per cluster worker, hosting the simulated workers
    placed there, and the real restore path's batchers (:func:`start_batchers`: one per
    cluster worker, shared by the generation workers there)."""

    def __init__(self, client: Client, store: AsyncStoreLike) -> None:
        from ..actors import current_workers, start_pinned_actors
        from ..restore.batcher import start_batchers

        self.client = client
        self.workers = current_workers(client)
        self.callers, self._caller_futures = start_pinned_actors(client, RestoreCaller, self.workers, args=[(store,)] * len(self.workers))
        self.by_worker = start_batchers(client, store, workers=self.workers, fields=_restore_fields())

    def batcher(self, w: int) -> Actor:
        """Simulated worker ``w``'s batcher: the one on its cluster worker."""
        return self.by_worker[self.workers[w % len(self.workers)]]

    def run(self, sc: Scenario, mode: str, chunk_tokens: int, expect: Expected | None) -> ModeRun:
        """One scenario in one mode; ``problems`` names the first read errors and, with
        ``expect``, every field of a sampled restore's rows that is not bit-exact."""
        W, R = sc["workers"], sc["restores"]
        n = len(self.workers)
        sample = sorted({0, (W * R) // 2, W * R - 1})[:SAMPLE_RESTORES]
        start = time.time() + START_MARGIN_S
        futures = []
        for c, caller in enumerate(self.callers):
            sims = list(range(c, W, n))
            if sims:
                futures.append(caller.run(sc, mode, sims, [self.batcher(w) for w in sims], chunk_tokens, start, sample))
        outs: list[CallerRun] = [f.result() for f in futures]
        latencies = np.zeros(W * R, dtype=np.float64)
        out = ModeRun(gets=0, errors=0, problems=[], wall_s=0.0, gc_ms=0.0, keys=W * R * sc["chunks"], latencies_ms=latencies)
        sampled: dict[int, PackedBatch] = {}
        for o in outs:
            for i, ms in o["latencies_ms"].items():
                latencies[i] = ms
            sampled.update(o["sampled"])
            out["gets"] += o["gets"]
            out["errors"] += o["errors"]
            out["problems"] += o["problems"][: max(0, 3 - len(out["problems"]))]
            out["wall_s"] = max(out["wall_s"], o["span_s"])
            out["gc_ms"] = max(out["gc_ms"], o["gc_ms"])
        if expect is not None:
            out["problems"] += _check_content(sampled, restore_keys(sc), _restore_fields(), expect)
        return out

    def close(self) -> None:
        for b in self.by_worker.values():
            try:
                b.close().result()
            except Exception:  # noqa: BLE001 - best effort: the cluster may be going away
                pass


def _check_content(sampled: dict[int, PackedBatch], keys: list[list[str]], fields: list[str], expect: Expected) -> list[str]:
    """Each sampled restore's rows, bit-exact (every field read) against the staged rows."""
    problems: list[str] = []
    for i, rows in sorted(sampled.items()):
        for j, k in enumerate(keys[i]):
            tmpl, r = expect[k]
            want = PackedBatch([k], tmpl.take([r]).fields)
            problems += compare_rows(want, rows.take([j]), fields=fields, what="read back ")
    return problems


def _row(sc: Scenario, mode: str, runs: list[ModeRun], chunk_tokens: int) -> dict[str, object]:
    walls = [r["wall_s"] for r in runs]
    p50s = [float(np.percentile(r["latencies_ms"], 50)) for r in runs]
    lat = np.concatenate([r["latencies_ms"] for r in runs])
    mid = runs[int(np.argsort(walls)[len(walls) // 2])]  # the median-wall run: its gets
    return {
        "scenario": sc["name"],
        "mode": mode,
        "workers": sc["workers"],
        "restores": sc["workers"] * sc["restores"],
        "chunks_per_restore": sc["chunks"],
        "chunk_tokens": chunk_tokens,
        "gap_ms": round(sc["period_s"] * 1000.0, 3),
        "runs": len(runs),
        "gets": mid["gets"],
        "keys_per_get": round(mid["keys"] / mid["gets"], 2) if mid["gets"] else 0.0,
        "wall_s": round(float(np.median(walls)), 3),
        "wall_s_runs": [round(w, 3) for w in walls],  # every run, in order: the spread behind wall_s
        "p50_ms": round(float(np.median(p50s)), 3),
        "p50_ms_runs": [round(p, 3) for p in p50s],
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "errors": int(sum(r["errors"] for r in runs)),
        "gc_ms": round(max(r["gc_ms"] for r in runs), 1),
    }


# ---- entry points ----------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, object]:
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
    meets: dict[str, bool] = {}
    if ("mass_resume", "coalesced") in by:
        result["mass_resume_speedup"] = round(by["mass_resume", "per-request"]["wall_s"] / by["mass_resume", "coalesced"]["wall_s"], 2)
        meets["mass_resume_speedup"] = result["mass_resume_speedup"] >= TARGETS["mass_resume_speedup"]
    ratios = {
        str(g): round(by[f"gap_{g}ms", "coalesced"]["p50_ms"] / by[f"gap_{g}ms", "per-request"]["p50_ms"], 3)
        for g in GAPS_MS if (f"gap_{g}ms", "coalesced") in by
    }
    if ratios:
        result["gap_p50_ratio"] = ratios
        meets["gap_p50_ratio"] = max(ratios.values()) <= TARGETS["gap_p50_ratio"]
    result["targets"] = TARGETS
    result["meets_targets"] = meets
    return result


def _run_scenarios(client: Client, scs: list[Scenario], args: argparse.Namespace) -> dict[str, object]:
    """Stage once, start the callers and batchers, warm up, then run every scenario in both
    modes, alternating order."""
    from .. import config
    from ..store import StagingStore

    say = notes("restore", args.quiet)
    result: dict[str, object] = {
        "benchmark": "restore",
        "scale": {
            "workers": args.workers,
            "restores_per_worker": args.restores,
            "tokens": args.tokens,
            "gap_workers": args.gap_workers,
            "gap_restores_per_worker": args.gap_restores,
            "repeats": args.repeats,
            "gap_repeats": args.gap_repeats,
            "reference": {"workers": 128, "restores_per_worker": 64, "tokens": 16384},
            "cluster_workers": len(client.scheduler_info(n_workers=-1)["workers"]),
            "storage_units": 2,
            "gc": args.gc,
            "fields": _restore_fields(),
        },
        "knobs": {k: config.get(f"restore.{k}") for k in ("window-ms", "eager-inflight", "batch-size", "max-tokens",
                                                         "max-concurrent-gets", "get-timeout-s")},
        "rows": [],
        "failures": [],
    }
    failures = result["failures"]
    expect: Expected = {}
    store = StagingStore.start(client, n_units=2, memory_limit=args.unit_memory_limit)
    rig = None
    try:
        staged = stage(store, scs, args.tokens, args, expect)
        rig = _Rig(client, store)
        # Open every connection (callers and batchers to the units) before measuring
        # anything: the first burst of gets pays connection setup, which is no mode's cost.
        warm = _warm_up(args)
        for mode in MODES:
            out = rig.run(warm, mode, staged[1], expect)
            failures += [f"warm-up {mode}: {p}" for p in out["problems"]]
        if args.gc == "freeze":
            client.run(_collect_garbage, True)
        say("warmed up")
        for sc in scs:
            chunk_tokens = staged[sc["chunks"]]
            runs: dict[str, list[ModeRun]] = {m: [] for m in MODES}
            for rep in range(sc["repeats"]):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    if args.gc == "collect":
                        client.run(_collect_garbage)  # no run pays for the previous run's survivors
                    out = rig.run(sc, mode, chunk_tokens, expect)
                    runs[mode].append(out)
                    if out["errors"] and not out["problems"]:
                        out["problems"].append(f"{out['errors']} restore(s) failed")
                    failures += [f"{sc['name']} {mode} run {rep + 1}: {p}" for p in out["problems"]]
                    say(f"{sc['name']:<20} {mode:<12} run {rep + 1}: {out['wall_s']:.3f} s, "
                        f"p50 {np.percentile(out['latencies_ms'], 50):.2f} ms, {out['gets']} gets")
            for mode in MODES:
                result["rows"].append(_row(sc, mode, runs[mode], chunk_tokens))
    finally:
        if rig is not None:
            rig.close()
        if args.gc == "freeze":
            client.run(gc.unfreeze)  # an attached cluster (--scheduler) outlives the run
        store.close()
    return result


def exit_status(result: dict[str, object]) -> int:
    """The CLI's exit status: 0 when every restore of every run read its rows intact, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
