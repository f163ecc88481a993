"""Re-replication: a lost storage unit's keys copied from the survivors onto a new unit.

Runs in the process that started a replicas=2 :class:`~pipeline.store.client.StagingStore`
(it holds the client and the actor futures), in one daemon thread. Every
``store.repair-interval-s`` it compares the units' workers with the scheduler's; for a
unit whose worker is gone it starts a replacement actor on another worker (not one
hosting a unit that shares keys with it), lists the keys each surviving partner holds a
copy of, copies them in chunks (one get per survivor per chunk, one put per chunk) and
then installs the new unit in the shared directory.

Keys whose two copies were BOTH lost (the unit and the partner holding the other copy
died together) cannot be copied; their names survive on their witness unit
(:func:`~pipeline.store.replication.witness_map`), and the new unit records them as lost:
they read ``lost_key`` and refuse new content, never pass for keys never staged. A
survivor's lost keys are copied like its rows, and a replaced witness gets its names
back from the units holding the keys it witnessed. Puts and gets go on meanwhile; reads
of the lost unit's keys are served by the survivors until the new unit is installed.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from tasks.keys import unit_for_key

from .. import config
from ..actors import current_workers, start_pinned_actors
from .protocol import pack_names
from .replication import partners, witnessed_by
from .unit import StorageUnit

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Client

logger = logging.getLogger(__name__)


class UnitArgsLike(Protocol):
    """What a replacement unit is built with (``owner.UnitArgs``)."""

    def for_unit(self, u: int) -> tuple: ...


class Repairer:
    """The background re-replication thread of one store (see the module docstring)."""

    def __init__(self, store: Any, client: "Client", unit_args: "UnitArgsLike"):
        self.store = store
        self.client = client
        self.unit_args = unit_args  # owner.UnitArgs: what every unit of the store is built with
        # Knobs read once: seconds between checks, seconds per unit call, keys per copy chunk.
        self.interval_s = float(config.get("store.repair-interval-s"))
        self.call_timeout_s = float(config.get("store.repair-call-timeout-s"))
        self.chunk_rows = int(config.get("store.repair-chunk-rows"))
        self.repaired: list[dict] = []  # one record per replaced unit: unit, worker, rows copied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="token-capture-store-repair", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=60)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
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
        units, futures = start_pinned_actors(self.client, StorageUnit, [worker], args=[self.unit_args.for_unit(u)])
        new = units[0]
        timeout, chunk_rows = self.call_timeout_s, self.chunk_rows
        dead = [p for p in partners(u, replica) if p not in mates]
        copied = lost = 0
        try:
            for partition in store.partitions or []:
                for s in mates:
                    copied += self._copy_pair(new, partition, u, s, timeout, chunk_rows)
                for d in dead:
                    lost += self._mark_pair_lost(new, partition, u, d, live, timeout)
                self._rebuild_witness(new, partition, u, live, timeout)
        except BaseException:
            self.client.cancel(futures, force=True)
            raise
        store.owner.replace_unit(store, u, new, worker, futures[0])
        self.repaired.append({"unit": u, "worker": worker, "rows": copied, "lost": lost, "version": store.version})
        logger.info("storage unit %d re-replicated onto %s (%d rows)", u, worker, copied)
        return True

    def _pair_keys(self, keys: list[str], u: int, s: int) -> list[str]:
        """Those of ``keys`` whose two copies are on units ``u`` and ``s``."""
        n, replica = len(self.store.units), self.store.replica
        return [k for k in keys if ((p := unit_for_key(k, n)) == u and replica[u] == s) or (p == s and replica[s] == u)]

    def _copy_pair(self, new: "Actor", partition: str, u: int, s: int, timeout: float, chunk_rows: int) -> int:
        """Copy the rows (and lost-key records) of pair (u, s) from survivor ``s``; rows copied.
        Lost keys are copied as records only: they have no row to read."""
        mate = self.store.units[s]
        lost = mate.lost_keys(partition).result(timeout=timeout)
        held = [k for k in self._pair_keys(mate.keys(partition).result(timeout=timeout), u, s) if k not in lost]
        copied = 0
        for i in range(0, len(held), chunk_rows):
            chunk = held[i : i + chunk_rows]
            got = mate.get_many(partition, pack_names(chunk), None).result(timeout=timeout)
            if len(got.batch):
                res = new.put_many(partition, got.batch, True).result(timeout=timeout)
                copied += len(res.ok)
                if res.failed:
                    logger.warning("re-replicating unit %d: %d rows refused, e.g. %s", u, len(res.failed), next(iter(res.failed.items())))
        by_how: dict[str, list[str]] = {}
        for k in self._pair_keys(list(lost), u, s):
            by_how.setdefault(lost[k], []).append(k)
        for how, names in by_how.items():
            new.mark_lost(partition, pack_names(names), how).result(timeout=timeout)
        return copied

    def _mark_pair_lost(self, new: "Actor", partition: str, u: int, d: int, live: set[str], timeout: float) -> int:
        """Pair (u, d) died together: record its keys' names (from their witness) as lost."""
        store, n = self.store, len(self.store.units)
        how = f"units {min(u, d)} and {max(u, d)} lost together, noticed {time.strftime('%Y-%m-%dT%H:%M:%S')}"
        marked = 0
        for primary in (p for p in (u, d) if store.replica[p] in (u, d)):
            w = store.witness[primary] if store.witness else None
            if w is None or store.unit_workers[w] not in live:
                logger.error(
                    "storage units %d and %d lost together and the witness of unit %d's keys is %s: "
                    "those keys read as missing, not lost", u, d, primary, "none" if w is None else "lost too",
                )
                continue
            names = store.units[w].witnessed_keys(partition, primary, n).result(timeout=timeout)
            if names:
                marked += new.mark_lost(partition, pack_names(names), how).result(timeout=timeout)
        if marked:
            logger.error("storage units %d and %d lost together: %d key(s) of partition %r lost (both copies)", u, d, marked, partition)
        return marked

    def _rebuild_witness(self, new: "Actor", partition: str, u: int, live: set[str], timeout: float) -> None:
        """``u`` witnessed other units' keys: give the new unit their names back."""
        store, n = self.store, len(self.store.units)
        for p in witnessed_by(u, store.witness or []):
            source = next((c for c in (p, store.replica[p]) if store.unit_workers[c] in live), None)
            if source is None:
                continue
            names = [k for k in store.units[source].keys(partition).result(timeout=timeout) if unit_for_key(k, n) == p]
            if names:
                new.witness(partition, pack_names(names)).result(timeout=timeout)
