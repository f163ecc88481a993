"""Accounting of adopted buffers: rows kept as views of the buffers a put handed over.

An adopted put keeps each row's token fields as views of the batch's buffers, ONE
buffer per field shared by the batch's rows (a *group*), freed when the last of them
leaves memory. :class:`AdoptedGroups` tracks the groups of one storage unit: the bytes
no live in-memory row covers any more are ``pinned_bytes`` (counted against capacity),
and a group that pins too much is compacted (its rows copied out). Sizes are in bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spill import Row, SpillMapping


@dataclass
class _Group:
    """Rows of one adopted put that still hold views of its buffers (see AdoptedGroups.adopt)."""

    members: dict[str, int]  # slot -> bytes of the row's views
    held: int  # bytes of the shared buffers (all of them, until the group ends)
    live: int  # bytes of them still covered by a member row in memory
    fields: tuple[str, ...] = ()


class AdoptedGroups:
    """The adopted-buffer groups of the rows of ``rows`` (a unit's :class:`SpillMapping`).

    Row weights stay exact (each view's bytes); :attr:`pinned_bytes` is the bytes of
    shared buffers no member row in memory covers. A group whose live rows cover less
    than half of its buffers is compacted, so pinned bytes never exceed live ones; so is
    one whose pinned bytes take the unit past its capacity.
    """

    def __init__(self, rows: SpillMapping):
        self._rows = rows
        self.groups: dict[int, _Group] = {}  # group id -> group
        self._slot_group: dict[str, int] = {}  # in-memory member slot -> its group id
        self._pending: set[int] = set()  # groups that lost members: compaction check due
        self._next_group = 0
        self.pinned_bytes = 0

    def __len__(self) -> int:
        return len(self.groups)

    def adopt(self, shared: list[str], held: int, slots: list[str], used_bytes: int, capacity: int) -> None:
        """Track the adopted buffers of fields ``shared`` (``held`` bytes in all) as one
        group of the rows stored under ``slots``."""
        members: dict[str, int] = {}
        for slot in slots:
            row = self._rows.fast.d.get(slot)
            if row is None:
                continue  # went straight to disk: holds nothing of the buffers
            # Bytes of the row's views (exact for any dtype / trailing shape).
            nbytes = sum(row[name].nbytes for name in shared if name in row)
            if nbytes:
                members[slot] = nbytes
        if not members:
            return  # nothing references the buffers: they are freed with the batch
        gid = self._next_group
        self._next_group += 1
        g = self.groups[gid] = _Group(members, held, sum(members.values()), tuple(shared))
        for slot in members:
            self._slot_group[slot] = gid
        self.pinned_bytes += g.held - g.live
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
            del self.groups[gid]
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

    def _maybe_compact(self, gid: int, used_bytes: int, capacity: int) -> None:
        g = self.groups.get(gid)
        if g is None or (2 * g.live >= g.held and used_bytes + self.pinned_bytes <= capacity):
            return
        del self.groups[gid]
        self.pinned_bytes -= g.held - g.live
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
