"""Re-replication: a lost storage unit's keys copied from the survivors onto a new unit.

Runs in the process that started a replicas=2 :class:`~pipeline.store.client.StagingStore`
(it holds the client and the actor futures), in one daemon thread. Every
``store.repair-interval-s`` it compares the units' workers with the scheduler's; for a
unit whose worker is gone it starts a replacement actor on another worker (one hosting
no unit of another failure domain: :meth:`~pipeline.store.placement.Placement.may_host`),
and each surviving unit sends, in chunks (one get per chunk, one put per chunk), the
keys the lost unit holds a copy of (it holds their other copy) and the names of the keys
it witnesses (the survivor being their primary, or their replica when the primary is
lost too). Then the new unit is installed in the shared directory. The replacement
keeps its unit's id and home, so no key changes units (:meth:`Placement.replaced`).

Keys whose two copies were BOTH lost (the unit and the unit holding the other copy
died together) cannot be copied; their names survive on their witness unit, and the
new unit records them as lost: they read ``lost_key`` and refuse new content, never pass
for keys never staged. A survivor's lost keys are copied like its rows (provisional rows
stay provisional under their claim), a replaced witness gets its names back from the
units holding the keys it witnessed. Puts and gets go on meanwhile; the survivors serve
the lost unit's keys until the new unit is installed, which then drops keys deleted meanwhile.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import config
from ..actors import current_workers, start_pinned_actors
from .placement import Placement
from .protocol import pack_names
from .unit import StorageUnit
from .unit_claims import keys_by_claim

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Client

logger = logging.getLogger(__name__)


class UnitArgsLike(Protocol):
    """What a replacement unit is built with (``owner.UnitArgs``)."""

    def for_unit(self, u: int) -> tuple: ...


@dataclass(frozen=True)
class Handed:
    """What one survivor handed a new unit for one partition: rows ``copied``, the keys
    asked (``keys``), the names it witnesses for the survivor (``names``) and the keys
    among them copied provisional, each with its claim (``provisional``)."""

    partition: str
    survivor: int
    copied: int
    keys: list[str]
    names: list[str]
    provisional: dict[str, str] = field(default_factory=dict)  # copied provisional key -> its claim


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
                with self.client.as_current():  # unit handles bind to it (in a scheduler process: the only client)
                    self.check()
            except Exception:  # noqa: BLE001 - try again next round; never kill the thread
                logger.exception("storage-unit re-replication failed; retrying")

    def check(self) -> list[int]:
        """Replace every unit whose worker has left; returns the units replaced."""
        live = set(current_workers(self.client))
        done = []
        with self.store.owner.lock:  # never while a rebalancer adds or drains a unit
            for u, w in enumerate(list(self.store.unit_workers)):
                if self._stop.is_set():
                    break
                if w not in live and self.repair(u, live):
                    done.append(u)
        return done

    def repair(self, u: int, live: set[str]) -> bool:
        store = self.store
        placement: Placement = store.placement
        worker = self._replacement_worker(placement, u, live)
        if worker is None:
            return False
        units, futures = start_pinned_actors(self.client, StorageUnit, [worker], args=[self.unit_args.for_unit(u)])
        new = units[0]
        survivors = [s for s in range(placement.n_units) if s != u and placement.workers[s] in live]
        dead = [d for d in range(placement.n_units) if d != u and placement.workers[d] not in live]
        copied = lost = 0
        handed: list[Handed] = []
        try:
            for partition in store.partitions or []:
                for s in survivors:
                    handed.append(self._copy_from(new, partition, placement, u, s, dead))
                    copied += handed[-1].copied
                if dead:
                    lost += self._mark_lost_together(new, partition, placement, u, dead, survivors)
        except BaseException:
            self.client.cancel(futures, force=True)
            raise
        store.owner.replace_unit(store, u, new, worker, futures[0])
        dropped = self._drop_deleted_meanwhile(new, handed)
        settled = self._settle_meanwhile(new, u, handed)
        self.repaired.append({
            "unit": u, "worker": worker, "rows": copied, "lost": lost, "dropped": dropped, "settled": settled,
            "version": store.version,
        })
        logger.info("storage unit %d re-replicated onto %s (%d rows)", u, worker, copied)
        return True

    @staticmethod
    def _replacement_worker(placement: Placement, u: int, live: set[str]) -> str | None:
        """A live worker for unit ``u``'s replacement sharing no failure domain with units
        that may hold its keys' other copies (fewest units first), or None (wait)."""
        ok = sorted(w for w in live if placement.may_host(u, w))
        if not ok and placement.by_host:
            ok = sorted(w for w in live if placement.may_host(u, w, by_host=False))
            if ok:
                logger.warning("unit %d lost: no live host free of its partners; its replacement shares a host with some", u)
        if not ok:
            logger.warning("unit %d lost: every live worker hosts a unit that may hold its keys' other copies; waiting", u)
            return None
        return min(ok, key=lambda w: (placement.workers.count(w), w))

    def _copy_from(self, new: "Actor", partition: str, placement: Placement, u: int, s: int, dead: list[int]) -> "Handed":
        """Survivor ``s``'s share of unit ``u``'s contents: the rows (and lost-key records)
        of the keys whose two copies are on ``u`` and ``s``, and the names ``u`` witnesses
        of keys ``s`` holds (``s`` their primary, or their replica with the primary in
        ``dead`` too). Lost keys are copied as records only: they have no row to read.
        Returns what was handed to ``new``. Keys deleted while a checkpoint is open on ``s``
        are not listed (their rows stay until it ends), so not copied: a copy would outlive
        the delete. Rows provisional on ``s`` under a restore's claim are put provisional
        under the same claim (:mod:`.unit_claims`)."""
        timeout, mate = self.call_timeout_s, self.store.units[s]
        listed = mate.keys(partition).result(timeout=timeout)
        if not listed:
            return Handed(partition, s, 0, [], [])
        lost = mate.lost_keys(partition).result(timeout=timeout)
        loc = placement.locate(listed)
        p, r, w = loc.primary, loc.replica, loc.witness
        assert r is not None and w is not None  # replicas=2
        pair = ((p == u) & (r == s)) | ((p == s) & (r == u))
        shared = [listed[i] for i in np.flatnonzero(pair)]
        held = [k for k in shared if k not in lost]
        claimed = mate.claimed_keys(partition).result(timeout=timeout)
        provisional = {k: claimed[k] for k in held if k in claimed}
        copied = self._copy_rows(new, partition, u, mate, [k for k in held if k not in provisional])
        for claim, ks in keys_by_claim(provisional).items():  # provisional there, provisional here: a release takes both
            copied += self._copy_rows(new, partition, u, mate, ks, claim)
        by_how: dict[str, list[str]] = {}
        for k in shared:
            if k in lost:
                by_how.setdefault(lost[k], []).append(k)
        for how, names in by_how.items():
            new.mark_lost(partition, pack_names(names), how).result(timeout=timeout)
        witnessed = (w == u) & ((p == s) | ((r == s) & np.isin(p, dead)))
        names = [listed[i] for i in np.flatnonzero(witnessed)]
        if names:
            new.witness(partition, pack_names(names)).result(timeout=timeout)
        return Handed(partition, s, copied, held, names, provisional)

    def _drop_deleted_meanwhile(self, new: "Actor", handed: list["Handed"]) -> int:
        """After the install: remove from ``new`` each copied key and witnessed name its
        survivor no longer lists (deleted, deferred or not). A delete between the copy and
        the install reaches the survivor only (the lost unit is unreachable and the deleter
        still plans on the old table), so without this the copy would stay with nobody to
        clear it. Returns the rows removed; a survivor that cannot be listed is logged and
        skipped."""
        timeout, dropped = self.call_timeout_s, 0
        for h in handed:
            if not h.keys and not h.names:
                continue
            try:
                still = set(self.store.units[h.survivor].keys(h.partition).result(timeout=timeout))
            except Exception as e:  # noqa: BLE001 - the survivor died too: its own repair follows
                logger.warning("re-replication: survivor %d not listed after the install (%s); deletes made "
                               "during the copy may leave rows on the new unit", h.survivor, e)
                continue
            gone = [k for k in h.keys if k not in still]
            unwitness = [k for k in h.names if k not in still]
            if gone or unwitness:
                res = new.delete(h.partition, pack_names(gone), pack_names(unwitness) if unwitness else None).result(timeout=timeout)
                dropped += len(res.ok)
        if dropped:
            logger.info("re-replication: %d row(s) deleted during the copy removed from the new unit", dropped)
        return dropped

    def _settle_meanwhile(self, new: "Actor", u: int, handed: list["Handed"]) -> int:
        """After the install: each row copied provisional that its survivor no longer holds
        provisional under the same claim (its restore settled, or another writer's
        identical put acknowledged it, during the copy: both reached the survivor only) is
        put again on ``new`` without a claim, which makes it an ordinary row there too.
        Rows the survivor no longer lists were removed by :meth:`_drop_deleted_meanwhile`.
        Returns the rows made ordinary; a survivor that cannot be asked is logged and skipped."""
        timeout, settled = self.call_timeout_s, 0
        for h in handed:
            if not h.provisional:
                continue
            mate = self.store.units[h.survivor]
            try:
                still = mate.claimed_keys(h.partition).result(timeout=timeout)
                done = [k for k, claim in h.provisional.items() if still.get(k) != claim]
                settled += self._copy_rows(new, h.partition, u, mate, done) if done else 0
            except Exception as e:  # noqa: BLE001 - the survivor died too: its own repair follows
                logger.warning("re-replication: survivor %d's claims not listed after the install (%s); rows of a "
                               "restore settled during the copy may stay provisional on the new unit", h.survivor, e)
        return settled

    def _copy_rows(self, new: "Actor", partition: str, u: int, mate: "Actor", held: list[str], claim: str | None = None) -> int:
        """Copy rows ``held`` from ``mate`` to ``new`` in chunks (provisional under
        ``claim`` when given: they were on ``mate``); rows copied."""
        timeout, copied = self.call_timeout_s, 0
        for i in range(0, len(held), self.chunk_rows):
            chunk = held[i : i + self.chunk_rows]
            got = mate.get_many(partition, pack_names(chunk), None).result(timeout=timeout)
            if len(got.batch):
                res = new.put_many(partition, got.batch, True, claim).result(timeout=timeout)
                copied += len(res.ok)
                if res.failed:
                    logger.warning("re-replicating unit %d: %d rows refused, e.g. %s", u, len(res.failed), next(iter(res.failed.items())))
        return copied

    def _mark_lost_together(
        self, new: "Actor", partition: str, placement: Placement, u: int, dead: list[int], survivors: list[int]
    ) -> int:
        """Keys whose two copies were on ``u`` and a unit of ``dead`` (lost together: the
        lost units not yet replaced): their names, from the surviving witnesses, recorded
        lost on ``new``. Returns how many."""
        timeout, ids = self.call_timeout_s, placement.unit_ids
        noticed = time.strftime("%Y-%m-%dT%H:%M:%S")
        marked = 0
        for v in survivors:
            names = self.store.units[v].witnessed_keys(partition).result(timeout=timeout)
            if not names:
                continue
            loc = placement.locate(names)
            p, r, w = loc.primary, loc.replica, loc.witness
            assert r is not None and w is not None  # replicas=2
            for d in dead:
                both = (w == v) & (((p == u) & (r == d)) | ((p == d) & (r == u)))
                gone = [names[i] for i in np.flatnonzero(both)]
                if gone:
                    how = f"units {ids[min(u, d)]} and {ids[max(u, d)]} lost together, noticed {noticed}"
                    marked += new.mark_lost(partition, pack_names(gone), how).result(timeout=timeout)
        if marked:
            logger.error("storage unit %d lost with unit(s) %s: %d key(s) of partition %r lost (both copies)", u, dead, marked, partition)
        homes = placement.homes
        for d in dead:
            could_witness = [v for v, h in enumerate(homes) if h not in (homes[u], homes[d])]
            if d in placement.partners(u) and (not could_witness or not set(could_witness) <= set(survivors)):
                logger.error(
                    "storage units %d and %d lost together and some of their keys' witness is %s: those keys read "
                    "as missing, not lost", u, d, "lost too" if could_witness else "none (units on two workers)",
                )
        return marked
