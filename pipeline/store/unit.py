"""The storage unit: a Dask actor holding staged rows of some rollouts.

One :class:`StorageUnit` lives on a worker (``client.submit(StorageUnit, ..., actor=True)``).
It keeps rows per partition in a :class:`~pipeline.store.spill.SpillMapping` (memory up
to a byte limit, then disk) and answers batched calls: one ``put_many`` / ``get_many`` /
``delete`` per client request, with per-key results. Its sync methods run on the
worker's single actor thread, so they never race each other; heavy work is numpy
(one slice-copy per field per row on put, one ``np.concatenate`` per field on get).

A row is ``{field: np.ndarray}`` copied out of the incoming :class:`PackedBatch`, so the
batch's buffers are not retained; a put with ``adopt=True`` (buffers handed over, as a batch
received off the wire is) keeps token fields as views instead, one shared buffer per field
per put, tracked so freed and pinned bytes are accounted exactly (``pinned_bytes``). Keys are write-once (identical re-put is ok, different
content is ``key_conflict``); each partition pins field dtypes at first write
(``dtype_mismatch``); a write beyond ``capacity`` bytes (memory + disk) is refused
(``store_full``). One bad row fails only its own key.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence

import msgpack
import numpy as np

from tasks.errors import InvalidKey, InvalidStoreRequest, StoreUnavailable
from tasks.keys import rollout_of_key
from tasks.packed import PackedBatch, PackedField

from . import checkpoint
from .registry import FieldRegistry, PartitionRegistry, Spec
from .spill import Row, SpillMapping, row_nbytes

# Fields averaging fewer elements per row than this are copied once per batch, not per row.
SMALL_FIELD_ELEMENTS = 64
PARTITION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Put/get/delete failure reasons (the per-key vocabulary of StoreResult/GetResult).
KEY_CONFLICT = "key_conflict"
DTYPE_MISMATCH = "dtype_mismatch"
STORE_FULL = "store_full"
INVALID_KEY = "invalid_key"
INVALID_BATCH = "invalid_batch"
MISSING_KEY = "missing_key"
ABSENT_FIELD = "absent_field"
STORE_ERROR = "store_error"


@dataclass
class _Group:
    """Rows of one adopted put that still hold views of its buffers (see _adopt_group)."""

    members: dict[str, int]  # slot -> bytes of the row's views
    held: int  # bytes of the shared buffers (all of them, until the group ends)
    live: int  # bytes of them still covered by a member row in memory
    fields: tuple[str, ...] = ()


@dataclass
class StoreResult:
    """Per-key outcome of a put or delete: ``ok`` keys and ``failed[key] = (reason, detail)``."""

    ok: list[str] = field(default_factory=list)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)

    @classmethod
    def merge(cls, results: Iterable["StoreResult"]) -> "StoreResult":
        out = cls()
        for r in results:
            out.ok.extend(r.ok)
            out.failed.update(r.failed)
        return out


@dataclass
class GetResult:
    """Found keys in request order as ONE packed batch, and per-key failures.

    A key whose row lacks a requested field is served (``present[i]`` false for that
    field) and also listed in ``failed`` with reason ``absent_field``.
    """

    batch: PackedBatch
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)


def check_partition(partition: object, allowed: Optional[Sequence[str]] = None) -> str:
    """Return ``partition`` if usable, else raise :class:`StoreError` naming it."""
    if not isinstance(partition, str) or not PARTITION_RE.match(partition):
        raise InvalidStoreRequest(f"partition must match {PARTITION_RE.pattern}, got {partition!r}")
    if allowed is not None and partition not in allowed:
        raise InvalidStoreRequest(f"unknown partition {partition!r}; configured: {list(allowed)}")
    return partition


def check_key(key: object) -> Optional[str]:
    """``None`` if ``key`` is a usable staging/cut key, else why not."""
    if not isinstance(key, str):
        return f"key must be str, got {type(key).__name__}"
    try:
        rollout_of_key(key)
    except InvalidKey as e:
        return str(e)
    return None


def field_problem(name: str, f: PackedField, n: int) -> Optional[str]:
    """Why a packed field cannot be cut into ``n`` rows, or ``None`` if it can."""
    if not isinstance(f, PackedField):
        return f"field {name!r} is {type(f).__name__}, not PackedField"
    off, values = f.offsets, f.values
    if not isinstance(off, np.ndarray) or not isinstance(values, np.ndarray):
        return f"field {name!r}: values and offsets must be numpy arrays"
    if off.ndim != 1 or len(off) != n + 1 or off.dtype.kind not in "iu":
        return f"field {name!r}: offsets must be integer[{n + 1}], got {off.dtype}{list(off.shape)}"
    if values.ndim < 1:
        return f"field {name!r}: values must be at least 1-d"
    if off[0] != 0 or off[-1] != len(values) or (n and np.any(np.diff(off) < 0)):
        return f"field {name!r}: offsets must rise from 0 to len(values)={len(values)}"
    if f.present is not None and (not isinstance(f.present, np.ndarray) or f.present.shape != (n,)):
        return f"field {name!r}: present must be bool[{n}]"
    return None


def pack_field(
    arrays: Sequence[Optional[np.ndarray]], spec: Optional[Spec], out: Optional[Callable[[np.dtype, tuple], np.ndarray]] = None
) -> PackedField:
    """Concatenate row arrays (``None`` = absent) into a NEW buffer (always a copy, so a
    caller never holds a view of stored rows). ``spec`` gives the dtype of an all-absent field.
    ``out(dtype, shape)``, when given, supplies that buffer (a pooled one, see
    :class:`AnswerBuffers`) instead of a fresh allocation."""
    n = len(arrays)
    lengths = np.fromiter((0 if a is None else len(a) for a in arrays), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    real = [a for a in arrays if a is not None]
    if real:
        dtype, trailing = real[0].dtype, real[0].shape[1:]
    elif spec is not None:
        dtype, trailing = np.dtype(spec[0]), tuple(spec[1])
    else:
        dtype, trailing = np.dtype(np.uint8), ()
    shape = (int(offsets[-1]),) + tuple(trailing)
    values = np.empty(shape, dtype=dtype) if out is None else out(dtype, shape)
    if len(real) > 1:
        np.concatenate(real, out=values)
    elif real:
        values[...] = real[0]
    present = None if len(real) == n else np.fromiter((a is not None for a in arrays), dtype=bool, count=n)
    return PackedField(values, offsets, present)


def pack_stored_rows(
    keys: list[str],
    rows: Sequence[Row],
    names: Sequence[str],
    reg: Optional[FieldRegistry],
    buffers: Optional["AnswerBuffers"] = None,
) -> PackedBatch:
    """Rows held by a unit as one packed batch with fields ``names`` (copies).

    With ``buffers``, the big fields' values are carved out of ONE pooled slab (reused
    once the answer is gone) rather than one fresh allocation each."""
    specs = reg.specs if reg is not None else {}
    cols = {n: [r.get(n) for r in rows] for n in names}
    out = None
    if buffers is not None:
        out = buffers.carver(cols)
    return PackedBatch(list(keys), {n: pack_field(cols[n], specs.get(n), out) for n in names})


class AnswerBuffers:
    """Reusable slabs (bytes) for the values of get answers, at most ``max_bytes`` of them.

    Dask starts worker processes with ``MALLOC_TRIM_THRESHOLD_`` set, which turns off
    glibc's adaptive mmap threshold: every allocation over 128 KiB is then a fresh mmap
    whose pages fault in (zeroed) one by one while the answer is packed, and are unmapped
    when it is dropped. Measured on these machines: packing a 32-row answer of 16,384-token
    rows (8 MB) takes ~5 ms that way against ~0.8 ms into memory already mapped.

    A slab is handed out again only when nothing refers to it any more: every field
    value is a numpy view whose ``base`` is the slab, and every later view, memoryview or
    pickle buffer of it (Dask's send path) holds such a view, so the slab's reference
    count tells when the answer has been sent and dropped (or, in-process, when the
    caller let go of it). Slabs come in size classes; each class is scanned oldest-handed-
    out first, so a free one is usually the first looked at (a get pays O(1), not a scan
    of every slab). The pool tracks at most ``max_bytes`` (in use or idle; idle slabs of
    other classes are released to make room); an answer beyond that is a plain allocation.
    """

    ALIGN = 64  # bytes; every field starts on a cache line (and on its dtype's alignment)
    FIELD_MIN_BYTES = 1 << 14  # smaller fields (ids, scalars, hashes) are plain allocations:
    # a caller keeping one of them must not pin a whole slab
    SCAN = 64  # slabs of a class looked at per take (bounds a get's cost when all are in use)

    def __init__(self, max_bytes: int, min_bytes: int = 1 << 17):
        self.max_bytes = int(max_bytes)  # bytes of slabs the pool may keep (0: no pooling)
        self.min_bytes = int(min_bytes)  # answers (big fields) smaller than this are plain allocations
        self._classes: dict[int, list[np.ndarray]] = {}  # size -> slabs, least recently handed out first
        self.held_bytes = 0  # bytes of every slab the pool keeps (in use or idle)
        self.reused = 0  # answers packed into a reused slab
        self.allocated = 0  # slabs allocated for the pool
        self.unpooled = 0  # answers packed into a plain allocation (the pool was full)
        # References a slab has when only this pool holds it, measured through the same
        # code path as the check (robust to how the interpreter counts argument refs).
        probe = [np.empty(0, np.uint8)]
        self._free_refs = self._refs(probe, 0)

    @staticmethod
    def _refs(slabs: list, i: int) -> int:
        return sys.getrefcount(slabs[i])

    @staticmethod
    def size_class(nbytes: int) -> int:
        """Eight classes per power of two (at most 12.5% slack): similar answers share slabs."""
        granule = 1 << max(0, (nbytes - 1).bit_length() - 4)
        return -(-nbytes // granule) * granule

    def take(self, nbytes: int) -> np.ndarray:
        """A ``uint8`` buffer of at least ``nbytes`` that nothing else refers to."""
        cap = self.size_class(max(self.min_bytes, int(nbytes)))
        slabs = self._classes.setdefault(cap, [])
        # The oldest handed out are the likeliest free; past SCAN of them, all are taken.
        for i in range(min(len(slabs), self.SCAN)):
            if self._refs(slabs, i) <= self._free_refs:
                slab = slabs.pop(i)
                slabs.append(slab)  # now the most recently handed out
                self.reused += 1
                return slab
        slab = np.empty(cap, dtype=np.uint8)
        if self.held_bytes + cap > self.max_bytes:
            self._release_idle(self.held_bytes + cap - self.max_bytes, but=cap)
        if self.held_bytes + cap <= self.max_bytes:
            slabs.append(slab)
            self.held_bytes += cap
            self.allocated += 1
        else:
            self.unpooled += 1  # kept by nobody but its answer: freed with it
        return slab

    def _release_idle(self, need: int, but: int) -> None:
        """Drop idle slabs of classes other than ``but`` (largest first) until ``need``
        bytes are freed or none is idle."""
        idle = []
        for cap, slabs in self._classes.items():
            if cap == but:
                continue  # just scanned: none of them is free
            for i in range(len(slabs)):
                if self._refs(slabs, i) <= self._free_refs:
                    idle.append((cap, i))
        freed = 0
        gone: dict[int, set] = {}
        for cap, i in sorted(idle, reverse=True):
            if freed >= need:
                break
            gone.setdefault(cap, set()).add(i)
            freed += cap
        for cap, ix in gone.items():
            self._classes[cap] = [s for i, s in enumerate(self._classes[cap]) if i not in ix]
        self.held_bytes -= freed

    def carver(self, cols: dict[str, list]) -> Optional[Callable[[np.dtype, tuple], np.ndarray]]:
        """``out(dtype, shape)`` for :func:`pack_field`, handing out consecutive views of
        one slab sized for every big field of ``cols``; ``None`` for a small answer."""
        if self.max_bytes <= 0:
            return None  # pooling off: plain allocations
        total = 0
        for arrays in cols.values():
            nb = sum(a.nbytes for a in arrays if a is not None)
            if nb >= self.FIELD_MIN_BYTES:
                total += -(-nb // self.ALIGN) * self.ALIGN
        if total < self.min_bytes:
            return None
        slab = self.take(total)
        pos = 0

        def out(dtype: np.dtype, shape: tuple) -> np.ndarray:
            nonlocal pos
            nb = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if nb < self.FIELD_MIN_BYTES or pos + nb > slab.nbytes:  # small field (or, never, no room left)
                return np.empty(shape, dtype=dtype)
            view = slab[pos : pos + nb].view(dtype).reshape(shape)
            pos += -(-nb // self.ALIGN) * self.ALIGN
            return view

        return out


def pack_names(names: Sequence[str]) -> bytes:
    """Keys or field names as ONE msgpack buffer for an actor call.

    Dask serializes a list argument element by element (~11 us per name per call, measured:
    an explicit 16-field list added ~180 us to every get); one ``bytes`` object costs
    nothing extra. msgpack, not pickle: the unit decodes plain strings only."""
    return msgpack.packb(list(names), use_bin_type=True)


def unpack_names(value: object, what: str) -> list:
    """The list a :func:`pack_names` buffer holds, or ``value`` itself as a list.

    Raises :class:`StoreError` naming ``what`` for undecodable bytes or a non-list."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = msgpack.unpackb(value, raw=False)
        except Exception as e:  # msgpack raises several types for bad input
            raise InvalidStoreRequest(f"{what}: undecodable packed names: {type(e).__name__}: {e}") from None
        if not isinstance(value, list):
            raise InvalidStoreRequest(f"{what}: packed names must hold a list, got {type(value).__name__}")
        return value
    if isinstance(value, str):
        raise InvalidStoreRequest(f"{what} must be a list of names, got a single str {value[:80]!r}")
    try:
        return list(value)
    except TypeError:
        raise InvalidStoreRequest(f"{what} must be a list of names, got {type(value).__name__}") from None


def _answer_buffer_bytes() -> int:
    # Read at call time (the knob may change between calls); bytes.
    from .. import config

    return config.get_bytes("store.answer-buffer-bytes")


def same_row(a: Row, b: Row) -> bool:
    """Bitwise equality of two rows: same fields, dtypes, shapes and bytes."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if not np.array_equal(np.ascontiguousarray(x).reshape(-1).view(np.uint8), np.ascontiguousarray(y).reshape(-1).view(np.uint8)):
            return False
    return True


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
    """

    def __init__(
        self,
        unit_index: int,
        memory_limit: int,
        capacity: int,
        spill_directory: Optional[str] = None,
        partitions: Optional[Sequence[str]] = None,
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
        self.rows.fast_to_slow_callbacks.append(self._on_spill)
        # Adopted buffers (see _adopt_group): groups by id, each in-memory member's group.
        self._groups: dict[int, _Group] = {}
        self._slot_group: dict[str, int] = {}
        self._pending: set[int] = set()  # groups that lost members: compaction check due
        self._next_group = 0
        self.pinned_bytes = 0
        self.index: dict[str, dict[str, str]] = {}  # partition -> key -> slot
        self.weights: dict[str, int] = {}  # slot -> row bytes, for capacity accounting
        self.used_bytes = 0
        self.registry = PartitionRegistry()
        self._next_slot = 0
        self.counters = {"puts": 0, "put_rows": 0, "gets": 0, "get_rows": 0, "deletes": 0, "deleted_rows": 0, "refused_rows": 0}
        self.answers = AnswerBuffers(_answer_buffer_bytes())
        self.closed = False

    # ---- puts -------------------------------------------------------------------

    def put_many(self, partition: str, batch: PackedBatch, adopt: bool = False) -> StoreResult:
        """Store every row of ``batch`` under ``partition``; per-key results.

        ``adopt``: the batch's buffers are handed over (the caller never touches them again;
        a batch that came over the wire always qualifies), so token-sized rows are kept as
        views of them instead of one copy per row."""
        self._check_open()
        check_partition(partition, self.partitions)
        if not isinstance(batch, PackedBatch):
            raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
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
        # Per field (not per row): a packed field has one dtype; present rows inherit its verdict.
        cols = []  # (name, values, offsets list, present list | None, spec, copy each row)
        shared: list[str] = []  # adopted fields: rows keep views of their buffers
        bad_field: list[Optional[str]] = [None] * n
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
            # Copy out of the batch buffer (the batch must not stay alive through our rows),
            # unless the buffers were adopted: then rows are views and the batch's token
            # buffers are tracked as one shared group (see _adopt_group).
            row = {
                name: values[off[i] : off[i + 1]].copy() if copy else values[off[i] : off[i + 1]]
                for name, values, off, present, _, copy in cols
                if present is None or present[i]
            }
            outcome, slot = self._store_row(partition, index, key, row)
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
            self._adopt_group(shared, cols, stored_slots)
        self._maybe_compact_pending()
        self.counters["put_rows"] += len(result.ok)
        self.counters["refused_rows"] += len(result.failed)
        return result

    # ---- adopted (shared) token buffers ----------------------------------------------
    #
    # An adopted put keeps each row's token fields as views of the batch's buffers: ONE
    # buffer per field shared by the batch's rows, freed when the last of them leaves
    # memory (deleted or spilled). Row weights stay exact (each view's bytes); the bytes
    # of a buffer no live in-memory row covers any more are ``pinned_bytes``, counted
    # against capacity. A group whose live rows cover less than half of its buffers is
    # compacted (its remaining rows copied out), so pinned bytes never exceed live ones; so
    # is a group whose pinned bytes take the unit past its capacity (rows refused from an
    # adopted put, or members spilled, must not hold memory the capacity does not allow).

    def _adopt_group(self, shared: list[str], cols: list, slots: list[str]) -> None:
        """Track the adopted buffers of fields ``shared`` as one group of rows ``slots``."""
        held = sum(c[1].nbytes for c in cols if c[0] in shared)
        members: dict[str, int] = {}
        for slot in slots:
            row = self.rows.fast.d.get(slot)
            if row is None:
                continue  # went straight to disk: holds nothing of the buffers
            # Bytes of the row's views (exact for any dtype / trailing shape).
            nbytes = sum(row[name].nbytes for name in shared if name in row)
            if nbytes:
                members[slot] = nbytes
        if not members:
            return  # nothing references the buffers: they are freed with the batch
        gid = self._next_group
        self._next_group += 1
        g = self._groups[gid] = _Group(members, held, sum(members.values()), tuple(shared))
        for slot in members:
            self._slot_group[slot] = gid
        self.pinned_bytes += g.held - g.live
        self._maybe_compact(gid)

    def _release(self, slot: str) -> None:
        """``slot``'s in-memory row is gone (deleted or spilled): update its group."""
        gid = self._slot_group.pop(slot, None)
        if gid is None:
            return
        g = self._groups[gid]
        nbytes = g.members.pop(slot)
        g.live -= nbytes
        if not g.members:
            self.pinned_bytes -= g.held - g.live - nbytes
            del self._groups[gid]
        else:
            self.pinned_bytes += nbytes
            self._pending.add(gid)

    def _on_spill(self, slot: str, row: Row) -> None:
        # zict callback, inside an eviction: only bookkeeping here; compaction waits for
        # the end of the current unit call (_maybe_compact_pending).
        self._release(slot)

    def _maybe_compact_pending(self) -> None:
        while self._pending:
            self._maybe_compact(self._pending.pop())

    def _maybe_compact(self, gid: int) -> None:
        g = self._groups.get(gid)
        if g is None or (2 * g.live >= g.held and self.used_bytes + self.pinned_bytes <= self.capacity):
            return
        del self._groups[gid]
        self.pinned_bytes -= g.held - g.live
        for slot in g.members:
            self._slot_group.pop(slot, None)
            row = self.rows.fast.d.get(slot)
            if row is not None:
                # Same key, same weight: zict keeps it in place (no eviction, no reorder of others).
                self.rows.fast.d[slot] = {k: (v.copy() if k in g.fields else v) for k, v in row.items()}

    def _store_row(self, partition: str, index: dict[str, str], key: str, row: Row) -> tuple[Optional[tuple[str, str]], Optional[str]]:
        """(failure or None, the new slot when the row was stored: None for an identical re-put)."""
        slot = index.get(key)
        if slot is not None:
            # Write-once: compare only when the key exists.
            try:
                existing = self.rows[slot]
            except Exception as e:  # a spill file gone bad must not take down the batch
                return (STORE_ERROR, f"{key!r}: reading the existing row failed: {e!r}"), None
            if same_row(existing, row):
                return None, None
            return (KEY_CONFLICT, f"{key!r} already holds different content in partition {partition!r}"), None
        weight = row_nbytes(row)
        if self.used_bytes + self.pinned_bytes + weight > self.capacity:
            return (
                STORE_FULL,
                f"{key!r}: {weight} bytes would exceed capacity {self.capacity} bytes "
                f"(used {self.used_bytes}, pinned {self.pinned_bytes}) of unit {self.unit_index}",
            ), None
        slot = str(self._next_slot)
        self._next_slot += 1
        try:
            self.rows[slot] = row
        except Exception as e:
            if slot not in self.rows:
                return (STORE_ERROR, f"{key!r}: storing failed: {e!r}"), None
        index[key] = slot
        self.weights[slot] = weight
        self.used_bytes += weight
        return None, slot

    # ---- gets -------------------------------------------------------------------

    def get_many(
        self, partition: str, keys: Sequence[str] | bytes, fields: Optional[Sequence[str] | bytes] = None
    ) -> GetResult:
        """Rows of ``keys`` (found ones, in request order) with ``fields`` (``None``: every
        field pinned in the partition; only explicitly requested fields report
        ``absent_field``). ``keys``/``fields`` may come as :func:`pack_names` bytes."""
        self._check_open()
        check_partition(partition, self.partitions)
        keys = unpack_names(keys, "keys")
        fields = None if fields is None else unpack_names(fields, "fields")
        self.counters["gets"] += 1
        index = self.index.get(partition, {})
        reg = self.registry.get(partition)
        failed: dict[str, tuple[str, str]] = {}
        found: list[str] = []
        rows: list[Row] = []
        for key in keys:
            slot = index.get(key) if isinstance(key, str) else None
            if slot is None:
                failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
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
        self._maybe_compact_pending()  # reading spilled rows back may have evicted others
        return out

    # ---- deletes ----------------------------------------------------------------

    def delete(self, partition: str, keys: Sequence[str]) -> StoreResult:
        """Remove ``keys``; an absent key is reported ``missing_key`` (nothing else changes)."""
        self._check_open()
        check_partition(partition, self.partitions)
        self.counters["deletes"] += 1
        index = self.index.get(partition, {})
        result = StoreResult()
        for key in keys:
            slot = index.pop(key, None) if isinstance(key, str) else None
            if slot is None:
                result.failed[key] = (MISSING_KEY, f"{key!r} not in partition {partition!r}")
                continue
            del self.rows[slot]
            self._release(slot)
            self.used_bytes -= self.weights.pop(slot)
            result.ok.append(key)
        self.counters["deleted_rows"] += len(result.ok)
        self._maybe_compact_pending()
        return result

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
            "pinned_bytes": self.pinned_bytes,
            "shared_groups": len(self._groups),
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
            **self.counters,
        }

    def keys(self, partition: str) -> list[str]:
        """Every key of ``partition`` (insertion order)."""
        return list(self.index.get(partition, {}))

    # ---- checkpoint -------------------------------------------------------------

    def checkpoint_write(self, directory: str, chunk_bytes: int) -> list[dict]:
        """Write every partition's rows as packed batch files (about ``chunk_bytes`` each)
        into ``directory`` atomically per file (temp, fsync, rename). Returns one manifest
        entry per file. Runs on the actor thread, so it is a consistent snapshot of this unit."""
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
            for j, (key, slot) in enumerate(items):
                chunk_keys.append(key)
                chunk_rows.append(self.rows.peek(slot))
                size += self.weights[slot]
                if size >= chunk_bytes or j == len(items) - 1:
                    batch = pack_stored_rows(chunk_keys, chunk_rows, names, reg)
                    name = f"u{self.unit_index:03d}-{partition}-{n_chunk:05d}{checkpoint.DATA_SUFFIX}"
                    sha, nbytes = checkpoint.write_atomic(os.path.join(directory, name), checkpoint.encode_batch(batch))
                    entries.append({"file": name, "partition": partition, "rows": len(batch), "bytes": nbytes, "sha256": sha})
                    chunk_keys, chunk_rows, size = [], [], 0
                    n_chunk += 1
        return entries

    # ---- lifecycle --------------------------------------------------------------

    def close(self) -> dict:
        """Drop every row and remove this unit's spill directory; returns final stats."""
        if self.closed:
            return {"unit": self.unit_index, "closed": True}
        final = self.stats()
        self.rows.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        self.index.clear()
        self.weights.clear()
        self._groups.clear()
        self._slot_group.clear()
        self._pending.clear()
        self.answers = AnswerBuffers(0)
        self.used_bytes = 0
        self.pinned_bytes = 0
        self.closed = True
        return final

    def _check_open(self) -> None:
        if self.closed:
            raise StoreUnavailable(f"storage unit {self.unit_index} is closed")
