"""Finalization of one training step as ONE Dask task graph, submitted in one message.

Per storage site (a worker hosting storage units): one union fetch of the staging rows
the site holds (and at most one of routes), pinned loosely to that worker, cut into one
piece per verify task as views; verify tasks (``finalize`` resource slot) run where their
pieces are, so fetched rows never cross workers. One assemble task per group publishes
the group's finalize event. One bad row rejects only its rollout; a verifier failure
marks its rollouts ``internal_error`` and is counted apart (``internal_errors``).
"""
from __future__ import annotations

import logging
import operator
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from tasks.errors import FinalizeError
from tasks import reasons
from tasks.finalize.assemble import FinalizedGroup, assemble_group, rebuild_group
from tasks.keys import STAGING_PARTITION, unit_for_key
from tasks.packed import PackedBatch, payload_bytes_per_row, slice_rows
from tasks.finalize.plan import pack_verify_tasks, plan_step
from tasks.schema import ROUTES_FIELD, STAGING_FIELDS
from tasks.finalize.verify import RolloutResult, internal_error_result, rejected_result, verify_many

from .. import config, events
from ..store.deadline import takes_timeout
from ..store.protocol import LOST_KEY, PlacedStoreLike, StoreLike
from . import timing

logger = logging.getLogger(__name__)


# ---- what travels between tasks ---------------------------------------------------------


@dataclass
class Piece:
    """The fetched rows one verify task needs, rollout after rollout.

    ``bounds[r] = (start, end)``: rows ``start:end`` of ``batch`` are rollout ``r``'s (``r``
    is the rollout's index in the step plan). ``row_bytes`` is each row's payload bytes.
    """

    batch: PackedBatch
    bounds: dict[int, tuple[int, int]]
    row_bytes: np.ndarray
    failed: dict[str, tuple[str, str]]
    timing: dict[str, Any]


@dataclass
class VerifyOut:
    """A verify task's results and figures, keyed by rollout index in the step plan."""

    task: int
    results: dict[int, RolloutResult]
    verify_ms: dict[int, float]
    bytes_fetched: dict[int, int]
    timing: dict[str, Any]
    fetch_timings: list[dict[str, Any]] = field(default_factory=list)


def _linearized_bytes(result: RolloutResult) -> int:
    lin = result.linearized
    if lin is None:
        return 0
    arrays = (lin.input_ids, lin.token_mask, lin.logprobs, lin.routed_experts)
    return sum(int(a.nbytes) for a in arrays if a is not None)


def _register_serializers() -> None:
    """Send a :class:`FinalizedGroup` as its numpy buffers, frame by frame, whatever the
    pickle protocol: Dask's scheduler talks protocol 4 (in-band copies of every tensor).
    And tell Dask what the objects between tasks weigh (it would take each for ~56 bytes:
    work stealing would move "free" pieces, memory accounting would miss them)."""
    from dask.sizeof import sizeof
    from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

    @sizeof.register(Piece)
    def _piece_bytes(piece: Piece) -> int:
        return int(piece.batch.nbytes) + int(piece.row_bytes.nbytes) + 64 * len(piece.batch.keys)

    @sizeof.register(VerifyOut)
    def _verify_out_bytes(out: VerifyOut) -> int:
        return sum(_linearized_bytes(r) + 256 for r in out.results.values())

    @sizeof.register(FinalizedGroup)
    def _group_bytes(group: FinalizedGroup) -> int:
        tensors = (getattr(group, n) for n in ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask",
                                               "sample_mask", "rewards", "routed_experts", "has_routes"))
        return sum(t.element_size() * t.nelement() for t in tensors if t is not None) + 256 * len(group.status)

    @dask_serialize.register(FinalizedGroup)
    def _dumps(group: FinalizedGroup) -> tuple[dict, list]:
        _, args = group.__reduce__()
        header, frames = serialize(args, serializers=("dask", "pickle"), on_error="raise")
        return {"sub": header}, frames

    @dask_deserialize.register(FinalizedGroup)
    def _loads(header: dict, frames: list) -> FinalizedGroup:
        return rebuild_group(*deserialize(header["sub"], frames))


