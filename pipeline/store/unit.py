"""The storage unit: a Dask actor holding staged rows of some rollouts.

One :class:`StorageUnit` lives on a worker (``client.submit(StorageUnit, ..., actor=True)``)
and keeps rows ``(partition, key) -> {field: array}`` in a
:class:`~pipeline.store.spill.SpillMapping` (memory up to ``memory_limit`` bytes, then
disk). It answers batched calls (one ``put_many`` / ``get_many`` / ``delete`` per client
request) with per-key results, on the worker's single actor thread. Keys are write-once;
a put beyond ``capacity`` bytes (memory + disk + pinned) is refused per key. While a
store checkpoint is open on the unit (:meth:`StorageUnit.begin_checkpoint`), deletes in
the partitions it covers are acknowledged ``deferred`` and applied when it ends.

On a worker, a unit publishes its figures (rows, memory and spilled bytes) as a
``token-capture-store`` event every ``store.report-interval-s`` seconds by itself
(:class:`StoreReporter`), so the dashboard and ``/metrics`` show the store without any
call from the controller.
"""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import uuid
import weakref
from typing import Any, Sequence

from tasks.errors import InvalidStoreRequest, StoreUnavailable
from tasks.keys import unit_for_key
from tasks.packed import PackedBatch, PackedField

from . import batch_file
from .adopted import AdoptedGroups
from .protocol import (
    ABSENT_FIELD,
    DTYPE_MISMATCH,
    INVALID_BATCH,
    INVALID_KEY,
    KEY_CONFLICT,
    LOST_KEY,
    MISSING_KEY,
    STORE_ERROR,
    STORE_FULL,
    GetResult,
    StoreResult,
    check_key,
    check_partition,
    field_problem,
    same_row,
    unpack_names,
)
from .registry import FieldRegistry, PartitionRegistry
from .slab_pool import SlabPool
from .spill import Row, SpillMapping, batch_row_nbytes

logger = logging.getLogger(__name__)

# Fields averaging fewer elements per row than this are copied once per batch, not per row.
SMALL_FIELD_ELEMENTS = 64
# Bytes charged to capacity per stored row besides its arrays (row_nbytes) and its key's
# UTF-8 bytes: the bookkeeping a row costs the unit wherever its arrays are (memory or
# disk), which never spills: the key str's object header, its index and weights dict
# entries, the slot name, the row dict and zict's LRU entries. Measured with tracemalloc
# on CPython 3.11: about 270 bytes for a field-less row (issue 11 #6).
ROW_OVERHEAD_BYTES = 256


def _lost_detail(key: str, how: str) -> str:
    return f"{key!r} was staged, but both its copies were lost ({how}); delete it to forget the loss"


def key_nbytes(key: str) -> int:
    """A (valid, so UTF-8 encodable) key's UTF-8 bytes, charged to capacity with its row."""
    return len(key) if key.isascii() else len(key.encode("utf-8"))


def pack_stored_rows(
    keys: list[str],
    rows: Sequence[Row],
    names: Sequence[str],
    reg: FieldRegistry | None,
    buffers: SlabPool | None = None,
) -> PackedBatch:
    """Rows held by a unit as one packed batch with fields ``names`` (always copies, so a
    caller never holds a view of stored rows; the registry's spec types a field no row has).

    With ``buffers``, the big fields' values are carved out of ONE pooled slab (reused
    once the answer is gone) rather than one fresh allocation each."""
    specs = reg.specs if reg is not None else {}
    cols = {n: [r.get(n) for r in rows] for n in names}
    out = None
    if buffers is not None:
        out = buffers.carver(cols)
    fields = {}
    for n in names:
        spec = specs.get(n)
        dtype, trailing = (None, None) if spec is None else spec
        fields[n] = PackedField.from_arrays(cols[n], dtype=dtype, trailing=trailing, copy=True, out=out)
    return PackedBatch(list(keys), fields)


