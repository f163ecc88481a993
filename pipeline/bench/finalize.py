"""Finalization: per-rollout fetch + per-token verify vs the one-union-fetch graph.

Two workloads (short: 8 x 1 call x 256 tokens; agentic: 8 x 16 calls x 1,024 tokens with
routes) are staged once and finalized by four modes side by side on the same cluster, each
``--repeats`` times (interleaved; min and median reported, speedups on medians):

- ``baseline``: one task per group, ONE store fetch PER ROLLOUT, the per-token verify as
  published (:mod:`tasks.finalize.reference`, the tests' oracle: ``.tolist()`` per token,
  linear byte building, routes hashed as one buffer);
- ``rollout_fetch_vec``: the same fetches, vectorized verify (:mod:`tasks.finalize.verify`);
- ``union_fetch_token``: ONE fetch per step, the baseline's per-token verify per group;
- ``graph``: :mod:`pipeline.finalize` (one union fetch per storage site, verify where the
  rows landed).

Every run's output is checked: every rollout accepted, the same tokens in every mode, and
sampled groups bit-identical to the graph's. Any failure: ``ok: false``, ``failures``, no
speedups, exit status 1. Figures and their definitions: docs/design.md, "Benchmarks".

    python -m pipeline bench finalize --json
    python -m pipeline.bench.finalize --json --agentic-groups 4
"""
from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from collections import Counter
from typing import Any, Sequence

import numpy as np

