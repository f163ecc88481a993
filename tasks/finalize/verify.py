"""Verify fetched rows against their receipts and linearize each rollout's chain.

:func:`verify_many` judges every rollout of a verify task on its own and returns one
:class:`RolloutResult` per rollout: ``ok`` with its training row, a rejection reason
from :mod:`tasks.reasons` for bad data, or :data:`tasks.reasons.INTERNAL_ERROR` when the
verifier itself failed (logged, never reported as bad data). :func:`merge_results` puts
a step's verdicts back in submission order.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from .. import hashing
from .. import reasons as R
from ..errors import RuleFailed
from ..packed import PackedBatch
from .chain import CallRules, ChainCheck
from .linearize import VIEWS, Alloc, Linearized, OutputArena, linearize_ranges, row_bytes
from .plan import RolloutPlan, StepPlan
from .tables import RoutesTable, RowTable, routes_tables

logger = logging.getLogger(__name__)


@dataclass
class RolloutResult:
    """Verdict for one rollout: ``status`` is ``"ok"``, a :mod:`tasks.reasons` rejection
    word, or :data:`tasks.reasons.INTERNAL_ERROR` (see :attr:`internal_error`)."""

    rollout_id: str
    status: str
    detail: str = ""
    linearized: Linearized | None = None
    n_calls: int = 0  # calls on the root -> terminal chain (0 if rejected before planning)
    # (oldest, newest) ``weight_version`` over the verified chain's calls; None unless ok.
    weight_versions: tuple[int, int] | None = None
    # The store's reason for the row that decided a missing/lost-row verdict (e.g.
    # ``unit_unavailable``, ``missing_key``); "" when the store reported none.
    store_reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == R.OK

    @property
    def internal_error(self) -> bool:
        """The verifier failed on this rollout (a bug), so nothing is known of its data."""
        return self.status == R.INTERNAL_ERROR


def rejected_result(rollout_id: str, reason: str, detail: str = "", n_calls: int = 0) -> RolloutResult:
    """A rejection (e.g. from :attr:`StepPlan.rejected`) as a result."""
    return RolloutResult(rollout_id, reason, detail, None, n_calls)


def internal_error_result(rollout_id: str, exc: BaseException, n_calls: int = 0) -> RolloutResult:
    """The verdict for a rollout the verifier failed on: :data:`tasks.reasons.INTERNAL_ERROR`
    with the exception in the detail. Callers log the exception."""
    return RolloutResult(rollout_id, R.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}", None, n_calls)


# ---- one rollout, step by step ---------------------------------------------------------


def chain_versions(plan: RolloutPlan) -> tuple[int, int]:
    """(oldest, newest) ``weight_version`` of the chain's calls (each verified equal to its
    row's by the ``wrong_weight_version`` rule)."""
    versions = [int(rec.weight_version) for rec in plan.chain]
    return min(versions), max(versions)


def linearize_chain(walk: ChainCheck, rows: RowTable, routes: RoutesTable, alloc: Alloc | None) -> Linearized:
    """The verified chain's training row: ranges of the batch buffers, one copy per field."""
    rows_i, rows_j = walk.rows_i, walk.rows_j
    delta = rows.scalars["delta_len"]
    lengths = [delta[i] for i in rows_i]

    def ranges(name: str) -> tuple:
        off = rows.offsets[name]
        starts = [off[i] for i in rows_i]
        return rows.values[name], starts, [s + n for s, n in zip(starts, lengths)]

    route_ranges = None
    if walk.routed:
        off = routes.offsets if routes.sound else routes.field.offsets.tolist()
        starts = [off[j] for j in rows_j]
        values = routes.values if routes.sound else routes.field.values
        route_ranges = (values, starts, [s + n for s, n in zip(starts, lengths)])
    names = [c.model_call_id for c in walk.plan.chain]
    parts = (ranges("token_ids"), ranges("token_mask"), ranges("logprobs"), route_ranges)
    return linearize_ranges(names, *parts) if alloc is None else linearize_ranges(names, *parts, alloc)


def check_training_row(lin: Linearized, rows: RowTable, terminal_row: int, digest_version: int) -> None:
    """The rules of the whole row: the terminal's cumulative hash, recomputed once over the
    linearized ids with the chain's ``digest_version`` (covers every token from the root
    on), then at least one generated token."""
    if hashing.cumulative_hash(lin.input_ids, digest_version) != rows.raw("cumulative_hash", terminal_row):
        raise RuleFailed(R.CUMULATIVE_HASH_MISMATCH, "cumulative hash of the linearized ids differs from the terminal's")
    # A terminal row the content pre-scan cleared ends with a generated token, and its
    # delta is in the row: the scan of the whole mask is then known to succeed.
    if rows.content_ok is not None and rows.content_ok[terminal_row]:
        return
    if lin.length == 0 or not lin.token_mask.any():
        raise RuleFailed(R.EMPTY_TRAINING_ROW, "no generated token in the training row")


