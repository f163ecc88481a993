"""Re-replication: a lost storage unit's keys copied from the survivors onto a new unit.

Runs in the process that started a replicas=2 :class:`~pipeline.store.client.StagingStore`
(it holds the client and the actor futures), in one daemon thread. Every
``store.repair-interval-s`` it compares the units' workers with the scheduler's; for a
unit whose worker is gone it starts a replacement actor on another worker (not one
hosting a unit that shares keys with it), lists the keys each surviving partner holds a
copy of, copies them in chunks (one get per survivor per chunk, one put per chunk) and
then installs the new unit in the shared directory. Puts and gets go on meanwhile; reads
of the lost unit's keys are served by the survivors until the new unit is installed.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from tasks.keys import unit_for_key

from .. import config
from ..actors import current_workers, start_pinned_actors
from .protocol import pack_names
from .replication import partners
from .unit import StorageUnit

logger = logging.getLogger(__name__)


class Repairer:
    """The background re-replication thread of one store (see the module docstring)."""

    def __init__(self, store: Any, client: Any, unit_args: tuple):
        self.store = store
        self.client = client
        self.unit_args = unit_args  # (memory_limit, capacity, spill directory, partitions, adopt_received)
        self.repaired: list[dict] = []  # one record per replaced unit: unit, worker, rows copied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="token-capture-store-repair", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(float(config.get("store.repair-interval-s"))):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - try again next round; never kill the thread
                logger.exception("storage-unit re-replication failed; retrying")

    def check(self) -> list[int]:
        """Replace every unit whose worker has left; returns the units replaced."""
        live = set(current_workers(self.client))
        done = []
        for u, w in enumerate(list(self.store.unit_workers)):
            if self._stop.is_set():
                break
            if w not in live and self.repair(u, live):
                done.append(u)
        return done

    def repair(self, u: int, live: set[str]) -> bool:
        store = self.store
        replica = store.replica
        mates = [p for p in partners(u, replica) if store.unit_workers[p] in live]
        avoid = {store.unit_workers[p] for p in partners(u, replica)}
        candidates = sorted(w for w in live if w not in avoid)
        if not candidates:
            logger.warning("unit %d lost: no live worker apart from its partners' %s; waiting", u, sorted(avoid))
            return False
        worker = min(candidates, key=lambda w: (store.unit_workers.count(w), w))
        units, futures = start_pinned_actors(self.client, StorageUnit, [worker], args=[(u, *self.unit_args)])
        new = units[0]
        timeout = float(config.get("store.repair-call-timeout-s"))
        chunk_rows = int(config.get("store.repair-chunk-rows"))
        n = len(store.units)
        copied = 0
        try:
            for partition in store.partitions or []:
                for s in mates:
                    held = store.units[s].keys(partition).result(timeout=timeout)
                    # Keys with a copy on s whose other copy was on u.
                    mine = [
                        k for k in held
                        if ((p := unit_for_key(k, n)) == u and replica[u] == s) or (p == s and replica[s] == u)
                    ]
                    for i in range(0, len(mine), chunk_rows):
                        chunk = mine[i : i + chunk_rows]
                        got = store.units[s].get_many(partition, pack_names(chunk), None).result(timeout=timeout)
                        if len(got.batch):
                            res = new.put_many(partition, got.batch, True).result(timeout=timeout)
                            copied += len(res.ok)
                            if res.failed:
                                logger.warning("re-replicating unit %d: %d rows refused, e.g. %s", u, len(res.failed), next(iter(res.failed.items())))
        except BaseException:
            self.client.cancel(futures, force=True)
            raise
        store._replace_unit(u, new, worker, futures[0])
        self.repaired.append({"unit": u, "worker": worker, "rows": copied, "version": store.version})
        logger.info("storage unit %d re-replicated onto %s (%d rows)", u, worker, copied)
        return True