_register_serializers()


# ---- task bodies (run on workers) ---------------------------------------------------------


def fetch_pieces(
    store: StoreLike,
    keys: list[str],
    fields: list[str],
    layout: list[list[tuple[int, list[str]]]],
    kind: str,
    partition: str = STAGING_PARTITION,
    site: int = 0,
) -> Piece | tuple[Piece, ...]:
    """ONE ``store.get_many`` over ``keys``, cut into one :class:`Piece` per verify task.

    ``layout[t]`` lists ``(rollout index, that rollout's keys)`` for verify task ``t``;
    ``keys`` are in layout order, so each piece is a run of rows: views, no copy.
    Returns the single piece when there is one task, else a tuple (read by getitem tasks).
    """
    # Bounded by finalize.fetch-timeout-s: a hung unit's keys come back unit_unavailable
    # (its rollouts are rejected missing_staging_row), never a hung step.
    bound = {"timeout": float(config.get("finalize.fetch-timeout-s"))} if takes_timeout(store.get_many) else {}
    with timing.Stopwatch() as sw, timing.meter(timing.METER_FETCH):
        res = store.get_many(keys, fields, partition=partition, **bound)
    with timing.Stopwatch() as sp:
        batch = res.batch
        row_bytes = payload_bytes_per_row(batch)
        pos = {k: i for i, k in enumerate(batch.keys)}
        info: dict[str, Any] = {
            "kind": kind,
            "id": f"{kind}-{site}",
            "start_s": sw.start_s,
            "fetch_ms": sw.ms,
            "keys": len(keys),
            "rows": len(batch),
            "failed": len(res.failed),
            "bytes": int(row_bytes.sum()),
        }
        pieces = []
        for task_layout in layout:
            idx: list[int] = []
            bounds: dict[int, tuple[int, int]] = {}
            failed: dict[str, tuple[str, str]] = {}
            for r, rkeys in task_layout:
                start = len(idx)
                for k in rkeys:
                    i = pos.get(k)
                    if i is not None:
                        idx.append(i)
                    if k in res.failed:
                        failed[k] = res.failed[k]
                bounds[r] = (start, len(idx))
            lo = idx[0] if idx else 0
            if idx == list(range(lo, lo + len(idx))):
                # A run of rows (keys were asked in layout order): views of the fetch.
                sub, sub_bytes = slice_rows(batch, lo, lo + len(idx)), row_bytes[lo : lo + len(idx)]
            else:
                index = np.asarray(idx, dtype=np.int64)
                sub, sub_bytes = batch.take(index), row_bytes[index]
            pieces.append(Piece(sub, bounds, sub_bytes, failed, info))
    info["split_ms"] = sp.ms
    return pieces[0] if len(pieces) == 1 else tuple(pieces)


def _rollout_bytes(piece: Piece | None, r: int) -> int:
    if piece is None or r not in piece.bounds:
        return 0
    start, end = piece.bounds[r]
    return int(piece.row_bytes[start:end].sum())


def verify_piece(
    task: int,
    plans: list[tuple[int, Any]],
    staging: Piece | None,
    routes: Piece | None,
    vocab_size: int,
    num_experts: int | None,
) -> VerifyOut:
    """Verify + linearize the rollouts of one packed task, each judged on its own.

    One ``verify_many`` call: the piece is indexed and pre-scanned once for all its
    rollouts. Per-rollout ``verify_ms`` is the task's time apportioned by tokens.
    """
    out = VerifyOut(task, {}, {}, {}, {})
    rows = staging.batch if staging is not None else PackedBatch([], {})
    with timing.Stopwatch() as sw, timing.meter(timing.METER_VERIFY):
        try:
            results = verify_many(
                [p for _, p in plans], rows, None if routes is None else routes.batch,
                vocab_size=vocab_size, num_experts=num_experts, views=True,
            )
        except Exception as e:  # verify_many never raises on data: a bug, not a rejection
            logger.error("verify_many raised in verify task %d (internal error)", task, exc_info=True)
            results = [internal_error_result(p.rollout_id, e, len(p.chain)) for _, p in plans]
    if staging is not None and staging.failed:
        results = [_with_store_reason(res, p, staging.failed) for (_, p), res in zip(plans, results)]
    tokens = np.array([max(int(p.n_tokens), 1) for _, p in plans], dtype=np.float64)
    share = tokens / tokens.sum() if len(tokens) else tokens
    for (r, _), result, frac in zip(plans, results, share):
        out.results[r] = result
        out.verify_ms[r] = sw.ms * float(frac)
        out.bytes_fetched[r] = _rollout_bytes(staging, r) + _rollout_bytes(routes, r)
    out.timing = {"task": task, "start_s": sw.start_s, "ms": sw.ms, "cpu_ms": sw.cpu_ms, "rollouts": len(plans)}
    out.fetch_timings = [p.timing for p in (staging, routes) if p is not None]
    return out


