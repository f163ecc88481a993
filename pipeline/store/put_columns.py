"""A put's batch as the columns a unit cuts rows from (per field, not per row).

A packed field has one dtype, so its verdict against the partition's pinned dtypes holds
for every row that has it. Small fields (ids, scalars, hashes: fewer than
:data:`~pipeline.store.row_packing.SMALL_FIELD_ELEMENTS` per row) are copied ONCE for
the batch and rows are views of that copy (a few KB, never keeping the batch's big
buffers alive). Big fields are copied per row, unless the put's buffers are adopted:
then rows are views of them, tracked as one shared group (see ``adopted.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tasks.packed import PackedBatch

from .registry import FieldRegistry
from .row_packing import SMALL_FIELD_ELEMENTS
from .spill import Row


@dataclass
class Column:
    """One field of the batch: values, offsets and presence as lists (indexed per row)."""

    name: str
    values: np.ndarray
    offsets: list[int]
    present: list[bool] | None
    spec: tuple
    copy: bool  # copy each row out (not adopted, not a small field's batch copy)


@dataclass
class Columns:
    """The fields rows are cut from, the adopted (shared) ones, and per row the first
    dtype mismatch against the partition's pinned fields (None: none)."""

    cols: list[Column]
    shared: list[str]
    bad_field: list[str | None]

    def row(self, i: int) -> Row:
        """Row ``i`` as ``{field: array}`` (copies or views, see the module docstring)."""
        return {
            c.name: c.values[c.offsets[i] : c.offsets[i + 1]].copy() if c.copy else c.values[c.offsets[i] : c.offsets[i + 1]]
            for c in self.cols
            if c.present is None or c.present[i]
        }

    def shared_bytes(self, rows: list[int]) -> int:
        """Bytes of the shared (adopted) fields in batch rows ``rows``."""
        total = 0
        for c in self.cols:
            if c.name in self.shared:
                per = c.values.itemsize * int(np.prod(c.values.shape[1:], dtype=np.int64))
                total += per * sum(c.offsets[i + 1] - c.offsets[i] for i in rows if c.present is None or c.present[i])
        return total

    def pin(self, reg: FieldRegistry, stored_rows: list[int]) -> None:
        """Pin the dtype of every field some stored row has."""
        for c in self.cols:
            if c.present is None or any(c.present[i] for i in stored_rows):
                reg.pin(c.name, c.spec)


def batch_columns(batch: PackedBatch, reg: FieldRegistry, adopt: bool) -> Columns:
    """``batch``'s fields as :class:`Columns` for a partition with registry ``reg``."""
    n = len(batch)
    cols: list[Column] = []
    shared: list[str] = []
    bad_field: list[str | None] = [None] * n
    for name, f in batch.fields.items():
        present = None if f.present is None else f.present.astype(bool).tolist()
        if present is not None and not any(present):
            continue
        detail = reg.mismatch(name, f.spec)
        if detail is not None:
            for i in range(n):
                if present is None or present[i]:
                    bad_field[i] = bad_field[i] or detail
            continue
        if len(f.values) < SMALL_FIELD_ELEMENTS * max(n, 1):
            cols.append(Column(name, f.values.copy(), f.offsets.tolist(), present, f.spec, False))
        else:
            cols.append(Column(name, f.values, f.offsets.tolist(), present, f.spec, not adopt))
            if adopt:
                shared.append(name)
    return Columns(cols, shared, bad_field)