class StoreReporter:
    """Publishes a unit's :meth:`StorageUnit.report_figures` as ``STORE`` events every
    ``interval_s`` seconds from its worker's event loop (a tornado ``PeriodicCallback``).

    The figures are read on the worker's actor thread (the one thread that runs the
    unit's methods), so a report never sees a half-applied put or delete. It holds the
    unit and the worker weakly and stops by itself once the unit is closed or gone, or
    the worker is closing. :meth:`start` and :meth:`stop` may be called from any thread.
    """

    def __init__(self, unit: "StorageUnit", worker: Any, interval_s: float) -> None:
        self._unit = weakref.ref(unit)
        self._worker = weakref.ref(worker)
        self.interval_s = float(interval_s)
        self._callback: Any = None
        self._stopped = False
        self.published = 0

    def start(self) -> None:
        worker = self._worker()
        if worker is not None:
            worker.loop.add_callback(self._start_on_loop)

    def stop(self) -> None:
        self._stopped = True
        worker = self._worker()
        if worker is not None:
            try:
                worker.loop.add_callback(self._stop_on_loop)
            except RuntimeError:  # the loop is already closed: nothing runs any more
                pass

    def _start_on_loop(self) -> None:
        from tornado.ioloop import PeriodicCallback

        if self._stopped or self._callback is not None:
            return
        self._callback = PeriodicCallback(self.report, self.interval_s * 1000.0)
        self._callback.start()
        asyncio.ensure_future(self.report())  # the first figures now, not one interval later

    def _stop_on_loop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    async def report(self) -> bool:
        """Publish the unit's figures once (on the worker's loop); False once stopped."""
        from distributed.core import Status

        from .. import dask_compat

        unit, worker = self._unit(), self._worker()
        if self._stopped or unit is None or unit.closed or worker is None or worker.status not in (Status.running, Status.paused):
            self._stopped = True
            self._stop_on_loop()
            return False
        try:
            figures = await asyncio.get_running_loop().run_in_executor(dask_compat.actor_executor(worker), unit.report_figures)
        except RuntimeError:  # the actor executor shut down with the worker
            self._stopped = True
            self._stop_on_loop()
            return False
        del unit
        if figures is None or self._stopped:
            return False
        from ..events import STORE

        try:
            worker.log_event(STORE, figures)
        except Exception:  # noqa: BLE001 - metrics must not fail the store
            logger.debug("store report not published", exc_info=True)
            return False
        self.published += 1
        return True


def _answer_buffer_bytes() -> int:
    # Read at call time (the knob may change between calls); bytes.
    from .. import config

    return config.get_bytes("store.answer-buffer-bytes")