def _with_store_reason(result: RolloutResult, plan: Any, failed: Mapping[str, tuple[str, str]]) -> RolloutResult:
    """A ``missing_staging_row`` verdict with the store's own per-key reason appended
    (e.g. ``unit_unavailable`` when the unit holding the row was lost), so the operator
    sees why the row is missing, not only that it is. A row the store reports
    ``lost_key`` (staged, both copies lost) rejects the rollout ``lost_staging_row``."""
    if result.status != reasons.MISSING_STAGING_ROW:
        return result
    hits = [failed[k] for k in plan.keys if k in failed]
    why = next((h for h in hits if h[0] == LOST_KEY), hits[0] if hits else None)
    if why is None:
        return result
    if why[0] == LOST_KEY:
        result.status = reasons.LOST_STAGING_ROW
    result.detail = f"{result.detail} (store: {why[0]}: {why[1]})"
    return result


@dataclass(frozen=True)
class Slot:
    """One row of a group: a planned rollout (``index`` into the step plan) or an early
    receipt rejection (``reason``/``detail``)."""

    rollout_id: str
    reward: float
    index: int | None = None
    reason: str | None = None
    detail: str = ""
    calls: int = 0


def assemble_piece(
    step_id: str,
    group_id: str,
    slots: list[Slot],
    submitted_s: float,
    queue_depth: int,
    *verify_outs: VerifyOut,
) -> FinalizedGroup:
    """Assemble one group (keeps its shape: rejected rows get ``sample_mask`` 0) and attach
    the group's split timing; publishes the group's finalize event."""
    results: dict[int, RolloutResult] = {}
    verify_ms: dict[int, float] = {}
    bytes_fetched: dict[int, int] = {}
    task_of: dict[int, dict[str, Any]] = {}
    fetch_timings: dict[str, dict[str, Any]] = {}
    for vo in verify_outs:
        for r, res in vo.results.items():
            results[r] = res
            verify_ms[r] = vo.verify_ms[r]
            bytes_fetched[r] = vo.bytes_fetched[r]
            task_of[r] = vo.timing
        for ft in vo.fetch_timings:
            fetch_timings[ft.get("id", ft["kind"])] = ft
    with timing.Stopwatch() as sw, timing.meter(timing.METER_ASSEMBLE):
        rows: list[RolloutResult] = []
        for s in slots:
            if s.index is not None:
                rows.append(results[s.index])
            else:
                rows.append(rejected_result(s.rollout_id, s.reason, s.detail))
        group = assemble_group(rows, [s.reward for s in slots])
    mine = [s.index for s in slots if s.index is not None]
    statuses = [r.status for r in rows]
    accepted, rejected, internal_errors = timing.status_counts(statuses)
    tokens = int(sum(int(r.linearized.input_ids.shape[0]) for r in rows if r.status == reasons.OK and r.linearized is not None))
    tasks_used = {task_of[r]["task"]: task_of[r] for r in mine}
    calls = sum(s.calls for s in slots if s.index is not None)
    metrics = {
        "kind": timing.EVENT_KIND_GROUP,
        "step_id": step_id,
        "group_id": group_id,
        "rollouts": len(slots),
        "accepted": accepted,
        "rejected": rejected,
        "internal_errors": internal_errors,
        "tokens": tokens,
        "fetch_ms": sum(t["fetch_ms"] for t in fetch_timings.values()),
        "verify_ms": sum(verify_ms[r] for r in mine),
        "assemble_ms": sw.ms,
        "queue_wait_ms": timing.queue_wait_ms(submitted_s, min((t["start_s"] for t in tasks_used.values()), default=None)),
        "queue_depth": queue_depth,
        "calls_per_rollout": calls / len(mine) if mine else 0.0,
        "fetch_calls": len(fetch_timings) if mine else 0,
        "bytes_fetched": int(sum(bytes_fetched[r] for r in mine)),
        "rejected_details": timing.detail_sample(group.status, group.details),
        # Private bookkeeping for the step's aggregate (stripped from events).
        "_verify_tasks": list(tasks_used.values()),
        "_fetch_timings": list(fetch_timings.values()) if mine else [],
        "_calls": calls,
        "_planned": len(mine),
    }
    group_metrics = getattr(group, "metrics", None)
    if isinstance(group_metrics, dict):
        group_metrics.update(metrics)
    else:  # pragma: no cover - assemble_group always gives a metrics dict
        group.metrics = metrics
    events.publish(events.FINALIZE, timing.public(metrics))
    return group


