"""A handle's claim calls: release or settle a restore's provisional rows on every copy.

Each call is stamped with the handle's table version. A unit fenced by a newer table
refuses it ``{"moved": version}``: the handle then takes the newest table and asks again
(:func:`~.whole_store.table_rounds`), so a handle made before a move (a restore running in
a task) still reaches the copies the move put on other units. Asking a unit twice is
harmless: a release or settle changes only rows still provisional under the claim. Each
round waits at most ``store.admin-call-timeout-s`` for the units (a hung unit's keys are
reported not reached; its call still applies if it ever runs).
"""
from __future__ import annotations

from typing import Sequence

from .calls import Driven
from .deadline import deadline, settle_all
from .moving import plan_all_moving
from .placement import plan_all_copies
from .protocol import MOVED, UNIT_UNAVAILABLE, pack_names
from .whole_store import moved_answer, table_rounds

Failed = dict[str, tuple[str, str]]  # key -> (reason, detail)


def release(store: Driven, keys: Sequence[str], claim: str, partition: str) -> tuple[int, Failed]:
    """(rows removed, keys whose copies may remain: their unit not reached, or still
    refused ``moved`` when no newer table was found)."""
    removed = 0
    for version in table_rounds(store):
        n, failed, moved = _release_once(store, keys, claim, partition, version)
        removed += n
        if not moved:
            break
    return removed, {**failed, **moved}


def _release_once(store: Driven, keys: Sequence[str], claim: str, partition: str, version: int) -> tuple[int, Failed, Failed]:
    _, parts, _ = plan_all_copies(store.placement, keys) if store.moving is None else plan_all_moving(store.moving, keys)
    calls = [store.units[u].release_claim(partition, pack_names(ks), claim, version) for u, ks in parts]
    answers = settle_all(calls, deadline(store.settings.admin_timeout_s))
    removed, failed, moved = 0, {}, {}
    for (u, ks), a in zip(parts, answers):
        if isinstance(a, Exception):  # the unit's copies stay; the caller says so
            failed.update({k: (UNIT_UNAVAILABLE, f"unit {u}: {type(a).__name__}: {a}") for k in ks})
        elif moved_answer(a):
            moved.update({k: (MOVED, f"unit {u} is on placement version {a['moved']}, this handle on {version}") for k in ks})
        else:
            removed += a["removed"]
    return removed, failed, moved


def settle(store: Driven, claim: str) -> int:
    """Rows made ordinary on every unit reached (a unit not reached keeps its marks)."""
    settled = 0
    for version in table_rounds(store):
        answers = settle_all([u.settle_claim(claim, version) for u in store.units], deadline(store.settings.admin_timeout_s))
        settled += sum(a for a in answers if isinstance(a, int))
        if not any(moved_answer(a) for a in answers):
            break
    return settled

