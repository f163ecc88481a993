"""The bodies of a step's Dask tasks, run on workers: fetch a site's rows and cut them into
pieces, verify a packed task's rollouts, assemble a group and publish its finalize event.

One bad row rejects only its rollout; a verifier failure marks its rollouts
``internal_error`` and is counted apart (``internal_errors``). Units: ``_ms``
milliseconds, ``_s`` wall-clock seconds since the epoch, ``bytes`` payload bytes.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from tasks import reasons
from tasks.finalize.assemble import BufferSource, FinalizedGroup, Staleness, assemble_group
from tasks.finalize.layout import Slot
from tasks.finalize.plan import RolloutPlan
from tasks.finalize.verify import RolloutResult, internal_error_result, rejected_result, verify_many
from tasks.keys import STAGING_PARTITION
from tasks.packed import PackedBatch, payload_bytes_per_row, slice_rows

from .. import events
from ..store.deadline import takes_timeout
from ..store.protocol import ABSENT_FIELD, LOST_KEY, StoreLike
from . import serializers  # registers how Dask weighs and ships these tasks' outputs
from . import timing
from .kept_rows import UNREAD_REASONS, rows_unread
from .serializers import verify_out_bytes
from .task_outputs import Piece, ShippedPlans, VerifyOut

logger = logging.getLogger(__name__)

FetchLayout = Sequence[Sequence[tuple[int, Sequence[str]]]]
"""Per verify task of a site: ``(rollout index, that rollout's keys)``, in fetch order."""


def fetch_pieces(
    store: StoreLike,
    keys: list[str],
    fields: list[str],
    layout: FetchLayout,
    kind: str,
    partition: str = STAGING_PARTITION,
    site: int = 0,
    timeout_s: float | None = None,
) -> Piece | tuple[Piece, ...]:
    """ONE ``store.get_many`` over ``keys``, cut into one :class:`Piece` per verify task.

    ``layout[t]`` lists ``(rollout index, that rollout's keys)`` for verify task ``t``;
    ``keys`` are in layout order (:func:`tasks.finalize.layout.site_fetch`), so each piece
    is a run of rows: views, no copy. Returns the single piece when there is one task,
    else a tuple (read by getitem tasks).
    """
    # Bounded by ``timeout_s`` (the finalizer's finalize.fetch-timeout-s): a hung unit's keys
    # come back unit_unavailable (its rollouts are rejected missing_staging_row), never a
    # hung step. None: the store's own bound.
    bound = {"timeout": timeout_s} if timeout_s is not None and takes_timeout(store.get_many) else {}
    with timing.Stopwatch() as sw, timing.meter(timing.METER_FETCH):
        res = store.get_many(keys, fields, partition=partition, **bound)
    with timing.Stopwatch() as sp:
        batch = res.batch
        row_bytes = payload_bytes_per_row(batch)
        pos = {k: i for i, k in enumerate(batch.keys)}
        info: timing.FetchTiming = {
            "kind": kind,
            "id": f"{kind}-{site}",
            "start_s": sw.start_s,
            "fetch_ms": sw.ms,
            "keys": len(keys),
            "rows": len(batch),
            # Keys the store could not serve: a row served without a field asked for (a
            # mixed step's routes fetch asks for both encodings' fields) is not one.
            "failed": sum(1 for why in res.failed.values() if why[0] != ABSENT_FIELD),
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
    plans: ShippedPlans | list[tuple[int, RolloutPlan]],
    staging: Piece | None,
    routes: Piece | None,
    vocab_size: int,
    num_experts: int | None,
) -> VerifyOut:
    """Verify + linearize the rollouts of one packed task, each judged on its own.

    One ``verify_many`` call: the piece is indexed and pre-scanned once for all its
    rollouts. Per-rollout ``verify_ms`` is the task's time apportioned by tokens.
    ``plans``: ``(rollout index, plan)`` pairs, or the controller's pickle of them.
    """
    if isinstance(plans, ShippedPlans):
        plans = plans.load()
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
    failed = {**(routes.failed if routes is not None else {}), **(staging.failed if staging is not None else {})}
    if failed:  # per key, the staging fetch's answer over the routes fetch's
        results = [_with_store_reason(res, p, failed) for (_, p), res in zip(plans, results)]
    tokens = np.array([max(int(p.n_tokens), 1) for _, p in plans], dtype=np.float64)
    share = tokens / tokens.sum() if len(tokens) else tokens
    for (r, _), result, frac in zip(plans, results, share):
        out.results[r] = result
        out.verify_ms[r] = sw.ms * float(frac)
        out.bytes_fetched[r] = _rollout_bytes(staging, r) + _rollout_bytes(routes, r)
    out.timing = {"task": task, "start_s": sw.start_s, "ms": sw.ms, "cpu_ms": sw.cpu_ms, "rollouts": len(plans),
                  "out_bytes": verify_out_bytes(out)}  # what Dask weighs (and ships) this output at
    out.fetch_timings = [p.timing for p in (staging, routes) if p is not None]
    return out


def _with_store_reason(result: RolloutResult, plan: RolloutPlan, failed: Mapping[str, tuple[str, str]]) -> RolloutResult:
    """A ``missing_staging_row`` or ``missing_routes`` verdict with the store's own per-key
    reason appended (e.g. ``unit_unavailable`` when the unit holding the row was lost), so
    the operator sees why the row is missing, not only that it is, and recorded as its
    ``store_reason`` (the step's clear keeps the rows of a rollout whose rows could not be
    read: :func:`~pipeline.finalize.kept_rows.rows_unread`). A row the store reports
    ``lost_key`` (staged, both copies lost) rejects the rollout ``lost_staging_row``; a
    row the store answered for (absent, lost) decides over one it could not read."""
    if result.status not in (reasons.MISSING_STAGING_ROW, reasons.MISSING_ROUTES):
        return result
    hits = [failed[k] for k in plan.keys if k in failed]
    if not hits:
        return result
    why = min(hits, key=lambda h: 0 if h[0] == LOST_KEY else 2 if h[0] in UNREAD_REASONS else 1)
    if why[0] == LOST_KEY:
        result.status = reasons.LOST_STAGING_ROW
    result.store_reason = why[0]
    result.detail = f"{result.detail} (store: {why[0]}: {why[1]})"
    return result


def assemble_piece(
    step_id: str,
    group_id: str,
    slots: list[Slot],
    submitted_s: float,
    queue_depth: int,
    *verify_outs: VerifyOut,
    staleness: Staleness | None = None,
) -> FinalizedGroup:
    """The task body of a group assembled on the cluster (a
    :attr:`~pipeline.finalize.controller.StepHandle.group_futures` future):
    :func:`assemble_outs`, then the group's finalize event published from the worker."""
    group = assemble_outs(step_id, group_id, slots, submitted_s, queue_depth, verify_outs, staleness=staleness)
    events.publish(events.FINALIZE, timing.public(group.metrics))
    return group


def assemble_outs(
    step_id: str,
    group_id: str,
    slots: Sequence[Slot],
    submitted_s: float,
    queue_depth: int,
    verify_outs: Sequence[VerifyOut],
    buffers: BufferSource | None = None,
    *,
    staleness: Staleness | None = None,
) -> FinalizedGroup:
    """Assemble one group from the verify outputs holding its rows (keeps its shape:
    rejected rows get ``sample_mask`` 0) and attach the group's split timing as its
    ``metrics`` (the group event, not published here). ``buffers``: where the padded
    tensors' memory comes from, ``staleness``: which verified rows are too stale
    (:func:`tasks.finalize.assemble.assemble_group`)."""
    results: dict[int, RolloutResult] = {}
    verify_ms: dict[int, float] = {}
    bytes_fetched: dict[int, int] = {}
    task_of: dict[int, timing.VerifyTiming] = {}
    fetch_timings: dict[str, timing.FetchTiming] = {}
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
        group = assemble_group(rows, [s.reward for s in slots], buffers=buffers, staleness=staleness)
    mine = [s.index for s in slots if s.index is not None]
    tasks_used = {task_of[r]["task"]: task_of[r] for r in mine}
    calls = sum(s.calls for s in slots if s.index is not None)
    metrics: timing.GroupMetrics = {
        "kind": timing.EVENT_KIND_GROUP,
        "step_id": step_id,
        "group_id": group_id,
        **_row_counts(slots, group),
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
        "_unread_rollouts": [r.rollout_id for r in rows if rows_unread(r)],
    }
    group_metrics = getattr(group, "metrics", None)
    if isinstance(group_metrics, dict):
        group_metrics.update(metrics)
    else:  # pragma: no cover - assemble_group always gives a metrics dict
        group.metrics = metrics
    return group


def _row_counts(slots: Sequence[Slot], group: FinalizedGroup) -> timing.RowCounts:
    """A group's ``rollouts``, ``accepted``, ``rejected`` (by reason, as assembled: rows
    dropped there included), ``internal_errors`` and ``tokens`` (of its accepted training
    rows: a rejected row has length 0)."""
    accepted, rejected, internal_errors = timing.status_counts(group.status)
    tokens = int(group.input_lengths.sum())
    return {"rollouts": len(slots), "accepted": accepted, "rejected": rejected, "internal_errors": internal_errors, "tokens": tokens}