# ---- planning the graph (controller) ------------------------------------------------------


def slots_for(plan: Any) -> list[Slot]:
    """Each submitted receipt (``plan.order``) as its planned rollout or early rejection."""
    index = {p.rollout_id: j for j, p in enumerate(plan.rollouts)}
    slots = []
    for rid, reward in zip(plan.order, plan.rewards):
        if rid in plan.rejected:
            reason, detail = plan.rejected[rid]
            slots.append(Slot(rid, reward, reason=reason, detail=detail))
        else:
            j = index[rid]
            slots.append(Slot(rid, reward, index=j, calls=len(plan.rollouts[j].keys)))
    return slots


def affinity(store: PlacedStoreLike, keys: Sequence[str]) -> list[str]:
    """Workers hosting the units that hold ``keys`` (soft affinity for the fetch task)."""
    workers = list(store.unit_workers)
    if not workers:
        return []
    units = {unit_for_key(k, len(workers)) for k in keys}
    return sorted({workers[u] for u in units})


def sites(store: PlacedStoreLike, rollouts: Sequence[Any]) -> list[tuple[str | None, list[int]]]:
    """The step's rollouts (indices, plan order) by the worker hosting their rows' unit.

    A rollout's rows all live on one unit (placed by rollout id), so each site's fetch
    reads only units of that worker: one get per unit per step, and its verify tasks run
    where the rows landed (no bytes cross between workers before verification).
    Without unit placement every rollout is one site (``None``).
    """
    workers = list(getattr(store, "unit_workers", None) or ())
    if not workers:
        return [(None, list(range(len(rollouts))))] if rollouts else []
    by_worker: dict[str, list[int]] = {}
    for r, p in enumerate(rollouts):
        by_worker.setdefault(workers[unit_for_key(p.keys[0], len(workers))], []).append(r)
    order = list(dict.fromkeys(workers))  # unit order: a stable site numbering
    return [(w, by_worker[w]) for w in order if w in by_worker]


def assembly_clusters(tokens: Sequence[int], k: int) -> list[int]:
    """Split groups (``tokens[g]``: group ``g``'s planned tokens, submission order) into
    ``k`` runs of about equal tokens: group ``g`` is in run ``result[g]``.

    Each run is assembled on one site; every site verifies its rows run by run, the runs
    assembled elsewhere first, so a row crosses to its assembling worker once, while that
    worker still verifies, and ``k`` sites share the assembly.
    """
    total = sum(tokens)
    out, before = [], 0
    for n in tokens:
        mid = before + n / 2
        out.append(min(k - 1, int(k * mid / total)) if total else 0)
        before += n
    return out


