"""Row storage for one storage unit: memory up to a byte limit, then spilled to disk.

Modelled on ``distributed/spill.py``: a :class:`zict.Buffer` whose fast side is a dict
bounded by bytes (LRU) and whose slow side is ``zict.Func(dump_row, load_row,
zict.File(directory))``. A row is ``{field: np.ndarray}``; on disk it is one file of a
small msgpack header followed by the raw (8-byte aligned) array buffers, so a spill is
one ``writelines`` and a load is one ``readinto`` plus zero-copy ``np.frombuffer`` views.

Mapping keys are short strings chosen by the unit (slot numbers), never user keys:
user keys can be longer than a file name may be.

A spill that fails (disk full, permission) keeps the row in memory: the
:class:`zict.LRU` guarantees the key stays in ``fast``; we log and count it. Data is
never dropped here.
"""
from __future__ import annotations

import logging
import shutil
import struct
from typing import Iterable, Iterator, Mapping

import msgpack
import numpy as np
import zict

from tasks.packed import PackedBatch, element_bytes

logger = logging.getLogger(__name__)

Row = dict[str, np.ndarray]

# Rough per-array bookkeeping (ndarray object + dict slot), in bytes, so many tiny fields
# still count against the memory limit.
ARRAY_OVERHEAD_BYTES = 112
_ALIGN = 8
_HEADER_LEN = struct.Struct("<I")
SPILL_FORMAT = 1


def row_nbytes(row: Mapping[str, np.ndarray]) -> int:
    """In-memory weight of a row in bytes: array payloads plus per-array overhead."""
    return sum(a.nbytes for a in row.values()) + ARRAY_OVERHEAD_BYTES * len(row)


def batch_row_nbytes(batch: PackedBatch, names: Iterable[str]) -> list[int]:
    """:func:`row_nbytes` of every row of ``batch`` made of its fields ``names`` (those a
    row has: absent entries weigh nothing), computed per field, not per row (bytes)."""
    payload = np.zeros(len(batch), dtype=np.int64)
    arrays = np.zeros(len(batch), dtype=np.int64)
    for name in names:
        f = batch.fields[name]
        has = 1 if f.present is None else f.present.astype(np.int64)
        payload += np.diff(f.offsets) * element_bytes(f) * has
        arrays += has
    return (payload + ARRAY_OVERHEAD_BYTES * arrays).tolist()


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def dump_row(row: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
    """Serialize a row to a list of buffers (header, then each array, 8-byte aligned).

    Layout v1: ``<I header_len>`` msgpack ``[1, [[name, dtype.str, shape, offset, nbytes], ...]]``
    then padding to 8 bytes, then the array bytes at the offsets given (relative to the
    start of the data section).
    """
    entries = []
    buffers: list[bytes | memoryview] = []
    offset = 0
    for name, a in row.items():
        a = np.ascontiguousarray(a)
        entries.append([name, a.dtype.str, list(a.shape), offset, a.nbytes])
        if a.nbytes:
            buffers.append(memoryview(a).cast("B"))
        pad = _pad(a.nbytes)
        if pad:
            buffers.append(b"\x00" * pad)
        offset += a.nbytes + pad
    header = msgpack.packb([SPILL_FORMAT, entries])
    head = _HEADER_LEN.pack(len(header)) + header
    head += b"\x00" * _pad(len(head))
    return [head, *buffers]


def load_row(buf: bytes | bytearray | memoryview) -> Row:
    """Inverse of :func:`dump_row`; arrays are zero-copy views of ``buf`` (writeable if
    ``buf`` is a bytearray, which :class:`zict.File` returns)."""
    (hlen,) = _HEADER_LEN.unpack_from(buf, 0)
    version, entries = msgpack.unpackb(bytes(memoryview(buf)[4 : 4 + hlen]))
    if version != SPILL_FORMAT:
        raise ValueError(f"spill file format {version}, expected {SPILL_FORMAT}")
    start = 4 + hlen
    start += _pad(start)
    row: Row = {}
    for name, dtype, shape, offset, nbytes in entries:
        dt = np.dtype(dtype)
        count = nbytes // dt.itemsize if dt.itemsize else 0
        row[name] = np.frombuffer(buf, dtype=dt, count=count, offset=start + offset).reshape(shape)
    return row


class _DiskRows(zict.Func):
    """``Func(dump_row, load_row, File(dir))`` that also tracks bytes on disk per key."""

    def __init__(self, directory: str):
        super().__init__(dump_row, load_row, zict.File(directory))
        self.directory = directory
        self.disk_bytes_by_key: dict[str, int] = {}
        self.total_disk_bytes = 0

    def __setitem__(self, key: str, value: Row) -> None:
        bufs = self.dump(value)
        self.d[key] = bufs
        n = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in bufs)
        self.total_disk_bytes += n - self.disk_bytes_by_key.get(key, 0)
        self.disk_bytes_by_key[key] = n

    def __delitem__(self, key: str) -> None:
        del self.d[key]
        self.total_disk_bytes -= self.disk_bytes_by_key.pop(key, 0)


