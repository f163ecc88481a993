"""A storage unit's side of a move: taking a fence, rows (and lost-key records) moved in,
copies dropped. A row provisional under a restore's claim moves provisional under it
(:mod:`.unit_claims`): a later release of the claim takes back the moved copy too.

The unit's actor methods ``set_fence``, ``move_in`` and ``drop`` call the functions here
(a fence of the final table, not moving, ends the move and its tombstones); its put, get and delete consult the :class:`~pipeline.store.fence.Fence`
(``moved`` answers, tombstones). The order of a move is
:mod:`pipeline.store.rebalance`'s.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import numpy as np

from tasks.errors import InvalidStoreRequest, StoreBusy
from tasks.packed import PackedBatch, take_rows

from .. import dask_compat
from .fence import Fence
from .protocol import MOVED, GetResult, StoreResult, check_partition, unpack_names
from .unit_claims import keys_by_claim

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor

    from .checkpoint_guard import CheckpointGuard
    from .held_rows import HeldRows
    from .losses import LossBook


class StorageUnit(Protocol):
    """What the functions here use of a :class:`~pipeline.store.unit.StorageUnit`."""

    unit_index: int
    fence: Fence | None
    guard: CheckpointGuard
    held: HeldRows
    losses: LossBook
    partitions: list[str] | None
    counters: dict[str, int]

    def _check_open(self) -> None: ...

    def put_many(self, partition: str, batch: PackedBatch, adopt: bool = ..., claim: str | None = ...,
                 witness: bytes | None = ..., moving: bool = ..., version: int | None = ...) -> StoreResult: ...

    def get_many(self, partition: str, keys: Sequence[str] | bytes, fields: Sequence[str] | bytes | None = ...,
                 version: int | None = ...) -> GetResult: ...

MOVE_COUNTERS = ("moved_in_rows", "moved_out_rows", "moved_refusals", "move_tombstone_skips", "sent_rows", "sent_bytes")


def take_fence(unit: StorageUnit, msg: Mapping[str, object]) -> dict:
    """Fence ``unit`` with the table of ``msg`` (:meth:`Fence.message`). Refuses an older
    table than the one it has, and a move while a store checkpoint is open on it. An early
    fence keeps the unit's floor until the same table comes again, not early; a move
    resumed under a newer table keeps the tombstones of the one it replaces (a late copy
    of the first attempt must not bring a deleted key back)."""
    unit._check_open()
    fence = Fence.from_message(msg)
    old = unit.fence
    if old is not None and fence.version < old.version:
        raise InvalidStoreRequest(
            f"storage unit {unit.unit_index}: placement version {fence.version} is older than its {old.version}; "
            "a fence never goes back (refresh the table)")
    if unit.guard.open:
        raise StoreBusy(f"storage unit {unit.unit_index} has a store checkpoint open; a move waits for it to end")
    if old is not None and old.version == fence.version:
        if old.early and not fence.early:  # the table is published now: older calls are stale from here on
            old.early, old.floor = False, fence.floor
        return {"version": fence.version, "unit_id": fence.unit_id}
    if fence.early:  # not published yet: calls keep the floor they had
        fence.floor = None if old is None else old.floor
    if old is not None and old.moving and fence.moving:
        fence.tombstones = old.tombstones
    unit.fence = fence
    return {"version": fence.version, "unit_id": fence.unit_id}


def move_in(unit: StorageUnit, partition: str, batch: PackedBatch, lost: Mapping[str, str] | None = None,
            claims: Mapping[str, str] | None = None, counted: bool = True) -> int:
    """Store the moved rows of ``batch`` and record the moved lost keys ``lost`` (key ->
    how it was lost), except keys deleted during the move; rows written (a key already
    held identically counts as written: the copy is there). ``claims``: key -> claim of
    the rows provisional on the source, stored provisional under it here (an identical
    row moved again without a claim makes the one here ordinary: its claim settled).
    ``counted``: False for rows sent again (a claim's catch-up), not counted as moved in."""
    unit._check_open()
    check_partition(partition, unit.partitions)
    fence = unit.fence
    if lost:
        _mark_moved_lost(unit, partition, lost)
    buried = set() if fence is None else fence.buried(partition, batch.keys)
    if buried:
        keep = np.asarray([i for i, k in enumerate(batch.keys) if k not in buried], dtype=np.int64)
        unit.counters["move_tombstone_skips"] += len(buried)
        if not len(keep):
            return 0
        batch = take_rows([batch], np.zeros(len(keep), np.int64), keep)
    if not len(batch):
        return 0
    written = 0
    for claim, rows in _by_claim(batch, claims or {}):
        res = unit.put_many(partition, rows, adopt=True, claim=claim, moving=True)
        written += len(res.ok)
    if counted:
        unit.counters["moved_in_rows"] += written
    return written


def _by_claim(batch: PackedBatch, claims: Mapping[str, str]) -> list[tuple[str | None, PackedBatch]]:
    """``batch`` split by each row's claim (None: an ordinary row); one part if all share one."""
    groups = keys_by_claim(claims, batch.keys)
    if len(groups) == 1:
        return [(next(iter(groups)), batch)]
    row = {k: i for i, k in enumerate(batch.keys)}
    return [(c, take_rows([batch], np.zeros(len(ks), np.int64), np.asarray([row[k] for k in ks], dtype=np.int64)))
            for c, ks in groups.items()]


def _mark_moved_lost(unit: StorageUnit, partition: str, lost: Mapping[str, str]) -> None:
    """Record the moved lost keys ``lost`` (key -> how) but those deleted during the move
    (a delete forgets a loss; a late copy must not bring it back) and those held here."""
    buried = set() if unit.fence is None else unit.fence.buried(partition, list(lost))
    by_how: dict[str, list[str]] = {}
    for key, how in lost.items():
        if key not in buried:
            by_how.setdefault(how, []).append(key)
    index = unit.held.index.get(partition, {})
    for how, keys in by_how.items():
        unit.losses.mark(partition, keys, how, index)


async def send(unit: StorageUnit, partition: str, keys: bytes, target: Actor, counted: bool = True) -> dict:
    """A move's copy, unit to unit: read ``keys`` here on the worker's actor thread (a
    consistent snapshot, in line with this unit's puts and deletes), then hand the rows,
    their claims and the lost-key records of ``keys`` to ``target.move_in`` from the
    worker's event loop, worker to worker. The actor thread is free while the rows travel
    and the target writes them. Keys no longer held (deleted since they were listed) are
    skipped. ``{"rows": rows the target wrote, "bytes": bytes of row data sent,
    "claimed": key -> claim of the rows sent provisional}``. ``counted``: False for rows
    sent again (a claim's catch-up: the move counted them once, in ``sent_rows`` here and
    ``moved_in_rows`` there). Runs as the unit's async actor method on a worker."""
    from distributed import get_worker

    thread = dask_compat.actor_executor(get_worker())
    got, lost, claims = await asyncio.get_running_loop().run_in_executor(thread, _read_moved, unit, partition, keys)
    if not len(got.batch) and not lost:
        return {"rows": 0, "bytes": 0, "claimed": {}}
    written = int(await target.move_in(partition, got.batch, lost or None, claims or None, counted))
    nbytes = int(got.batch.nbytes)
    if counted:
        unit.counters["sent_rows"] += written
        unit.counters["sent_bytes"] += nbytes
    return {"rows": written, "bytes": nbytes, "claimed": claims}


def _read_moved(unit: StorageUnit, partition: str, keys: bytes) -> tuple[GetResult, dict[str, str], dict[str, str]]:
    """The rows of ``keys``, the lost ones with how each was lost and the provisional ones
    with their claim (one snapshot: runs on the unit's actor thread; lost keys are not
    read, so no ``lost_reads`` counted)."""
    names = unpack_names(keys, "keys")
    lost = {k: how for k in names if (how := unit.losses.how(partition, k)) is not None}
    got = unit.get_many(partition, [k for k in names if k not in lost] if lost else keys, None)
    index, held_claims = unit.held.index.get(partition, {}), unit.held.claims
    claims = {k: held_claims[s] for k in got.batch.keys if (s := index.get(k)) in held_claims} if held_claims else {}
    return got, lost, claims


def drop(unit: StorageUnit, partition: str, keys: Sequence[str] | bytes) -> int:
    """Remove this unit's copies of ``keys`` (they live elsewhere now), rows and lost-key
    records; rows removed. A key deleted meanwhile is simply absent."""
    unit._check_open()
    check_partition(partition, unit.partitions)
    names = unpack_names(keys, "keys")
    index = unit.held.index.get(partition, {})
    removed = 0
    for key in names:
        if key in index:
            removed += unit.held.remove(partition, key)
        else:
            unit.losses.forget(partition, key)
    unit.counters["moved_out_rows"] += removed
    unit.held.compact()
    return removed


def refused_keys(unit: StorageUnit, keys: Sequence[str], moving: bool) -> set[str]:
    """Keys a put must refuse ``moved`` (not this unit's under its fence); none for the
    move's own puts (``moving``) and for a unit never fenced."""
    fence = unit.fence
    if fence is None or moving:
        return set()
    out = set(fence.not_given(keys))
    unit.counters["moved_refusals"] += len(out)
    return out


def stale_answer(unit: StorageUnit, keys: Sequence[str]) -> StoreResult:
    """Every key of a stale call answers ``moved`` (the caller refreshes and calls again)."""
    assert unit.fence is not None
    unit.counters["moved_refusals"] += len(keys)
    why = (MOVED, f"planned on an older placement than version {unit.fence.version}; refresh the table")
    out = StoreResult()
    out.failed = {k if isinstance(k, str) else repr(k): why for k in keys}
    return out