# ---- task keys ---------------------------------------------------------------------------
#
# Every key is a tuple ``(f"{kind}-{token}", i)``: Dask's task GROUP is the tuple's name
# (``key_split_group``), so each step's tasks form their own groups and Dask's spans
# charge them to their own step, while the task PREFIX (``key_split``: the name's words
# before the token, shown in the task stream) is the task's kind. ``key_split`` drops an
# 8-letter word starting with a-f as if it were a hex token, so no kind may hold one
# ("assemble" would show as ``tc``: the assemble tasks are ``tc-assembler``).
FETCH_STAGING = "tc-fetch-staging"
FETCH_ROUTES = "tc-fetch-routes"
PIECE = "tc-piece"
VERIFY = "tc-verify"
ASSEMBLE = "tc-assembler"
CLEAR = "tc-clear"


def new_token() -> str:
    """A step's key token: 16 hex digits, never all letters (``key_split`` would keep an
    all-letter token as part of the task prefix)."""
    token = uuid.uuid4().hex[:16]
    return token if not token.isalpha() else "0" + token[1:]


def task_key(kind: str, token: str, index: int = 0) -> tuple[str, int]:
    """The key of task ``index`` of ``kind`` (e.g. :data:`VERIFY`) in the step ``token``."""
    return (f"{kind}-{token}", index)


@dataclass
class StepGraph:
    """The submitted graph of one step: plan, layout and Dask futures. ``span`` is the
    step's span annotation (name and ids), for tasks submitted later (the clear)."""

    step_id: str
    token: str
    plan: Any
    group_ids: list[str]
    slots: dict[str, list[Slot]]
    submitted_s: float
    queue_depth: int
    fetch_futures: list[Any]  # these three are empty unless keep_intermediates
    piece_futures: list[Any]
    verify_futures: list[Any]
    group_futures: dict[str, Any]
    fetch_calls: int
    verify_layout: list[list[int]]
    span: dict[str, Any] | None = None

    @property
    def futures(self) -> list[Any]:
        return list(self.group_futures.values())


