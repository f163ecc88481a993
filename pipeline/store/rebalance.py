"""Changing a running store's units: add one (a storage worker joined), drain one (its
worker is about to be retired), without losing or changing a row.

:class:`Rebalancer` runs in the process that owns the store (the scheduler's store host),
one change at a time (``store.owner.lock``, shared with the repairer): fence every unit
early (tombstones), publish the moving table, **fence** (older calls answer ``moved``),
**copy** in chunks (:func:`~pipeline.store.moves.plan_moves`; lost-key records and claims
ride with the rows, a claim settled or released meanwhile is caught up after the copy;
``move_in`` skips tombstoned keys; names go to their new witness: :mod:`.moved_names`),
**switch** to the final table and fence it, **drop** every copy (and witnessed name) it
does not give, listed after that fence, and release a drained unit.

Refused before anything changes, naming the fix: a second unit on one worker, draining
the last unit or one without which replicas=2 keeps a single failure domain
(:class:`~tasks.errors.InvalidStoreRequest`); a change while a unit has a store checkpoint
open or an earlier move is unfinished (:class:`~tasks.errors.StoreBusy`). A change that
fails after the fence leaves the store moving (still correct: writes reach both tables'
copies, reads fall back); :meth:`Rebalancer.resume` completes it from current holdings,
dropping a unit the move added whose worker died. docs/design.md, "Moves", says why.
"""
from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from tasks.errors import InvalidStoreRequest, StoreBusy, StoreUnavailable

from .. import config
from ..actors import current_workers, start_pinned_actors
from .directory import UnitDirectory
from .fence import Fence
from .moved_names import HandedNames, names_to_drop, names_to_hand
from .moves import Transfer, plan_moves, unheld
from .moving import MovingTable
from .pacing import Pacer, PhaseClock
from .placement import Placement
from .protocol import pack_names
from .unit import StorageUnit
from .unit_claims import keys_by_claim

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, BaseActorFuture, Client

    from .client import StagingStore
    from .owner import UnitArgs

logger = logging.getLogger(__name__)

RETRY_INTERVAL_S = 0.5  # between two tries of a change refused StoreBusy (the store host's back-off), s


@dataclass(frozen=True)
class RebalanceSettings:
    """Knobs read once (``token-capture.store.*``)."""

    chunk_keys: int  # keys per copy call (``rebalance-chunk-rows``)
    call_timeout_s: float  # bound on each unit call, s (``repair-call-timeout-s``)
    retry_s: float = 60.0  # how long the store host retries a change refused StoreBusy, s (``rebalance-retry-s``)
    inflight: int = 2  # copy calls (chunks) in flight at once (``rebalance-inflight``)
    rate_bytes_s: float = 0.0  # average copy rate cap, bytes/s; 0: none (``rebalance-rate-bytes-s``)

    @classmethod
    def from_config(cls) -> RebalanceSettings:
        return cls(int(config.get("store.rebalance-chunk-rows")), float(config.get("store.repair-call-timeout-s")),
                   float(config.get("store.rebalance-retry-s")), max(1, int(config.get("store.rebalance-inflight"))),
                   float(config.get("store.rebalance-rate-bytes-s")))