def _verify(plan: RolloutPlan, rules: CallRules, alloc: Alloc | None) -> RolloutResult:
    """The rules of :mod:`tasks.reasons` for one rollout, in their order; raises
    :class:`RuleFailed` at the first failure."""
    walk = ChainCheck(plan)
    walk.run(rules)
    lin = linearize_chain(walk, rules.rows, rules.routes_for(walk.root_enc), alloc)
    check_training_row(lin, rules.rows, walk.rows_i[-1], walk.scheme.version)
    return RolloutResult(plan.rollout_id, R.OK, "", lin, len(plan.chain), chain_versions(plan))


def _verdict(plan: RolloutPlan, rules: CallRules, alloc: Alloc | None = None) -> RolloutResult:
    """:func:`_verify` as a verdict: a rejection for bad data, an internal error (logged)
    for anything else, so one rollout never takes down its task."""
    try:
        return _verify(plan, rules, alloc)
    except RuleFailed as e:
        return RolloutResult(plan.rollout_id, e.reason, e.detail, None, len(plan.chain))
    except Exception as e:
        logger.error("verifier failed on rollout %r (internal error, not bad data)", plan.rollout_id, exc_info=True)
        return internal_error_result(plan.rollout_id, e, len(plan.chain))


# ---- public ------------------------------------------------------------------------------


def verify_rollout(
    plan: RolloutPlan,
    rows: PackedBatch,
    routes: PackedBatch | None,
    *,
    vocab_size: int,
    num_experts: int | None,
) -> RolloutResult:
    """Verify one rollout's chain and linearize it.

    ``rows``: a batch holding (at least) ``plan.keys`` with the STAGING_FIELDS;
    ``routes``: a batch of ``routed_experts`` for ``plan.routes_keys`` (or ``None``).
    ``num_experts=None``: expert ids need only be ``>= 0`` (no upper bound is known).
    """
    return verify_many([plan], rows, routes, vocab_size=vocab_size, num_experts=num_experts)[0]


def verify_many(
    plans: Sequence[RolloutPlan],
    rows: PackedBatch,
    routes: PackedBatch | None,
    *,
    vocab_size: int,
    num_experts: int | None,
    views: bool = False,
) -> list[RolloutResult]:
    """:func:`verify_rollout` for a packed verify task: the batch is indexed and scanned once.

    ``views=True``: a training row whose calls are back-to-back rows of the batch is a view
    of its buffers, not a copy; only for a caller that owns ``rows``/``routes`` and never
    changes them while the results live (the finalize graph: fetched rows, assembled into
    new tensors). Verdicts are the same either way.
    """
    needed = [k for p in plans for k in p.keys]
    try:
        table = RowTable(rows, vocab_size, needed)
        rtables = routes_tables(routes, num_experts)
    except Exception as e:  # an unusable batch rejects its rollouts, not the task
        return [
            RolloutResult(p.rollout_id, R.INVALID_STAGING_ROW, f"unreadable batch: {type(e).__name__}: {e}", None, len(p.chain))
            for p in plans
        ]
    rules = CallRules(table, rtables, vocab_size, num_experts)
    if views:
        return [_verdict(p, rules, VIEWS) for p in plans]
    arena = _arena(plans, table, rtables)
    if arena is None:
        return [_verdict(p, rules) for p in plans]
    return [_verdict(p, rules, arena.alloc(k)) for k, p in enumerate(plans)]


def _arena(plans: Sequence[RolloutPlan], table: RowTable, rtables: Mapping[int, RoutesTable]) -> OutputArena | None:
    """One output buffer for every rollout's training row, sized from the receipts.

    A verified chain's tokens are exactly its receipts' delta lengths, and rollouts of
    one step never share rows, so all verifiable rows together fit in the batch's tokens:
    slots are handed out only up to that many tokens (forged receipts cannot make the
    arena bigger than the batch); a rollout past it gets its own allocation. None for an
    unusable batch.
    """
    if table.batch_problem is not None:
        return None
    left = int(table.values["token_ids"].shape[0])
    # Bytes per token of each encoding's routes (0: unrouted, or no sound table).
    per_token_routes = {enc: t.bytes_per_token if t.sound else 0 for enc, t in rtables.items()}
    sizes = []
    for p in plans:
        n = sum(rec.delta_len for rec in p.chain)
        fits = 0 < n <= left
        left -= n if fits else 0
        sizes.append(row_bytes(n, per_token_routes.get(p.chain[0].routes_encoding, 0)) if fits else 0)
    return OutputArena(sizes) if any(sizes) else None


def merge_results(step: StepPlan, results: Sequence[RolloutResult]) -> list[RolloutResult]:
    """Every submitted receipt's result in submission order: early rejections included.

    ``results`` are verify results of ``step.rollouts`` (any order); a rollout with no
    result is reported ``missing_staging_row`` (its verify never delivered).
    """
    by_id = {r.rollout_id: r for r in results}
    out = []
    for rid in step.order:
        if rid in step.rejected:
            out.append(rejected_result(rid, *step.rejected[rid]))
        else:
            out.append(by_id.get(rid) or rejected_result(rid, R.MISSING_STAGING_ROW, "no verify result"))
    return out
