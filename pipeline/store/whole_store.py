"""Whole-store answers: every unit's ``stats()`` or ``keys()``, or an error naming the unit.

A whole-store call asks every unit at once (in :func:`table_rounds`: again on the newest
table when a unit is fenced by a newer one) and waits at most ``store.admin-call-timeout-s``
(a unit alive but hung never holds the caller: the store host's bookkeeping, a metrics
scrape, a cut's orphan sweep). :func:`every_unit_answered` wants every unit's answer;
:func:`listed_keys` accepts a unit's silence when, with replicas=2, the units that may hold
the other copy of its keys answered (a listing is never silently partial).
"""
from __future__ import annotations

from typing import Any, Iterator

from tasks.errors import StoreError, StoreUnavailable

from .moving import MovingTable
from .operations import REFRESHES
from .placement import Placement


def moved_answer(answer: object) -> bool:
    """A unit's refusal of a call planned on a table older than its fence."""
    return isinstance(answer, dict) and "moved" in answer


def table_rounds(store: Any) -> Iterator[int]:
    """The rounds of a call planned on ``store``'s table, each yielding the table version
    to stamp it with. The caller breaks once no unit answered ``moved``; otherwise the
    handle takes the newest table from the unit directory (``store.refresh`` told
    ``moved``: it waits a moment for the newer table) and the next round begins: at most
    ``REFRESHES`` times, none when no newer table came (or the store has no ``refresh``)."""
    for _ in range(REFRESHES + 1):
        seen = store.placement.version
        yield seen
        refresh = getattr(store, "refresh", None)
        if refresh is None or not refresh(seen, True):
            return


def unit_failed(i: int, what: str, error: BaseException | dict) -> str:
    """Why unit ``i`` could not give ``what`` (its keys, its figures): one line."""
    if isinstance(error, dict):
        return (f"storage unit {i} cannot give {what}: it is on placement version {error['moved']}, newer than the "
                "handle's, and no newer table could be fetched")
    if isinstance(error, TimeoutError):
        return f"storage unit {i} cannot give {what}: no answer in time (store.admin-call-timeout-s)"
    return f"storage unit {i} cannot give {what}: {type(error).__name__}: {error}"


def every_unit_answered(answers: list, what: str) -> list:
    """``answers`` (one per unit, settled), when none is an error; else
    :class:`StoreUnavailable` naming the first unit that failed or did not answer."""
    for i, a in enumerate(answers):
        if isinstance(a, BaseException):
            raise StoreUnavailable(unit_failed(i, what, a)) from a
        if moved_answer(a):
            raise StoreUnavailable(unit_failed(i, what, a))
    return answers


def listed_keys(answers: list, prefix: str | None, placement: Placement, moving: MovingTable | None) -> list[str]:
    """The keys the units listed (``answers``: one settled answer per unit), those starting
    with ``prefix`` if given; unit order, then insertion order, each key once. A unit not
    reached (or silent, or on a newer table than the caller's) is :class:`StoreUnavailable` with one copy per key, or when a unit
    that may hold the other copy of its keys was not reached either."""
    out: list[str] = []
    lost: dict[int, str] = {}
    for i, ks in enumerate(answers):
        if isinstance(ks, (OSError, RuntimeError, StoreError)) or moved_answer(ks):  # TimeoutError is an OSError
            lost[i] = unit_failed(i, "its keys", ks)
            continue
        if isinstance(ks, Exception):
            raise ks
        out.extend(ks if prefix is None else (k for k in ks if k.startswith(prefix)))
    one_copy = placement.replicas == 1
    for i, why in lost.items():
        if one_copy or any(p in lost for p in partners(i, placement, moving)):
            raise StoreUnavailable(why)
    return out if one_copy else list(dict.fromkeys(out))


def partners(i: int, placement: Placement, moving: MovingTable | None) -> set[int]:
    """Indices into the store's units that may hold the other copy of a key on unit ``i``:
    while keys move, of either table (a unit being drained is in the old one only)."""
    if moving is None:
        return set(placement.partners(i))
    ids = moving.unit_ids
    out: set[int] = set()
    for table in (moving.placement, moving.previous):
        if ids[i] in table.unit_ids:
            out.update(ids.index(table.unit_ids[v]) for v in table.partners(table.index_of(ids[i])))
    return out