class Rebalancer:
    """Adds and drains units of ``store`` (its owner's process); one change at a time.

    Handles copied from ``store`` after this is built follow every change (it gives a
    store without one a shared unit directory, so a handle refreshes on ``moved``)."""

    def __init__(self, store: StagingStore, client: Client, unit_args: UnitArgs, settings: RebalanceSettings | None = None):
        self.store, self.client, self.unit_args = store, client, unit_args
        self.settings = settings or RebalanceSettings.from_config()
        self.changes: list[dict] = []  # one record per change: kind, unit, rows moved, seconds
        self.interrupted: dict | None = None  # the unfinished move: kind, unit, version, error
        if store.directory is None and store.owner is not None:
            store.directory = UnitDirectory(f"token-capture-units-{uuid.uuid4().hex[:12]}")
            store.directory.publish(client, store.table())

    # ---- the changes (each under the owner's lock) ---------------------------------

    def add_unit(self, worker: str) -> dict:
        """Start a unit on ``worker`` and move to it the keys the new table gives it."""
        with self.store.owner.lock:  # one change at a time (the repairer takes it too)
            return self._add_unit(worker)

    def drain_unit(self, unit_id: str) -> dict:
        """Move every copy off unit ``unit_id``, then close and release it."""
        with self.store.owner.lock:
            return self._drain_unit(unit_id)

    def resume(self) -> dict | None:
        """Complete an interrupted move (None when the store is not moving): re-fence every
        reachable unit, re-plan from what each holds now, copy, switch, drop. A unit the
        move added whose worker is gone is dropped from the table (nothing was only there:
        every write of the move reached the old holders too)."""
        with self.store.owner.lock:
            return self._resume()

    def _add_unit(self, worker: str) -> dict:
        self._refuse_if_moving()
        old = self.store.placement
        check_worker(self.store, worker)
        unit_id = next_unit_id(old.unit_ids)
        new = old.with_unit(unit_id, worker)  # refuses a worker already hosting a unit
        self._refuse_if_unit_lost(old)
        self._refuse_if_checkpointing(dict(zip(old.unit_ids, self.store.units)))
        args = self.unit_args.for_unit(int(unit_id))  # a unique unit_index (names, spill files)
        handles, futures = start_pinned_actors(self.client, StorageUnit, [worker], args=[args])
        self.store.owner.futures.extend(futures)  # kept in the table's unit order
        try:
            return self._change("add", unit_id, MovingTable(new, old), list(self.store.units) + handles)
        except BaseException:
            if self.store.moving is None:  # nothing was published: the new unit goes
                self._release_futures(handles)
            raise

    def _drain_unit(self, unit_id: str) -> dict:
        self._refuse_if_moving()
        old = self.store.placement
        new = drained(old, unit_id)
        self._refuse_if_unit_lost(old)
        self._refuse_if_checkpointing(dict(zip(old.unit_ids, self.store.units)))
        u = old.index_of(unit_id)
        units = [h for i, h in enumerate(self.store.units) if i != u] + [self.store.units[u]]
        return self._change("drain", unit_id, MovingTable(new, old), units)

    def _resume(self) -> dict | None:
        moving = self.store.moving
        if moving is None:
            return None
        # The current table, not the move's: a repair may have replaced a unit meanwhile.
        current, previous = self.store.placement, moving.previous
        handles = dict(zip(MovingTable(current, previous).unit_ids, self.store.units))
        dead = self._unreachable(current, previous)
        target = without_units(current, dead, moving.version)
        table = MovingTable(target, previous)
        live = {uid: h for uid, h in handles.items() if uid not in dead}
        self._refuse_if_checkpointing(live)
        abandoned = [uid for uid in handles if uid not in table.unit_ids]
        why = self.interrupted or {"kind": "resume", "unit": ",".join(abandoned) or "?"}
        record = self._change(str(why["kind"]), str(why["unit"]), table, [handles[u] for u in table.unit_ids], dead,
                              extra={"resumed": True, "abandoned": abandoned})
        self._release_futures([handles[u] for u in abandoned])
        return record

    # ---- one move: publish, fence, copy, switch, fence final, drop -----------------

    def _change(self, kind: str, unit_id: str, moving: MovingTable, units: Sequence[Actor], dead: set[str] = frozenset(),
                extra: dict | None = None) -> dict:
        """Fence every reachable unit early, publish ``moving`` (``units``: one handle per
        ``moving.unit_ids``) and run it to the end; a failure leaves the store moving (even
        in the early fence: a unit may hold it) and is remembered for :meth:`resume`.
        ``extra``: more keys for the change's record."""
        by_id = dict(zip(moving.unit_ids, units))
        live = {uid: h for uid, h in by_id.items() if uid not in dead}
        new, old = moving.placement, moving.previous
        started_at = time.time()
        try:
            try:  # 0. tombstones on every unit before any writer has the new table
                self._all(live, lambda uid, h: h.set_fence(Fence.message(new, uid, True, old, early=True)))
            finally:
                self.store.install_moving(moving, list(units))  # writers reach both tables' copies
            record = self._run(kind, unit_id, moving, by_id, dead, started_at, extra or {})
        except BaseException as e:
            self.interrupted = {"kind": kind, "unit": unit_id, "version": moving.version, "error": f"{type(e).__name__}: {e}"}
            logger.warning("store %s of unit %s interrupted at placement version %d (%s); the store keeps moving "
                           "until Rebalancer.resume() completes it", kind, unit_id, moving.version, self.interrupted["error"])
            raise
        self.interrupted = None
        return record

    def _run(self, kind: str, unit_id: str, moving: MovingTable, units: dict[str, Actor], dead: set[str],
             started_at: float, extra: dict) -> dict:
        """Steps 1-4 of the module docstring over the reachable ``units``; the record
        (with each phase's seconds: fence, list + plan, copy, switch, drop; ``started_at``
        and ``ended_at``: the move's own interval, wall clock s; plus ``extra``)."""
        clock = PhaseClock()
        new, old = moving.placement, moving.previous
        live = {uid: h for uid, h in units.items() if uid not in dead}
        self._all(live, lambda uid, h: h.set_fence(Fence.message(new, uid, True, old)))  # 1. fence: older calls refused
        clock.lap("fence")
        moved = moved_bytes = caught_up = 0
        handed: dict[str, HandedNames] = {}
        for partition in self.store.partitions or []:  # 2. copy
            held = dict(zip(live, self._all(live, lambda uid, h, p=partition: h.keys(p))))
            clock.lap("list")
            plan = plan_moves(old, new, held, self.settings.chunk_keys, unreachable=sorted(dead))
            clock.lap("plan")
            rows, nbytes, claimed = self._copy(live, partition, plan.transfers)
            caught_up += self._catch_up_claims(live, partition, claimed)
            handed[partition] = self._hand_names(live, partition, new, held)
            moved, moved_bytes = moved + rows, moved_bytes + nbytes
            clock.lap("copy")
        final = Placement(new.version + 1, new.workers, new.unit_ids, new.replicas, new.homes)
        self.store.install_placement(final, [units[u] for u in new.unit_ids])  # 3. switch
        self._all(live, lambda uid, h: h.set_fence(Fence.message(final, uid, False)))
        clock.lap("switch")
        leaving = [uid for uid in moving.unit_ids if uid not in new.unit_ids]
        dropped = self._drop_unheld({u: h for u, h in live.items() if u not in leaving}, final, handed)  # 4. drop
        self._all({u: live[u] for u in leaving if u in live}, lambda uid, h: h.close())  # they hold nothing of their own now
        self._release_futures([units[u] for u in leaving])
        clock.lap("drop")
        record = {"kind": kind, "unit": unit_id, "rows_moved": moved, "bytes_moved": moved_bytes,
                  "copies_dropped": dropped, "claims_caught_up": caught_up, "version": final.version, "seconds": clock.total(), "phases_s": clock.laps,
                  "started_at": started_at, "ended_at": time.time(), **extra}
        self.changes.append(record)
        logger.info("store %s of unit %s: %d rows moved, %d copies dropped in %.2fs", kind, unit_id, moved, dropped, record["seconds"])
        return record

    def _drop_unheld(self, units: dict[str, Actor], final: Placement, handed: dict[str, HandedNames]) -> int:
        """Each unit's copies (rows, lost-key records) ``final`` does not give it, listed
        after its fence (no write adds one since): the move's sources' and those a writer
        on the moving table put on an old holder during the copy (left, a later move would
        bring them back after a delete); then the names it must no longer witness
        (:func:`names_to_drop`). Rows removed."""
        dropped = 0
        for partition in self.store.partitions or []:
            held = dict(zip(units, self._all(units, lambda uid, h, p=partition: h.keys(p))))
            extra = unheld(final, held)
            drops = {uid: units[uid] for uid in extra}
            dropped += sum(self._all(drops, lambda uid, h, p=partition: h.drop(p, pack_names(list(extra[uid])))))
            if final.replicas == 2:
                self._drop_names(units, partition, final, held, handed.get(partition))
        return dropped

    def _drop_names(self, units: dict[str, Actor], partition: str, final: Placement, held: dict[str, list[str]],
                    handed: HandedNames | None) -> None:
        """Unwitness on each unit the names :func:`names_to_drop` lists (``held``: unit id
        -> keys listed after the final fence; ``handed``: what the copy handed)."""
        witnessed = dict(zip(units, self._all(units, lambda uid, h: h.witnessed_keys(partition))))
        stale = names_to_drop(final, witnessed, handed, held)
        self._all({u: units[u] for u in stale}, lambda uid, h: h.witness(partition, None, pack_names(stale[uid])))

    def _hand_names(self, units: dict[str, Actor], partition: str, new: Placement,
                    held: dict[str, list[str]]) -> HandedNames:
        """Hand each unit the names ``new`` makes it witness and it lacks, of the keys
        ``held`` (unit id -> keys listed after the fence) and the names the units witness
        (listed now), in chunks of ``settings.chunk_keys`` names; what was handed."""
        if new.replicas != 2:
            return HandedNames({}, frozenset())
        witnessed = dict(zip(units, self._all(units, lambda uid, h: h.witnessed_keys(partition))))
        hand = names_to_hand(new, held, witnessed)
        step = self.settings.chunk_keys
        futures = [units[u].witness(partition, pack_names(names[i : i + step]))
                   for u, names in hand.items() for i in range(0, len(names), step)]
        for f in futures:
            f.result(timeout=self.settings.call_timeout_s)
        return HandedNames(hand, frozenset(k for keys in held.values() for k in keys))

    def _copy(self, by_id: dict[str, Actor], partition: str,
              transfers: Sequence[Transfer]) -> tuple[int, int, dict[tuple[str, str], dict[str, str]]]:
        """Each transfer as one ``send`` from its source unit straight to its target
        (worker to worker: rows never pass through this process), at most
        ``settings.inflight`` at once, paced to ``settings.rate_bytes_s``; (rows, bytes)
        written and, per (source, target), the rows sent provisional (key -> claim)."""
        s = self.settings
        pacer, moved = Pacer(s.rate_bytes_s), 0
        claimed: dict[tuple[str, str], dict[str, str]] = {}
        pending: deque[tuple[Transfer, BaseActorFuture]] = deque()
        for t in transfers:
            if len(pending) >= s.inflight:
                moved += self._sent(*pending.popleft(), pacer, claimed)
            pending.append((t, by_id[t.source].send(partition, pack_names(list(t.keys)), by_id[t.target])))
        while pending:
            moved += self._sent(*pending.popleft(), pacer, claimed)
        return moved, pacer.sent_bytes, claimed

    def _sent(self, t: Transfer, future: BaseActorFuture, pacer: Pacer, claimed: dict) -> int:
        """Rows one ``send`` wrote (its provisional ones noted in ``claimed``), after
        waiting out the pace its bytes call for."""
        out = future.result(timeout=self.settings.call_timeout_s)
        if out.get("claimed"):
            claimed.setdefault((t.source, t.target), {}).update(out["claimed"])
        wait = pacer.sent(out["bytes"])
        if wait:
            time.sleep(wait)
        return int(out["rows"])

    def _catch_up_claims(self, by_id: dict[str, Actor], partition: str,
                         claimed: dict[tuple[str, str], dict[str, str]]) -> int:
        """After the copy: each row sent provisional that its source no longer holds
        provisional under the same claim (settled, acknowledged to another writer, or
        released, between the source's read and the target's write: the call may have
        reached the target before the row did) is sent again, which makes a row the source
        still holds ordinary on the target, then released there under its claim (what the
        source no longer holds). Claim calls from here on find the row on the target
        (settles reach every unit, releases both tables' copies). Rows caught up."""
        timeout, caught_up = self.settings.call_timeout_s, 0
        for (source, target), claims in claimed.items():
            src, dst = by_id[source], by_id[target]
            still = src.claimed_keys(partition).result(timeout=timeout)
            changed = {k: c for k, c in claims.items() if still.get(k) != c}
            if not changed:
                continue
            src.send(partition, pack_names(list(changed)), dst, False).result(timeout=timeout)  # counted once, by the copy
            for c, keys in keys_by_claim(changed).items():  # rows the re-send made ordinary are kept
                dst.release_claim(partition, pack_names(keys), c).result(timeout=timeout)
            caught_up += len(changed)
        return caught_up

    def _all(self, by_id: dict[str, Actor], call: Callable) -> list:
        """``call(unit id, handle)`` on every unit at once; each answer (raises the first error)."""
        futures = [call(uid, h) for uid, h in by_id.items()]
        return [f.result(timeout=self.settings.call_timeout_s) for f in futures]

    # ---- refusals and bookkeeping -------------------------------------------------

    def _refuse_if_moving(self) -> None:
        """A change while an earlier move is unfinished is refused, naming that move."""
        moving = self.store.moving
        if moving is None:
            return
        why = self.interrupted or {}
        raise StoreBusy(
            f"the store is still moving keys to placement version {moving.version} ({why.get('kind', 'a change')} of "
            f"unit {why.get('unit', '?')!r} interrupted: {why.get('error', 'in progress')}); Rebalancer.resume() completes "
            "it first (the store host resumes it by itself)"
        )

    def _refuse_if_unit_lost(self, table: Placement) -> None:
        """StoreBusy, before anything changes, while a unit of ``table`` sits on a worker
        the cluster no longer has: its keys have one copy until the repairer replaces it,
        and a move planned now would count on the lost unit (the store host retries the
        change, so it lands once the repair does)."""
        gone = self._unreachable(table, table)
        lost = [f"{uid} on {w}" for uid, w in zip(table.unit_ids, table.workers) if uid in gone]
        if lost:
            raise StoreBusy(
                f"storage unit(s) {lost} lost with their worker and not re-replicated yet; a change of the units waits "
                f"for the repair (the store host retries every {RETRY_INTERVAL_S} s for up to store.rebalance-retry-s)"
            )

    def _refuse_if_checkpointing(self, units: dict[str, Actor]) -> None:
        """StoreBusy, before anything changes, when a unit has a store checkpoint open (a
        move must not overlap one: it would write some keys twice or not at all) or does
        not answer (its worker just lost, or cut off: the change waits for it)."""
        try:
            stats = self._all(units, lambda uid, h: h.stats())
        except (OSError, StoreUnavailable) as e:  # includes a timeout; a bug still raises
            raise StoreBusy(f"a storage unit did not answer before a change of the units ({type(e).__name__}: {e}); "
                            f"the change waits until every unit answers (the store host retries every "
                            f"{RETRY_INTERVAL_S} s for up to store.rebalance-retry-s)") from e
        busy = [uid for uid, s in zip(units, stats) if s["open_checkpoints"]]
        if busy:
            raise StoreBusy(
                f"storage unit(s) {busy} have a store checkpoint open; a change of the units waits until it ends "
                f"(the store host retries every {RETRY_INTERVAL_S} s for up to store.rebalance-retry-s)"
            )

    def _unreachable(self, current: Placement, previous: Placement) -> set[str]:
        """Units of either table whose worker is not connected now."""
        live = set(current_workers(self.client))
        where = {**dict(zip(previous.unit_ids, previous.workers)), **dict(zip(current.unit_ids, current.workers))}
        return {uid for uid, w in where.items() if w not in live}

    def _release_futures(self, handles: Sequence[Actor]) -> None:
        """Cancel the actor tasks of ``handles`` (units that left the table)."""
        keys = {h.key for h in handles}
        owner = self.store.owner
        gone = [f for f in owner.futures if f.key in keys]
        owner.futures[:] = [f for f in owner.futures if f.key not in keys]
        if gone:
            self.client.cancel(gone, force=True)


