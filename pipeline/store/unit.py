"""The storage unit: a Dask actor holding staged rows ``(partition, key) -> {field: array}``
(:mod:`.held_rows`: memory up to ``memory_limit`` bytes, then disk; write-once keys, a put
past ``capacity`` bytes refused per key). It answers batched calls (one ``put_many`` /
``get_many`` / ``delete`` per client request) with per-key results, on its worker's one
actor thread.

The unit is the edge that stores, so it validates everything it is sent, whoever sends
it (fields, keys, dtypes): a client's own checks only decide routing. Beside the rows it
keeps: open store checkpoints and the deletes they defer (:mod:`.checkpoint_guard`),
provisional rows of a restore's claim (:mod:`.unit_claims`), witnessed names and lost
keys (:mod:`.losses`). On a worker it publishes its figures by itself (:mod:`.reporter`).
"""
from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from typing import TYPE_CHECKING, Sequence

from tasks.digests import BLAKE3
from tasks.errors import InvalidStoreRequest, StoreBusy, StoreUnavailable
from tasks.packed import PackedBatch

from . import receive_pool
from .checkpoint_files import write_unit_files
from ..answers import WireDict, WireList
from .checkpoint_guard import CheckpointGuard
from .fence import Fence, stale, stale_refusal
from .held_rows import HeldRows
from .location import Location
from .losses import LossBook, lost_detail
from .protocol import (
    ABSENT_FIELD,
    INVALID_BATCH,
    LOST_KEY,
    MISSING_KEY,
    MOVED,
    GetResult,
    StoreResult,
    check_partition,
    field_problem,
    unpack_names,
)
from .registry import PartitionRegistry
from .reporter import start_reporter
from .row_packing import ROW_OVERHEAD_BYTES, SMALL_FIELD_ELEMENTS, key_nbytes, pack_stored_rows, view_stored_rows  # noqa: F401 (re-exported)
from .settings import UnitSettings
from .slab_pool import SlabPool
from .spill import Row
from .unit_claims import ClaimedRows, checkpoint_left_out
from .unit_puts import put_rows
from .unit_moves import MOVE_COUNTERS, drop, move_in, refused_keys, send, stale_answer, take_fence
from .unit_stats import unit_event, unit_stats

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Worker

logger = logging.getLogger(__name__)


