"""What a stored row costs and how stored rows leave a unit: byte weights and packing.

A row's weight (bytes, counted against a unit's capacity) is its arrays, its key's UTF-8
bytes and :data:`ROW_OVERHEAD_BYTES`. :func:`pack_stored_rows` packs rows a unit holds
into ONE packed batch, always copying, so no caller ever holds a view of stored rows;
:func:`view_stored_rows` gives heavy rows as read-only views instead, for an answer that
only crosses the wire (its bytes are sent from where they are stored, never copied).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from tasks.packed import PackedBatch, PackedField

from .adopted import root_of
from .registry import FieldRegistry
from .slab_pool import SlabPool
from .spill import Row

# Fields averaging fewer elements per row than this are copied once per batch, not per row.
SMALL_FIELD_ELEMENTS = 64
# Bytes charged to capacity per stored row besides its arrays (row_nbytes) and its key's
# UTF-8 bytes: the bookkeeping a row costs the unit wherever its arrays are (memory or
# disk), which never spills: the key str's object header, its index and weights dict
# entries, the slot name, the row dict and zict's LRU entries. Measured with tracemalloc
# on CPython 3.11: about 270 bytes for a field-less row.
ROW_OVERHEAD_BYTES = 256
# An answer whose rows weigh at least this on average (bytes) goes out as views: finding
# runs of rows stored side by side costs a few microseconds per row and field, copying a
# row of this size costs more.
VIEW_MIN_ROW_BYTES = 1 << 18


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


def view_stored_rows(keys: list[str], rows: Sequence[Row], names: Sequence[str]) -> list[PackedBatch] | None:
    """Rows held by a unit as runs of rows stored side by side (a put's rows, kept as
    views of the buffers it was received into), each run ONE packed batch whose fields
    are read-only views spanning the run: nothing copied. For an answer sent over the
    wire only (an in-process caller must get :func:`pack_stored_rows`' copies). ``None``
    (copy instead) for light rows, a row without one of ``names``, or no rows."""
    n = len(rows)
    sample = rows[: min(n, 8)]  # light rows are told by a few (the copy serves them either way)
    if not n or sum(a.nbytes for r in sample for a in r.values()) < len(sample) * VIEW_MIN_ROW_BYTES:
        return None
    if any(len(r) < len(names) or any(name not in r for name in names) for r in rows):
        return None
    runs: list[PackedBatch] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or not all(_follows(rows[i - 1][name], rows[i][name]) for name in names):
            runs.append(_run(keys[start:i], rows[start:i], names))
            start = i
    return runs


def _follows(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` starts right where ``a`` ends, in the same buffer, alike in layout."""
    if a.dtype != b.dtype or a.shape[1:] != b.shape[1:] or not (a.flags.c_contiguous and b.flags.c_contiguous):
        return False
    if b.__array_interface__["data"][0] != a.__array_interface__["data"][0] + a.nbytes:
        return False
    if a.base is not None and a.base is b.base:  # views of one array: the rows of one put
        return True
    return root_of(a) is root_of(b)


def _run(keys: list[str], rows: Sequence[Row], names: Sequence[str]) -> PackedBatch:
    """Rows lying side by side as one batch of read-only views spanning them."""
    fields = {}
    for name in names:
        first = rows[0][name]
        lengths = np.fromiter((len(r[name]) for r in rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        shape = (int(offsets[-1]),) + first.shape[1:]
        values = np.lib.stride_tricks.as_strided(first, shape=shape, strides=first.strides, writeable=False)
        fields[name] = PackedField(values, offsets, None)
    return PackedBatch(list(keys), fields)
