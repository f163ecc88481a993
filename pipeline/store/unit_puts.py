"""A storage unit's side of a put: each row of a well-formed batch stored or refused.

:meth:`StorageUnit.put_many <pipeline.store.unit.StorageUnit.put_many>` checks the call
and calls :func:`put_rows`: per key, the refusals that need no row (a key moved away, a
malformed key, a dtype against the partition's pinned one, a lost key), then the held
rows' own answer (write-once, capacity), and for the rows of an adopted put the group of
buffers their views keep alive (:mod:`.adopted`). A key whose delete an open checkpoint
defers is staged again only identical (its deferred delete is then cancelled: the put is
acknowledged, so the row must outlive the checkpoint; a restore's put revives it
provisional under its claim, to be taken back if the restore fails); other content is
refused until the checkpoint ends.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from tasks.packed import PackedBatch

from .adopted import root_nbytes
from .losses import LossBook, lost_detail
from .protocol import DTYPE_MISMATCH, INVALID_KEY, KEY_CONFLICT, LOST_KEY, MOVED, StoreResult, check_key, same_row
from .put_columns import Columns, batch_columns
from .registry import PartitionRegistry
from .spill import batch_row_nbytes

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint_guard import CheckpointGuard
    from .fence import Fence
    from .held_rows import HeldRows


class StorageUnit(Protocol):
    """What a put uses of a :class:`~pipeline.store.unit.StorageUnit`."""

    held: HeldRows
    registry: PartitionRegistry
    losses: LossBook
    fence: Fence | None
    guard: CheckpointGuard
    counters: dict[str, int]


def put_rows(unit: StorageUnit, partition: str, batch: PackedBatch, adopt: bool, claim: str | None,
             result: StoreResult, refused: set[str]) -> None:
    """Store each row of a well-formed ``batch`` (per-key answers into ``result``);
    ``refused``: keys a move gave another unit."""
    reg = unit.registry[partition]
    columns = batch_columns(batch, reg, adopt)
    row_weights = batch_row_nbytes(batch, [c.name for c in columns.cols])  # each row's row_nbytes, at once
    stored_rows: list[int] = []  # batch rows stored under a NEW slot
    stored_slots: list[str] = []
    deferred = unit.guard.deferred.get(partition) or {}  # keys deleted, held for an open checkpoint
    torn = conflicting_duplicates(batch.keys, columns.row)
    for i, key in enumerate(batch.keys):
        if key in torn:
            result.failed[key] = (KEY_CONFLICT, f"{key!r} appears {torn[key]} times in this put with different content; none is stored")
            continue
        why = (MOVED, unit.fence.detail(key)) if key in refused else refusal(unit, partition, key, columns.bad_field[i])  # type: ignore[union-attr]
        if why is not None:
            result.failed[key] = why
            continue
        outcome, slot = unit.held.store(partition, key, columns.row(i), row_weights[i], claim)
        if outcome is not None:
            result.failed[key] = deferred_conflict(key, partition) if key in deferred and outcome[0] == KEY_CONFLICT else outcome
            continue
        result.ok.append(key)
        if key in deferred:  # acknowledged again: the checkpoint's end must not remove it
            tokens = unit.guard.undefer(partition, key)
            if claim is not None and slot is None:  # deleted for every writer: the claim revived it
                unit.held.take_claim(partition, key, claim)
                unit.guard.revive(partition, key, tokens or frozenset())
        if slot is not None:
            stored_rows.append(i)
            stored_slots.append(slot)
    if stored_rows:
        columns.pin(reg, stored_rows)
    _adopt(unit, columns, stored_rows, stored_slots)


def conflicting_duplicates(keys: Sequence[str], row: Callable[[int], Mapping]) -> dict[str, int]:
    """Keys that appear more than once in one put with different content (``row(i)``: the
    batch's row ``i``), with how often: none of their copies is stored, so the writer is
    never told both ``ok`` and ``key_conflict`` for one key. Identical copies are one row."""
    if len(set(keys)) == len(keys):
        return {}
    at: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        at.setdefault(key, []).append(i)
    return {k: len(ix) for k, ix in at.items()
            if len(ix) > 1 and not all(same_row(row(ix[0]), row(j)) for j in ix[1:])}


def deferred_conflict(key: str, partition: str) -> tuple[str, str]:
    """The refusal of new content under a key deleted while a checkpoint is open: the old
    row stays until the checkpoint ends (it may still write it), then the key is free."""
    return KEY_CONFLICT, (f"{key!r} was deleted from partition {partition!r} while a store checkpoint is open; "
                          "its old row stays until the checkpoint ends: stage new content under it after that")


def refusal(unit: StorageUnit, partition: str, key: str, bad_field: str | None) -> tuple[str, str] | None:
    """Why ``key`` is refused before its row is looked at, or None."""
    problem = check_key(key)
    if problem is not None:
        return INVALID_KEY, problem
    if bad_field is not None:
        return DTYPE_MISMATCH, bad_field
    how = unit.losses.how(partition, key)
    if how is not None:
        return LOST_KEY, lost_detail(key, how)
    return None


def _adopt(unit: StorageUnit, columns: Columns, stored: list[int], slots: list[str]) -> None:
    """Track the buffers the new rows ``slots`` (batch rows ``stored``) keep views of."""
    if not columns.shared or not slots:
        return
    held = root_nbytes(c.values for c in columns.cols if c.name in columns.shared)
    unit.held.adopt(columns.shared, slots, columns.shared_bytes(stored), held)
    unit.counters["adopted_rows"] += len(slots)
