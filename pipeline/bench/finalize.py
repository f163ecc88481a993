"""Finalization: per-rollout fetch + per-token reference verify vs the one-union-fetch graph.

Two workloads (short: 8 x 1 call x 256 tokens; agentic: 8 x 16 calls x 1,024 tokens with
routes) are staged once and finalized by both modes side by side on the same cluster.
``baseline`` is one task per group fetching per rollout and verifying with
:mod:`tasks.finalize.reference`; ``graph`` is :mod:`pipeline.finalize`. Figures and their
definitions: docs/design.md, "Benchmarks".

    python -m pipeline bench finalize --json
    python -m pipeline.bench.finalize --json --agentic-groups 4
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from typing import Any, Sequence

import numpy as np

from tasks.gate import CaptureGate
from tasks.packed import pack_rows
from tasks.receipts import Receipt
from tasks.schema import ALL_FIELDS, ROUTES_FIELD, STAGING_FIELDS

from .common import add_cluster_arguments, bench_client, main, notes

VOCAB, EXPERTS = 512, 8

WORKLOADS = {
    # name: (rollouts per group, calls per rollout, tokens per delta, routes (L, K) or None)
    "short": (8, 1, 256, None),
    "agentic": (8, 16, 1024, (4, 2)),
}
TARGETS = {"agentic": {"speedup": 20.0, "fetch_calls_per_group_graph": 2, "verify_vs_hash": 3.0}, "short": {"speedup": 1.0}}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench finalize``."""
    from ..cli_args import non_negative_int, positive_int

    p.add_argument("--short-groups", type=non_negative_int, default=32, help="groups in the short workload (default 32; 0 skips it)")
    p.add_argument("--agentic-groups", type=non_negative_int, default=8, help="groups in the agentic workload (default 8; 0 skips it)")
    p.add_argument("--groups-per-step", type=non_negative_int, default=0, help="groups per graph step (default 0: all in one step)")
    p.add_argument("--workers", type=positive_int, default=2, help="LocalCluster workers (default 2, one thread each)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed of the staged data")
    add_cluster_arguments(p)


# ---- staged data -------------------------------------------------------------------------


def make_rollout(rng: np.random.Generator, rid: str, gid: str, calls: int, delta: int, routes) -> tuple[list, Receipt]:
    """One rollout through the capture gate: a chain of ``calls`` deltas of ``delta`` tokens
    (the root: a quarter prompt; later calls: a quarter tool tokens; the rest generated)."""
    gate = CaptureGate(rid, vocab_size=VOCAB, num_experts=EXPERTS, group_id=gid)
    n_ctx = delta // 4
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(delta - n_ctx, np.float32)])
    rows, parent = [], None
    for c in range(calls):
        ids = rng.integers(0, VOCAB, delta)
        lps = np.where(mask > 0, -rng.random(delta, dtype=np.float32) - 0.01, 0.0).astype(np.float32)
        experts = None if routes is None else rng.integers(0, EXPERTS, (delta,) + tuple(routes)).astype(np.int16)
        rows.append(gate.stage_call(f"c{c}", parent, ids, mask, lps, routed_experts=experts))
        parent = f"c{c}"
    return rows, gate.receipt(float(rng.random()))