def drained(old: Placement, unit_id: str) -> Placement:
    """``old`` without unit ``unit_id``; refused, naming the fix, for the last unit and
    for the unit without which replicas=2 would keep every copy in one failure domain."""
    old.index_of(unit_id)  # an unknown id: InvalidStoreRequest naming the units
    if old.n_units == 1:
        raise InvalidStoreRequest(
            f"cannot drain storage unit {unit_id!r}: it is the store's last unit; add a unit on another worker first, "
            "or close the store")
    try:
        return old.without_unit(unit_id)
    except InvalidStoreRequest:
        left = sorted({w for u, w in zip(old.unit_ids, old.homes) if u != unit_id})
        raise InvalidStoreRequest(
            f"cannot drain storage unit {unit_id!r}: store.replicas=2 needs units in two failure domains and the "
            f"units left would all be on {left}; start another storage worker first, then drain") from None


def without_units(current: Placement, dead: set[str], above: int) -> Placement:
    """``current`` without the units ``dead``, numbered above both ``current`` and ``above``;
    StoreUnavailable, naming the fix, when no valid table is left without them."""
    keep = [i for i, u in enumerate(current.unit_ids) if u not in dead]
    pick = lambda t: tuple(t[i] for i in keep)  # noqa: E731
    try:
        return Placement(max(current.version, above) + 1, pick(current.workers), pick(current.unit_ids),
                         current.replicas, pick(current.homes))
    except InvalidStoreRequest as e:
        raise StoreUnavailable(
            f"the interrupted move cannot complete without the unreachable unit(s) {sorted(dead)}: {e}; start a "
            "storage worker (the store host resumes the move by itself)") from None


def next_unit_id(existing: Sequence[str]) -> str:
    """The smallest decimal id not in ``existing`` ("0", "1", ...): stable, readable."""
    taken = set(existing)
    n = 0
    while str(n) in taken:
        n += 1
    return str(n)


def check_worker(store: StagingStore, worker: str) -> None:
    """Refuse a second unit on ``worker`` before starting anything."""
    p = store.placement
    if worker in p.workers or worker in p.homes:
        held = [u for u, w, h in zip(p.unit_ids, p.workers, p.homes) if worker in (w, h)]
        raise InvalidStoreRequest(
            f"worker {worker!r} already hosts storage unit {held[0]!r} of this store; a store keeps one unit per "
            "worker: add the unit on another worker")
