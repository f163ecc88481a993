"""What a storage unit reports about itself: counters and sizes (bytes)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

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

    @property
    def pinned_bytes(self) -> int: ...

    def event(self) -> dict: ...


def unit_stats(unit: StorageUnit) -> dict:
    """``StorageUnit.stats()``: rows, bytes in memory / spilled / used, capacity, buffer
    pools, open checkpoints, claims, witnessed and lost keys, the placement version it was
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
