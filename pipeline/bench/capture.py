"""Capture-client throughput: staging through CaptureClient vs a direct put_many, side by side.

``client`` mode: ``--threads`` engine threads each advance their share of the rollouts
turn by turn (an engine batch), ``stage`` every call (the capture gate validates and
hashes it on the calling thread) and ``finish`` them; the client batches rows from every
thread into ONE put per flush. ``direct`` mode: the SAME
rows, gated and packed into batches of ``--flush-calls`` rows beforehand (untimed), put
with ``StagingStore.put_many`` one batch after another. Each mode runs ``--runs`` times
on a fresh store (fresh keys: keys are write-once); the median rows/s of each mode and
their ratio (client / direct) are reported. A run fails if any receipt is poisoned or
the units did not store exactly its rows; any failed run makes the command exit non-zero.

    python -m pipeline bench capture --json
    python -m pipeline bench capture --json --profile qwen3-moe --rollouts 32
    python -m pipeline.bench.capture --json --rollouts 512 --tokens 4096
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, Mapping, TypedDict

import numpy as np

from .common import add_cluster_arguments, bench_client, main, notes
from .profile_args import add_profile_argument, payload_figures, profile_from_args, rounded_gb_s, route_id_bytes

if TYPE_CHECKING:
    from tasks.receipts import Receipt
    from tasks.schema import StagedRow

    from ..store.protocol import StoreLike

VOCAB = 512


class Delta(TypedDict):
    """One call's delta arrays, as an engine hands them to ``stage``."""

    token_ids: np.ndarray
    token_mask: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None  # None with --no-routes


