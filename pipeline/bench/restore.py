"""Restore reads: per-request gets vs the real PrefixReadBatcher actors, side by side.

W simulated generation workers, placed round-robin on the cluster's workers, read
pre-staged cut rows from a real StagingStore of 2 units. ``per-request``: each restore is
one ``store.get_many_async`` from its worker; ``coalesced``: each restore is one ``read`` on
its worker's PrefixReadBatcher (``start_batchers``, as the real restore path places them).
Scenarios: mass resume (1 and 4 chunks), and one restore per worker every 5/10/20/50 ms.
Latency: a restore's scheduled start to its rows in hand (ms). Modes alternate over
``--repeats`` runs (gap scenarios ``--gap-repeats``); ``wall_s``, ``p50_ms`` are medians,
``gb_s`` the payload read over the median wall. Rows carry the routes of ``--profile``
(staged as :mod:`~pipeline.bench.restore_stage` says). A restore that errs, comes back
short or not bit-exact fails the run: ``ok`` false, ``failures`` say what, no speedup or
ratio, exit 1. See docs/design.md, "Restore" and "Benchmarks".

    python -m pipeline bench restore --json
    python -m pipeline bench restore --json --profile qwen3-moe
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
from tasks.packed import PackedBatch

from ..actors import workers_now
from .common import add_cluster_arguments, bench_client, compare_rows, main, notes
from .profile_args import add_profile_argument, payload_figures, profile_from_args, rounded_gb_s, route_id_bytes, routes_profile
from .restore_stage import (
    CONTEXT_TOKENS,
    GAPS_MS,
    Expected,
    Scenario,
    restore_fields,
    restore_keys,
    restore_tokens,
    scenario_names,
    scenarios,
    stage,
    templates,
    warm_up,
)

if TYPE_CHECKING:
    from distributed import Actor, Client

    from ..restore.batcher import PrefixReadBatcher
    from ..store.protocol import AsyncStoreLike, StoreLike

__all__ = ["add_arguments", "exit_status", "restore_keys", "run", "scenario_names", "scenarios", "stage"]

TARGETS = {"mass_resume_speedup": 13.0, "gap_p50_ratio": 1.05}
MODES = ("per-request", "coalesced")
SAMPLE_RESTORES = 3  # restores per run whose rows are compared bit-exact with what was staged
START_MARGIN_S = 0.05  # every worker's first restore starts this long after the run is sent


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
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="prefix tokens T (default 16,384, the reference's, at the toy profile; fewer for bigger profiles, same bytes per row)")
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
    add_profile_argument(p)
    p.add_argument("--no-routes", action="store_true", help="cut rows without routed experts (the rows of earlier rounds)")
    add_cluster_arguments(p, n_workers=2)


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
                  start_wall: float, sample: list[int], fields: list[str]) -> CallerRun:
        """Restores of simulated workers ``sims`` (``batchers[i]`` is ``sims[i]``'s, unused
        per-request), the first at wall-clock ``start_wall`` (s); ``sampled``: ``sample``'s rows."""
        from ..restore.batcher import local_batcher

        keys = restore_keys(sc)
        W, R, period = sc["workers"], sc["restores"], sc["period_s"]
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

    def __init__(self, client: Client, store: AsyncStoreLike, fields: list[str]) -> None:
        from ..actors import current_workers, start_pinned_actors
        from ..restore.batcher import start_batchers

        self.client = client
        self.workers = current_workers(client)
        self.callers, self._caller_futures = start_pinned_actors(client, RestoreCaller, self.workers, args=[(store,)] * len(self.workers))
        self.fields = fields  # what every restore reads
        self.by_worker = start_batchers(client, store, workers=self.workers, fields=fields)

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
                futures.append(caller.run(sc, mode, sims, [self.batcher(w) for w in sims], chunk_tokens, start, sample, self.fields))
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
            out["problems"] += _check_content(sampled, restore_keys(sc), self.fields, expect)
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


def _row(sc: Scenario, mode: str, runs: list[ModeRun], chunk_tokens: int, bytes_per_token: int) -> dict[str, object]:
    """A scenario's table row in one mode: medians over its runs; ``gb_s`` is the payload
    read (every restore's rows, ``bytes_per_token`` each token) over the median wall."""
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
        "gb_s": rounded_gb_s(sc["workers"] * sc["restores"] * sc["chunks"] * chunk_tokens * bytes_per_token / float(np.median(walls)) / 1e9),
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
    tokens, prof = restore_tokens(args), routes_profile(args)
    probe = templates(CONTEXT_TOKENS + 1, prof, n=1)  # one small row, packed as the staged ones
    fields, id_bytes = restore_fields(probe), route_id_bytes(prof)
    payload = payload_figures(profile_from_args(args), route_id_bytes=id_bytes)
    result: dict[str, object] = {
        "benchmark": "restore",
        **payload,
        "routes": prof is not None,
        "route_id_bytes": id_bytes,
        "scale": {
            "workers": args.workers,
            "restores_per_worker": args.restores,
            "tokens": tokens,
            "gap_workers": args.gap_workers,
            "gap_restores_per_worker": args.gap_restores,
            "repeats": args.repeats,
            "gap_repeats": args.gap_repeats,
            "reference": {"workers": 128, "restores_per_worker": 64, "tokens": 16384},
            "cluster_workers": len(workers_now(client)),
            "storage_units": 2,
            "gc": args.gc,
            "fields": fields,
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
        staged = stage(store, scs, tokens, args, expect)
        rig = _Rig(client, store, fields)
        # Open every connection (callers and batchers to the units) before measuring
        # anything: the first burst of gets pays connection setup, which is no mode's cost.
        warm = warm_up(args)
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
                result["rows"].append(_row(sc, mode, runs[mode], chunk_tokens, payload["bytes_per_token"]))
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
