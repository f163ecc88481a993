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

from tasks.errors import InvalidStoreRequest
from tasks.keys import key_problem
from tasks.packed import PackedBatch, PackedField

PARTITION_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# numpy dtype kinds a field's values may have: bool, signed/unsigned int, float, complex
# (fixed-size numbers). Object, str/unicode, bytes, void/structured, datetime are refused.
STORABLE_KINDS = frozenset("biufc")

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
MOVED = "moved"  # the unit was fenced by a move: the call's table is stale or the key is not its (refresh, retry)
# get/put: the key was staged, but both its copies were lost with their units (replicas=2;
# known from its witness). It reads as lost, never as missing, and a put of it is refused
# until a delete forgets the loss.
LOST_KEY = "lost_key"
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
    field) and also listed in ``failed`` with reason ``absent_field``. ``more``: keys of
    the request a unit left for further calls, its answer having reached the call's byte
    budget (neither served nor failed; the store client asks again). ``parts``: a unit's
    answer over the wire may serve its rows as several batches instead (runs of rows it
    stores side by side, sent from where they are: see ``view_stored_rows``), in request
    order after ``batch``'s; the store client merges them into one batch.
    """

    batch: PackedBatch
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)
    more: list[str] = field(default_factory=list)
    parts: list[PackedBatch] = field(default_factory=list)


class StoreLike(Protocol):
    """What code that stages or reads rows needs of a store (e.g. a :class:`StagingStore`)."""

    def put_many(self, batch: PackedBatch, partition: str = ..., adopt: bool = False, timeout: float | None = None) -> StoreResult: ...

    def get_many(self, keys: Sequence[str], fields: Sequence[str] | None = None, partition: str = ..., timeout: float | None = None) -> GetResult: ...

    def delete(self, keys: Sequence[str], partition: str = ..., timeout: float | None = None) -> StoreResult: ...


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
    """``None`` if ``key`` is a usable staging/cut key, else why not
    (:func:`tasks.keys.key_problem`: str, valid UTF-8, shape, id and key byte limits)."""
    return key_problem(key)


def split_valid_keys(keys: Sequence[object]) -> tuple[list[int], dict[str, tuple[str, str]]]:
    """``(indices of usable keys, {bad key: (INVALID_KEY, detail)})`` for a request's keys.

    A bad key (not str, not valid UTF-8 such as a lone surrogate, malformed, over the
    id/key byte limits: :func:`tasks.keys.key_problem`) fails alone; the others are
    served. A non-str key is reported under its ``repr``. Per key a few C-level string
    calls (an ASCII key is its own byte length; only a key longer than
    :data:`~tasks.keys.MAX_ID_BYTES` has its ids measured), no per-character Python."""
    valid: list[int] = []
    failed: dict[str, tuple[str, str]] = {}
    for i, key in enumerate(keys):
        detail = key_problem(key)
        if detail is None:
            valid.append(i)
        else:
            failed[key if isinstance(key, str) else repr(key)] = (INVALID_KEY, detail)
    return valid, failed


def field_problem(name: str, f: PackedField, n: int) -> str | None:
    """Why a packed field cannot be cut into ``n`` rows or stored (its dtype is not a
    fixed-size numeric or bool one, :data:`STORABLE_KINDS`), or ``None`` if it can."""
    if not isinstance(f, PackedField):
        return f"field {name!r} is {type(f).__name__}, not PackedField"
    off, values = f.offsets, f.values
    if not isinstance(off, np.ndarray) or not isinstance(values, np.ndarray):
        return f"field {name!r}: values and offsets must be numpy arrays"
    if off.ndim != 1 or len(off) != n + 1 or off.dtype.kind not in "iu":
        return f"field {name!r}: offsets must be integer[{n + 1}], got {off.dtype}{list(off.shape)}"
    if values.ndim < 1:
        return f"field {name!r}: values must be at least 1-d"
    if values.dtype.kind not in STORABLE_KINDS:
        # Objects would be stored as pointers (spill and checkpoint fail, or write
        # garbage); strings, bytes, void and structured dtypes are not row fields.
        return f"field {name!r}: dtype {values.dtype.str} ({values.dtype}) is not a fixed-size numeric or bool dtype"
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
