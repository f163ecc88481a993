"""What a change of the placement table moves: pure plans (no Dask, no I/O).

Given the table before and after a change (a unit added, drained or lost) and the keys
each unit holds, :func:`plan_moves` says which keys each surviving unit sends to which
unit (in chunks of at most ``chunk_keys``), which copies each unit drops once the new
table is in force, and which keys no reachable unit holds (lost). Every copy the new
table asks for comes from exactly one source: the key's old primary when it is
reachable, else any reachable holder; a target that already holds the key gets nothing.
:func:`unheld` lists the copies a table does not give (what a move drops once its final
table is fenced). The order a move runs in (fence, copy, switch, drop) is
:class:`~pipeline.store.rebalance.Rebalancer`'s; docs/design.md, "Moves", says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from .placement import Placement


@dataclass(frozen=True)
class Transfer:
    """``keys`` copied from unit ``source`` to unit ``target`` (unit ids), one chunk."""

    source: str
    target: str
    keys: tuple[str, ...]


@dataclass(frozen=True)
class MovePlan:
    """A change's moves for one partition (see the module docstring)."""

    transfers: tuple[Transfer, ...]
    drops: dict[str, tuple[str, ...]]  # unit id -> keys it holds that the new table does not give it
    lost: tuple[str, ...]  # keys the new table places but no reachable unit holds

    @property
    def keys_moved(self) -> int:
        """Key copies the change sends (a key sent to two new holders counts twice)."""
        return sum(len(t.keys) for t in self.transfers)


def copies_of(placement: Placement, keys: Sequence[str]) -> list[tuple[str, ...]]:
    """The unit ids holding each key's copies under ``placement`` (primary first)."""
    if not keys:
        return []
    loc = placement.locate(keys)
    ids = np.asarray(placement.unit_ids + ("",), dtype=object)
    primary = ids[loc.primary]
    if loc.replica is None:
        return [(str(p),) for p in primary]
    replica = ids[loc.replica]
    return [(str(p),) if not r else (str(p), str(r)) for p, r in zip(primary, replica)]


def plan_moves(
    old: Placement,
    new: Placement,
    held: Mapping[str, Sequence[str]],
    chunk_keys: int,
    unreachable: Sequence[str] = (),
) -> MovePlan:
    """The moves turning the holdings ``held`` (unit id -> keys it holds, under ``old``)
    into what ``new`` asks for. ``unreachable``: unit ids whose keys cannot be read (a
    lost worker); they are neither sources nor asked to drop. ``chunk_keys`` bounds a
    transfer (>= 1)."""
    if chunk_keys < 1:
        raise ValueError(f"chunk_keys must be >= 1, got {chunk_keys}")
    gone = set(unreachable)
    holders: dict[str, list[str]] = {}
    for unit_id, keys in held.items():
        if unit_id in gone:
            continue
        for k in keys:
            holders.setdefault(k, []).append(unit_id)
    keys = list(holders)
    wanted = copies_of(new, keys)
    was = copies_of(old, keys)
    sends: dict[tuple[str, str], list[str]] = {}
    drops: dict[str, list[str]] = {}
    for k, targets, before in zip(keys, wanted, was):
        have = holders[k]
        source = before[0] if before[0] in have else have[0]
        for t in targets:
            if t not in have:
                sends.setdefault((source, t), []).append(k)
        for h in have:
            if h not in targets:
                drops.setdefault(h, []).append(k)
    lost = _lost(held, gone, holders)
    transfers = tuple(
        Transfer(src, dst, tuple(ks[i : i + chunk_keys]))
        for (src, dst), ks in sorted(sends.items())
        for i in range(0, len(ks), chunk_keys)
    )
    return MovePlan(transfers, {u: tuple(ks) for u, ks in sorted(drops.items())}, lost)


def unheld(table: Placement, held: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    """Unit id -> the keys it holds (``held``) that ``table`` does not give it (units ids
    ascending, keys in listing order; units with none left out)."""
    out: dict[str, tuple[str, ...]] = {}
    for unit_id, keys in sorted(held.items()):
        keys = list(keys)
        extra = tuple(k for k, cs in zip(keys, copies_of(table, keys)) if unit_id not in cs)
        if extra:
            out[unit_id] = extra
    return out


def _lost(held: Mapping[str, Sequence[str]], gone: set[str], holders: Mapping[str, list[str]]) -> tuple[str, ...]:
    """Keys an unreachable unit held that no reachable unit holds (their rows are gone)."""
    out: dict[str, None] = {}
    for unit_id in gone:
        for k in held.get(unit_id, ()):
            if k not in holders:
                out[k] = None
    return tuple(out)
