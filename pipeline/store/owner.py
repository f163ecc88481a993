"""What only the process that started a store holds: its actors' futures, the repairer,
and the close that releases them.

:func:`start_units` places the storage-unit actors (round-robin over workers) and gives
the :class:`StoreOwner` and the first :class:`~pipeline.store.placement.Placement`. The
owner lives in the creating :class:`~pipeline.store.client.StagingStore` only: a pickled
copy of the store is a handle (it calls the units, it cannot release them). Closing
through the owner also cancels the actor tasks, so a later call through any copy fails
at once instead of reaching a closed unit.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence

from distributed import Actor, Client, Future

from tasks.errors import InvalidStoreRequest, StoreUnavailable

from .. import config
from ..actors import current_workers, start_pinned_actors
from .directory import UnitDirectory, UnitTable
from .placement import Placement
from .protocol import check_partition
from .unit import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    from .repair import Repairer


class Owned(Protocol):
    """What the owner uses of the store it owns."""

    directory: UnitDirectory | None

    def install_unit(self, u: int, handle: Actor, worker: str) -> None: ...

    def table(self) -> UnitTable: ...

    def close_units(self) -> list[dict]: ...


@dataclass(frozen=True)
class UnitArgs:
    """The constructor arguments every unit of a store shares (replacements included)."""

    memory_limit: int  # bytes
    capacity: int  # bytes
    spill_directory: str | None
    partitions: list[str]
    adopt_received: bool

    def for_unit(self, u: int) -> tuple:
        return (u, self.memory_limit, self.capacity, self.spill_directory, self.partitions, self.adopt_received)


@dataclass
class StoreOwner:
    """The creating process's hold on a store's actors (see the module docstring)."""

    client: Client
    futures: list[Future]
    unit_args: UnitArgs
    retired: list[Future] = field(default_factory=list)  # futures of replaced units
    repairer: "Repairer | None" = None
    closed: list[dict] | None = None
    # Held by whoever changes the units (the repairer's replacement, a rebalancer's add or
    # drain): one change at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def replace_unit(self, store: Owned, u: int, handle: Actor, worker: str, future: Future) -> None:
        """Install a re-replicated unit ``u`` (the repairer) and publish the new table."""
        if u < len(self.futures):
            self.retired.append(self.futures[u])
            self.futures[u] = future
        store.install_unit(u, handle, worker)
        if store.directory is not None:
            store.directory.publish(self.client, store.table())

    def close(self, store: Owned) -> list[dict]:
        """Close every unit, stop repairing and release the actors. Idempotent."""
        if self.closed is not None:
            return self.closed
        if self.repairer is not None:
            self.repairer.stop()
        out = store.close_units()
        # Drop the actors now, not whenever every handle copy (graph submissions make
        # some) is garbage-collected: a forced cancel ends the actor tasks on the
        # scheduler whoever still holds a future.
        futures = self.futures + self.retired
        if futures:
            try:
                self.client.cancel(futures, force=True)
            except Exception:  # noqa: BLE001 - the cluster may already be gone; nothing left to free
                pass
        if store.directory is not None:
            store.directory.close(self.client)
        self.closed = out
        return out


def unit_args_from_config(
    memory_limit: int | str | None, capacity: int | str | None, spill_directory: str | None
) -> UnitArgs:
    """The units' arguments: given values, else ``token-capture.store.*`` (read once, here)."""
    memory = config.parse_bytes(config.get("store.memory-limit") if memory_limit is None else memory_limit)
    cap = config.parse_bytes(config.get("store.capacity") if capacity is None else capacity)
    if spill_directory is None:
        spill_directory = config.get("store.spill-directory")
    partitions = [check_partition(p) for p in config.get("store.partitions")]
    spill = None if spill_directory is None else str(spill_directory)
    return UnitArgs(memory, cap, spill, partitions, bool(config.get("store.adopt-received")))


def start_units(
    client: Client, n_units: int, args: UnitArgs, workers: Sequence[str] | None, replicas: int | None = None
) -> tuple[list[Actor], StoreOwner, Placement, UnitDirectory | None]:
    """Start ``n_units`` units round-robin over ``workers`` (default: every worker now),
    named ``"0".."n-1"``, with ``replicas`` copies of every key (``None``:
    ``token-capture.store.replicas``, read here).

    Returns the unit handles, their owner, the placement (each unit's home is the worker
    it starts on; with replicas=2 a key's replica is on another worker, or another host
    when the workers span several) and, with replicas=2, the unit directory."""
    if n_units <= 0:
        raise InvalidStoreRequest(f"n_units must be positive, got {n_units}")
    workers = current_workers(client) if workers is None else list(workers)
    if not workers:
        raise StoreUnavailable("no workers to host storage units")
    placed = tuple(workers[i % len(workers)] for i in range(n_units))
    copies = int(config.get("store.replicas")) if replicas is None else replicas
    placement = Placement(0, placed, replicas=copies)  # refuses replicas=2 on a single worker
    units, futures = start_pinned_actors(client, StorageUnit, list(placed), args=[args.for_unit(i) for i in range(n_units)])
    owner = StoreOwner(client, list(futures), args)
    if copies == 1:
        return units, owner, placement, None
    import uuid

    return units, owner, placement, UnitDirectory(f"token-capture-units-{uuid.uuid4().hex[:12]}")
