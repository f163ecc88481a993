"""Which staged rows a delivered step's clear keeps (:meth:`StepHandle.clear_keys`).

The clear deletes every key of the step's planned rollouts and of its plan-time rejected
receipts, except rows a later step may still finalize or that cannot be told apart:
receipts rejected for a reason in :data:`KEEP_ROWS_OF`, rollouts the verifier failed on
(:data:`KEEP_ROWS_OF_VERDICT`), and rollouts rejected ``missing_staging_row`` or
``missing_routes`` because the store could not READ a row (:data:`UNREAD_REASONS`: a slow or lost unit, a failed spill
read), not because it holds none. The verify task records the store's reason on the
verdict (:attr:`RolloutResult.store_reason`); each group's ``_unread_rollouts`` metric
names those rollouts for the clear.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from tasks import reasons as R
from tasks.keys import staging_key

from ..store.protocol import MOVED, STORE_ERROR, UNIT_UNAVAILABLE

if TYPE_CHECKING:
    from tasks.finalize.assemble import FinalizedGroup
    from tasks.finalize.verify import RolloutResult

# Plan-time rejections whose rows are kept: a receipt submitted under another group may be
# resubmitted under its own, and rows behind a duplicated rollout id cannot be told apart.
KEEP_ROWS_OF = frozenset({R.WRONG_GROUP, R.DUPLICATE_STAGING_KEY})
# Delivered verdicts whose rollouts' rows are kept: the verifier failed on them (a bug), so
# nothing is known of their data and a resubmission may still finalize them.
KEEP_ROWS_OF_VERDICT = frozenset({R.INTERNAL_ERROR})
# The store's per-key reasons that say a row could not be read, not that it is absent
# (``missing_key``) or lost (``lost_key``): a missing_staging_row rollout failed for one of
# these keeps its rows.
UNREAD_REASONS = frozenset({UNIT_UNAVAILABLE, STORE_ERROR, MOVED})
UNREAD_METRIC = "_unread_rollouts"  # a group's private metric: its rollouts with unread rows


def rows_unread(result: RolloutResult) -> bool:
    """Whether ``result`` rejects its rollout only because the store could not read a row
    (its staging fields or its routes)."""
    return result.status in (R.MISSING_STAGING_ROW, R.MISSING_ROUTES) and result.store_reason in UNREAD_REASONS


def kept_rollouts(groups: Iterable[FinalizedGroup]) -> set[str]:
    """Rollout ids of the delivered ``groups`` whose rows the step's clear keeps."""
    kept: set[str] = set()
    for g in groups:
        kept.update(rid for rid, s in zip(g.rollout_ids, g.status) if s in KEEP_ROWS_OF_VERDICT)
        kept.update(g.metrics.get(UNREAD_METRIC, ()) if isinstance(g.metrics, Mapping) else ())
    return kept


def _field(obj: object, name: str) -> object:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def rejected_receipt_keys(groups: Mapping[str, Sequence[object]], rejected: Mapping[str, tuple[str, str]]) -> list[str]:
    """Staging keys of receipts rejected at plan time (``rejected``: rollout id ->
    (reason, detail)), except those rejected for a reason in :data:`KEEP_ROWS_OF`.

    Keys are derived as ``staging_key(rollout_id, model_call_id)`` from each readable call
    record, never taken from the receipt's ``staging_key`` field, so a rejected receipt can
    name only rows of its own rollout id. Unreadable receipts or records name no key."""
    keys: dict[str, None] = {}
    for receipts in groups.values():
        for raw in receipts:
            try:
                rid = _field(raw, "rollout_id")
                if not isinstance(rid, str) or rid not in rejected or rejected[rid][0] in KEEP_ROWS_OF:
                    continue
                calls = _field(raw, "calls")
                for call in calls if isinstance(calls, (list, tuple)) else ():
                    try:
                        keys[staging_key(rid, _field(call, "model_call_id"))] = None
                    except Exception:  # noqa: BLE001 - an unreadable record names no row
                        continue
            except Exception:  # noqa: BLE001 - a hostile receipt names no row
                continue
    return list(keys)
