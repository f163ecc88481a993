"""Columnar batches: many rows as ONE contiguous buffer per field, plus offsets.

Row ``i`` of field ``f`` is ``values[offsets[i]:offsets[i + 1]]`` (offsets count
elements along axis 0; the trailing shape is fixed per field). A row may lack a field
(``present[i]`` false, zero length). Besides the two classes: row-range views
(:func:`slice_rows`), field alignment and gathers across batches (:func:`align_fields`,
:func:`concat_aligned`, :func:`take_rows`), and StagedRow packing. Pure numpy, no Dask.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from .schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_ENCODINGS,
    ROUTES_FIELD,
    ROUTES_UINT8,
    ROUTES_U8_FIELD,
    SCALAR_FIELDS,
    TOKEN_FIELDS,
    StagedRow,
)

Row = Mapping[str, np.ndarray]
# ``out(dtype, shape)`` -> an empty array to pack a field's values into (e.g. a view of a
# pooled slab); see :meth:`PackedField.from_arrays`.
Allocator = Callable[[np.dtype, tuple], np.ndarray]
# Fields whose rows average more elements than this are gathered by row slices (one
# memcpy per row) in :func:`take_rows`; smaller ones by numpy's element gather, which is
# cheaper for them.
SLICE_GATHER_MIN_ELEMENTS = 64
# A field's values of at least this many bytes travel as their own pickle buffer (out of
# band with protocol 5: Dask sends each as one frame, no copy); smaller values and every
# offsets/present array travel together in ONE buffer. A batch is then a handful of
# frames instead of two or three per field (each frame costs Dask ~tens of us per side).
OWN_BUFFER_MIN_BYTES = 1 << 16
_WIRE_ALIGN = 16  # byte alignment of each array inside the shared small buffer


@dataclass
class PackedField:
    """One field of a batch: a contiguous ``values`` buffer cut into rows by ``offsets``."""

    values: np.ndarray  # [total, *trailing]
    offsets: np.ndarray  # int64[n + 1]
    present: np.ndarray | None = None  # bool[n]; None means every row has the field

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> np.ndarray | None:
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
    def from_arrays(
        cls,
        arrays: Sequence[np.ndarray | None],
        *,
        dtype=None,
        trailing=None,
        copy: bool = False,
        out: Allocator | None = None,
    ) -> "PackedField":
        """Concatenate per-row arrays (``None`` = absent) into one buffer: one copy.

        ``dtype``: the values' dtype (rows of another dtype are cast); with ``trailing``,
        also the (empty) buffer's spec when no row has the field (default ``uint8``, ``()``).
        A lone contiguous row is used as is unless ``copy`` (always a NEW buffer, so the
        caller never holds a view of the rows). ``out(dtype, shape)`` supplies that new
        buffer (e.g. a view of a pooled slab) instead of a fresh allocation; implies ``copy``.
        """
        n = len(arrays)
        real = [a for a in arrays if a is not None]
        lengths = np.fromiter((0 if a is None else len(a) for a in arrays), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        present = None if len(real) == n else np.fromiter((a is not None for a in arrays), dtype=bool, count=n)
        if copy or out is not None:
            if real:
                dt, shape = real[0].dtype if dtype is None else np.dtype(dtype), real[0].shape[1:]
            else:
                dt, shape = np.dtype(np.uint8 if dtype is None else dtype), tuple(trailing or ())
            shape = (int(offsets[-1]),) + tuple(shape)
            values = np.empty(shape, dtype=dt) if out is None else out(dt, shape)
            if len(real) > 1:
                np.concatenate(real, out=values, casting="unsafe")
            elif real:
                values[...] = real[0]
        elif real:
            values = np.concatenate(real) if len(real) > 1 else np.ascontiguousarray(real[0])
            if dtype is not None and values.dtype != dtype:
                values = values.astype(dtype)
        else:
            values = np.zeros((0,) + tuple(trailing or ()), dtype=dtype or np.uint8)
        return cls(values, offsets, present)

    @classmethod
    def absent(cls, n: int, dtype, trailing: tuple = ()) -> "PackedField":
        """A field that none of ``n`` rows has (empty values of ``dtype``/``trailing``)."""
        return cls(np.zeros((0, *trailing), dtype=dtype), np.zeros(n + 1, dtype=np.int64), np.zeros(n, dtype=bool))

    def any_present(self) -> bool:
        """Whether some row has the field (``True`` whenever ``present`` is ``None``)."""
        return self.present is None or bool(self.present.any())

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
    # True only for a batch rebuilt from pickle protocol 5 buffers (:func:`_rebuild_batch`:
    # it arrived over a wire), whose buffers no caller holds: a storage unit may keep its
    # rows as views of them. Never set for a batch built, sliced or passed in-process.
    received: bool = field(default=False, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def __reduce_ex__(self, protocol: int) -> Any:
        # Protocol 5 (Dask's comms, multiprocessing): the few-buffers form; else the default.
        reduced = _reduce_batch(self, protocol) if protocol >= 5 else None
        return reduced if reduced is not None else super().__reduce_ex__(protocol)

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
    def from_rows(cls, keys: Sequence[str], rows: Sequence[Row], names: Iterable[str] | None = None) -> "PackedBatch":
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


# ---- pickling: a batch as a few buffers --------------------------------------------------


def _reduce_batch(batch: PackedBatch, protocol: int) -> tuple | None:
    """``(rebuild, args)`` carrying the big values as their own :class:`pickle.PickleBuffer`
    each and everything else in ONE shared buffer; ``None`` (use the default pickling)
    for a batch holding anything but plain numpy arrays (e.g. a malformed one being sent
    to a unit that must refuse it)."""
    layout: list[tuple] = []
    small: list[tuple[int, np.ndarray]] = []
    bigs: list[pickle.PickleBuffer] = []
    pos = 0
    try:
        for name, f in batch.fields.items():
            entries: list[tuple | None] = [name]
            for arr, own in ((f.values, True), (f.offsets, False), (f.present, False)):
                if arr is None:
                    entries.append(None)
                    continue
                if not isinstance(arr, np.ndarray) or arr.dtype.hasobject or arr.ndim == 0:
                    return None
                arr = np.ascontiguousarray(arr)
                if own and arr.nbytes >= OWN_BUFFER_MIN_BYTES:
                    entries.append(("b", len(bigs), arr.dtype.str, arr.shape))
                    bigs.append(pickle.PickleBuffer(arr))
                else:
                    pos = -(-pos // _WIRE_ALIGN) * _WIRE_ALIGN
                    entries.append(("s", pos, arr.dtype.str, arr.shape))
                    small.append((pos, arr))
                    pos += arr.nbytes
            layout.append(tuple(entries))
    except (ValueError, TypeError, BufferError):  # a dtype without the buffer protocol
        return None
    blob = np.empty(pos, dtype=np.uint8)
    for off, arr in small:
        blob[off : off + arr.nbytes] = arr.reshape(-1).view(np.uint8)
    return _rebuild_batch, (list(batch.keys), layout, pickle.PickleBuffer(blob), *bigs)


def _wire_array(entry: tuple | None, blob: memoryview, bigs: tuple) -> np.ndarray | None:
    if entry is None:
        return None
    kind, where, dtype, shape = entry
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype=dtype)
    if kind == "b":
        return np.frombuffer(bigs[where], dtype=dtype, count=count).reshape(shape)
    arr = np.frombuffer(blob, dtype=dtype, count=count, offset=where).reshape(shape)
    return arr if arr.flags.aligned else arr.copy()  # the shared buffer may land unaligned


def _rebuild_batch(keys: list, layout: list[tuple], blob: Any, *bigs: Any) -> PackedBatch:
    """Inverse of :func:`_reduce_batch`: arrays are views of the received buffers."""
    # Buffers handed over as PickleBuffer objects are a sender's own arrays, unpickled in
    # its process (no wire crossed): such a batch is not the receiver's to keep.
    received = not any(isinstance(b, pickle.PickleBuffer) for b in (blob, *bigs))
    blob = memoryview(blob)
    fields = {}
    for name, values, offsets, present in layout:
        fields[name] = PackedField(_wire_array(values, blob, bigs), _wire_array(offsets, blob, bigs), _wire_array(present, blob, bigs))
    return PackedBatch(keys, fields, received=received)


# ---- operations on batches: row ranges, alignment, gathers ----------------------------


def element_bytes(f: PackedField) -> int:
    """Bytes of one element of ``f`` along axis 0 (its itemsize times its trailing shape)."""
    return f.values.itemsize * int(np.prod(f.values.shape[1:], dtype=np.int64))


def payload_bytes_per_row(batch: PackedBatch) -> np.ndarray:
    """Payload bytes of each row of ``batch`` (all fields, offsets excluded), vectorized."""
    total = np.zeros(len(batch), dtype=np.int64)
    for f in batch.fields.values():
        total += np.diff(f.offsets) * element_bytes(f)
    return total


def gathered_nbytes(batch: PackedBatch, rows: np.ndarray) -> list[int]:
    """Bytes of each field's values for rows ``rows`` of ``batch``: what gathering them
    (:func:`take_rows`) allocates per field."""
    return [int(np.diff(f.offsets)[rows].sum()) * element_bytes(f) for f in batch.fields.values()]


def slice_rows(batch: PackedBatch, lo: int, hi: int) -> PackedBatch:
    """Rows ``lo:hi`` of ``batch`` as views of its buffers (offsets rebased, no copy);
    ``batch`` itself for the whole range."""
    if lo == 0 and hi == len(batch):
        return batch
    fields = {}
    for name, f in batch.fields.items():
        start, end = int(f.offsets[lo]), int(f.offsets[hi])
        present = None if f.present is None else f.present[lo:hi]
        if present is not None and present.all():
            present = None
        fields[name] = PackedField(f.values[start:end], f.offsets[lo : hi + 1] - start, present)
    return PackedBatch(list(batch.keys[lo:hi]), fields)


def align_fields(batches: Sequence[PackedBatch]) -> list[PackedBatch]:
    """Give every batch the union of the batches' fields (missing ones all-absent, with
    the spec of the first batch that has the field).

    A get of rows without routed experts may carry no ``routed_experts`` field at all;
    rows of several batches can only be gathered into one once the fields agree.
    """
    names: dict[str, PackedField] = {}
    for b in batches:
        for name, f in b.fields.items():
            names.setdefault(name, f)
    aligned = []
    for b in batches:
        if len(b.fields) == len(names):
            aligned.append(b)
            continue
        fields = {}
        for name, proto in names.items():
            f = b.fields.get(name)
            if f is None:
                f = PackedField.absent(len(b), proto.values.dtype, proto.values.shape[1:])
            fields[name] = f
        aligned.append(PackedBatch(list(b.keys), fields))
    return aligned


def concat_aligned(batches: Sequence[PackedBatch]) -> PackedBatch:
    """:meth:`PackedBatch.concat` for batches whose field sets differ."""
    return PackedBatch.concat(align_fields(batches))


def take_rows(batches: Sequence[PackedBatch], src: np.ndarray, rows: np.ndarray, out: Allocator | None = None) -> PackedBatch:
    """Row ``rows[i]`` of ``batches[src[i]]`` for every ``i``, as ONE new packed batch.

    The batches must carry the same fields (see :func:`align_fields`). Does the work of
    ``PackedBatch.concat`` + ``take`` in one copy per field. Long rows (token fields) are
    copied as row slices (a memcpy each) instead of building an element index as large
    as the data, which is what makes ``take`` slow on them; ``out(dtype, shape)`` supplies
    their values' buffers (e.g. views of a pooled slab) instead of fresh allocations.
    """
    keys = [batches[b].keys[j] for b, j in zip(src.tolist(), rows.tolist())]
    fields = {}
    for name in batches[0].fields:
        parts = [b.fields[name] for b in batches]
        if len(parts) == 1:
            field, index = parts[0], rows
        else:
            base = np.cumsum([0] + [len(p) for p in parts[:-1]])
            index = base[src] + rows
            field = None
        total = sum(len(p.values) for p in parts)
        n_rows = max(1, sum(len(p) for p in parts))
        if total / n_rows < SLICE_GATHER_MIN_ELEMENTS:
            if field is None:
                field = PackedBatch.concat([PackedBatch(b.keys, {name: b.fields[name]}) for b in batches]).fields[name]
            fields[name] = field.take(index)
            continue
        slices = []
        lengths = np.empty(len(src), dtype=np.int64)
        for i, (b, j) in enumerate(zip(src.tolist(), rows.tolist())):
            p = parts[b]
            lo, hi = int(p.offsets[j]), int(p.offsets[j + 1])
            slices.append(p.values[lo:hi])
            lengths[i] = hi - lo
        offsets = np.zeros(len(src) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        proto = parts[0].values
        shape = (int(offsets[-1]),) + proto.shape[1:]
        values = np.empty(shape, dtype=proto.dtype) if out is None else out(proto.dtype, shape)
        if slices:
            np.concatenate(slices, out=values)
        if all(p.present is None for p in parts):
            present = None
        else:
            present = np.fromiter((parts[b].has(j) for b, j in zip(src.tolist(), rows.tolist())), dtype=bool, count=len(src))
            if present.all():
                present = None
        fields[name] = PackedField(values, offsets, present)
    return PackedBatch(keys, fields)


# ---- StagedRow <-> PackedBatch -------------------------------------------------------


def _id_bytes(s: str | None) -> np.ndarray:
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
        # Each encoding in its own field (one dtype per field): int16 rows and uint8 rows
        # may share a batch, each row present in its encoding's field only.
        for enc, (name, dt) in ROUTES_ENCODINGS.items():
            routes = [r.routed_experts if r.routes_encoding == enc else None for r in rows]
            if any(a is not None for a in routes):
                fields[name] = PackedField.from_arrays(routes, dtype=dt)
    return PackedBatch(keys, fields)


def row_from_fields(row: Mapping[str, np.ndarray]) -> StagedRow:
    """Rebuild a :class:`StagedRow` from one packed row's field views (copies nothing big).

    Raises ``KeyError``/``ValueError``/``UnicodeDecodeError`` on a malformed row; the
    verifier maps those to ``invalid_staging_row``.
    """
    parent = bytes(row["parent_call_id"]).decode("utf-8")
    routes = row.get(ROUTES_U8_FIELD) if int(row["routes_encoding"][0]) == ROUTES_UINT8 else row.get(ROUTES_FIELD)
    return StagedRow(
        rollout_id=bytes(row["rollout_id"]).decode("utf-8"),
        model_call_id=bytes(row["model_call_id"]).decode("utf-8"),
        parent_call_id=parent or None,
        **{name: int(row[name][0]) for name in SCALAR_FIELDS},
        token_ids=row["token_ids"],
        token_mask=row["token_mask"],
        logprobs=row["logprobs"],
        routed_experts=routes,
        **{name: bytes(row[name]) for name in HASH_FIELDS},
    )


def unpack_rows(batch: PackedBatch) -> list[StagedRow]:
    """Every row of a batch as a :class:`StagedRow` (token arrays are views)."""
    return [row_from_fields(batch.row(i)) for i in range(len(batch))]
