"""One coalesced get's answer, sliced into the rows each request it serves asked for.

:class:`GetAnswer` prepares a get's packed batch once; each slice (rows ``lo:hi``) is
views of the get's buffers, no copy, with rebased, read-only offsets.
"""
from __future__ import annotations

import numpy as np

from tasks.packed import PackedBatch, PackedField


class GetAnswer:
    """One get's rows, prepared once for the many requests that take slices of it.

    A mass resume slices each get's answer once per request (32 requests of 16 fields
    per get): the per-field offsets are read into Python lists once here, and fields
    whose offsets are equal (the token fields, the scalars, the hashes) share one rebased
    offsets array per slice, made read-only so no consumer can change one field's
    layout through another.
    """

    __slots__ = ("batch", "_fields", "_single", "_offsets")

    def __init__(self, batch: PackedBatch) -> None:
        self.batch = batch
        self._fields: list | None = None  # (name, values, offsets list, present, group), built on first slice
        self._single: list[np.ndarray] = []  # per group: read-only [n, 2] rows of [0, row length]
        self._offsets: list[np.ndarray] = []  # per group: the answer's offsets (int64)

    def _prepare(self) -> list:
        fields = []
        groups: list[np.ndarray] = []  # one offsets array per distinct layout
        for name, f in self.batch.fields.items():
            g = -1
            for j, other in enumerate(groups):
                if other is f.offsets or (other.shape == f.offsets.shape and np.array_equal(other, f.offsets)):
                    g = j
                    break
            if g < 0:
                g = len(groups)
                groups.append(f.offsets)
            fields.append((name, f.values, f.offsets.tolist(), f.present, g))
        for offsets in groups:
            self._offsets.append(np.asarray(offsets, dtype=np.int64))
            # A one-row slice's offsets are a row of this table: a view, no arithmetic.
            single = np.zeros((len(offsets) - 1, 2), dtype=np.int64)
            np.subtract(offsets[1:], offsets[:-1], out=single[:, 1])
            single.flags.writeable = False
            self._single.append(single)
        self._fields = fields
        return fields

    def slice(self, lo: int, hi: int) -> PackedBatch:
        """Rows ``lo:hi`` as views of the answer's buffers (offsets rebased), no copy."""
        if lo == 0 and hi == len(self.batch):
            return self.batch
        fields = self._fields if self._fields is not None else self._prepare()
        shared: dict[int, np.ndarray] = {}
        out = {}
        for name, values, offs, present, g in fields:
            start = offs[lo]
            rebased = shared.get(g)
            if rebased is None:
                if hi == lo + 1:
                    rebased = self._single[g][lo]
                else:
                    rebased = self._offsets[g][lo : hi + 1] - start
                    rebased.flags.writeable = False
                shared[g] = rebased
            if present is not None:
                present = present[lo:hi]
                if present.all():
                    present = None
            out[name] = PackedField(values[start : offs[hi]], rebased, present)
        return PackedBatch(self.batch.keys[lo:hi], out)
