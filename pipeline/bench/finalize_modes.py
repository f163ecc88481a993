"""The four ways ``bench finalize`` finalizes the same staged groups, each timed end to end
on the cluster (wall seconds from the first submit to the last answer):

- ``baseline``: one task per group, ONE store fetch PER ROLLOUT, the per-token verify as
  published (:mod:`tasks.finalize.reference`, the tests' oracle);
- ``rollout_fetch_vec``: the same fetches, vectorized verify (:mod:`tasks.finalize.verify`);
- ``union_fetch_token``: ONE fetch per step, the baseline's per-token verify per group;
- ``graph``: :mod:`pipeline.finalize` (one union fetch per storage site, verify where the
  rows landed), on rows hashed with the default digest (BLAKE3);
- ``graph_sha256``: the same graph on the same rows hashed with SHA-256.

The first three run on the SHA-256 copy too (:data:`SHA256_MODES`): the seed's per-token
path keeps SHA-256, what teams run today. ``graph`` against ``graph_sha256`` is the
algorithm's share, ``graph_sha256`` against ``baseline`` the graph's.

The group functions (:func:`per_rollout_group`, :func:`union_fetch`, :func:`union_group`)
run as Dask tasks.
"""
from __future__ import annotations

import statistics
import time
from collections import Counter
from typing import TYPE_CHECKING, Sequence, TypedDict

from tasks.finalize.reference import RoutesView, RowsView, reference_verify_rollout
from tasks.receipts import Receipt
from tasks.schema import ALL_FIELDS, ROUTES_FIELDS, STAGING_FIELDS

if TYPE_CHECKING:
    from distributed import Client

    from tasks.finalize.assemble import FinalizedGroup
    from tasks.finalize.plan import RolloutPlan
    from tasks.finalize.verify import RolloutResult
    from tasks.packed import PackedBatch

    from ..store import StagingStore

VOCAB, EXPERTS = 512, 8  # token ids in [0, VOCAB) and expert ids in [0, EXPERTS) of every staged row

MODES = ("baseline", "rollout_fetch_vec", "union_fetch_token", "graph", "graph_sha256")
# The modes that finalize the SHA-256 copy of a workload (the others: the default digest's).
SHA256_MODES = frozenset({"baseline", "rollout_fetch_vec", "union_fetch_token", "graph_sha256"})

# The per-token path as published (``.tolist()`` per token, ``bytes()`` for ids, hash inputs
# built linearly, float and routes buffers hashed as one buffer each) is the reference
# verifier, tasks/finalize/reference.py: the tests' oracle is the benchmark's baseline.
per_token_verify_rollout = reference_verify_rollout


class _GroupCounts(TypedDict):
    tokens: int  # tokens in the group's rows (accepted or not)
    accepted: int  # rollouts accepted
    rollouts: int
    rejected: dict[str, int]  # rollouts per rejection reason
    fetch_calls: int  # store gets this task made


class GroupOutcome(_GroupCounts, total=False):
    """One group finalized by a per-group task (:func:`per_rollout_group`, :func:`union_group`)."""

    group: FinalizedGroup  # the group itself, for the sampled groups only


class ModeRun(TypedDict):
    """One timed run of one mode over a workload's groups."""

    wall_s: float  # seconds, first submit to last answer
    tokens: int
    accepted: int  # rollouts accepted
    rollouts: int
    rejected: dict[str, int]  # rollouts per rejection reason
    fetch_calls_per_group: float  # store gets per group (mean)
    sample: dict[str, FinalizedGroup | None]  # group id -> the sampled groups' output (bench finalize keeps their prints)


class GraphRun(ModeRun):
    """A run of ``graph``: also the finalizer's own step metrics."""

    fetch_calls_per_step: float  # mean over steps
    sites: int  # workers hosting the staged rows' units
    steps: int
    fetch_ms: float  # summed over steps
    verify_ms: float  # summed over steps
    verify_cpu_ms: float  # summed over steps
    verify_tasks: int  # summed over steps
    assemble_ms: float  # summed over steps
    queue_wait_ms: float  # the longest over steps
    bytes_fetched: int  # summed over steps


# ---- the per-group tasks ------------------------------------------------------------------


def _group_out(receipts: Sequence[Receipt], results: list[RolloutResult], fetches: int, keep: bool) -> GroupOutcome:
    from tasks.finalize.assemble import assemble_group

    group = assemble_group(results, [r.reward for r in receipts])
    out: GroupOutcome = {
        "tokens": int(group.input_lengths.sum()),
        "accepted": int(group.sample_mask.sum()),
        "rollouts": len(group),
        "rejected": {st: group.status.count(st) for st in set(group.status) if st != "ok"},
        "fetch_calls": fetches,
    }
    if keep:
        out["group"] = group
    return out


def _plan_one(receipt: Receipt) -> tuple[RolloutPlan, None] | tuple[None, RolloutResult]:
    """(rollout plan, None) or (None, the rejection as a result) for one receipt."""
    from tasks.finalize.plan import plan_step
    from tasks.finalize.verify import rejected_result

    plan = plan_step([receipt])
    if not plan.rollouts:
        rid = plan.order[0]
        return None, rejected_result(rid, *plan.rejected[rid])
    return plan.rollouts[0], None


def per_rollout_group(store: StagingStore, receipts: Sequence[Receipt], vocab_size: int, num_experts: int | None,
                      vectorized: bool, keep: bool) -> GroupOutcome:
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


def union_fetch(store: StagingStore, receipts: Sequence[Receipt]) -> PackedBatch:
    """ONE store get for a whole step's rows (routes included when any are routed)."""
    from tasks.finalize.plan import plan_step

    plan = plan_step(list(receipts))
    fields = list(ALL_FIELDS) if plan.routes_keys else list(STAGING_FIELDS)
    return store.get_many(plan.staging_keys, fields).batch


