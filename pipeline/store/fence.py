"""A unit's view of the placement table while keys move (pure: no Dask).

Before a change of the table copies anything, every unit is *fenced* with the new table
(and, while moving, the one keys come from): from then on a unit refuses every call
planned on an older table (reason ``moved``: the caller refreshes its table and calls
again), refuses a put of a key neither table gives it, and answers ``moved``, not
``missing_key``, for a read or delete of a key it neither holds nor is given. A delete, during the move, of a key the unit is given but does not hold
yet leaves a *tombstone*, so the move's copy of that key (which may have been read from
its old holder before the delete) is not written after it: a deleted key never comes
back. :meth:`Fence.settled` ends the move (tombstones dropped); the table stays. An
*early* fence (sent before the moving table is published) keeps the tombstones but not
yet the refusals of older calls: a delete from a writer on the new table always finds one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from .placement import Placement
from .protocol import MOVED  # noqa: F401 (the reason a fenced unit answers)


@dataclass
class Fence:
    """The table a unit was last told (``placement``), its own id in it, and whether a
    move into that table is still copying (``moving``: tombstones are kept)."""

    placement: Placement
    unit_id: str
    moving: bool = True
    leaving: bool = False  # the table no longer names this unit (it is being drained)
    previous: Placement | None = None  # while moving: the table keys come from (writes to its copies are accepted)
    tombstones: dict[str, set[str]] = field(default_factory=dict)  # partition -> deleted keys
    early: bool = False  # sent before the table is published: calls keep the ``floor`` the unit had
    floor: int | None = None  # calls stamped below this version are stale (None: none is); default ``version``

    def __post_init__(self) -> None:
        if not self.early and self.floor is None:
            self.floor = self.placement.version

    @classmethod
    def from_message(cls, msg: Mapping[str, object]) -> Fence:
        """The fence a ``fence`` call describes (what :meth:`message` wrote)."""
        placement = _placement(msg)
        unit_id, leaving = str(msg["unit_id"]), bool(msg.get("leaving", False))
        if not leaving:
            placement.index_of(unit_id)  # refuses an id the table does not name
        previous = msg.get("previous")
        return cls(placement, unit_id, bool(msg.get("moving", True)), leaving,
                   None if previous is None else _placement(previous), early=bool(msg.get("early", False)))  # type: ignore[arg-type]

    @staticmethod
    def message(placement: Placement, unit_id: str, moving: bool = True, previous: Placement | None = None,
                early: bool = False) -> dict[str, object]:
        """What a ``fence`` call carries (plain values: it crosses the wire). A
        ``unit_id`` the table does not name marks a unit being drained (``leaving``);
        ``early``: the table is not published yet (see the module docstring)."""
        return {
            **_table(placement), "unit_id": unit_id, "moving": moving, "leaving": unit_id not in placement.unit_ids,
            "previous": None if previous is None else _table(previous), "early": early,
        }

    def stale(self, version: int | None) -> bool:
        """A call planned on a table older than this fence's floor (None: an unstamped
        call, e.g. the move's own, is never stale)."""
        return version is not None and self.floor is not None and version < self.floor

    @property
    def version(self) -> int:
        return self.placement.version

    def given(self, keys: Sequence[str]) -> np.ndarray:
        """bool per key: the table gives this unit a copy of it (unusable keys: False)."""
        mine = np.zeros(len(keys), dtype=bool)
        if not len(keys):
            return mine
        tables = [] if self.leaving else [self.placement]
        if self.moving and self.previous is not None:
            tables.append(self.previous)
        for table in tables:
            if self.unit_id in table.unit_ids:
                me, loc = table.index_of(self.unit_id), table.locate(keys)
                mine |= loc.primary == me
                if loc.replica is not None:
                    mine |= loc.replica == me
        return mine

    def not_given(self, keys: Sequence[str]) -> list[str]:
        """The keys of ``keys`` this unit must refuse to write (see the module docstring)."""
        mask = self.given(keys)
        return [k for k, ok in zip(keys, mask) if not ok]

    def detail(self, key: str) -> str:
        return f"key {key!r} is not this unit's ({self.unit_id!r}) under placement version {self.version}; refresh the table"

    def deleted(self, partition: str, keys: Sequence[str]) -> None:
        """Remember deletes while moving, so a late copy does not bring them back."""
        if self.moving and keys:
            self.tombstones.setdefault(partition, set()).update(keys)

    def revived(self, partition: str, keys: Sequence[str]) -> None:
        """A writer put ``keys`` again after deleting them: theirs now, not buried."""
        dead = self.tombstones.get(partition)
        if dead:
            dead.difference_update(keys)

    def buried(self, partition: str, keys: Sequence[str]) -> set[str]:
        """The keys of ``keys`` deleted during the move (a move's copy skips them)."""
        dead = self.tombstones.get(partition)
        return set() if not dead else {k for k in keys if k in dead}

    def settled(self) -> None:
        """The move is over: every copy is written; tombstones are no longer needed."""
        self.moving = False
        self.tombstones.clear()


def _table(p: Placement) -> dict[str, object]:
    return {"version": p.version, "workers": list(p.workers), "unit_ids": list(p.unit_ids),
            "replicas": p.replicas, "homes": list(p.homes)}


def _placement(msg: Mapping[str, object]) -> Placement:
    return Placement(
        int(msg["version"]), tuple(msg["workers"]), tuple(msg["unit_ids"]),  # type: ignore[arg-type]
        int(msg["replicas"]), tuple(msg["homes"]),  # type: ignore[arg-type]
    )


class Fenced(Protocol):
    """A unit as :func:`stale_refusal` reads it."""

    fence: Fence | None
    counters: dict[str, int]
    unit_index: int


def stale(unit: Fenced, version: int | None) -> bool:
    """The call was planned on a table older than the unit's fence."""
    return unit.fence is not None and unit.fence.stale(version)


def stale_refusal(unit: Fenced, version: int | None, count: int = 1) -> dict | None:
    """A whole-unit call (a listing, a claim call, a checkpoint's open) planned on table
    ``version``, older than the unit's fence: its answer ``{"unit", "moved": the fence's
    version}``, counted in ``moved_refusals`` (``count``: keys or calls); else None."""
    if not stale(unit, version):
        return None
    unit.counters["moved_refusals"] += count
    return {"unit": unit.unit_index, "moved": unit.fence.version}