def submit_graph(
    client: Any,
    store: PlacedStoreLike,
    groups: Mapping[str, Sequence[Any]],
    *,
    step_id: str,
    vocab_size: int,
    num_experts: int | None,
    queue_depth: int = 0,
    priority: int = 0,
    token_budget: int | None = None,
    retries: int | None = None,
    keep_intermediates: bool = False,
    check_groups: bool = True,
) -> StepGraph:
    """Plan ``groups`` (group id -> receipts) and submit the step's graph; returns futures.

    With ``check_groups`` (the default) a receipt whose own ``group_id`` names a group
    other than the one it is submitted in is rejected ``wrong_group``; the controller
    turns it off for groups given as a plain list (their ids ``"g0"``, ... are made up).

    Only the per-group futures are held by default, so Dask frees fetched rows, pieces
    and verify outputs as soon as their dependents ran; ``keep_intermediates=True`` also
    keeps the fetch, piece and verify futures (debugging, tests).

    Knobs not given are read from config now: ``finalize.verify-token-budget`` (tokens),
    ``finalize.retries``. Tasks of a step share ``priority`` (the controller gives older
    steps a higher one, so several steps in flight drain in order).

    Placement (soft hints, see :func:`sites` and :func:`assembly_clusters`): each site's
    fetches on the worker hosting its units; verify tasks where their pieces are; each
    group's assemble on the site chosen for its run of groups.
    """
    import dask
    from dask.task_spec import Task, TaskRef
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    from distributed import span

    if not groups:
        raise FinalizeError("a step needs at least one group")
    for gid, receipts in groups.items():
        if not isinstance(receipts, Sequence) or isinstance(receipts, (str, bytes)) or not len(receipts):
            raise FinalizeError(f"group {gid!r} has no receipts (expected a non-empty list)")
    token_budget = int(config.get("finalize.verify-token-budget") if token_budget is None else token_budget)
    retries = int(config.get("finalize.retries") if retries is None else retries)
    token = new_token()

    group_ids = [str(g) for g in groups]
    if len(set(group_ids)) != len(group_ids):
        raise FinalizeError("group ids collide once converted to str")
    plan = plan_step(dict(zip(group_ids, groups.values())) if check_groups else [r for g in groups.values() for r in g])
    slot_list = slots_for(plan)
    slots: dict[str, list[Slot]] = {}
    pos = 0
    for gid, receipts in zip(group_ids, groups.values()):
        slots[gid] = slot_list[pos : pos + len(receipts)]
        pos += len(receipts)

    rollouts = list(plan.rollouts)
    group_of = {s.index: gid for gid in group_ids for s in slots[gid] if s.index is not None}
    site_list = sites(store, rollouts)
    # Which site assembles each group (placed stores only): the groups split into runs, one
    # per assembling site, the sites holding the most rows first. One site assembles the
    # whole step unless a site holds more than a verify budget of rows: a cluster is one
    # more verify task per site, which costs more than it saves on a small step.
    site_tokens = [sum(rollouts[r].n_tokens for r in rs) for _, rs in site_list]
    assemblers = sorted(range(len(site_list)), key=lambda s: -site_tokens[s])
    k = min(len(site_list), max(1, -(-max(site_tokens, default=0) // token_budget)))
    tokens = [sum(rollouts[s.index].n_tokens for s in slots[gid] if s.index is not None) for gid in group_ids]
    placed = bool(site_list) and site_list[0][0] is not None
    cluster = {g: assemblers[c] for g, c in zip(group_ids, assembly_clusters(tokens, k))} if placed else {}
    # Per site: its rollouts of each cluster (those assembled elsewhere first) packed into
    # verify tasks (group-aligned), numbered globally; ``ships`` are those sent elsewhere.
    layout: list[list[int]] = []
    site_tasks: list[tuple[str | None, list[int]]] = []
    ships: set[int] = set()
    for site, (worker, rs) in enumerate(site_list):
        first = len(layout)
        order = sorted(set(cluster.get(group_of[r], site) for r in rs), key=lambda c: (c == site, c))
        for c in order:
            mine = [r for r in rs if cluster.get(group_of[r], site) == c]
            at = 0
            for task in pack_verify_tasks([rollouts[r] for r in mine], token_budget, [group_of[r] for r in mine]):
                if c != site:
                    ships.add(len(layout))
                layout.append(mine[at : at + len(task)])
                at += len(task)
        site_tasks.append((worker, list(range(first, len(layout)))))

    submitted_s = timing.wall_s()
    # The whole step goes to the scheduler as ONE graph (one message, however many tasks):
    # a layer per site (fetches and pieces, loosely pinned to the site's worker), one of
    # verify tasks (a finalize slot each) and one of assemble tasks.
    layers: dict[str, dict[Any, Task]] = {}
    annotations: dict[str, dict[str, Any]] = {}
    fetch_keys: list[Any] = []
    piece_keys: list[Any] = []
    verify_keys: list[Any] = [None] * len(layout)

    def add(layer: str, key: Any, func: Any, *args: Any) -> TaskRef:
        layers.setdefault(layer, {})[key] = Task(key, func, *args)
        return TaskRef(key)

    def fetch(layer: str, kind: str, fields: list[str], keys_of: Any, site: int, tasks: list[int]) -> TaskRef | None:
        """The site's fetch of ``kind`` for its verify ``tasks`` (keys in task order), or
        None when no task needs a row of that kind."""
        task_layout = [[(r, list(keys_of(rollouts[r]))) for r in layout[t]] for t in tasks]
        keys = [k for tl in task_layout for _, ks in tl for k in ks]
        if not keys:
            return None
        key = task_key(FETCH_STAGING if kind == "staging" else FETCH_ROUTES, token, site)
        fetch_keys.append(key)
        return add(layer, key, fetch_pieces, store, keys, fields, task_layout, kind, STAGING_PARTITION, site)

    def piece(layer: str, ref: TaskRef | None, t: int, j: int, n: int, kind: str) -> TaskRef | None:
        """Verify task ``t``'s piece: the fetch itself when its site has one task. In the
        site's layer: unpinned, Dask would take these getitem tasks for root tasks and run
        them on any worker, moving the whole fetch there."""
        if ref is None or n == 1:
            return ref
        key = task_key(f"{PIECE}-{kind}", token, t)
        piece_keys.append(key)
        return add(layer, key, operator.getitem, ref, j)

    task_of_rollout: dict[int, int] = {}
    for site, (worker, tasks) in enumerate(site_tasks):
        layer = f"{FETCH_STAGING}-{token}-site{site}"
        annotations[layer] = {"workers": [worker], "allow_other_workers": True} if worker else {}
        staging = fetch(layer, "staging", list(STAGING_FIELDS), lambda p: p.keys, site, tasks)
        routes = fetch(layer, "routes", [ROUTES_FIELD], lambda p: p.routes_keys, site, tasks)
        for j, t in enumerate(tasks):
            has_routes = routes is not None and any(rollouts[r].routes_keys for r in layout[t])
            # No worker restriction: the scheduler runs it where its pieces are.
            verify_keys[t] = task_key(VERIFY, token, t)
            add(
                f"{VERIFY}-{token}-ships" if t in ships else VERIFY, verify_keys[t],
                verify_piece, t, [(r, rollouts[r]) for r in layout[t]],
                piece(layer, staging, t, j, len(tasks), "staging"),
                piece(layer, routes, t, j, len(tasks), "routes") if has_routes else None,
                vocab_size, num_experts,
            )
            for r in layout[t]:
                task_of_rollout[r] = t
    annotations[VERIFY] = {"resources": {"finalize": 1}, "priority": priority}
    # Rows assembled on another worker are verified first (a step keeps its own priority).
    annotations[f"{VERIFY}-{token}-ships"] = {"resources": {"finalize": 1}, "priority": priority + 0.5}
    group_keys = [task_key(ASSEMBLE, token, g) for g in range(len(group_ids))]
    for gid, key in zip(group_ids, group_keys):
        needed = sorted({task_of_rollout[s.index] for s in slots[gid] if s.index is not None})
        worker = site_tasks[cluster[gid]][0] if gid in cluster and needed else None
        layer = ASSEMBLE if worker is None else f"{ASSEMBLE}-{token}-site{cluster[gid]}"
        annotations[layer] = {"workers": [worker], "allow_other_workers": True} if worker else {}
        deps = [TaskRef(verify_keys[t]) for t in needed]
        add(layer, key, assemble_piece, step_id, gid, slots[gid], submitted_s, queue_depth, *deps)
    names = list(layers)
    graph = HighLevelGraph(
        {name: MaterializedLayer(layers[name], annotations=annotations[name] or None) for name in names},
        {name: set(names[:i]) for i, name in enumerate(names)},
    )
    wanted = group_keys + (fetch_keys + piece_keys + verify_keys if keep_intermediates else [])
    with span("token-capture", "finalize", step_id):
        span_annotation = dask.get_annotations().get("span")
        futures = client.get(graph, wanted, sync=False, retries=retries or None, priority=priority, fifo_timeout="100ms")
    by_key = dict(zip(wanted, futures))
    group_futures = {gid: by_key[k] for gid, k in zip(group_ids, group_keys)}
    fetch_futures = [by_key[k] for k in fetch_keys] if keep_intermediates else []
    piece_futures = [by_key[k] for k in piece_keys] if keep_intermediates else []
    verify_futures = [by_key[k] for k in verify_keys] if keep_intermediates else []
    fetch_calls = len(fetch_keys)
    return StepGraph(
        step_id=step_id,
        token=token,
        plan=plan,
        group_ids=group_ids,
        slots=slots,
        submitted_s=submitted_s,
        queue_depth=queue_depth,
        fetch_futures=fetch_futures,
        piece_futures=piece_futures,
        verify_futures=verify_futures,
        group_futures=group_futures,
        fetch_calls=fetch_calls,
        verify_layout=layout,
        span=span_annotation,
    )
