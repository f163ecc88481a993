"""Columnar batches: many rows as ONE contiguous buffer per field, plus offsets.

Serializing a dict of 256 small arrays costs per-array overhead that dominates the
payload (SPEC section 6: ~20 MB/s vs ~500 MB/s for one big array), so every round trip
in this project moves a :class:`PackedBatch`.

Every field is ragged along axis 0: row ``i`` of field ``f`` is
``values[offsets[i]:offsets[i + 1]]``, with a fixed trailing shape per field (``()`` for
tokens, ``(L, K)`` for routed experts). Scalars are one element per row, hashes 32
``uint8`` per row, ids their UTF-8 bytes. A row may lack a field (``present[i]`` false,
zero length), as a row without routed experts does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from .schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_DTYPE,
    ROUTES_FIELD,
    ROUTES_INT16,
    SCALAR_FIELDS,
    TOKEN_FIELDS,
    StagedRow,
)

Row = Mapping[str, np.ndarray]


@dataclass
class PackedField:
    """One field of a batch: a contiguous ``values`` buffer cut into rows by ``offsets``."""

    values: np.ndarray  # [total, *trailing]
    offsets: np.ndarray  # int64[n + 1]
    present: Optional[np.ndarray] = None  # bool[n]; None means every row has the field

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> Optional[np.ndarray]:
        if self.present is not None and not self.present[i]:
            return None
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def has(self, i: int) -> bool:
        return self.present is None or bool(self.present[i])

    @property
    def spec(self) -> tuple[str, tuple[int, ...]]:
        """(dtype string, trailing shape): what the store's registry pins per field."""
        return self.values.dtype.str, tuple(self.values.shape[1:])

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @classmethod
    def from_arrays(cls, arrays: Sequence[Optional[np.ndarray]], *, dtype=None, trailing=None) -> "PackedField":
        """Concatenate per-row arrays (``None`` = absent) into one buffer: one copy."""
        present = np.fromiter((a is not None for a in arrays), dtype=bool, count=len(arrays))
        real = [a for a in arrays if a is not None]
        lengths = np.fromiter((0 if a is None else len(a) for a in arrays), dtype=np.int64, count=len(arrays))
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if real:
            values = np.concatenate(real) if len(real) > 1 else np.ascontiguousarray(real[0])
            if dtype is not None and values.dtype != dtype:
                values = values.astype(dtype)
        else:
            values = np.zeros((0,) + tuple(trailing or ()), dtype=dtype or np.uint8)
        return cls(values, offsets, None if present.all() else present)

    def take(self, index: np.ndarray) -> "PackedField":
        """Rows ``index`` (in that order) as a new packed field."""
        index = np.asarray(index, dtype=np.int64)
        starts, ends = self.offsets[index], self.offsets[index + 1]
        lengths = ends - starts
        offsets = np.zeros(len(index) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if len(index) and offsets[-1]:
            # Gather index of every element without a Python loop over elements.
            gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
            values = self.values[gather]
        else:
            values = self.values[:0].copy()
        present = None if self.present is None else self.present[index]
        if present is not None and present.all():
            present = None
        return PackedField(values, offsets, present)


@dataclass
class PackedBatch:
    """Rows keyed by ``keys``, stored column-wise (see module docstring)."""

    keys: list[str]
    fields: dict[str, PackedField] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return sum(f.values.nbytes + f.offsets.nbytes for f in self.fields.values())

    def row(self, i: int) -> dict[str, np.ndarray]:
        """Row ``i`` as {field: view}; absent fields are left out."""
        out = {}
        for name, f in self.fields.items():
            v = f.row(i)
            if v is not None:
                out[name] = v
        return out

    def take(self, index: Iterable[int]) -> "PackedBatch":
        index = np.fromiter(index, dtype=np.int64) if not isinstance(index, np.ndarray) else index
        return PackedBatch([self.keys[i] for i in index], {n: f.take(index) for n, f in self.fields.items()})

    def select(self, names: Iterable[str]) -> "PackedBatch":
        return PackedBatch(list(self.keys), {n: self.fields[n] for n in names if n in self.fields})

    @classmethod
    def from_rows(cls, keys: Sequence[str], rows: Sequence[Row], names: Optional[Iterable[str]] = None) -> "PackedBatch":
        """Pack generic rows ({field: array}); a field missing from a row is marked absent."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} rows")
        if names is None:
            seen: dict[str, None] = {}
            for r in rows:
                seen.update(dict.fromkeys(r))
            names = list(seen)
        fields = {}
        for name in names:
            arrays = [r.get(name) for r in rows]
            proto = next((a for a in arrays if a is not None), None)
            fields[name] = PackedField.from_arrays(
                arrays,
                dtype=None if proto is None else proto.dtype,
                trailing=None if proto is None else proto.shape[1:],
            )
        return cls(list(keys), fields)

    @classmethod
    def concat(cls, batches: Sequence["PackedBatch"]) -> "PackedBatch":
        """Append batches that carry the same fields."""
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls([], {})
        if len(batches) == 1:
            return batches[0]
        keys = [k for b in batches for k in b.keys]
        names = list(batches[0].fields)
        fields = {}
        for name in names:
            parts = [b.fields[name] for b in batches]
            values = np.concatenate([p.values for p in parts])
            lengths = np.concatenate([p.lengths() for p in parts])
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            if all(p.present is None for p in parts):
                present = None
            else:
                present = np.concatenate([np.ones(len(p), bool) if p.present is None else p.present for p in parts])
            fields[name] = PackedField(values, offsets, present)
        return cls(keys, fields)


# ---- StagedRow <-> PackedBatch -------------------------------------------------------


def _id_bytes(s: Optional[str]) -> np.ndarray:
    return np.frombuffer((s or "").encode("utf-8"), dtype=np.uint8)


def pack_rows(rows: Sequence[StagedRow], *, with_routes: bool = True) -> PackedBatch:
    """Pack staged rows into one buffer per field. Per-row Python only, never per-token."""
    n = len(rows)
    keys = [r.staging_key for r in rows]
    arange = np.arange(n + 1, dtype=np.int64)
    fields: dict[str, PackedField] = {}
    for name in ID_FIELDS:
        fields[name] = PackedField.from_arrays([_id_bytes(getattr(r, name)) for r in rows], dtype=np.uint8)
    for name, dt in SCALAR_FIELDS.items():
        fields[name] = PackedField(np.fromiter((getattr(r, name) for r in rows), dtype=dt, count=n), arange.copy())
    for name in HASH_FIELDS:
        buf = b"".join(getattr(r, name) for r in rows)
        if len(buf) != n * HASH_BYTES:
            raise ValueError(f"{name}: every row needs {HASH_BYTES} bytes")
        fields[name] = PackedField(np.frombuffer(buf, dtype=np.uint8).copy(), arange * HASH_BYTES)
    for name, dt in TOKEN_FIELDS.items():
        fields[name] = PackedField.from_arrays([getattr(r, name) for r in rows], dtype=dt)
    if with_routes and any(r.routed_experts is not None for r in rows):
        fields[ROUTES_FIELD] = PackedField.from_arrays(
            [r.routed_experts if r.routes_encoding == ROUTES_INT16 else None for r in rows], dtype=ROUTES_DTYPE
        )
    return PackedBatch(keys, fields)


def row_from_fields(row: Mapping[str, np.ndarray]) -> StagedRow:
    """Rebuild a :class:`StagedRow` from one packed row's field views (copies nothing big).

    Raises ``KeyError``/``ValueError``/``UnicodeDecodeError`` on a malformed row; the
    verifier maps those to ``invalid_staging_row``.
    """
    parent = bytes(row["parent_call_id"]).decode("utf-8")
    return StagedRow(
        rollout_id=bytes(row["rollout_id"]).decode("utf-8"),
        model_call_id=bytes(row["model_call_id"]).decode("utf-8"),
        parent_call_id=parent or None,
        **{name: int(row[name][0]) for name in SCALAR_FIELDS},
        token_ids=row["token_ids"],
        token_mask=row["token_mask"],
        logprobs=row["logprobs"],
        routed_experts=row.get(ROUTES_FIELD),
        **{name: bytes(row[name]) for name in HASH_FIELDS},
    )


def unpack_rows(batch: PackedBatch) -> list[StagedRow]:
    """Every row of a batch as a :class:`StagedRow` (token arrays are views)."""
    return [row_from_fields(batch.row(i)) for i in range(len(batch))]
