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
    """One field of the batch: values, offsets (numpy for sums over rows, a list for
    slicing one row) and presence (a bool array, None: every row has it)."""

    name: str
    values: np.ndarray
    offsets: np.ndarray
    bounds: list[int]  # offsets.tolist(): Python ints slice a row faster than numpy scalars
    present: np.ndarray | None
    spec: tuple
    copy: bool  # copy each row out (not adopted, not a small field's batch copy)

    def elements(self, rows: np.ndarray) -> int:
        """Elements (first-axis entries) of this field in batch rows ``rows`` that have it."""
        sizes = self.offsets[rows + 1] - self.offsets[rows]
        return int(sizes.sum() if self.present is None else sizes[self.present[rows]].sum())


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
            c.name: c.values[c.bounds[i] : c.bounds[i + 1]].copy() if c.copy else c.values[c.bounds[i] : c.bounds[i + 1]]
            for c in self.cols
            if c.present is None or c.present[i]
        }

    def shared_bytes(self, rows: list[int]) -> int:
        """Bytes of the shared (adopted) fields in batch rows ``rows``."""
        idx = np.asarray(rows, dtype=np.int64)
        total = 0
        for c in self.cols:
            if c.name in self.shared:
                per = c.values.itemsize * int(np.prod(c.values.shape[1:], dtype=np.int64))
                total += per * c.elements(idx)
        return total

    def pin(self, reg: FieldRegistry, stored_rows: list[int]) -> None:
        """Pin the dtype of every field some stored row has."""
        idx = np.asarray(stored_rows, dtype=np.int64)
        for c in self.cols:
            if c.present is None or bool(c.present[idx].any()):
                reg.pin(c.name, c.spec)


def batch_columns(batch: PackedBatch, reg: FieldRegistry, adopt: bool) -> Columns:
    """``batch``'s fields as :class:`Columns` for a partition with registry ``reg``."""
    n = len(batch)
    cols: list[Column] = []
    shared: list[str] = []
    bad_field: list[str | None] = [None] * n
    for name, f in batch.fields.items():
        present = None if f.present is None else f.present.astype(bool)
        if present is not None and not present.any():
            continue
        detail = reg.mismatch(name, f.spec)
        if detail is not None:
            for i in range(n) if present is None else np.flatnonzero(present).tolist():
                bad_field[i] = bad_field[i] or detail
            continue
        offsets = np.asarray(f.offsets, dtype=np.int64)
        if len(f.values) < SMALL_FIELD_ELEMENTS * max(n, 1):
            cols.append(Column(name, f.values.copy(), offsets, offsets.tolist(), present, f.spec, False))
        else:
            cols.append(Column(name, f.values, offsets, offsets.tolist(), present, f.spec, not adopt))
            if adopt:
                shared.append(name)
    return Columns(cols, shared, bad_field)
