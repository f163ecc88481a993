"""What a storage unit reports about itself: counters and sizes (bytes)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from . import receive_pool

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint_guard import CheckpointGuard
    from .fence import Fence
    from .held_rows import HeldRows
    from .losses import LossBook
    from .registry import PartitionRegistry
    from .slab_pool import SlabPool


class StorageUnit(Protocol):
    """What a report reads of a :class:`~pipeline.store.unit.StorageUnit`."""

    unit_index: int
    worker_address: str | None
    held: HeldRows
    answers: SlabPool
    memory_limit: int
    capacity: int
    directory: str
    registry: PartitionRegistry
    guard: CheckpointGuard
    losses: LossBook
    fence: Fence | None
    counters: dict[str, int]
    hosted_bytes: int

    @property
    def pinned_bytes(self) -> int: ...

    def event(self) -> dict: ...


def unit_stats(unit: StorageUnit) -> dict:
    """``StorageUnit.stats()``: rows, bytes in memory / spilled / used / resident (rows in
    memory and the adopted bytes they pin), capacity, buffer pools, open checkpoints, claims, witnessed and lost keys, the placement version it was
    fenced with, and every counter."""
    return {
        "unit": unit.unit_index,
        "worker": unit.worker_address,
        "rows": unit.held.count(),
        "partitions": {p: len(ix) for p, ix in unit.held.index.items()},
        "used_bytes": unit.held.used_bytes,
        "pinned_bytes": unit.pinned_bytes,
        "shared_groups": len(unit.held.adopted),
        "memory_bytes": unit.held.rows.memory_bytes,
        "spilled_bytes": unit.held.rows.spilled_bytes,
        "disk_bytes": unit.held.rows.spilled_bytes,
        "spilled_rows": unit.held.rows.spilled_rows,
        "spill_errors": unit.held.rows.spill_errors,
        "dead_bytes": unit.held.adopted.dead_bytes,
        "resident_bytes": unit.held.resident_bytes,
        "compacted_groups": unit.held.adopted.compacted_groups,
        **receive_figures(unit.hosted_bytes > 0),
        "answer_buffer_bytes": unit.answers.held_bytes,
        "answer_buffers_reused": unit.answers.reused,
        "answer_buffers_allocated": unit.answers.allocated,
        "answer_buffers_unpooled": unit.answers.unpooled,
        "memory_limit": unit.memory_limit,
        "capacity": unit.capacity,
        "spill_directory": unit.directory,
        "registry": unit.registry.to_dict(),
        "open_checkpoints": len(unit.guard.open),
        "pending_deletes": unit.guard.pending(),
        "provisional_rows": len(unit.held.claims),
        "lost_keys": unit.losses.lost_count(),
        "witnessed_keys": unit.losses.witnessed_count(),
        "event": unit_event(unit),
        "placement_version": None if unit.fence is None else unit.fence.version,
        "unit_id": None if unit.fence is None else unit.fence.unit_id,
            **unit.counters,
    }


def receive_figures(hosted: bool) -> dict:
    """The receive pool of the unit's process (shared by every unit and frame there): its
    cap (``store.receive-buffer-bytes`` plus the memory limits of the units hosted there),
    slab bytes it keeps, frames served from reused slabs and from new ones, frames given plain
    memory; zeros for a unit not hosted by a worker."""
    pool = receive_pool.pool() if hosted else None
    return {
        "receive_buffer_cap_bytes": pool.max_bytes if pool else 0,
        "receive_buffer_bytes": pool.held_bytes if pool else 0,
        "receive_buffers_reused": pool.reused if pool else 0,
        "receive_buffers_allocated": pool.allocated if pool else 0,
        "receive_buffers_unpooled": pool.unpooled if pool else 0,
    }


def unit_event(unit: StorageUnit) -> dict:
    """The unit's ``token-capture-store`` event (the one place it is built): rows, bytes
    in memory / spilled / used, capacity (bytes), lost keys; O(partitions), cheap."""
    return {
        "unit": unit.unit_index,
        "worker": unit.worker_address,
        "rows": unit.held.count(),
        "memory_bytes": unit.held.rows.memory_bytes,
        "spilled_bytes": unit.held.rows.spilled_bytes,
        "used_bytes": unit.held.used_bytes,
        "capacity_bytes": unit.capacity,
        "lost_keys": unit.losses.lost_count(),
    }
