"""The store's wire protocol: per-key results, their reason words, request checks.

What a storage unit and the client exchange besides the packed rows themselves:
:class:`StoreResult` / :class:`GetResult` (per-key outcomes), the per-key reason words
(defined here once), the checks both sides apply to partitions, keys and packed fields,
key/field lists packed as one msgpack buffer, and the duck types of a store
(:class:`StoreLike`, :class:`PlacedStoreLike`, :class:`AsyncStoreLike`). No Dask
import: the restore coalescer uses the reason words too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Protocol, Sequence

import msgpack
import numpy as np

from tasks.errors import InvalidKey, InvalidStoreRequest
from tasks.keys import rollout_of_key
from tasks.packed import PackedBatch, PackedField

PARTITION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Per-key failure reasons of put/get/delete (the vocabulary of StoreResult/GetResult).
KEY_CONFLICT = "key_conflict"  # put: the key holds different content (keys are write-once)
DTYPE_MISMATCH = "dtype_mismatch"  # put: a field's dtype/trailing shape differs from the pinned one
STORE_FULL = "store_full"  # put: the row would take the unit past its capacity (bytes)
INVALID_KEY = "invalid_key"  # the key is not a staging/cut key
INVALID_BATCH = "invalid_batch"  # put: a field cannot be cut into the batch's rows
MISSING_KEY = "missing_key"  # get/delete: no such key in the partition
ABSENT_FIELD = "absent_field"  # get: the row is served but lacks a requested field
STORE_ERROR = "store_error"  # the unit failed reading or writing the row (spill file)
UNIT_UNAVAILABLE = "unit_unavailable"  # client: the unit holding the key cannot be reached
# Not a failure: a delete acknowledged (the key is in ``ok``) whose removal waits until
# every store checkpoint open on the unit has ended (``StoreResult.deferred``).
DEFERRED = "deferred"


@dataclass
class StoreResult:
    """Per-key outcome of a put or delete: ``ok`` keys and ``failed[key] = (reason, detail)``.

    ``deferred`` (deletes only): keys of ``ok`` whose rows stay until the store checkpoint
    open on their unit ends (:data:`DEFERRED`); they are removed then, with no further call.
    """

    ok: list[str] = field(default_factory=list)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    deferred: list[str] = field(default_factory=list)

    @classmethod
    def merge(cls, results: Iterable["StoreResult"]) -> "StoreResult":
        out = cls()
        for r in results:
            out.ok.extend(r.ok)
            out.failed.update(r.failed)
            out.deferred.extend(getattr(r, "deferred", ()))
        return out


@dataclass
class GetResult:
    """Found keys in request order as ONE packed batch, and per-key failures.

    A key whose row lacks a requested field is served (``present[i]`` false for that
    field) and also listed in ``failed`` with reason ``absent_field``.
    """

    batch: PackedBatch
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)


class StoreLike(Protocol):
    """What code that stages or reads rows needs of a store (e.g. a :class:`StagingStore`)."""

    def put_many(self, batch: PackedBatch, partition: str = ..., adopt: bool = False) -> StoreResult: ...

    def get_many(self, keys: Sequence[str], fields: Sequence[str] | None = None, partition: str = ...) -> GetResult: ...

    def delete(self, keys: Sequence[str], partition: str = ...) -> StoreResult: ...


class PlacedStoreLike(StoreLike, Protocol):
    """A :class:`StoreLike` whose rows live on storage units: ``unit_workers[i]`` is the
    address of the worker hosting unit ``i`` (rows are placed by rollout over the units)."""

    @property
    def unit_workers(self) -> Sequence[str]: ...


class AsyncStoreLike(Protocol):
    """The async twins of :class:`StoreLike`, for coroutines on a worker's event loop
    (e.g. a :class:`StagingStore` inside an async actor)."""

    async def put_many_async(self, batch: PackedBatch, partition: str = ..., adopt: bool = False) -> StoreResult: ...

    async def get_many_async(
        self, keys: Sequence[str], fields: Sequence[str] | None = None, partition: str = ...
    ) -> GetResult: ...

    async def delete_async(self, keys: Sequence[str], partition: str = ...) -> StoreResult: ...


def check_partition(partition: object, allowed: Sequence[str] | None = None) -> str:
    """Return ``partition`` if usable, else raise :class:`InvalidStoreRequest` naming it."""
    if not isinstance(partition, str) or not PARTITION_RE.match(partition):
        raise InvalidStoreRequest(f"partition must match {PARTITION_RE.pattern}, got {partition!r}")
    if allowed is not None and partition not in allowed:
        raise InvalidStoreRequest(f"unknown partition {partition!r}; configured: {list(allowed)}")
    return partition


def check_key(key: object) -> str | None:
    """``None`` if ``key`` is a usable staging/cut key, else why not."""
    if not isinstance(key, str):
        return f"key must be str, got {type(key).__name__}"
    try:
        rollout_of_key(key)
    except InvalidKey as e:
        return str(e)
    return None


def field_problem(name: str, f: PackedField, n: int) -> str | None:
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


def same_row(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> bool:
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


def pack_names(names: Sequence[str]) -> bytes:
    """Keys or field names as ONE msgpack buffer for an actor call.

    Dask serializes a list argument element by element (~11 us per name per call, measured:
    an explicit 16-field list added ~180 us to every get); one ``bytes`` object costs
    nothing extra. msgpack, not pickle: the unit decodes plain strings only."""
    return msgpack.packb(list(names), use_bin_type=True)


def unpack_names(value: object, what: str) -> list:
    """The list a :func:`pack_names` buffer holds, or ``value`` itself as a list.

    Raises :class:`InvalidStoreRequest` naming ``what`` for undecodable bytes or a non-list."""
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
