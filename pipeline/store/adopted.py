"""Accounting of adopted buffers: rows kept as views of the buffers a put handed over.

An adopted put keeps each row's token fields as views of the batch's buffers: on a unit's
worker, the frames Dask received them into, which come out of the process's receive pool
(:mod:`.receive_pool`) and go back to it once nothing refers to them. The buffers are
ONE *group* shared by the batch's rows, freed when the last of them leaves memory.
:class:`AdoptedGroups` tracks the groups of one storage unit. A group holds the whole of
the memory its rows' views reach (:func:`root_nbytes`: a pooled slab's full size, a
shared small-field buffer's), so the bytes no live in-memory row covers any more are
exact: ``pinned_bytes``, counted against capacity and, with the rows' own bytes, against
the memory limit. A group that pins too much is compacted (its rows copied out). Sizes
are in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

from .spill import Row, SpillMapping


def root_of(a: object) -> object:
    """The object that owns the memory ``a`` (an array or buffer) views."""
    while True:
        if isinstance(a, np.ndarray):
            if a.base is None:
                return a
            a = a.base
        elif isinstance(a, memoryview):
            if a.obj is None:
                return a
            a = a.obj
        else:
            return a


def root_nbytes(arrays: Iterable[np.ndarray]) -> int:
    """Bytes of the distinct buffers that own the memory of ``arrays``: what keeping
    views of them keeps alive (a received frame, the pooled slab it was read into, the
    shared buffer of a batch's small fields)."""
    roots: dict[int, int] = {}
    for a in arrays:
        r = root_of(a)
        if id(r) not in roots:
            roots[id(r)] = r.nbytes if isinstance(r, (np.ndarray, memoryview)) else memoryview(r).nbytes  # type: ignore[arg-type]
    return sum(roots.values())


@dataclass
class _Group:
    """Rows of one adopted put that still hold views of its buffers (see AdoptedGroups.adopt)."""

    members: dict[str, int]  # slot -> bytes of the row's views
    held: int  # bytes of the buffers the views keep alive (all of them, until the group ends)
    live: int  # bytes of them still covered by a member row in memory
    slack: int  # bytes of them no row ever covered (slab slack, offsets, other fields)
    fields: tuple[str, ...] = ()

    @property
    def dead(self) -> int:
        """Bytes of members gone (deleted or spilled) that the buffers still hold."""
        return self.held - self.live - self.slack


class AdoptedGroups:
    """The adopted-buffer groups of the rows of ``rows`` (a unit's :class:`SpillMapping`).

    Row weights stay exact (each view's bytes); :attr:`pinned_bytes` is the bytes of
    shared buffers no member row in memory covers (slack included). A group whose live
    rows cover less than half of its buffers is compacted, so pinned bytes never exceed
    live ones; so is one whose pinned bytes take the unit past its capacity, and
    (:meth:`relieve`) ones with dead members when the unit is past its memory limit.
    """

    def __init__(self, rows: SpillMapping):
        self._rows = rows
        self.groups: dict[int, _Group] = {}  # group id -> group
        self._slot_group: dict[str, int] = {}  # in-memory member slot -> its group id
        self._pending: set[int] = set()  # groups that lost members: compaction check due
        self._next_group = 0
        self.pinned_bytes = 0
        self.slack_bytes = 0  # of pinned_bytes: what no member row ever covered
        self.compacted_groups = 0  # groups whose rows were copied out (counter)

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def dead_bytes(self) -> int:
        """Of :attr:`pinned_bytes`: bytes of member rows gone (deleted or spilled)."""
        return self.pinned_bytes - self.slack_bytes

    def adopt(self, shared: list[str], slots: list[str], covered: int, held: int, used_bytes: int, capacity: int) -> None:
        """Track the buffers the views of fields ``shared`` of the rows stored under
        ``slots`` keep alive (``held`` bytes: :func:`root_nbytes` of the fields' values) as
        one group; ``covered``: bytes of those fields in all of the rows (rows the put
        itself spilled included)."""
        members: dict[str, int] = {}
        fast = self._rows.fast.d
        for slot in slots:
            row = fast.get(slot)
            if row is None:
                continue  # went straight to disk: holds nothing of the buffers
            nbytes = sum(row[name].nbytes for name in shared if name in row)  # exact for any dtype / trailing shape
            if nbytes:
                members[slot] = nbytes
        if not members:
            return  # nothing references the buffers: they are freed with the batch
        gid = self._next_group
        self._next_group += 1
        live = sum(members.values())
        held = max(live, int(held))
        covered = min(held, max(live, int(covered)))
        g = self.groups[gid] = _Group(members, held, live, held - covered, tuple(shared))
        for slot in members:
            self._slot_group[slot] = gid
        self.pinned_bytes += g.held - g.live
        self.slack_bytes += g.slack
        self._maybe_compact(gid, used_bytes, capacity)

    def release(self, slot: str) -> None:
        """``slot``'s in-memory row is gone (deleted or spilled): update its group.

        Only bookkeeping (it runs inside zict evictions); compaction waits for
        :meth:`compact_pending` at the end of the unit's call."""
        gid = self._slot_group.pop(slot, None)
        if gid is None:
            return
        g = self.groups[gid]
        nbytes = g.members.pop(slot)
        g.live -= nbytes
        if not g.members:
            self.pinned_bytes -= g.held - g.live - nbytes
            self.slack_bytes -= g.slack
            del self.groups[gid]
            self._pending.discard(gid)
        else:
            self.pinned_bytes += nbytes
            self._pending.add(gid)

    def on_spill(self, slot: str, row: Row) -> None:
        """zict ``fast_to_slow`` callback: the row of ``slot`` left memory."""
        self.release(slot)

    def compact_pending(self, used_bytes: int, capacity: int) -> None:
        """Compact the groups that lost members, where they now pin too much."""
        while self._pending:
            self._maybe_compact(self._pending.pop(), used_bytes, capacity)

    def relieve(self, excess: int, pending_only: bool = False) -> int:
        """Compact groups with dead members, most dead bytes first, until ``excess`` bytes
        of memory are freed or none is left; the excess still to free. ``pending_only``:
        look only at the groups that lost members since :meth:`compact_pending` (after a
        full relieve left excess, the only ones that can have dead members)."""
        gids = self._pending if pending_only else self.groups
        for gid in sorted((gid for gid in gids if self.groups[gid].dead > 0), key=lambda gid: -self.groups[gid].dead):
            if excess <= 0:
                break
            g = self.groups[gid]
            excess -= g.held - g.live
            self._compact(gid)
        return excess

    def _maybe_compact(self, gid: int, used_bytes: int, capacity: int) -> None:
        g = self.groups.get(gid)
        if g is None or (2 * g.live >= g.held and used_bytes + self.pinned_bytes <= capacity):
            return
        self._compact(gid)

    def _compact(self, gid: int) -> None:
        """Copy the live rows of group ``gid`` out of its buffers (which are then freed)."""
        g = self.groups.pop(gid)
        self._pending.discard(gid)
        self.pinned_bytes -= g.held - g.live
        self.slack_bytes -= g.slack
        self.compacted_groups += 1
        fast = self._rows.fast.d
        for slot in g.members:
            self._slot_group.pop(slot, None)
            row = fast.get(slot)
            if row is not None:
                # Same key, same weight: zict keeps it in place (no eviction, no reorder of others).
                fast[slot] = {k: (v.copy() if k in g.fields else v) for k, v in row.items()}

    def clear(self) -> None:
        self.groups.clear()
        self._slot_group.clear()
        self._pending.clear()
        self.pinned_bytes = 0
        self.slack_bytes = 0
