"""Witnessed names in a move (replicas=2): each key's name goes to the unit the new table
makes its witness, like its copies go to their new holders (pure: no Dask, no I/O).

A witness records only key names (:mod:`pipeline.store.losses`), so that a key whose two
copies die together reads ``lost_key``, not ``missing_key``. After the fence, the move
hands each unit the names the new table makes it witness and it lacks
(:func:`names_to_hand`: of every key the units list or witness). Once the final table is
fenced, :func:`names_to_drop` takes from each unit the names that table does not make it
witness, and the names it was handed of keys no unit lists any more: a delete during the
copy may unwitness a name before the move's copy of it arrives (the repairer re-lists
after its install for the same reason). The order is
:class:`~pipeline.store.rebalance.Rebalancer`'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .placement import Placement


@dataclass(frozen=True)
class HandedNames:
    """What a move handed for one partition: unit id -> names (``handed``), and the keys
    the units listed when it did (``listed``)."""

    handed: dict[str, list[str]]
    listed: frozenset[str]


def witness_ids(table: Placement, keys: Sequence[str]) -> list[str]:
    """The unit id of each key's witness under ``table`` ("" for none: one copy, a store
    on two workers, an unusable key)."""
    if not keys:
        return []
    w = table.locate(keys).witness
    if w is None:
        return [""] * len(keys)
    ids = table.unit_ids + ("",)  # index -1 -> ""
    return [ids[i] for i in w.tolist()]


def names_to_hand(table: Placement, listed: Mapping[str, Sequence[str]],
                  witnessed: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Unit id -> the names ``table`` makes it witness that it does not witness yet, of
    every key a unit lists (``listed``: unit id -> keys, rows and lost keys) or witnesses
    (``witnessed``: unit id -> names)."""
    keys = list(dict.fromkeys(_chain([*listed.values(), *witnessed.values()])))
    have = {u: set(names) for u, names in witnessed.items()}
    out: dict[str, list[str]] = {}
    for key, w in zip(keys, witness_ids(table, keys)):
        if w and key not in have.get(w, ()):
            out.setdefault(w, []).append(key)
    return out


def names_to_drop(table: Placement, witnessed: Mapping[str, Sequence[str]], handed: HandedNames | None,
                  listed: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Unit id -> the names it witnesses (``witnessed``, listed after the final fence)
    that ``table`` does not make it witness, or that the move ``handed`` it of a key
    listed then and by no unit now (``listed``: unit id -> keys): deleted meanwhile."""
    now = set(_chain(listed.values()))
    gone = set() if handed is None else handed.listed - now
    out: dict[str, list[str]] = {}
    for u, names in witnessed.items():
        names = list(names)
        given = set(() if handed is None else handed.handed.get(u, ()))
        extra = [k for k, w in zip(names, witness_ids(table, names)) if w != u or (k in gone and k in given)]
        if extra:
            out[u] = extra
    return out


def _chain(groups: Iterable[Sequence[str]]) -> Iterable[str]:
    for group in groups:
        yield from group