from tasks.finalize.reference import RoutesView, RowsView, reference_verify_rollout
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
TARGETS = {
    "agentic": {"speedup": 25.0, "fetch_calls_per_site_graph": 2, "graph_verify_vs_hash": 2.0},
    "short": {"speedup": 1.0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench finalize``."""
    from ..cli_args import non_negative_int, positive_int

    p.add_argument("--short-groups", type=non_negative_int, default=32, help="groups in the short workload (default 32; 0 skips it)")
    p.add_argument("--agentic-groups", type=non_negative_int, default=8, help="groups in the agentic workload (default 8; 0 skips it)")
    p.add_argument("--groups-per-step", type=non_negative_int, default=0, help="groups per graph step (default 0: all in one step)")
    p.add_argument("--workers", type=positive_int, default=2, help="LocalCluster workers (default 2, one thread each)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed of the staged data")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per mode and workload, interleaved (default 3; min and median reported)")
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


# ---- the baseline's verify -----------------------------------------------------------------
#
# The per-token path as published (``.tolist()`` per token, ``bytes()`` for ids, hash inputs
# built linearly, float and routes buffers hashed as one buffer each) is the reference
# verifier, tasks/finalize/reference.py: the tests' oracle is the benchmark's baseline.

per_token_verify_rollout = reference_verify_rollout


# ---- modes --------------------------------------------------------------------------------
#
#   baseline             a fetch per rollout + per-token verify (one task per group)
#   rollout_fetch_vec    a fetch per rollout + vectorized verify (one task per group)
#   union_fetch_token    ONE fetch per step + per-token verify (one task per group)
#   graph                pipeline.finalize: union fetch, packed vectorized verify tasks

MODES = ("baseline", "rollout_fetch_vec", "union_fetch_token", "graph")
TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts", "has_routes")


def _group_out(receipts, results, fetches: int, keep: bool) -> dict:
    from tasks.finalize.assemble import assemble_group

    group = assemble_group(results, [r.reward for r in receipts])
    out = {
        "tokens": int(group.input_lengths.sum()),
        "accepted": int(group.sample_mask.sum()),
        "rollouts": len(group),
        "rejected": {st: group.status.count(st) for st in set(group.status) if st != "ok"},
        "fetch_calls": fetches,
    }
    if keep:
        out["group"] = group
    return out


def _plan_one(receipt):
    """(rollout plan, None) or (None, the rejection as a result) for one receipt."""
    from tasks.finalize.plan import plan_step
    from tasks.finalize.verify import rejected_result

    plan = plan_step([receipt])
    if not plan.rollouts:
        rid = plan.order[0]
        return None, rejected_result(rid, *plan.rejected[rid])
    return plan.rollouts[0], None


def per_rollout_group(store, receipts: Sequence[Receipt], vocab_size: int, num_experts: int | None, vectorized: bool, keep: bool) -> dict:
    """One group, ONE store fetch PER ROLLOUT; per-token (baseline) or vectorized verify.
    Runs as a Dask task."""
    from tasks.finalize.verify import verify_rollout

    results, fetches = [], 0
    for receipt in receipts:
        rp, rejected = _plan_one(receipt)
        if rp is None:
            results.append(rejected)
            continue
        fields = list(ALL_FIELDS) if rp.routes_keys else list(STAGING_FIELDS)
        got = store.get_many(rp.keys, fields)  # ONE fetch per rollout, in both modes
        fetches += 1
        verify = verify_rollout if vectorized else per_token_verify_rollout
        results.append(verify(rp, got.batch, got.batch if rp.routes_keys else None, vocab_size=vocab_size, num_experts=num_experts))
    return _group_out(receipts, results, fetches, keep)


def union_fetch(store, receipts: Sequence[Receipt]):
    """ONE store get for a whole step's rows (routes included when any are routed)."""
    from tasks.finalize.plan import plan_step

    plan = plan_step(list(receipts))
    fields = list(ALL_FIELDS) if plan.routes_keys else list(STAGING_FIELDS)
    return store.get_many(plan.staging_keys, fields).batch


def union_group(batch, receipts: Sequence[Receipt], vocab_size: int, num_experts: int | None, keep: bool) -> dict:
    """One group verified per token against the step's union fetch. Runs as a Dask task."""
    rows = RowsView(batch)
    routes = RoutesView(batch if ROUTES_FIELD in batch.fields else None)
    results = []
    for receipt in receipts:
        rp, rejected = _plan_one(receipt)
        results.append(rejected if rp is None else per_token_verify_rollout(rp, rows, routes, vocab_size=vocab_size, num_experts=num_experts))
    return _group_out(receipts, results, 0, keep)


def _summ(outs: list[dict], wall: float, keep: Sequence[int], groups) -> dict[str, Any]:
    rejected: Counter = Counter()
    for o in outs:
        rejected.update(o["rejected"])
    return {
        "wall_s": wall,
        "tokens": sum(o["tokens"] for o in outs),
        "accepted": sum(o["accepted"] for o in outs),
        "rollouts": sum(o["rollouts"] for o in outs),
        "rejected": dict(rejected),
        "fetch_calls_per_group": statistics.mean(o["fetch_calls"] for o in outs),
        "sample": {groups[i][0].group_id: outs[i]["group"] for i in keep},
    }


def _key(mode: str, i: int) -> str:
    return f"bench-{mode}-{i}-{time.time_ns()}"


def run_per_rollout(client, store, groups: list[list[Receipt]], vectorized: bool, keep: Sequence[int] = ()) -> dict[str, Any]:
    mode = "rollout-fetch-vec" if vectorized else "baseline"
    t0 = time.perf_counter()
    futures = [client.submit(per_rollout_group, store, g, VOCAB, EXPERTS, vectorized, i in keep, pure=False, key=_key(mode, i)) for i, g in enumerate(groups)]
    outs = client.gather(futures)
    wall = time.perf_counter() - t0
    return _summ(outs, wall, keep, groups)


def run_baseline(client, store, groups: list[list[Receipt]], keep: Sequence[int] = ()) -> dict[str, Any]:
    return run_per_rollout(client, store, groups, False, keep)


def run_union_per_token(client, store, groups: list[list[Receipt]], groups_per_step: int, keep: Sequence[int] = ()) -> dict[str, Any]:
    per = groups_per_step or len(groups)
    t0 = time.perf_counter()
    futures = []
    for s0 in range(0, len(groups), per):
        step = groups[s0 : s0 + per]
        batch = client.submit(union_fetch, store, [r for g in step for r in g], pure=False, key=_key("union-fetch", s0))
        futures += [client.submit(union_group, batch, g, VOCAB, EXPERTS, s0 + i in keep, pure=False, key=_key("union-verify", s0 + i)) for i, g in enumerate(step)]
    outs = client.gather(futures)
    wall = time.perf_counter() - t0
    out = _summ(outs, wall, keep, groups)
    out["fetch_calls_per_group"] = -(-len(groups) // per) / len(groups)
    return out


# ---- graph -------------------------------------------------------------------------------


def run_graph(client, store, groups: list[list[Receipt]], groups_per_step: int, keep: Sequence[int] = ()) -> dict[str, Any]:
    from pipeline.finalize import Finalizer

    fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=EXPERTS)
    per = groups_per_step or len(groups)
    t0 = time.perf_counter()
    for s in range(0, len(groups), per):
        # Each group under its receipts' own group id (a receipt under another is wrong_group).
        fin.submit_step({(g[0].group_id or f"g{s + i}"): g for i, g in enumerate(groups[s : s + per])})
    steps = fin.drain()
    wall = time.perf_counter() - t0
    all_groups = {gid: g for st in steps for gid, g in st.groups.items()}
    group_metrics = [g.metrics for g in all_groups.values()]
    rejected: Counter = Counter()
    for m in group_metrics:
        rejected.update(m["rejected_by_reason"])
        if m.get("internal_errors"):
            rejected["internal_error"] += m["internal_errors"]
    return {
        "wall_s": wall,
        "tokens": sum(st.metrics["tokens"] for st in steps),
        "accepted": sum(st.metrics["accepted"] for st in steps),
        "rollouts": sum(st.metrics["rollouts"] for st in steps),
        "rejected": dict(rejected),
        "sample": {groups[i][0].group_id: all_groups.get(groups[i][0].group_id) for i in keep},
        "fetch_calls_per_group": statistics.mean(m["fetch_calls"] for m in group_metrics),
        "fetch_calls_per_step": statistics.mean(st.metrics["fetch_calls"] for st in steps),
        "sites": len({_site_of(store, r.rollout_id) for g in groups for r in g}),
        "steps": len(steps),
        "fetch_ms": sum(st.metrics["fetch_ms"] for st in steps),
        "verify_ms": sum(st.metrics["verify_ms"] for st in steps),
        "verify_cpu_ms": sum(st.metrics.get("verify_cpu_ms", 0.0) for st in steps),
        "verify_tasks": sum(st.metrics["verify_tasks"] for st in steps),
        "assemble_ms": sum(st.metrics["assemble_ms"] for st in steps),
        "queue_wait_ms": max(st.metrics["queue_wait_ms"] for st in steps),
        "bytes_fetched": sum(st.metrics["bytes_fetched"] for st in steps),
    }


def _site_of(store, rollout_id: str) -> str:
    """The worker hosting the unit that holds ``rollout_id``'s rows (a graph fetch site)."""
    from tasks.keys import unit_for_rollout

    workers = list(store.unit_workers)
    return workers[unit_for_rollout(rollout_id, len(workers))]


def run_mode(mode: str, client, store, groups, groups_per_step: int, keep: Sequence[int] = ()) -> dict[str, Any]:
    if mode == "baseline":
        return run_per_rollout(client, store, groups, False, keep)
    if mode == "rollout_fetch_vec":
        return run_per_rollout(client, store, groups, True, keep)
    if mode == "union_fetch_token":
        return run_union_per_token(client, store, groups, groups_per_step, keep)
    if mode == "graph":
        return run_graph(client, store, groups, groups_per_step, keep)
    raise ValueError(f"unknown mode {mode!r}")


def group_diff(a, b) -> str | None:
    """``None`` when two FinalizedGroups hold bit-identical training rows, else what differs."""
    if a is None or b is None:
        return "group missing"
    if list(a.rollout_ids) != list(b.rollout_ids):
        return "rollout_ids differ"
    if list(a.status) != list(b.status):
        return f"status {a.status} vs {b.status}"
    for name in TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return f"{name}: present in one only"
        if x is not None and (x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape) or x.numpy().tobytes() != y.numpy().tobytes()):
            return f"{name} differs"
    return None


def verify_vs_hash(store, groups: list[list[Receipt]], repeats: int = 3) -> dict[str, float]:
    """Vectorized verify of every rollout vs ONE SHA-256 pass over the same fetched bytes.

    Both run here, on the controller, on the same two fetched batches, interleaved and
    best of ``repeats`` each, so machine load hits both alike. Hashed: every field's
    packed buffer (ids, scalars, hashes, tokens, mask, logprobs, routes) once. Wall time
    (``*_ms``) and this thread's CPU time (``*_cpu_ms``) of each.
    """
    from tasks.finalize.plan import plan_step
    from tasks.finalize.verify import verify_many

    plan = plan_step([r for g in groups for r in g])
    rows = store.get_many(plan.staging_keys, list(STAGING_FIELDS)).batch
    routes = store.get_many(plan.routes_keys, [ROUTES_FIELD]).batch if plan.routes_keys else None
    buffers = [np.ascontiguousarray(f.values) for b in (rows, routes) if b is not None for f in b.fields.values()]
    best = {"verify_ms": float("inf"), "verify_cpu_ms": float("inf"), "hash_ms": float("inf"), "hash_cpu_ms": float("inf")}

    def timed(what: str, fn: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn()
        best[f"{what}_ms"] = min(best[f"{what}_ms"], (time.perf_counter() - t0) * 1e3)
        best[f"{what}_cpu_ms"] = min(best[f"{what}_cpu_ms"], (time.thread_time() - c0) * 1e3)
        return out

    def hash_all() -> None:
        for b in buffers:
            hashlib.sha256(memoryview(b).cast("B")).digest()

    for _ in range(repeats):
        results = timed("verify", lambda: verify_many(plan.rollouts, rows, routes, vocab_size=VOCAB, num_experts=EXPERTS))
        timed("hash", hash_all)
    if not all(r.ok for r in results):
        raise RuntimeError("verify_vs_hash: staged rows did not verify")
    return {**best, "bytes": int(sum(b.nbytes for b in buffers))}


# ---- the run -----------------------------------------------------------------------------


def _stats(runs: list[float]) -> dict[str, Any]:
    return {"wall_s_runs": [round(w, 4) for w in runs], "wall_s_min": round(min(runs), 4), "wall_s_median": round(statistics.median(runs), 4)}


def _sample_groups(n: int) -> list[int]:
    return sorted({0, n - 1})


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Stage both workloads, run every mode ``--repeats`` times on each (interleaved),
    check every run's output, return the figures (``ok: false`` and ``failures`` when a
    check failed; no speedups then)."""
    import dask

    from pipeline.store import StagingStore

    repeats = getattr(args, "repeats", 3)
    if repeats < 3:
        raise SystemExit("--repeats must be at least 3 (min and median of 3 or more runs)")
    say = notes("finalize", args.quiet)
    rng = np.random.default_rng(args.seed)
    counts = {"short": args.short_groups, "agentic": args.agentic_groups}
    failures: list[str] = []
    out: dict[str, Any] = {"benchmark": "finalize", "repeats": repeats, "modes": list(MODES)}
    # Every mode reads the same staged rows, run after run: the graph must not delete them.
    with dask.config.set({"token-capture.finalize.clear-staged": False}), bench_client(args, n_workers=args.workers) as client:
        say(f"cluster up: {len(client.scheduler_info()['workers'])} workers")
        store = StagingStore.start(client)
        try:
            staged = {name: stage_workload(store, name, n, rng, say) for name, n in counts.items() if n > 0}
            # Warm-up (imports, first-call costs on workers), untimed: one rollout per mode
            # and workload is enough to load every module on both workers.
            for name, groups in staged.items():
                for mode in MODES:
                    run_mode(mode, client, store, [groups[0][:1], groups[-1][:1]], 0)
            say("warm-up done")
            runs: dict[str, dict[str, list[dict]]] = {name: {m: [] for m in MODES} for name in staged}
            for k in range(repeats):
                for name, groups in staged.items():
                    keep = _sample_groups(len(groups))
                    order = MODES[k % len(MODES):] + MODES[: k % len(MODES)]  # interleaved, rotating who goes first
                    this: dict[str, dict] = {}
                    for mode in order:
                        try:
                            r = run_mode(mode, client, store, groups, args.groups_per_step, keep)
                        except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
                            failures.append(f"{name} {mode} run {k}: {type(e).__name__}: {e}")
                            say(f"{name}: {mode} run {k} FAILED: {type(e).__name__}: {e}")
                            continue
                        say(f"{name}: {mode:18s} run {k}: {r['wall_s']:.3f}s")
                        expected = sum(len(g) for g in groups)
                        if r["accepted"] != expected or r["rejected"]:
                            failures.append(f"{name} {mode} run {k}: {expected - r['accepted']} of {expected} rollouts rejected: {r['rejected']}")
                        this[mode] = r
                        runs[name][mode].append(r)
                    # Output checks: the same tokens, and sampled groups bit-identical to the graph's.
                    ref_mode = "graph" if "graph" in this else next(iter(this), None)
                    for mode, r in this.items():
                        if mode == ref_mode:
                            continue
                        if r["tokens"] != this[ref_mode]["tokens"]:
                            failures.append(f"{name} {mode} run {k}: {r['tokens']} tokens, {ref_mode} {this[ref_mode]['tokens']}")
                        for gid, g in r["sample"].items():
                            diff = group_diff(this[ref_mode]["sample"].get(gid), g)
                            if diff:
                                failures.append(f"{name} {mode} run {k}: group {gid} not bit-identical to {ref_mode}: {diff}")
            for name, groups in staged.items():
                try:
                    vh = verify_vs_hash(store, groups)
                except Exception as e:  # noqa: BLE001
                    failures.append(f"{name} verify_vs_hash: {type(e).__name__}: {e}")
                    vh = None
                out[name] = _figures(name, groups, runs[name], vh)
        finally:
            store.close()
    out["failures"] = failures
    out["ok"] = not failures
    if failures:
        say(f"{len(failures)} check(s) failed: {failures[:5]}")
        for name in staged:
            for key in [k for k in out[name] if k.startswith("speedup") or k.endswith("vs_hash")]:
                del out[name][key]
    return out


def _figures(name: str, groups, runs: dict[str, list[dict]], vh: dict | None) -> dict[str, Any]:
    rollouts, calls, delta, routes = WORKLOADS[name]
    res: dict[str, Any] = {
        "groups": len(groups),
        "rollouts_per_group": rollouts,
        "calls_per_rollout": calls,
        "tokens_per_delta": delta,
        "routes": None if routes is None else list(routes),
    }
    modes: dict[str, Any] = {}
    for mode, rs in runs.items():
        if not rs:
            modes[mode] = {"wall_s_runs": []}
            continue
        st = _stats([r["wall_s"] for r in rs])
        st["fetch_calls_per_group"] = rs[0]["fetch_calls_per_group"]
        st["tokens"] = rs[0]["tokens"]
        st["tokens_per_s_median"] = round(rs[0]["tokens"] / st["wall_s_median"], 1)
        modes[mode] = st
    res["modes"] = modes
    ok = all(modes[m].get("wall_s_runs") for m in MODES)
    base = modes["baseline"]
    if ok:
        for mode, suffix in (("graph", ""), ("rollout_fetch_vec", "_rollout_fetch_vec"), ("union_fetch_token", "_union_fetch_token")):
            res[f"speedup_median{suffix}"] = round(base["wall_s_median"] / modes[mode]["wall_s_median"], 2)
            res[f"speedup_min{suffix}"] = round(base["wall_s_min"] / modes[mode]["wall_s_min"], 2)
    g = runs["graph"]
    if g:

        def med(key: str) -> float:
            return statistics.median(r[key] for r in g)

        res.update({
            "fetch_calls_per_step_graph": g[0]["fetch_calls_per_step"],
            "graph_sites": g[0]["sites"],
            "fetch_calls_per_site_graph": round(g[0]["fetch_calls_per_step"] / max(g[0]["sites"], 1), 2),
            "graph_steps": g[0]["steps"],
            "graph_fetch_ms": round(med("fetch_ms"), 2),
            "graph_verify_ms": round(med("verify_ms"), 2),
            "graph_verify_cpu_ms": round(med("verify_cpu_ms"), 2),
            "graph_verify_tasks": g[0]["verify_tasks"],
            "graph_assemble_ms": round(med("assemble_ms"), 2),
            "graph_queue_wait_ms": round(med("queue_wait_ms"), 2),
            "graph_bytes_fetched": g[0]["bytes_fetched"],
        })
    if vh is not None:
        res.update({
            "verify_ms_in_process": round(vh["verify_ms"], 3),
            "hash_ms": round(vh["hash_ms"], 3),
            "hash_cpu_ms": round(vh["hash_cpu_ms"], 3),
            "hash_bytes": vh["bytes"],
            "verify_vs_hash": round(vh["verify_ms"] / vh["hash_ms"], 2),
        })
        if g:
            # The same ratio with the graph's own verify tasks (2 busy workers; median run): their
            # wall time (waits for a CPU and the GIL included), and their threads' CPU time
            # against the hash pass's (what the verify computed).
            res["graph_verify_vs_hash"] = round(res["graph_verify_ms"] / vh["hash_ms"], 2)
            res["graph_verify_cpu_vs_hash"] = round(res["graph_verify_cpu_ms"] / vh["hash_cpu_ms"], 2)
    res["targets"] = TARGETS[name]
    return res


def exit_status(result: dict[str, Any]) -> int:
    """The CLI's exit status: 0 when every run of every mode passed its checks, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
