"""What a stored row costs and how stored rows leave a unit: byte weights and packing.

A row's weight (bytes, counted against a unit's capacity) is its arrays, its key's UTF-8
bytes and :data:`ROW_OVERHEAD_BYTES`. :func:`pack_stored_rows` packs rows a unit holds
into ONE packed batch, always copying, so no caller ever holds a view of stored rows.
"""
from __future__ import annotations

from typing import Sequence

from tasks.packed import PackedBatch, PackedField

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
