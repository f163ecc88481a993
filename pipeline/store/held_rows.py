"""The rows one storage unit holds: where each lives (a slot in a zict
:class:`~pipeline.store.spill.SpillMapping`), what it weighs against capacity, which
adopted buffers it keeps alive, and which are still provisional under a restore's claim.

Write-once: a row is stored once per key; an identical re-put is acknowledged (and makes
a provisional row its writer's), different content is ``key_conflict``. A new row's
weight (bytes) is its arrays, its key's UTF-8 bytes and ``ROW_OVERHEAD_BYTES``; a put
past ``capacity`` (memory + disk + pinned adopted bytes) is ``store_full``; removing a
row frees exactly its weight.
"""
from __future__ import annotations

from .adopted import AdoptedGroups
from .protocol import KEY_CONFLICT, STORE_ERROR, STORE_FULL, same_row
from .row_packing import ROW_OVERHEAD_BYTES, key_nbytes
from .spill import Row, SpillMapping

Failure = tuple[str, str]


class HeldRows:
    """Rows by ``partition -> key -> slot``, their weights and adopted groups (bytes)."""

    def __init__(self, directory: str, memory_limit: int, capacity: int, unit_index: int):
        self.rows = SpillMapping(directory, memory_limit)
        # Rows of adopted puts keep views of the put's buffers: their groups, pinned bytes.
        self.adopted = AdoptedGroups(self.rows)
        self.rows.fast_to_slow_callbacks.append(self.adopted.on_spill)
        self.index: dict[str, dict[str, str]] = {}  # partition -> key -> slot
        self.weights: dict[str, int] = {}  # slot -> row bytes, for capacity accounting
        self.claims: dict[str, str] = {}  # slot -> claim token of a restore's provisional row
        self.used_bytes = 0
        self.capacity = int(capacity)
        self.unit_index = int(unit_index)
        self._next_slot = 0

    def count(self) -> int:
        return sum(len(ix) for ix in self.index.values())

    def store(self, partition: str, key: str, row: Row, nbytes: int, claim: str | None) -> tuple[Failure | None, str | None]:
        """(failure or None, the new slot when the row was stored: None for an identical
        re-put). ``nbytes`` is the row's ``row_nbytes`` (computed per batch by the caller)."""
        index = self.index.setdefault(partition, {})
        slot = index.get(key)
        if slot is not None:
            return self._re_put(partition, slot, key, row, claim), None
        weight = nbytes + key_nbytes(key) + ROW_OVERHEAD_BYTES
        pinned = self.adopted.pinned_bytes
        if self.used_bytes + pinned + weight > self.capacity:
            return (
                STORE_FULL,
                f"{key!r}: {weight} bytes would exceed capacity {self.capacity} bytes "
                f"(used {self.used_bytes}, pinned {pinned}) of unit {self.unit_index}",
            ), None
        slot = str(self._next_slot)
        self._next_slot += 1
        try:
            self.rows.put_row(slot, row, nbytes)
        except Exception as e:  # noqa: BLE001 - a spill failure fails this key, not the batch
            if slot not in self.rows:
                return (STORE_ERROR, f"{key!r}: storing failed: {e!r}"), None
        index[key] = slot
        self.weights[slot] = weight
        self.used_bytes += weight
        if claim is not None:
            self.claims[slot] = claim
        return None, slot

    def _re_put(self, partition: str, slot: str, key: str, row: Row, claim: str | None) -> Failure | None:
        """An identical re-put is ok (and acknowledges the row to its writer); different
        content is ``key_conflict``. Compared only when the key exists."""
        try:
            existing = self.rows[slot]
        except Exception as e:  # noqa: BLE001 - a spill file gone bad must not take down the batch
            return STORE_ERROR, f"{key!r}: reading the existing row failed: {e!r}"
        if not same_row(existing, row):
            return KEY_CONFLICT, f"{key!r} already holds different content in partition {partition!r}"
        if self.claims.get(slot, claim) != claim:
            del self.claims[slot]  # acknowledged to another writer: no longer provisional
        return None

    def adopt(self, shared: list[str], slots: list[str], covered: int, held: int) -> None:
        """The new rows ``slots`` keep views of the buffers of fields ``shared`` (``held``
        bytes, ``covered`` bytes of them by the rows)."""
        self.adopted.adopt(shared, slots, covered, held, self.used_bytes, self.capacity)

    @property
    def memory_limit(self) -> int:
        """Bytes of rows and pinned bytes kept in memory: the spill buffer's own limit."""
        return int(self.rows.n)

    @property
    def resident_bytes(self) -> int:
        """Bytes this unit holds in memory: its rows' and the adopted bytes they pin."""
        return self.rows.memory_bytes + self.adopted.pinned_bytes

    def compact(self) -> None:
        """At the end of each unit call: free adopted groups that now pin too much, then
        fit the memory limit with the pinned bytes counted: groups with dead members
        freed first (:meth:`AdoptedGroups.relieve`), then the least recently used rows
        spilled, each with the rest of its group.

        One pass over the groups: once the full relieve leaves excess, every group with
        dead members is compacted, so after each eviction only the evicted row's group
        (pending since then) can have dead members and only it is looked at."""
        self.adopted.compact_pending(self.used_bytes, self.capacity)
        excess = self.adopted.relieve(self.resident_bytes - self.memory_limit)
        lru = self.rows.fast
        while excess > 0 and lru.d:
            try:
                lru.evict()  # zict spills it
            except OSError:  # a failed spill keeps the row in memory (spill.py): stop here
                self.rows.spill_errors += 1
                break
            excess = self.adopted.relieve(self.resident_bytes - self.memory_limit, pending_only=True)
        self.adopted.compact_pending(self.used_bytes, self.capacity)

    def remove(self, partition: str, key: str) -> bool:
        """Remove ``key``'s row; False if there was none."""
        slot = self.index.get(partition, {}).pop(key, None)
        if slot is None:
            return False
        del self.rows[slot]
        self.adopted.release(slot)
        self.used_bytes -= self.weights.pop(slot)
        self.claims.pop(slot, None)
        return True

    def release(self, partition: str, keys: list, claim: str, spare: dict | frozenset = frozenset()) -> tuple[int, list[str], list[str]]:
        """Remove the rows of ``keys`` still provisional under ``claim``, but those in
        ``spare`` (kept, no longer provisional): (removed, kept keys, spared keys)."""
        index = self.index.get(partition, {})
        removed, kept, spared = 0, [], []
        for key in keys:
            slot = index.get(key) if isinstance(key, str) else None
            if slot is None:
                continue
            if self.claims.get(slot) == claim and key in spare:
                del self.claims[slot]
                spared.append(key)
            elif self.claims.get(slot) == claim and self.remove(partition, key):
                removed += 1
            else:
                kept.append(key)
        return removed, kept, spared

    def take_claim(self, partition: str, key: str, claim: str) -> None:
        """``key``'s row (held: one a delete left for an open checkpoint) becomes
        provisional under ``claim``, whose put revived it."""
        self.claims[self.index[partition][key]] = claim

    def settle(self, claim: str) -> int:
        """The rows provisional under ``claim`` become ordinary rows; how many."""
        slots = [slot for slot, c in self.claims.items() if c == claim]
        for slot in slots:
            del self.claims[slot]
        return len(slots)

    def find(
        self, partition: str, keys: list, max_bytes: int | None = None,
    ) -> tuple[list[str], list[Row], list, dict[str, Failure], list]:
        """(found keys, their rows, keys not held, read failures, keys left over) for
        ``keys`` in order, one lookup per key. ``max_bytes``: only the first keys whose
        row weights total at most this (at least one; keys not held weigh nothing) are
        read, the rest are left over."""
        index = self.index.get(partition, {})
        weights = self.weights
        found: list[str] = []
        rows: list[Row] = []
        absent: list = []
        failed: dict[str, Failure] = {}
        total = 0
        for n, key in enumerate(keys):
            slot = index.get(key) if isinstance(key, str) else None
            if max_bytes is not None and slot is not None:
                total += weights.get(slot, 0)
                if total > max_bytes and n:
                    return found, rows, absent, failed, keys[n:]
            if slot is None:
                absent.append(key)
                continue
            try:
                rows.append(self.rows[slot])
            except Exception as e:  # noqa: BLE001 - a spill file gone bad fails its key only
                failed[key] = (STORE_ERROR, f"{key!r}: read failed: {e!r}")
                continue
            found.append(key)
        return found, rows, absent, failed, []

    def clear(self) -> None:
        self.rows.close()
        self.index.clear()
        self.weights.clear()
        self.adopted.clear()
        self.claims.clear()
        self.used_bytes = 0