class ModeRun(TypedDict, total=False):
    """One run of one mode (:func:`run_client`, :func:`run_direct`), rates added by :func:`run`."""

    wall_s: float
    puts: int
    bytes: int
    problems: list[str]
    untimed_gate_s: float  # direct only
    untimed_pack_s: float  # direct only
    rows_per_s: float | None  # None for a run that raised
    mb_per_s: float | None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench capture``."""
    p.add_argument("--rollouts", type=int, default=256, help="rollouts per run (default 256)")
    p.add_argument("--calls", type=int, default=4, help="model calls per rollout (default 4)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per call delta (default 1,024)")
    p.add_argument("--threads", type=int, default=4, help="engine threads staging in client mode (default 4)")
    p.add_argument("--runs", type=int, default=3, help="runs per mode, median reported (at least 3)")
    p.add_argument("--flush-calls", type=int, default=256, help="rows per flush (client) and per put (direct)")
    p.add_argument("--flush-ms", type=float, default=10.0, help="client flush deadline after the oldest queued row (ms)")
    add_profile_argument(p)
    p.add_argument("--layers", type=int, default=None, help="routed-experts L (default: the profile's)")
    p.add_argument("--top-k", type=int, default=None, help="routed-experts K (default: the profile's)")
    p.add_argument("--no-routes", action="store_true", help="calls without routed experts")
    add_cluster_arguments(p)


def make_deltas(args: argparse.Namespace, seed: int = 0) -> list[list[Delta]]:
    """Per rollout, per call: the delta arrays an engine would hand to ``stage`` (routes:
    int16 ids in ``[0, experts)`` of ``--profile``; the capture gate picks their encoding)."""
    prof = profile_from_args(args)
    rng = np.random.default_rng(seed)
    n_ctx = min(16, args.tokens - 1)
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(args.tokens - n_ctx, np.float32)])
    out = []
    for _ in range(args.rollouts):
        calls = []
        for _ in range(args.calls):
            lp = np.where(mask > 0, -rng.random(args.tokens, dtype=np.float32) - 0.01, 0.0).astype(np.float32)
            routes = None if args.no_routes else rng.integers(0, prof.experts, (args.tokens, prof.layers, prof.top_k), dtype=np.int16)
            calls.append(Delta(token_ids=rng.integers(0, VOCAB, args.tokens), token_mask=mask, logprobs=lp, routed_experts=routes))
        out.append(calls)
    return out


def _stage_rollout(stage: Callable[..., None], deltas: list[Delta]) -> None:
    for t, d in enumerate(deltas):
        stage(f"c{t}", None if t == 0 else f"c{t - 1}", **d)


def run_client(store: StoreLike, deltas: list[list[Delta]], args: argparse.Namespace, tag: str) -> ModeRun:
    """Engine threads stage every rollout through one CaptureClient (timed: gate + puts)."""
    from ..client import CaptureClient

    shares = [list(range(t, len(deltas), args.threads)) for t in range(args.threads)]
    receipts: list[Receipt] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(args.threads + 1)
    cap = CaptureClient(store, flush_calls=args.flush_calls, flush_ms=args.flush_ms)
    experts = profile_from_args(args).experts  # resolved once, not per rollout

    def engine(mine: list[int]) -> None:
        barrier.wait()
        try:
            # An engine batch: every rollout of this thread advances turn by turn.
            rcs = [cap.open(f"{tag}r{i}", f"{tag}g", vocab_size=VOCAB, num_experts=experts) for i in mine]
            for t in range(args.calls):
                for i, rc in zip(mine, rcs):
                    rc.stage(f"c{t}", None if t == 0 else f"c{t - 1}", **deltas[i][t])
            receipts.extend(rc.finish(0.0) for rc in rcs)
        except BaseException as e:  # noqa: BLE001 - reported as a failed run
            errors.append(e)

    threads = [threading.Thread(target=engine, args=(m,), daemon=True) for m in shares]
    for th in threads:
        th.start()
    barrier.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    cap.close()
    wall = time.perf_counter() - t0
    stats = cap.stats()
    problems = [f"{type(e).__name__}: {e}" for e in errors[:2]]
    problems += [f"{r.rollout_id}: {r.failure_reason}" for r in receipts if r.poisoned][:2]
    return {"wall_s": wall, "puts": stats["puts"], "bytes": stats["bytes"], "problems": problems}


def run_direct(store: StoreLike, deltas: list[list[Delta]], args: argparse.Namespace, tag: str) -> ModeRun:
    """The same rows gated and packed beforehand (untimed), then put batch by batch (timed)."""
    from tasks.gate import CaptureGate
    from tasks.packed import pack_rows

    rows: list[StagedRow] = []
    experts = profile_from_args(args).experts  # resolved once, not per rollout
    g0 = time.perf_counter()
    for i, calls in enumerate(deltas):
        gate = CaptureGate(f"{tag}r{i}", vocab_size=VOCAB, num_experts=experts, group_id=f"{tag}g")
        _stage_rollout(lambda *a, **kw: rows.append(gate.stage_call(*a, **kw)), calls)
    gate_s = time.perf_counter() - g0
    p0 = time.perf_counter()
    batches = [pack_rows(rows[i:i + args.flush_calls]) for i in range(0, len(rows), args.flush_calls)]
    pack_s = time.perf_counter() - p0
    problems: list[str] = []
    t0 = time.perf_counter()
    for b in batches:
        result = store.put_many(b, adopt=True)
        if result.failed:
            problems.append(f"{len(result.failed)} rows refused, e.g. {next(iter(result.failed.items()))}")
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "puts": len(batches), "bytes": sum(b.nbytes for b in batches), "problems": problems,
            "untimed_gate_s": round(gate_s, 4), "untimed_pack_s": round(pack_s, 4)}


def run(args: argparse.Namespace) -> dict[str, object]:
    """Run both modes ``--runs`` times each (interleaved); returns the JSON-able result."""
    from ..store.client import StagingStore

    if args.runs < 3:
        raise SystemExit("--runs must be at least 3")
    say = notes("capture", args.quiet)
    n_rows = args.rollouts * args.calls
    say(f"making {n_rows} deltas of {args.tokens} tokens ...")
    deltas = make_deltas(args)
    modes = {"client": run_client, "direct": run_direct}
    runs: dict[str, list[ModeRun]] = {m: [] for m in modes}
    failures: list[str] = []
    with bench_client(args) as client:
        for k in range(args.runs):
            for mode, fn in modes.items():  # interleaved: drift hits both modes alike
                store = StagingStore.start(client, n_units=2)
                tag = f"{mode[0]}{k}-"
                try:
                    before = sum(s["put_rows"] for s in store.stats())
                    r = fn(store, deltas, args, tag)
                    stored = sum(s["put_rows"] for s in store.stats()) - before
                    if stored != n_rows:
                        r["problems"].append(f"units stored {stored} rows, expected {n_rows}")
                except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
                    r = ModeRun(wall_s=float("nan"), puts=0, bytes=0, problems=[f"{type(e).__name__}: {e}"])
                finally:
                    store.close()
                r["rows_per_s"] = round(n_rows / r["wall_s"], 1) if r["wall_s"] == r["wall_s"] else None
                r["mb_per_s"] = round(r["bytes"] / r["wall_s"] / 1e6, 1) if r["wall_s"] == r["wall_s"] else None
                r["wall_s"] = round(r["wall_s"], 4)
                if r["problems"]:
                    failures.append(f"{mode} run {k}: {r['problems']}")
                say(f"{mode:6s} run {k}: {r['rows_per_s']} rows/s, {r['puts']} puts, {r['mb_per_s']} MB/s"
                    + (f", FAILED {r['problems']}" if r["problems"] else ""))
                runs[mode].append(r)
    out: dict[str, object] = {
        "benchmark": "capture",
        "rows_per_run": n_rows,
        "tokens_per_call": args.tokens,
        "routes": not args.no_routes,
        "threads": args.threads,
        "flush_calls": args.flush_calls,
        "flush_ms": args.flush_ms,
        "runs": runs,
    }
    medians: dict[str, float | None] = {}
    for mode, rs in runs.items():
        ok = [r["rows_per_s"] for r in rs if not r["problems"]]
        medians[mode] = out[f"{mode}_median_rows_per_s"] = statistics.median(ok) if ok else None
    client_rate, direct_rate = medians["client"], medians["direct"]
    if client_rate and direct_rate:
        out["ratio_client_over_direct"] = round(client_rate / direct_rate, 3)
    out.update(_payload(args, rows_per_s=client_rate))
    say(f"median rows/s: client {client_rate}, direct {direct_rate}, "
        f"ratio {out.get('ratio_client_over_direct')}")
    out["failures"] = failures
    out["ok"] = not failures
    if failures:
        say(f"{len(failures)} run(s) failed: {failures}")
    return out


def _payload(args: argparse.Namespace, rows_per_s: float | None) -> dict[str, object]:
    """The profile's keys, bytes per token (routes as the gate stores them for the
    profile's experts) and the client mode's GB/s."""
    prof = profile_from_args(args)
    id_bytes = route_id_bytes(prof)
    rate = None if rows_per_s is None else rows_per_s * args.tokens
    out = payload_figures(prof, route_id_bytes=id_bytes, tokens_per_s=rate)
    if "gb_s" in out:
        out["gb_s"] = rounded_gb_s(out["gb_s"])
    return {**out, "route_id_bytes": id_bytes}


def exit_status(result: Mapping[str, object]) -> int:
    """The CLI's exit status: 0 when every run of both modes succeeded, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