def stage_workload(store, name: str, n_groups: int, rng: np.random.Generator, progress) -> list[list[Receipt]]:
    """Stage ``n_groups`` groups of workload ``name`` (one put per group); their receipts."""
    rollouts, calls, delta, routes = WORKLOADS[name]
    groups = []
    for g in range(n_groups):
        rows, receipts = [], []
        for r in range(rollouts):
            rr, rec = make_rollout(rng, f"{name}-g{g}-r{r}", f"{name}-g{g}", calls, delta, routes)
            rows += rr
            receipts.append(rec)
        res = store.put_many(pack_rows(rows))
        if res.failed:
            raise RuntimeError(f"staging {name} group {g} failed: {dict(list(res.failed.items())[:3])}")
        groups.append(receipts)
        if (g + 1) % max(1, n_groups // 4) == 0 or g + 1 == n_groups:
            progress(f"staged {name} {g + 1}/{n_groups}")
    return groups


# ---- baseline: a fetch per rollout + per-token reference --------------------------------


def baseline_group(store, receipts: Sequence[Receipt], vocab_size: int, num_experts: int | None) -> dict:
    """One group the reference way; runs as a Dask task. Returns tokens and fetch count."""
    from tasks.finalize.assemble import assemble_group
    from tasks.finalize.plan import plan_step
    from tasks.finalize.reference import reference_verify_rollout
    from tasks.finalize.verify import rejected_result

    results, fetches = [], 0
    for receipt in receipts:
        plan = plan_step([receipt])
        if not plan.rollouts:
            rid = plan.order[0]
            results.append(rejected_result(rid, *plan.rejected[rid]))
            continue
        rp = plan.rollouts[0]
        fields = list(ALL_FIELDS) if rp.routes_keys else list(STAGING_FIELDS)
        got = store.get_many(rp.keys, fields)  # one fetch per rollout
        fetches += 1
        results.append(reference_verify_rollout(rp, got.batch, got.batch if rp.routes_keys else None, vocab_size=vocab_size, num_experts=num_experts))
    group = assemble_group(results, [r.reward for r in receipts])
    return {"tokens": int(group.input_lengths.sum()), "accepted": int(group.sample_mask.sum()), "fetch_calls": fetches}


def run_baseline(client, store, groups: list[list[Receipt]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    futures = [client.submit(baseline_group, store, g, VOCAB, EXPERTS, pure=False, key=f"bench-baseline-{i}-{time.time_ns()}") for i, g in enumerate(groups)]
    outs = client.gather(futures)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "tokens": sum(o["tokens"] for o in outs),
        "accepted": sum(o["accepted"] for o in outs),
        "fetch_calls_per_group": statistics.mean(o["fetch_calls"] for o in outs),
    }


# ---- graph -------------------------------------------------------------------------------


def run_graph(client, store, groups: list[list[Receipt]], groups_per_step: int) -> dict[str, Any]:
    from pipeline.finalize import Finalizer

    fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=EXPERTS)
    per = groups_per_step or len(groups)
    t0 = time.perf_counter()
    for s in range(0, len(groups), per):
        # Each group under its receipts' own group id (a receipt under another is wrong_group).
        fin.submit_step({(g[0].group_id or f"g{s + i}"): g for i, g in enumerate(groups[s : s + per])})
    steps = fin.drain()
    wall = time.perf_counter() - t0
    group_metrics = [g.metrics for st in steps for g in st.groups.values()]
    return {
        "wall_s": wall,
        "tokens": sum(st.metrics["tokens"] for st in steps),
        "accepted": sum(st.metrics["accepted"] for st in steps),
        "fetch_calls_per_group": statistics.mean(m["fetch_calls"] for m in group_metrics),
        "fetch_calls_per_step": statistics.mean(st.metrics["fetch_calls"] for st in steps),
        "steps": len(steps),
        "fetch_ms": sum(st.metrics["fetch_ms"] for st in steps),
        "verify_ms": sum(st.metrics["verify_ms"] for st in steps),
        "verify_tasks": sum(st.metrics["verify_tasks"] for st in steps),
        "assemble_ms": sum(st.metrics["assemble_ms"] for st in steps),
        "queue_wait_ms": max(st.metrics["queue_wait_ms"] for st in steps),
        "bytes_fetched": sum(st.metrics["bytes_fetched"] for st in steps),
    }


def verify_vs_hash(store, groups: list[list[Receipt]], repeats: int = 3) -> dict[str, float]:
    """Vectorized verify of every rollout vs ONE SHA-256 pass over the same fetched bytes.

    Both run here, on the controller, on the same two fetched batches, interleaved and
    best of ``repeats`` each, so machine load hits both alike. Hashed: every field's
    packed buffer (ids, scalars, hashes, tokens, mask, logprobs, routes) once.
    """
    from tasks.finalize.plan import plan_step
    from tasks.finalize.verify import verify_many

    plan = plan_step([r for g in groups for r in g])
    rows = store.get_many(plan.staging_keys, list(STAGING_FIELDS)).batch
    routes = store.get_many(plan.routes_keys, [ROUTES_FIELD]).batch if plan.routes_keys else None
    buffers = [np.ascontiguousarray(f.values) for b in (rows, routes) if b is not None for f in b.fields.values()]
    best_v = best_h = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        results = verify_many(plan.rollouts, rows, routes, vocab_size=VOCAB, num_experts=EXPERTS)
        best_v = min(best_v, (time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        for b in buffers:
            hashlib.sha256(memoryview(b).cast("B")).digest()
        best_h = min(best_h, (time.perf_counter() - t0) * 1e3)
    if not all(r.ok for r in results):
        raise RuntimeError("verify_vs_hash: staged rows did not verify")
    return {"verify_ms": best_v, "hash_ms": best_h, "bytes": int(sum(b.nbytes for b in buffers))}


# ---- the run -----------------------------------------------------------------------------



def run(args: argparse.Namespace) -> dict[str, Any]:
    """Stage both workloads, run baseline and graph on each, return the figures."""
    from pipeline.store import StagingStore

    say = notes("finalize", args.quiet)
    rng = np.random.default_rng(args.seed)
    counts = {"short": args.short_groups, "agentic": args.agentic_groups}
    with bench_client(args, n_workers=args.workers) as client:
        say(f"cluster up: {len(client.scheduler_info()['workers'])} workers")
        store = StagingStore.start(client)
        try:
            staged = {name: stage_workload(store, name, n, rng, say) for name, n in counts.items() if n > 0}
            # Warm-up (imports, first-call costs on workers), untimed: one rollout per mode
            # and workload is enough to load every module on both workers.
            for name, groups in staged.items():
                run_baseline(client, store, [groups[0][:1], groups[-1][:1]])
                run_graph(client, store, [groups[0][:1], groups[-1][:1]], 0)
            say("warm-up done")
            out: dict[str, Any] = {}
            for name, groups in staged.items():
                base = run_baseline(client, store, groups)
                say(f"{name}: baseline {base['wall_s']:.2f}s")
                graph = run_graph(client, store, groups, args.groups_per_step)
                say(f"{name}: graph {graph['wall_s']:.3f}s")
                vh = verify_vs_hash(store, groups)
                if base["tokens"] != graph["tokens"] or base["accepted"] != graph["accepted"]:
                    raise RuntimeError(f"{name}: modes disagree: baseline {base} vs graph {graph}")
                rollouts, calls, delta, routes = WORKLOADS[name]
                out[name] = {
                    "groups": len(groups),
                    "rollouts_per_group": rollouts,
                    "calls_per_rollout": calls,
                    "tokens_per_delta": delta,
                    "routes": None if routes is None else list(routes),
                    "baseline_wall_s": round(base["wall_s"], 4),
                    "graph_wall_s": round(graph["wall_s"], 4),
                    "speedup": round(base["wall_s"] / graph["wall_s"], 2),
                    "fetch_calls_per_group_baseline": base["fetch_calls_per_group"],
                    "fetch_calls_per_group_graph": graph["fetch_calls_per_group"],
                    "fetch_calls_per_step_graph": graph["fetch_calls_per_step"],
                    "graph_steps": graph["steps"],
                    "graph_fetch_ms": round(graph["fetch_ms"], 2),
                    "graph_verify_ms": round(graph["verify_ms"], 2),
                    "graph_verify_tasks": graph["verify_tasks"],
                    "graph_assemble_ms": round(graph["assemble_ms"], 2),
                    "graph_queue_wait_ms": round(graph["queue_wait_ms"], 2),
                    "graph_bytes_fetched": graph["bytes_fetched"],
                    "tokens": graph["tokens"],
                    "tokens_per_s_baseline": round(base["tokens"] / base["wall_s"], 1),
                    "tokens_per_s_graph": round(graph["tokens"] / graph["wall_s"], 1),
                    "verify_ms_in_process": round(vh["verify_ms"], 3),
                    "hash_ms": round(vh["hash_ms"], 3),
                    "hash_bytes": vh["bytes"],
                    "verify_vs_hash": round(vh["verify_ms"] / vh["hash_ms"], 2),
                    # The same ratio with the graph's own verify-task time (2 busy workers).
                    "graph_verify_vs_hash": round(graph["verify_ms"] / vh["hash_ms"], 2),
                    "targets": TARGETS[name],
                }
            return out
        finally:
            store.close()


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