class SpillMapping(zict.Buffer):
    """``slot -> row`` kept in memory up to ``memory_limit`` bytes, the rest on disk.

    Parameters
    ----------
    directory:
        Spill directory (created if absent). :meth:`close` removes it.
    memory_limit:
        Bytes of rows (see :func:`row_nbytes`) kept in memory before the least recently
        used rows are written to disk. A row heavier than this goes straight to disk.
    """

    def __init__(self, directory: str, memory_limit: int):
        self.directory = str(directory)
        self.disk = _DiskRows(self.directory)
        # A row stored through put_row comes with its weight (computed for a whole batch
        # at once); any other insert (reads back from disk) is weighed here.
        self._known_weight: tuple[str, int] | None = None

        def weight(key: str, row: Row) -> int:
            known = self._known_weight
            return known[1] if known is not None and known[0] == key else row_nbytes(row)

        super().__init__(fast={}, slow=self.disk, n=int(memory_limit), weight=weight)
        self.spill_errors = 0
        # The LRU discards a key before every insert; for a key it does not hold that is a
        # raised-and-caught KeyError per row. Same semantics, checked first.
        lru = self.fast

        def discard_if_held(key: str) -> None:
            if key in lru.d or key in lru._cancel_evict:
                zict.common.discard(lru, key)

        lru.discard = discard_if_held

    def __setitem__(self, key: str, value: Row) -> None:
        try:
            if key in self.slow or key in self._cancel_restore:
                super().__setitem__(key, value)
            else:
                # A new key (the store's case: slots are never reused): skip Buffer's
                # discard-from-slow, which costs a raised KeyError per row.
                self.fast[key] = value
        except OSError:
            # zict keeps the row that failed to spill in memory: nothing is lost.
            self.spill_errors += 1
            logger.error("spill to %s failed; keeping row in memory", self.directory, exc_info=True)
            if key not in self:
                raise

    def put_row(self, key: str, row: Row, nbytes: int) -> None:
        """``self[key] = row`` for a row whose :func:`row_nbytes` is already known (``nbytes``)."""
        self._known_weight = (key, nbytes)
        try:
            self[key] = row
        finally:
            self._known_weight = None

    def peek(self, key: str) -> Row:
        """A row without promoting it from disk to memory (for scans like checkpoints)."""
        if key in self.fast:
            return self.fast.d[key]
        return self.slow[key]

    @property
    def memory_bytes(self) -> int:
        """Bytes of rows held in memory (by :func:`row_nbytes`)."""
        return int(self.fast.total_weight)

    @property
    def spilled_bytes(self) -> int:
        """Bytes written to spill files currently on disk."""
        return self.disk.total_disk_bytes

    @property
    def spilled_rows(self) -> int:
        return len(self.slow)

    def row_weight(self, key: str) -> int | None:
        """Stored weight of a key in memory, or ``None`` if it is on disk / absent."""
        return self.fast.weights.get(key)

    def iter_keys(self) -> Iterator[str]:
        return iter(list(self.fast.d) + list(self.slow))

    def close(self) -> None:
        """Drop every row and remove the spill directory. The rows in memory go now (zict's
        own close keeps them for as long as this object lives): their memory, a pooled
        slab they are views of, serves what comes next."""
        try:
            self.fast.clear()
            super().close()
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)