class StorageUnit:
    """A Dask actor holding rows ``(partition, key) -> {field: array}``.

    Parameters
    ----------
    unit_index:
        This unit's position in the store (for names and stats).
    memory_limit:
        Bytes of rows kept in memory before spilling to disk.
    capacity:
        Bytes of rows (memory + disk) beyond which puts are refused with ``store_full``.
    spill_directory:
        Parent directory for this unit's spill files; ``None``: the hosting worker's
        local directory. The unit's own subdirectory is removed by :meth:`close`.
    partitions:
        Allowed partition names; ``None`` allows any well-formed name.
    adopt_received:
        Keep the rows of a batch received off the wire as views of its buffers (no
        second copy); ``None``: ``store.adopt-received``.
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
        if spill_directory is None:
            from distributed import get_worker

            spill_directory = get_worker().local_directory
        self.unit_index = int(unit_index)
        self.memory_limit = int(memory_limit)
        self.capacity = int(capacity)
        self.partitions = None if partitions is None else [check_partition(p) for p in partitions]
        self.directory = os.path.join(str(spill_directory), f"storage-unit-{unit_index}-{uuid.uuid4().hex[:12]}")
        self.rows = SpillMapping(self.directory, self.memory_limit)
        # Rows of adopted puts keep views of the put's buffers: their groups, pinned bytes.
        self.adopted = AdoptedGroups(self.rows)
        self.rows.fast_to_slow_callbacks.append(self.adopted.on_spill)
        self.index: dict[str, dict[str, str]] = {}  # partition -> key -> slot
        self.weights: dict[str, int] = {}  # slot -> row bytes, for capacity accounting
        self.used_bytes = 0
        self.registry = PartitionRegistry()
        self._next_slot = 0
        # ``deletes`` counts delete CALLS (one per client request), ``deleted_rows`` rows removed
        # (deferred ones when applied), ``deferred_rows`` rows whose delete waited for a checkpoint.
        # ``gets`` counts get CALLS, ``get_keys`` the keys they asked for, ``get_rows`` rows found.
        self.counters = {
            "puts": 0, "put_rows": 0, "gets": 0, "get_keys": 0, "get_rows": 0, "deletes": 0, "deleted_rows": 0,
            "deferred_rows": 0, "refused_rows": 0, "checkpoints_begun": 0, "checkpoints_ended": 0,
            "checkpoints_expired": 0, "adopted_rows": 0, "released_rows": 0, "lost_reads": 0,
        }
        # Rows still provisional under a restore's claim: slot -> claim token.
        self.claims: dict[str, str] = {}
        # replicas=2: names of the keys this unit witnesses (their copies live on two other
        # units), and keys whose both copies were lost (key -> how), per partition.
        self.witnessed: dict[str, dict[str, None]] = {}
        self.lost: dict[str, dict[str, str]] = {}
        # Open store checkpoints: token -> partitions covered (None: every partition); and
        # per partition the keys whose delete waits until no open checkpoint covers it.
        self.open_checkpoints: dict[str, frozenset[str] | None] = {}
        self.deferred: dict[str, dict[str, None]] = {}
        # When each open checkpoint began (:attr:`clock`, s), for its lease; and the
        # tokens a lease ended (their end_checkpoint says so, once).
        self._checkpoint_began: dict[str, float] = {}
        self.expired_checkpoints: set[str] = set()
        self.answers = SlabPool(_answer_buffer_bytes())
        from .. import config

        # Whether a batch received off the wire is kept as the rows (no second copy).
        self.adopt_received = bool(config.get("store.adopt-received") if adopt_received is None else adopt_received)
        self.closed = False
        self.worker_address: str | None = None
        self.reporter: StoreReporter | None = None
        self._start_reporter()

    def _start_reporter(self) -> None:
        """On a worker, publish this unit's figures every ``store.report-interval-s``
        seconds (0: never); outside a worker (in-process use) there is nothing to do."""
        from distributed import get_worker

        from .. import config

        try:
            worker = get_worker()
        except ValueError:
            return
        self.worker_address = worker.address
        interval_s = float(config.get("store.report-interval-s"))
        if interval_s > 0:
            self.reporter = StoreReporter(self, worker, interval_s)
            self.reporter.start()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of adopted buffers that no row in memory covers (counted against capacity)."""
        return self.adopted.pinned_bytes

    # ---- puts -------------------------------------------------------------------

    def put_many(
        self,
        partition: str,
        batch: PackedBatch,
        adopt: bool = False,
        claim: str | None = None,
        witness: bytes | Sequence[str] | None = None,
    ) -> StoreResult:
        """Store every row of ``batch`` under ``partition``; per-key results.

        ``claim`` (a restore's token): the rows this put creates stay *provisional* under
        it until :meth:`settle_claim`, so :meth:`release_claim` can take back exactly
        them; a row another writer re-puts (and so is acknowledged to it) stops being
        provisional and is never taken back. ``witness``: names of keys (of this put, stored
        on other units) this unit records as their witness (see :meth:`witness`). A key
        recorded lost (:meth:`mark_lost`) is refused ``lost_key``.

        ``adopt``: the caller hands the batch's buffers over (it never touches them
        again), so token-sized rows are kept as views of them instead of one copy per
        row. A batch whose buffers this process received off the wire
        (:attr:`PackedBatch.received`) is adopted too (``store.adopt-received``); one passed
        in-process (an actor or task on this worker, a local call) holds its caller's
        memory, so without ``adopt`` its rows are copied."""
        self._check_open()
        check_partition(partition, self.partitions)
        if not isinstance(batch, PackedBatch):
            raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
        adopt = bool(adopt) or (self.adopt_received and batch.received)
        if witness is not None:
            self.witness(partition, witness)
        self.counters["puts"] += 1
        n = len(batch)
        result = StoreResult()
        for name, f in batch.fields.items():
            problem = field_problem(name, f, n)
            if problem:
                result.failed.update({k: (INVALID_BATCH, problem) for k in batch.keys})
                self.counters["refused_rows"] += n
                return result

        reg = self.registry[partition]
        index = self.index.setdefault(partition, {})
        lost = self.lost.get(partition, {})
        # Per field (not per row): a packed field has one dtype; present rows inherit its verdict.
        cols = []  # (name, values, offsets list, present list | None, spec, copy each row)
        shared: list[str] = []  # adopted fields: rows keep views of their buffers
        bad_field: list[str | None] = [None] * n
        for name, f in batch.fields.items():
            present = None if f.present is None else f.present.astype(bool).tolist()
            if present is not None and not any(present):
                continue
            spec = f.spec
            detail = reg.mismatch(name, spec)
            if detail is not None:
                for i in range(n):
                    if present is None or present[i]:
                        bad_field[i] = bad_field[i] or detail
                continue
            values = f.values
            if len(values) < SMALL_FIELD_ELEMENTS * max(n, 1):
                # Small fields (ids, scalars, hashes): ONE copy for the batch, rows are views
                # of it. It is a few KB, so it never keeps the batch's big buffers alive.
                values = values.copy()
                cols.append((name, values, f.offsets.tolist(), present, spec, False))
            else:
                cols.append((name, values, f.offsets.tolist(), present, spec, not adopt))
                if adopt:
                    shared.append(name)

        row_weights = batch_row_nbytes(batch, [c[0] for c in cols])  # row_nbytes of each row, at once
        stored_rows: list[int] = []  # batch rows stored under a NEW slot
        stored_slots: list[str] = []
        for i, key in enumerate(batch.keys):
            problem = check_key(key)
            if problem is not None:
                result.failed[key] = (INVALID_KEY, problem)
                continue
            if bad_field[i] is not None:
                result.failed[key] = (DTYPE_MISMATCH, bad_field[i])
                continue
            if key in lost:
                result.failed[key] = (LOST_KEY, _lost_detail(key, lost[key]))
                continue
            # Copy out of the batch buffer (the batch must not stay alive through our rows),
            # unless the buffers were adopted: then rows are views and the batch's token
            # buffers are tracked as one shared group (see AdoptedGroups).
            row = {
                name: values[off[i] : off[i + 1]].copy() if copy else values[off[i] : off[i + 1]]
                for name, values, off, present, _, copy in cols
                if present is None or present[i]
            }
            outcome, slot = self._store_row(partition, index, key, row, row_weights[i], claim)
            if outcome is None:
                result.ok.append(key)
                if slot is not None:
                    stored_rows.append(i)
                    stored_slots.append(slot)
            else:
                result.failed[key] = outcome
        if stored_rows:
            for name, _, _, present, spec, _ in cols:
                if present is None or any(present[i] for i in stored_rows):
                    reg.pin(name, spec)
        if shared and stored_slots:
            self.adopted.adopt(shared, cols, stored_slots, self.used_bytes, self.capacity)
            self.counters["adopted_rows"] += len(stored_slots)
        self.adopted.compact_pending(self.used_bytes, self.capacity)
        self.counters["put_rows"] += len(result.ok)
        self.counters["refused_rows"] += len(result.failed)
        return result

    def _store_row(
        self, partition: str, index: dict[str, str], key: str, row: Row, nbytes: int, claim: str | None = None
    ) -> tuple[tuple[str, str] | None, str | None]:
        """(failure or None, the new slot when the row was stored: None for an identical re-put).

        ``nbytes`` is the row's :func:`row_nbytes` (computed per batch by the caller).
        A new row's weight (capacity, bytes) is its arrays, its key's UTF-8 bytes and
        :data:`ROW_OVERHEAD_BYTES`; deleting it frees exactly that weight."""
        slot = index.get(key)
        if slot is not None:
            # Write-once: compare only when the key exists.
            try:
                existing = self.rows[slot]
            except Exception as e:  # a spill file gone bad must not take down the batch
                return (STORE_ERROR, f"{key!r}: reading the existing row failed: {e!r}"), None
            if same_row(existing, row):
                if self.claims.get(slot, claim) != claim:
                    del self.claims[slot]  # acknowledged to another writer: no longer provisional
                return None, None
            return (KEY_CONFLICT, f"{key!r} already holds different content in partition {partition!r}"), None
        weight = nbytes + key_nbytes(key) + ROW_OVERHEAD_BYTES
        pinned = self.adopted.pinned_bytes
        if self.used_bytes + pinned + weight > self.capacity:
            return (
                STORE_FULL,
                f"{key!r}: {weight} bytes would exceed capacity {self.capacity} bytes "
                f"(used {self.used_bytes}, pinned {pinned}) of unit {self.unit_index}",
            ), None
        slot = str(self._next_slot)
        self._next_slot += 1
        try:
            self.rows.put_row(slot, row, nbytes)
        except Exception as e:
            if slot not in self.rows:
                return (STORE_ERROR, f"{key!r}: storing failed: {e!r}"), None
        index[key] = slot
        self.weights[slot] = weight
        self.used_bytes += weight
        if claim is not None:
            self.claims[slot] = claim
        return None, slot

    # ---- gets -------------------------------------------------------------------

    def get_many(
        self, partition: str, keys: Sequence[str] | bytes, fields: Sequence[str] | bytes | None = None
    ) -> GetResult:
        """Rows of ``keys`` (found ones, in request order) with ``fields`` (``None``: every
        field pinned in the partition; only explicitly requested fields report
        ``absent_field``). ``keys``/``fields`` may come as :func:`pack_names` bytes."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        fields = None if fields is None else unpack_names(fields, "fields")
        self.counters["gets"] += 1
        self.counters["get_keys"] += len(keys)
        index = self.index.get(partition, {})
        lost = self.lost.get(partition, {})
        reg = self.registry.get(partition)
        failed: dict[str, tuple[str, str]] = {}
        found: list[str] = []
        rows: list[Row] = []
        for key in keys:
            slot = index.get(key) if isinstance(key, str) else None
            if slot is None:
                how = lost.get(key) if isinstance(key, str) else None
                if how is None:
                    failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
                else:
                    failed[key] = (LOST_KEY, _lost_detail(key, how))
                    self.counters["lost_reads"] += 1
                continue
            try:
                rows.append(self.rows[slot])
            except Exception as e:
                failed[key] = (STORE_ERROR, f"{key!r}: read failed: {e!r}")
                continue
            found.append(key)
        names = list(fields) if fields is not None else (list(reg.specs) if reg else [])
        if fields is not None:
            for key, row in zip(found, rows):
                absent = [n for n in names if n not in row]
                if absent:
                    failed[key] = (ABSENT_FIELD, f"{key!r} has no field(s) {absent}")
        self.counters["get_rows"] += len(found)
        self.answers.max_bytes = _answer_buffer_bytes()
        out = GetResult(pack_stored_rows(found, rows, names, reg, self.answers), failed)
        del rows  # the answer holds copies
        self.adopted.compact_pending(self.used_bytes, self.capacity)  # reading spilled rows back may have evicted others
        return out

    # ---- deletes ----------------------------------------------------------------

    def delete(
        self, partition: str, keys: Sequence[str] | bytes, unwitness: bytes | Sequence[str] | None = None
    ) -> StoreResult:
        """Remove ``keys`` (one call, any number of keys); an absent key is reported
        ``missing_key`` (nothing else changes). While an open checkpoint covers
        ``partition`` the rows stay: their keys come back ``ok`` and ``deferred`` and are
        removed when the last such checkpoint ends (:meth:`end_checkpoint`). Deleting a
        lost key forgets the loss (``ok``): it may be staged again. ``unwitness``: names
        this unit stops witnessing (deleted from the units holding their copies)."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        if unwitness is not None:
            self.witness(partition, None, unwitness)
        self.counters["deletes"] += 1
        self.expire_checkpoints()
        index = self.index.get(partition, {})
        lost = self.lost.get(partition, {})
        defer = self._covered(partition)
        result = StoreResult()
        forgotten = 0
        for key in keys:
            if isinstance(key, str) and key not in index and lost.pop(key, None) is not None:
                result.ok.append(key)  # the loss is forgotten; no row to remove
                forgotten += 1
                continue
            if not isinstance(key, str) or key not in index:
                result.failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
                continue
            if defer:
                self.deferred.setdefault(partition, {})[key] = None
                result.deferred.append(key)
            else:
                self._remove(index, key)
            result.ok.append(key)
        self.counters["deleted_rows"] += len(result.ok) - len(result.deferred) - forgotten
        self.counters["deferred_rows"] += len(result.deferred)
        self.adopted.compact_pending(self.used_bytes, self.capacity)
        return result

    def _remove(self, index: dict[str, str], key: str) -> bool:
        slot = index.pop(key, None)
        if slot is None:
            return False
        del self.rows[slot]
        self.adopted.release(slot)
        self.used_bytes -= self.weights.pop(slot)
        self.claims.pop(slot, None)
        return True

    # ---- provisional rows (a restore's claim) -------------------------------------

    def release_claim(self, partition: str, keys: Sequence[str] | bytes, claim: str) -> dict:
        """Remove the rows of ``keys`` still provisional under ``claim`` (created by a put
        with that claim, acknowledged to no other writer since); every other row stays.
        Not deferred by open checkpoints: no writer was ever told these rows exist.
        Returns ``{"unit", "removed": rows removed, "kept": keys that stay}``."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        index = self.index.get(partition, {})
        removed, kept = 0, []
        for key in keys:
            slot = index.get(key) if isinstance(key, str) else None
            if slot is None:
                continue
            if self.claims.get(slot) == claim and self._remove(index, key):
                removed += 1
            else:
                kept.append(key)
        self.counters["released_rows"] += removed
        self.adopted.compact_pending(self.used_bytes, self.capacity)
        return {"unit": self.unit_index, "removed": removed, "kept": kept}

    def settle_claim(self, claim: str) -> int:
        """The rows provisional under ``claim`` become ordinary rows; returns how many."""
        if self.closed:
            return 0
        slots = [slot for slot, c in self.claims.items() if c == claim]
        for slot in slots:
            del self.claims[slot]
        return len(slots)

    # ---- witness names and lost keys (replicas=2) ----------------------------------

    def witness(self, partition: str, add: bytes | Sequence[str] | None = None, drop: bytes | Sequence[str] | None = None) -> int:
        """Record the names ``add`` (keys staged on two other units) and forget ``drop``;
        returns how many names this unit now witnesses in ``partition``. Names only, no
        rows: if both copies of a key are lost, its name says it was staged."""
        self._check_open()
        check_partition(partition, self.partitions)
        names = self.witnessed.setdefault(partition, {})
        if add is not None:
            names.update(dict.fromkeys(k for k in unpack_names(add, "witness") if isinstance(k, str)))
        if drop is not None:
            for key in unpack_names(drop, "unwitness"):
                names.pop(key, None)
        return len(names)

    def witnessed_keys(self, partition: str, primary: int, n_units: int) -> list[str]:
        """The witnessed names of ``partition`` whose primary unit is ``primary`` (of ``n_units``)."""
        return [k for k in self.witnessed.get(partition, {}) if unit_for_key(k, n_units) == primary]

    def mark_lost(self, partition: str, keys: bytes | Sequence[str], how: str) -> int:
        """Record ``keys`` (not held here) as lost, ``how`` saying when and where; returns
        how many were newly recorded. A lost key reads ``lost_key`` and refuses puts until
        a delete forgets it."""
        self._check_open()
        check_partition(partition, self.partitions)
        index = self.index.get(partition, {})
        lost = self.lost.setdefault(partition, {})
        new = [k for k in unpack_names(keys, "keys") if isinstance(k, str) and k not in index and k not in lost]
        lost.update(dict.fromkeys(new, str(how)))
        return len(new)

    def lost_keys(self, partition: str) -> dict[str, str]:
        """Every lost key of ``partition`` with how it was lost."""
        return dict(self.lost.get(partition, {}))

    def _covered(self, partition: str) -> bool:
        """Whether an open checkpoint covers ``partition`` (deletes there are deferred)."""
        return any(parts is None or partition in parts for parts in self.open_checkpoints.values())

    # ---- checkpoint guard ---------------------------------------------------------

    def begin_checkpoint(self, token: str, partitions: Sequence[str] | None = None) -> dict:
        """Open checkpoint ``token`` on this unit: until :meth:`end_checkpoint` deletes in
        ``partitions`` (``None``: all) are deferred, so no row the checkpoint may still
        write is lost. The state lives in the unit, so it holds whichever process deletes.
        Opening a token again is a no-op."""
        self._check_open()
        if not isinstance(token, str) or not token:
            raise InvalidStoreRequest(f"checkpoint token must be a non-empty str, got {token!r}")
        parts = None if partitions is None else frozenset(check_partition(p, self.partitions) for p in partitions)
        if token not in self.open_checkpoints:
            self.open_checkpoints[token] = parts
            self._checkpoint_began[token] = self.clock()
            self.counters["checkpoints_begun"] += 1
        return {"unit": self.unit_index, "open": len(self.open_checkpoints)}

    def end_checkpoint(self, token: str) -> dict:
        """Close checkpoint ``token`` (unknown or already closed: nothing to do) and apply
        the deferred deletes of every partition no open checkpoint covers any more.
        Returns ``{"unit", "open", "applied"}`` (rows removed now)."""
        if self.closed:
            return {"unit": self.unit_index, "open": 0, "applied": 0}
        expired = token in self.expired_checkpoints
        self.expired_checkpoints.discard(token)
        self._checkpoint_began.pop(token, None)
        if self.open_checkpoints.pop(token, ...) is not ...:
            self.counters["checkpoints_ended"] += 1
        applied = self._apply_deferred()
        out = {"unit": self.unit_index, "open": len(self.open_checkpoints), "applied": applied}
        return {**out, "expired": True} if expired else out

    def _apply_deferred(self) -> int:
        """Remove the deferred deletes of every partition no open checkpoint covers; rows removed."""
        applied = 0
        for partition in [p for p in self.deferred if not self._covered(p)]:
            index = self.index.get(partition, {})
            applied += sum(self._remove(index, key) for key in self.deferred.pop(partition))
        self.counters["deleted_rows"] += applied
        if applied:
            self.adopted.compact_pending(self.used_bytes, self.capacity)
        return applied

    def expire_checkpoints(self) -> int:
        """End every open checkpoint older than ``store.checkpoint-lease-s`` seconds (0: never),
        as if its writer had, and apply the deletes it deferred: a controller that died
        mid-checkpoint must not keep rows forever. Asked at every delete and report; the
        writer's own ``end_checkpoint`` then answers ``expired``. Returns how many ended."""
        from .. import config

        lease = float(config.get("store.checkpoint-lease-s"))
        if lease <= 0 or not self._checkpoint_began:
            return 0
        now = self.clock()
        old = [t for t, began in self._checkpoint_began.items() if now - began > lease]
        for token in old:
            del self._checkpoint_began[token]
            self.open_checkpoints.pop(token, None)
            self.expired_checkpoints.add(token)
            self.counters["checkpoints_expired"] += 1
            logger.warning(
                "storage unit %d: checkpoint %r outlived store.checkpoint-lease-s (%.0f s); its deferred deletes are "
                "applied now and its writer will be told it expired", self.unit_index, token, lease,
            )
        if old:
            self._apply_deferred()
        return len(old)

    # ---- introspection ----------------------------------------------------------

    def stats(self) -> dict:
        """Counters and sizes (bytes) of this unit."""
        from distributed import get_worker

        try:
            worker = get_worker().address
        except ValueError:
            worker = None
        return {
            "unit": self.unit_index,
            "worker": worker,
            "rows": sum(len(ix) for ix in self.index.values()),
            "partitions": {p: len(ix) for p, ix in self.index.items()},
            "used_bytes": self.used_bytes,
            "pinned_bytes": self.adopted.pinned_bytes,
            "shared_groups": len(self.adopted),
            "memory_bytes": self.rows.memory_bytes,
            "spilled_bytes": self.rows.spilled_bytes,
            "disk_bytes": self.rows.spilled_bytes,
            "spilled_rows": self.rows.spilled_rows,
            "spill_errors": self.rows.spill_errors,
            "answer_buffer_bytes": self.answers.held_bytes,
            "answer_buffers_reused": self.answers.reused,
            "answer_buffers_allocated": self.answers.allocated,
            "answer_buffers_unpooled": self.answers.unpooled,
            "memory_limit": self.memory_limit,
            "capacity": self.capacity,
            "spill_directory": self.directory,
            "registry": self.registry.to_dict(),
            "open_checkpoints": len(self.open_checkpoints),
            "pending_deletes": sum(len(d) for d in self.deferred.values()),
            "event": self.event(),
            "provisional_rows": len(self.claims),
            "lost_keys": sum(len(d) for d in self.lost.values()),
            "witnessed_keys": sum(len(d) for d in self.witnessed.values()),
            **self.counters,
        }

    def report_figures(self) -> dict | None:
        """The figures a ``token-capture-store`` event carries (None once closed): rows,
        memory and spilled bytes (bytes; O(partitions), cheap enough to read each period)."""
        if self.closed:
            return None
        self.expire_checkpoints()  # the reporter's tick ends leases nobody else asks about
        return self.event()

    def event(self) -> dict:
        """This unit's ``token-capture-store`` event (the one place it is built): rows,
        bytes in memory / spilled / used and the capacity (bytes), lost keys."""
        return {
            "unit": self.unit_index,
            "worker": self.worker_address,
            "rows": sum(len(ix) for ix in self.index.values()),
            "memory_bytes": self.rows.memory_bytes,
            "spilled_bytes": self.rows.spilled_bytes,
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity,
            "lost_keys": sum(len(d) for d in self.lost.values()),
        }

    def keys(self, partition: str) -> list[str]:
        """Every key of ``partition``: held ones (insertion order), then lost ones (their
        reads answer ``lost_key``)."""
        return [*self.index.get(partition, {}), *self.lost.get(partition, {})]

    # ---- checkpoint -------------------------------------------------------------

    def checkpoint_write(self, directory: str, chunk_bytes: int, primary_of_units: int | None = None) -> list[dict]:
        """Write every partition's rows as packed batch files (about ``chunk_bytes`` each)
        into ``directory`` atomically per file (temp, fsync, rename). Returns one manifest
        entry per file. Runs on the actor thread, so it is a consistent snapshot of this unit.

        ``primary_of_units`` (a replicated store's unit count): write only the keys this unit
        is the primary of, so a checkpoint holds each key once, not once per copy."""
        self._check_open()
        entries: list[dict] = []
        for partition, index in self.index.items():
            reg = self.registry.get(partition)
            names = list(reg.specs) if reg else []
            chunk_keys: list[str] = []
            chunk_rows: list[Row] = []
            size = 0
            n_chunk = 0
            items = list(index.items())
            if primary_of_units is not None:
                items = [(k, v) for k, v in items if unit_for_key(k, primary_of_units) == self.unit_index]
            for j, (key, slot) in enumerate(items):
                chunk_keys.append(key)
                chunk_rows.append(self.rows.peek(slot))
                size += self.weights[slot]
                if size >= chunk_bytes or j == len(items) - 1:
                    batch = pack_stored_rows(chunk_keys, chunk_rows, names, reg)
                    name = f"u{self.unit_index:03d}-{partition}-{n_chunk:05d}{batch_file.DATA_SUFFIX}"
                    sha, nbytes = batch_file.write_atomic(os.path.join(directory, name), batch_file.encode_batch(batch))
                    entries.append({"file": name, "partition": partition, "rows": len(batch), "bytes": nbytes, "sha256": sha})
                    chunk_keys, chunk_rows, size = [], [], 0
                    n_chunk += 1
        return entries

    # ---- lifecycle --------------------------------------------------------------

    def close(self) -> dict:
        """Drop every row and remove this unit's spill directory; returns final stats."""
        if self.closed:
            return {"unit": self.unit_index, "closed": True}
        if self.reporter is not None:
            self.reporter.stop()
        final = self.stats()
        self.rows.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.index.clear()
        self.weights.clear()
        self.adopted.clear()
        self.open_checkpoints.clear()
        self.deferred.clear()
        self.claims.clear()
        self.witnessed.clear()
        self.lost.clear()
        self.answers = SlabPool(0)
        self.used_bytes = 0
        self.closed = True
        return final

    def _check_open(self) -> None:
        if self.closed:
            raise StoreUnavailable(f"storage unit {self.unit_index} is closed")
