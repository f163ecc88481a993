"""Changing a running store's units: add one (a storage worker joined), drain one (its
worker is about to be retired), without losing or changing a row.

:class:`Rebalancer` runs in the process that owns the store (the scheduler's store host),
one change at a time, in this order:

1. **fence**: every unit (the new one included) is told the new table; from then on a
   unit refuses writes of keys the new table does not give it (``moved``: the writer
   refreshes its table and writes to the new holders) and keeps tombstones of deletes;
2. **copy**: each unit lists its keys (after the fence, so the lists only shrink) and
   sends the copies the new table asks for, in chunks (:func:`~pipeline.store.moves.plan_moves`),
   as ``move_in`` puts that skip tombstoned keys;
3. **switch**: the handle and the shared unit directory take the new table (clients
   refresh by version when a unit answers ``moved``);
4. **drop**: each unit deletes the copies it no longer holds under the new table, the
   fence settles (tombstones go), and a drained unit is closed and released.

A read during the change finds a row on its old holder until step 4, on its new one
from step 3; a delete during it reaches every copy (tombstones); a store checkpoint is
not taken during a change (the host refuses one while the other is in progress).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from tasks.errors import InvalidStoreRequest, StoreBusy

from .. import config
from ..actors import start_pinned_actors
from .fence import Fence
from .moves import Transfer, plan_moves
from .moving import MovingTable
from .placement import Placement
from .protocol import pack_names
from .unit import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Client

    from .client import StagingStore
    from .owner import UnitArgs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RebalanceSettings:
    """Knobs read once (``token-capture.store.*``)."""

    chunk_keys: int  # keys per copy call (``rebalance-chunk-rows``)
    call_timeout_s: float  # bound on each unit call, s (``repair-call-timeout-s``)

    @classmethod
    def from_config(cls) -> RebalanceSettings:
        return cls(int(config.get("store.rebalance-chunk-rows")), float(config.get("store.repair-call-timeout-s")))


class Rebalancer:
    """Adds and drains units of ``store`` (its owner's process); one change at a time."""

    def __init__(self, store: StagingStore, client: Client, unit_args: UnitArgs, settings: RebalanceSettings | None = None):
        self.store, self.client, self.unit_args = store, client, unit_args
        self.settings = settings or RebalanceSettings.from_config()
        self.changes: list[dict] = []  # one record per change: kind, unit, rows moved, seconds

    def add_unit(self, worker: str) -> dict:
        """Start a unit on ``worker`` and move to it the keys the new table gives it."""
        with self.store.owner.lock:  # one change at a time (the repairer takes it too)
            return self._add_unit(worker)

    def drain_unit(self, unit_id: str) -> dict:
        """Move every copy off unit ``unit_id``, then close and release it."""
        with self.store.owner.lock:
            return self._drain_unit(unit_id)

    def _add_unit(self, worker: str) -> dict:
        old = self.store.placement
        unit_id = next_unit_id(old.unit_ids)
        new = old.with_unit(unit_id, worker)  # refuses a worker already hosting a unit
        args = self.unit_args.for_unit(int(unit_id))  # a unique unit_index (names, spill files)
        handles, futures = start_pinned_actors(self.client, StorageUnit, [worker], args=[args])
        units = list(self.store.units) + handles
        try:
            record = self._change("add", unit_id, old, new, units)
        except BaseException:
            self.client.cancel(futures, force=True)
            raise
        self.store.owner.futures.extend(futures)
        return record

    def _drain_unit(self, unit_id: str) -> dict:
        old = self.store.placement
        u = old.index_of(unit_id)
        new = old.without_unit(unit_id)  # refuses the last unit
        leaving = self.store.units[u]
        units = [h for i, h in enumerate(self.store.units) if i != u]
        record = self._change("drain", unit_id, old, new, units, extra=[(unit_id, leaving)])
        leaving.close().result(timeout=self.settings.call_timeout_s)  # it holds nothing of its own now
        owner = self.store.owner
        if u < len(owner.futures):
            self.client.cancel([owner.futures.pop(u)], force=True)
        return record

    def _change(self, kind: str, unit_id: str, old: Placement, new: Placement, units: Sequence[Actor],
                extra: Sequence[tuple[str, Actor]] = ()) -> dict:
        """Publish and fence the moving table, copy, publish and fence the final one,
        drop (module docstring); returns the change's record. A store still moving
        (a change that failed part-way) is refused: its keys are on both tables' units."""
        if self.store.moving is not None:
            raise StoreBusy(f"the store is still moving keys to placement version {self.store.moving.version}")
        t0 = time.perf_counter()
        moving = MovingTable(new, old)
        union = list(units) + [h for _, h in extra]
        by_id = dict(zip(moving.unit_ids, union))
        self.store.install_moving(moving, union)  # 1. writers reach both tables' copies
        self._all(by_id, lambda uid, h: h.set_fence(Fence.message(new, uid, True, old)))
        moved = dropped = 0
        drops: list[tuple[str, str, tuple[str, ...]]] = []
        for partition in self.store.partitions or []:  # 2. copy
            held = dict(zip(by_id, self._all(by_id, lambda uid, h, p=partition: h.keys(p))))
            plan = plan_moves(old, new, held, self.settings.chunk_keys)
            moved += self._copy(by_id, partition, plan.transfers)
            drops.extend((partition, uid, keys) for uid, keys in plan.drops.items())
        final = Placement(new.version + 1, new.workers, new.unit_ids, new.replicas, new.homes)
        self.store.install_placement(final, list(units))  # 3. switch: the new holders have every row
        self._all(by_id, lambda uid, h: h.set_fence(Fence.message(final, uid, False)))
        for partition, uid, keys in drops:  # 4. drop
            dropped += by_id[uid].drop(partition, pack_names(list(keys))).result(timeout=self.settings.call_timeout_s)
        record = {"kind": kind, "unit": unit_id, "rows_moved": moved, "copies_dropped": dropped,
                  "version": final.version, "seconds": time.perf_counter() - t0}
        self.changes.append(record)
        logger.info("store %s of unit %s: %d rows moved, %d copies dropped in %.2fs", kind, unit_id, moved, dropped, record["seconds"])
        return record

    def _copy(self, by_id: dict[str, Actor], partition: str, transfers: Sequence[Transfer]) -> int:
        """Each transfer as one get from its source and one ``move_in`` to its target."""
        moved, timeout = 0, self.settings.call_timeout_s
        for t in transfers:
            got = by_id[t.source].get_many(partition, pack_names(list(t.keys)), None).result(timeout=timeout)
            if len(got.batch):
                moved += by_id[t.target].move_in(partition, got.batch).result(timeout=timeout)
        return moved

    def _all(self, by_id: dict[str, Actor], call) -> list:
        """``call(unit id, handle)`` on every unit at once; each answer (raises the first error)."""
        futures = [call(uid, h) for uid, h in by_id.items()]
        return [f.result(timeout=self.settings.call_timeout_s) for f in futures]


def next_unit_id(existing: Sequence[str]) -> str:
    """The smallest decimal id not in ``existing`` ("0", "1", ...): stable, readable."""
    taken = set(existing)
    n = 0
    while str(n) in taken:
        n += 1
    return str(n)


def check_worker(store: StagingStore, worker: str) -> None:
    """Refuse a second unit on ``worker`` before starting anything."""
    if worker in store.placement.workers:
        raise InvalidStoreRequest(f"worker {worker!r} already hosts a unit of this store")