class StorageUnit(ClaimedRows):
    """A Dask actor holding rows ``(partition, key) -> {field: array}``.

    ``unit_index``: its position when the store started (names, stats); ``memory_limit``
    and ``capacity``: bytes in memory before spilling, and in memory + disk before puts
    are refused ``store_full``; ``spill_directory``: parent of its spill files (``None``:
    the worker's local directory; its own subdirectory goes at :meth:`close`);
    ``partitions``: allowed names (``None``: any well-formed one); ``adopt_received``:
    keep a batch received off the wire as the rows (``None``: ``store.adopt-received``).
    """

    clock = staticmethod(time.monotonic)  # seconds, for checkpoint leases (tests turn it)

    def __init__(
        self,
        unit_index: int,
        memory_limit: int,
        capacity: int,
        spill_directory: str | None = None,
        partitions: Sequence[str] | None = None,
        adopt_received: bool | None = None,
    ):
        worker = _hosting_worker()
        if spill_directory is None:
            if worker is None:
                raise InvalidStoreRequest("a storage unit outside a Dask worker needs a spill_directory")
            spill_directory = worker.local_directory
        self.settings = UnitSettings.from_config(adopt_received)
        self.unit_index = int(unit_index)
        self.memory_limit = int(memory_limit)
        self.capacity = int(capacity)
        self.partitions = None if partitions is None else [check_partition(p) for p in partitions]
        self.directory = os.path.join(str(spill_directory), f"storage-unit-{unit_index}-{uuid.uuid4().hex[:12]}")
        self.held = HeldRows(self.directory, self.memory_limit, self.capacity, self.unit_index)
        self.registry = PartitionRegistry()
        # ``deletes`` counts delete CALLS (one per client request), ``deleted_rows`` rows removed
        # (deferred ones when applied), ``deferred_rows`` rows whose delete waited for a checkpoint.
        # ``gets`` counts get CALLS, ``get_keys`` the keys they asked for, ``get_rows`` rows found.
        self.counters = {
            "puts": 0, "put_rows": 0, "gets": 0, "get_keys": 0, "get_rows": 0, "deletes": 0, "deleted_rows": 0,
            "deferred_rows": 0, "refused_rows": 0, "checkpoints_begun": 0, "checkpoints_ended": 0,
            "checkpoints_expired": 0, "adopted_rows": 0, "released_rows": 0, "lost_reads": 0,
            **dict.fromkeys(MOVE_COUNTERS, 0),
        }
        self.fence: Fence | None = None  # the table of the last move (unit_moves.py)
        self.losses = LossBook()
        self.guard = CheckpointGuard(self.settings.lease_s)
        self.answers = SlabPool(self.settings.answer_buffer_bytes)
        # On a worker its puts' frames are read into the process's receive pool, which
        # grows by this unit's memory limit: rows are views of memory the process owns,
        # and a delete hands it to the next put (receive_pool.py, adopted.py).
        self.hosted_bytes = self.memory_limit if worker is not None and receive_pool.host_unit(self.memory_limit) else 0
        self.closed = False
        self.worker_address: str | None = None  # set before the reporter's first tick reads it
        # On a worker it publishes its figures every report_interval_s (0: never).
        self.worker_address, self.reporter = start_reporter(self, self.settings.report_interval_s)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of adopted buffers that no row in memory covers (counted against capacity)."""
        return self.held.adopted.pinned_bytes

    # ---- puts -------------------------------------------------------------------

    def put_many(
        self,
        partition: str,
        batch: PackedBatch,
        adopt: bool = False,
        claim: str | None = None,
        witness: bytes | Sequence[str] | None = None,
        moving: bool = False,
        version: int | None = None,
    ) -> StoreResult:
        """Store every row of ``batch`` under ``partition``; per-key results.

        ``adopt``: the caller hands the batch's buffers over (it never touches them
        again), so token-sized rows are kept as views of them instead of one copy per
        row. A batch whose buffers this process received off the wire
        (:attr:`PackedBatch.received`) is adopted too (``store.adopt-received``); one passed
        in-process (an actor or task on this worker, a local call) holds its caller's
        memory, so without ``adopt`` its rows are copied.

        ``claim`` (a restore's token): the rows this put creates stay *provisional* under
        it until :meth:`settle_claim`, so :meth:`release_claim` can take back exactly
        them; a row another writer re-puts (and so is acknowledged to it) stops being
        provisional. ``witness``: names this unit records for keys stored on two other
        units (:meth:`witness`). A key recorded lost is refused ``lost_key``; once fenced
        by a move, a key the table does not give this unit is refused ``moved``
        (``moving``: the move's own copies, :meth:`move_in`), and every key of a call
        planned on an older table (``version``)."""
        self._check_open()
        check_partition(partition, self.partitions)
        if not isinstance(batch, PackedBatch):
            raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
        if stale(self, version):
            return stale_answer(self, batch.keys)
        adopt = bool(adopt) or (self.settings.adopt_received and batch.received)
        if witness is not None:
            self.witness(partition, witness)
        self.counters["puts"] += 1
        result = StoreResult()
        problem = next((p for name, f in batch.fields.items() if (p := field_problem(name, f, len(batch)))), None)
        if problem:
            result.failed.update({k: (INVALID_BATCH, problem) for k in batch.keys})
        else:
            put_rows(self, partition, batch, adopt, claim, result, refused_keys(self, batch.keys, moving))
            if self.fence is not None and not moving:
                self.fence.revived(partition, result.ok)
        self.held.compact()
        self.counters["put_rows"] += len(result.ok)
        self.counters["refused_rows"] += len(result.failed)
        return result

    # ---- gets -------------------------------------------------------------------

    def get_many(
        self, partition: str, keys: Sequence[str] | bytes, fields: Sequence[str] | bytes | None = None,
        version: int | None = None, max_bytes: int | None = None, views: bool = False,
    ) -> GetResult:
        """Rows of ``keys`` (found ones, in request order) with ``fields`` (``None``: every
        field pinned in the partition; only explicitly requested fields report
        ``absent_field``). ``keys``/``fields`` may come as :func:`pack_names` bytes.
        ``max_bytes``: the answer covers the first keys whose rows weigh at most this
        together (at least one); the others come back in ``more``, to ask again.
        ``views``: the answer only crosses the wire, so heavy rows may be served as
        read-only views of the stored memory (``parts``: sent without a copy); never for
        an in-process caller, who gets copies."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        if stale(self, version):
            return GetResult(PackedBatch([], {}), stale_answer(self, keys).failed)
        fields = None if fields is None else unpack_names(fields, "fields")
        found, rows, failed, more = self._find(partition, keys, None if max_bytes is None else int(max_bytes))
        self.counters["gets"] += 1
        self.counters["get_keys"] += len(keys) - len(more)
        reg = self.registry.get(partition)
        names = list(fields) if fields is not None else (list(reg.specs) if reg else [])
        if fields is not None:
            for key, row in zip(found, rows):
                absent = [n for n in names if n not in row]
                if absent:
                    failed[key] = (ABSENT_FIELD, f"{key!r} has no field(s) {absent}")
        self.counters["get_rows"] += len(found)
        parts = view_stored_rows(found, rows, names) if views else None
        if parts is None:
            out = GetResult(pack_stored_rows(found, rows, names, reg, self.answers), failed, more)
        else:
            out = GetResult(PackedBatch([], {}), failed, more, parts)
        del rows  # the answer holds copies, or views it keeps alive itself
        self.held.compact()  # reading spilled rows back may have evicted others
        return out

    def _find(
        self, partition: str, keys: list, max_bytes: int | None,
    ) -> tuple[list[str], list[Row], dict[str, tuple[str, str]], list]:
        """(found keys, their rows, failures: ``missing_key``, ``lost_key`` or a read error,
        keys past ``max_bytes`` left for the next call; see :meth:`HeldRows.find`)."""
        found, rows, absent, failed, more = self.held.find(partition, keys, max_bytes)
        elsewhere = set() if self.fence is None or not absent else set(self.fence.not_given(absent))
        for key in absent:
            how = self.losses.how(partition, key)
            if key in elsewhere and how is None:
                failed[key] = (MOVED, self.fence.detail(key))  # type: ignore[union-attr]
            elif how is None:
                failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
            else:
                failed[key] = (LOST_KEY, lost_detail(key, how))
                self.counters["lost_reads"] += 1
        return found, rows, failed, more

    # ---- deletes ----------------------------------------------------------------

    def delete(
        self, partition: str, keys: Sequence[str] | bytes, unwitness: bytes | Sequence[str] | None = None,
        version: int | None = None,
    ) -> StoreResult:
        """Remove ``keys`` (one call, any number of keys); an absent key is reported
        ``missing_key`` (nothing else changes). While an open checkpoint covers
        ``partition`` the rows stay (reads answer them; :meth:`keys` lists them no more):
        their keys come back ``ok`` and ``deferred`` and are removed when the last such
        checkpoint ends (:meth:`end_checkpoint`). Deleting a
        lost key forgets the loss (``ok``): it may be staged again. ``unwitness``: names
        this unit stops witnessing (deleted from the units holding their copies)."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        if stale(self, version):
            return stale_answer(self, keys)
        if unwitness is not None:
            self.witness(partition, None, unwitness)
        self.counters["deletes"] += 1
        self.expire_checkpoints()
        index = self.held.index.get(partition, {})
        defer = self.guard.covers(partition)
        result = StoreResult()
        removed = 0
        fence = self.fence
        elsewhere = set() if fence is None else set(fence.not_given([k for k in keys if isinstance(k, str) and k not in index]))
        if fence is not None:
            fence.deleted(partition, [k for k in keys if isinstance(k, str)])  # a late copy must not revive them
        for key in keys:
            if isinstance(key, str) and key not in index and self.losses.forget(partition, key):
                result.ok.append(key)  # the loss is forgotten; no row to remove
            elif key in elsewhere:
                result.failed[key] = (MOVED, fence.detail(key))  # type: ignore[union-attr]
            elif not isinstance(key, str) or key not in index:
                result.failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
            elif defer:
                self.guard.defer(partition, key)
                result.ok.append(key)
                result.deferred.append(key)
            else:
                removed += self.held.remove(partition, key)
                result.ok.append(key)
        self.counters["deleted_rows"] += removed
        self.counters["deferred_rows"] += len(result.deferred)
        self.held.compact()
        return result

    # ---- witness names and lost keys (replicas=2) ----------------------------------

    def witness(self, partition: str, add: bytes | Sequence[str] | None = None, drop: bytes | Sequence[str] | None = None) -> int:
        """Record the names ``add`` (keys staged on two other units) and forget ``drop``;
        returns how many names this unit now witnesses in ``partition``."""
        self._check_open()
        check_partition(partition, self.partitions)
        return self.losses.witness(
            partition,
            () if add is None else unpack_names(add, "witness"),
            () if drop is None else unpack_names(drop, "unwitness"),
        )

    def witnessed_keys(self, partition: str, primary: int | None = None, units: int | Sequence[str] | None = None) -> list[str]:
        """Witnessed names of ``partition`` (given ``primary``: those of unit ``primary`` of ``units``, ids or count)."""
        return WireList(self.losses.witnessed_of(partition, primary, units))

    def mark_lost(self, partition: str, keys: bytes | Sequence[str], how: str) -> int:
        """Record ``keys`` (not held here) as lost, ``how`` saying when and where; returns
        how many were newly recorded. A lost key reads ``lost_key`` and refuses puts until
        a delete forgets it."""
        self._check_open()
        check_partition(partition, self.partitions)
        return self.losses.mark(partition, unpack_names(keys, "keys"), how, self.held.index.get(partition, {}))

    def lost_keys(self, partition: str) -> dict[str, str]:
        """Every lost key of ``partition`` with how it was lost."""
        return WireDict(self.losses.lost.get(partition, {}))

    def deferred_keys(self, partition: str) -> list[str]:
        """Keys of ``partition`` deleted while a checkpoint is open here: their rows stay
        (reads still answer them, the checkpoint may write them) until it ends, but they are
        deleted for every writer, so :meth:`keys` does not list them and they are never
        copied to another unit."""
        self._check_open()
        check_partition(partition, self.partitions)
        return WireList(self.guard.deferred.get(partition, {}))

    # ---- checkpoint guard ---------------------------------------------------------

    def begin_checkpoint(self, token: str, partitions: Sequence[str] | None = None, version: int | None = None) -> dict:
        """Open checkpoint ``token`` on this unit: until :meth:`end_checkpoint` deletes in
        ``partitions`` (``None``: all) are deferred, so no row the checkpoint may still
        write is lost. The state lives in the unit, so it holds whichever process deletes.
        Opening a token again is a no-op. A save planned on a table older than the unit's
        fence (``version``) opens nothing and answers ``{"unit", "moved": its version}``:
        its handle does not know every unit that holds rows now."""
        self._check_open()
        if not isinstance(token, str) or not token:
            raise InvalidStoreRequest(f"checkpoint token must be a non-empty str, got {token!r}")
        refused = stale_refusal(self, version)
        if refused:
            return refused
        if self.fence is not None and self.fence.moving:
            raise StoreBusy(f"storage unit {self.unit_index} is moving keys (placement version {self.fence.version}); "
                            "checkpoint once the move has ended")
        parts = None if partitions is None else frozenset(check_partition(p, self.partitions) for p in partitions)
        if self.guard.begin(token, parts, self.clock()):
            self.counters["checkpoints_begun"] += 1
        return {"unit": self.unit_index, "open": len(self.guard.open)}

    def end_checkpoint(self, token: str) -> dict:
        """Close checkpoint ``token`` (unknown or already closed: nothing to do) and apply
        the deferred deletes of every partition no open checkpoint covers any more.
        Returns ``{"unit", "open", "applied"}`` (rows removed now), plus ``expired`` once
        when its lease had ended it."""
        if self.closed:
            return {"unit": self.unit_index, "open": 0, "applied": 0}
        was_open, expired = self.guard.end(token)
        if was_open:
            self.counters["checkpoints_ended"] += 1
        out = {"unit": self.unit_index, "open": len(self.guard.open), "applied": self._apply_deferred()}
        return {**out, "expired": True} if expired else out

    def _apply_deferred(self) -> int:
        """Remove the deferred deletes no open checkpoint holds back any more; rows removed."""
        applied = 0
        for partition, keys in self.guard.due().items():
            applied += sum(self.held.remove(partition, key) for key in keys)
        self.counters["deleted_rows"] += applied
        if applied:
            self.held.compact()
        return applied

    def expire_checkpoints(self) -> int:
        """End every open checkpoint older than ``store.checkpoint-lease-s`` s (0: never) and apply
        its deferred deletes (a dead writer keeps no rows forever); asked at every delete and
        report, its writer's ``end_checkpoint`` then answers ``expired``. Returns how many."""
        old = self.guard.expire(self.clock())
        for token in old:
            self.counters["checkpoints_expired"] += 1
            logger.warning(
                "storage unit %d: checkpoint %r outlived store.checkpoint-lease-s (%.0f s); its deferred deletes are "
                "applied now and its writer will be told it expired", self.unit_index, token, self.guard.lease_s,
            )
        if old:
            self._apply_deferred()
        return len(old)

    # ---- moves (the store host's rebalancer, unit_moves.py) -------------------------

    def set_fence(self, table: dict) -> dict:
        """Take the next table of a move (older ones refused); see :mod:`.fence`."""
        return take_fence(self, table)

    def move_in(self, partition: str, batch: PackedBatch, lost: dict[str, str] | None = None,
                claims: dict[str, str] | None = None, counted: bool = True) -> int:
        """Rows (and lost keys: key -> how) moved here, except keys deleted meanwhile, the
        rows of ``claims`` (key -> claim) provisional under their claim; rows written
        (``counted``: in ``moved_in_rows``; False for rows sent again)."""
        return move_in(self, partition, batch, lost, claims, counted)

    def drop(self, partition: str, keys: Sequence[str] | bytes) -> int:
        """Remove this unit's copies of ``keys`` (they live elsewhere now); rows removed."""
        return drop(self, partition, keys)

    async def send(self, partition: str, keys: bytes, target: Actor, counted: bool = True) -> dict:
        """Copy this unit's rows of ``keys`` straight to unit ``target`` ({rows, bytes,
        claimed}); ``counted``: False for rows sent again (not counted as moved)."""
        return await send(self, partition, keys, target, counted)

    # ---- introspection ----------------------------------------------------------

    def stats(self, version: int | None = None) -> dict:
        """Counters and sizes (bytes) of this unit (:func:`.unit_stats.unit_stats`); a call
        planned on a table older than the unit's fence (``version``) answers ``moved``
        (:func:`~.fence.stale_refusal`)."""
        return stale_refusal(self, version) or unit_stats(self)

    def report_figures(self) -> dict | None:
        """This unit's event for its reporter's tick (None once closed)."""
        if self.closed:
            return None
        self.expire_checkpoints()  # the reporter's tick ends leases nobody else asks about
        return self.event()

    def event(self) -> dict:
        """This unit's ``token-capture-store`` event (:func:`.unit_stats.unit_event`)."""
        return unit_event(self)

    def keys(self, partition: str, version: int | None = None) -> list[str] | dict:
        """Every live key of ``partition``: held ones (insertion order) but those deleted
        while a checkpoint is open here (:meth:`deferred_keys`: their rows stay until it
        ends, yet they are deleted for every writer), then lost ones (their reads answer
        ``lost_key``). A listing planned on a table older than the unit's fence
        (``version``) answers ``{"unit", "moved": its version}``: the caller's table does
        not name every unit holding rows now."""
        refused = stale_refusal(self, version)
        if refused:
            return refused
        held, gone = self.held.index.get(partition, {}), self.guard.deferred.get(partition)
        live = held if not gone else (k for k in held if k not in gone)
        return WireList([*live, *self.losses.lost.get(partition, {})])

    # ---- checkpoint -------------------------------------------------------------

    def checkpoint_write(
        self, directory: str | Location, chunk_bytes: int, primary_of_units: int | Sequence[str] | None = None, index: int | None = None,
        digest: str = BLAKE3, token: str | None = None,
    ) -> list[dict]:
        """Write every partition's rows as packed batch files (about ``chunk_bytes`` each)
        into ``directory`` (a local directory: atomically per file; or a generation at an
        fsspec URL, written from this worker). Returns one manifest entry per file, and one of
        the lost keys it records, if any (:mod:`.checkpoint_losses`). Runs on the actor thread: a snapshot.

        ``primary_of_units`` (a replicated store's unit ids, or count: default ids): write only
        the keys this unit is the primary of, so a checkpoint holds each key once, not twice.
        ``index``: this unit's position in the caller's table (default ``unit_index``).
        ``digest``: the files' algorithm, ``"blake3"`` or ``"sha256"`` (the saver's ``capture.digest``).
        ``token``: the checkpoint this write is for (opened by :meth:`begin_checkpoint`): rows
        deleted before it began, held back only for older checkpoints, are left out; so are
        rows provisional under a restore's claim (:func:`.unit_claims.checkpoint_left_out`)."""
        self._check_open()
        me = self.unit_index if index is None else int(index)
        skip = checkpoint_left_out(self.held, self.guard, token)
        return write_unit_files(directory, me, self.held, self.registry, chunk_bytes, primary_of_units, digest, skip, self.losses)

    # ---- lifecycle --------------------------------------------------------------

    def close(self) -> dict:
        """Drop every row and remove this unit's spill directory; returns final stats."""
        if self.closed:
            return {"unit": self.unit_index, "closed": True}
        if self.reporter is not None:
            self.reporter.stop()
        final = self.stats()
        self.held.clear()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.guard.clear()
        self.losses.clear()
        self.answers = SlabPool(0)
        if self.hosted_bytes:
            receive_pool.unhost_unit(self.hosted_bytes)
            self.hosted_bytes = 0
        self.closed = True
        return final

    def _check_open(self) -> None:
        if self.closed:
            raise StoreUnavailable(f"storage unit {self.unit_index} is closed")


def _hosting_worker() -> "Worker | None":
    """The Dask worker this code runs on, or None (a unit built directly, in a test)."""
    try:
        from distributed import get_worker

        return get_worker()
    except ValueError:
        return None