def union_group(batch: PackedBatch, receipts: Sequence[Receipt], vocab_size: int, num_experts: int | None,
                keep: bool) -> GroupOutcome:
    """One group verified per token against the step's union fetch. Runs as a Dask task."""
    rows = RowsView(batch)
    routes = RoutesView(batch if any(f in batch.fields for f in ROUTES_FIELDS) else None)
    results = []
    for receipt in receipts:
        rp, rejected = _plan_one(receipt)
        results.append(rejected if rp is None else per_token_verify_rollout(rp, rows, routes, vocab_size=vocab_size, num_experts=num_experts))
    return _group_out(receipts, results, 0, keep)


# ---- timed runs ---------------------------------------------------------------------------


def _summ(outs: list[GroupOutcome], wall: float, keep: Sequence[int], groups: list[list[Receipt]]) -> ModeRun:
    rejected: Counter[str] = Counter()
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


def run_per_rollout(client: Client, store: StagingStore, groups: list[list[Receipt]], vectorized: bool,
                    keep: Sequence[int] = (), experts: int = EXPERTS) -> ModeRun:
    """``baseline`` (per-token verify) or ``rollout_fetch_vec`` (``vectorized``): one task
    per group, each fetching rollout by rollout. ``keep``: indexes of the groups sampled."""
    mode = "rollout-fetch-vec" if vectorized else "baseline"
    t0 = time.perf_counter()
    futures = [client.submit(per_rollout_group, store, g, VOCAB, experts, vectorized, i in keep, pure=False, key=_key(mode, i)) for i, g in enumerate(groups)]
    outs = client.gather(futures)
    wall = time.perf_counter() - t0
    return _summ(outs, wall, keep, groups)


def run_baseline(client: Client, store: StagingStore, groups: list[list[Receipt]], keep: Sequence[int] = ()) -> ModeRun:
    """``baseline``: :func:`run_per_rollout` with the per-token verify."""
    return run_per_rollout(client, store, groups, False, keep)


def run_union_per_token(client: Client, store: StagingStore, groups: list[list[Receipt]], groups_per_step: int,
                        keep: Sequence[int] = (), experts: int = EXPERTS) -> ModeRun:
    """``union_fetch_token``: per step of ``groups_per_step`` groups (0: all), one fetch
    task, then one per-token verify task per group on its answer."""
    per = groups_per_step or len(groups)
    t0 = time.perf_counter()
    futures = []
    for s0 in range(0, len(groups), per):
        step = groups[s0 : s0 + per]
        batch = client.submit(union_fetch, store, [r for g in step for r in g], pure=False, key=_key("union-fetch", s0))
        futures += [client.submit(union_group, batch, g, VOCAB, experts, s0 + i in keep, pure=False, key=_key("union-verify", s0 + i)) for i, g in enumerate(step)]
    outs = client.gather(futures)
    wall = time.perf_counter() - t0
    out = _summ(outs, wall, keep, groups)
    out["fetch_calls_per_group"] = -(-len(groups) // per) / len(groups)
    return out


def run_graph(client: Client, store: StagingStore, groups: list[list[Receipt]], groups_per_step: int,
              keep: Sequence[int] = (), experts: int = EXPERTS, on_cluster: bool = False) -> GraphRun:
    """``graph``: :class:`pipeline.finalize.Finalizer` steps of ``groups_per_step`` groups
    (0: all), submitted together and drained; ``on_cluster``: each step's groups assembled
    on the cluster (``StepHandle.group_futures``) instead of by the controller."""
    from pipeline.finalize import Finalizer

    fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=experts)
    per = groups_per_step or len(groups)
    t0 = time.perf_counter()
    for s in range(0, len(groups), per):
        # Each group under its receipts' own group id (a receipt under another is wrong_group).
        handle = fin.submit_step({(g[0].group_id or f"g{s + i}"): g for i, g in enumerate(groups[s : s + per])})
        if on_cluster:
            handle.group_futures  # one assemble task per group, on the site holding most of its rows
    steps = fin.drain()
    wall = time.perf_counter() - t0
    all_groups = {gid: g for st in steps for gid, g in st.groups.items()}
    group_metrics = [g.metrics for g in all_groups.values()]
    rejected: Counter[str] = Counter()
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


def _site_of(store: StagingStore, rollout_id: str) -> str:
    """The worker hosting the unit that holds ``rollout_id``'s rows (a graph fetch site)."""
    from tasks.keys import primary_unit

    return store.unit_workers[primary_unit(rollout_id, store.placement.unit_ids)]


def run_mode(mode: str, client: Client, store: StagingStore, groups: list[list[Receipt]], groups_per_step: int,
             keep: Sequence[int] = (), experts: int = EXPERTS, on_cluster: bool = False) -> ModeRun:
    """One timed run of ``mode`` (one of :data:`MODES`) over ``groups`` (expert ids in
    ``[0, experts)``: the bound every mode verifies them against; ``on_cluster``: the
    graph modes assemble the groups on the cluster)."""
    if mode == "baseline":
        return run_per_rollout(client, store, groups, False, keep, experts)
    if mode == "rollout_fetch_vec":
        return run_per_rollout(client, store, groups, True, keep, experts)
    if mode == "union_fetch_token":
        return run_union_per_token(client, store, groups, groups_per_step, keep, experts)
    if mode in ("graph", "graph_sha256"):  # the store given holds the mode's copy
        return run_graph(client, store, groups, groups_per_step, keep, experts, on_cluster)
    raise ValueError(f"unknown mode {mode!r}")
