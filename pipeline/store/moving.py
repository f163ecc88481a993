"""Plans for a store whose keys are moving between two tables (pure: no Dask, no I/O).

While a change copies keys (:mod:`pipeline.store.rebalance`), a handle carries a
:class:`MovingTable`: the table keys go to (``placement``), the one they come from
(``previous``) and every unit of either, in the order of the handle's unit list (the new
table's units, then any unit being drained). Writes reach the copies of BOTH tables, so a
row written during the copy is on its new holders whether or not the copy saw it, and on
its old ones as well. Reads therefore ask the OLD primary first (it holds every row until
the move's final table is fenced: one round trip, as without a move) and the next holder
in :func:`read_order` only for what one could not give (missing, moved, unreachable: a
holder's death mid-move keeps reads served); deletes reach every copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tasks.packed import PackedBatch, payload_bytes_per_row

from .placement import Failures, Placement, PutPlan, chunks_by_bytes, plan_put
from .protocol import MISSING_KEY, MOVED, UNIT_UNAVAILABLE


ASK_NEXT = frozenset({MISSING_KEY, MOVED, UNIT_UNAVAILABLE})  # a read asks the key's next holder after these


@dataclass(frozen=True)
class MovingTable:
    """A move in progress (module docstring); ``unit_ids`` index the handle's units."""

    placement: Placement
    previous: Placement

    @property
    def unit_ids(self) -> tuple[str, ...]:
        leaving = tuple(u for u in self.previous.unit_ids if u not in self.placement.unit_ids)
        return self.placement.unit_ids + leaving

    @property
    def version(self) -> int:
        return self.placement.version

    def previous_index(self) -> np.ndarray:
        """Union index of each unit of ``previous`` (int64), plus -1 at the end (for -1)."""
        where = {u: i for i, u in enumerate(self.unit_ids)}
        return np.asarray([where[u] for u in self.previous.unit_ids] + [-1], dtype=np.int64)

    def holders(self, keys: Sequence[str]) -> tuple[np.ndarray, Failures]:
        """Union indices of every copy of each key under either table (``[keys, 4]``, -1
        where none) and the unusable keys' failures."""
        new, old = self.placement.locate(keys), self.previous.locate(keys)
        back = self.previous_index()
        none = np.full(len(keys), -1, dtype=np.int64)
        cols = [new.primary, none if new.replica is None else new.replica,
                back[old.primary], back[none if old.replica is None else old.replica]]
        return np.stack(cols, axis=1), new.failed


def plan_put_moving(table: MovingTable, batch: PackedBatch, max_call_bytes: int) -> PutPlan:
    """:func:`~pipeline.store.placement.plan_put` over the copies of both tables (each row
    once per unit), with the new table's witnesses."""
    base = plan_put(table.placement, batch, max_call_bytes)
    if base.failed and not base.parts:
        return base  # the batch itself is unusable
    where, failed = table.holders(batch.keys)
    row_bytes = payload_bytes_per_row(batch)
    parts: list[tuple[int, np.ndarray]] = []
    for u in range(len(table.unit_ids)):
        idx = np.flatnonzero((where == u).any(axis=1))
        parts.extend((u, chunk) for chunk in chunks_by_bytes(idx, row_bytes, max_call_bytes))
    return PutPlan(parts, failed, base.witness)


def plan_all_moving(table: MovingTable, keys: Sequence[str]) -> tuple[list[str], list[tuple[int, list[str]]], Failures]:
    """The unique keys and, per unit holding a copy under either table, its keys (a
    delete during a move reaches every copy)."""
    uniq = list(dict.fromkeys(keys))
    where, failed = table.holders(uniq)
    parts = []
    for u in range(len(table.unit_ids)):
        idx = np.flatnonzero((where == u).any(axis=1))
        if len(idx):
            parts.append((u, [uniq[i] for i in idx]))
    return uniq, parts, failed


def read_order(table: MovingTable, keys: Sequence[str]) -> np.ndarray:
    """Union indices of each key's holders in the order a read asks them (``[keys, 4]``:
    old primary, new primary, old replica, new replica; -1 where there is none or the
    unit was asked already for that key)."""
    holders, _ = table.holders(keys)
    order = holders[:, [2, 0, 3, 1]].copy()
    for c in range(1, order.shape[1]):
        seen = (order[:, [c]] == order[:, :c]).any(axis=1)
        order[seen, c] = -1
    return order


def holder_parts(order: np.ndarray, column: int, keys: Sequence[str], pending: Sequence[int]) -> list[tuple[int, list[str]]]:
    """(union index, its keys) per call asking column ``column`` of :func:`read_order` for
    the keys at positions ``pending`` (keys with no holder there are left out), sorted."""
    out: dict[int, list[str]] = {}
    for i in pending:
        u = int(order[i, column])
        if u >= 0:
            out.setdefault(u, []).append(keys[i])
    return sorted(out.items())
