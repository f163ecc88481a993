"""StagingStore: the client of the storage-unit actors.

Picklable (only actor handles and addresses), so one object works on the controller, in
Dask tasks and in other actors. A request is split by ``unit_for_key``, ONE actor call
goes to each unit involved (puts capped at ``store.max-call-bytes`` bytes per call), all
concurrently, and the per-key answers are merged (gets back into request order as ONE
packed batch). Sync methods block on actor futures; ``*_async`` twins await them.
"""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

import numpy as np

from tasks.errors import InvalidKey, InvalidStoreRequest, StoreError, StoreUnavailable
from tasks.keys import STAGING_PARTITION as DEFAULT_PARTITION, unit_for_key
from tasks.packed import PackedBatch, PackedField, payload_bytes_per_row, slice_rows, take_rows

from .. import config
from ..actors import current_workers, start_pinned_actors
from . import checkpoint as _checkpoint
from .protocol import (
    DTYPE_MISMATCH,
    INVALID_BATCH,
    INVALID_KEY,
    UNIT_UNAVAILABLE,
    GetResult,
    StoreResult,
    check_partition,
    field_problem,
    pack_names,
)
from .unit import StorageUnit


class StagingStore:
    """Batched, write-once row store over :class:`StorageUnit` actors.

    Build with :meth:`start` (or :meth:`from_checkpoint`); ``units[i]`` is an actor
    handle hosted on ``unit_workers[i]``.
    """

    def __init__(self, units: Sequence[Any], unit_workers: Sequence[str], partitions: Sequence[str] | None = None):
        self.units = list(units)
        self.unit_workers = list(unit_workers)
        self.partitions = None if partitions is None else list(partitions)

    # ---- construction -----------------------------------------------------------

    @classmethod
    def start(
        cls,
        client,
        n_units: int | None = None,
        memory_limit: int | str | None = None,
        capacity: int | str | None = None,
        spill_directory: str | None = None,
        workers: Sequence[str] | None = None,
    ) -> "StagingStore":
        """Create ``n_units`` storage units spread round-robin over ``workers``.

        Knobs left ``None`` come from config (``token-capture.store.units``,
        ``memory-limit`` and ``capacity`` in bytes or ``"256MiB"`` strings,
        ``spill-directory``; ``None`` there means each hosting worker's local directory).
        """
        n_units = int(config.get("store.units") if n_units is None else n_units)
        if n_units <= 0:
            raise InvalidStoreRequest(f"n_units must be positive, got {n_units}")
        memory_limit = config.parse_bytes(config.get("store.memory-limit") if memory_limit is None else memory_limit)
        capacity = config.parse_bytes(config.get("store.capacity") if capacity is None else capacity)
        if spill_directory is None:
            spill_directory = config.get("store.spill-directory")
        partitions = list(config.get("store.partitions"))
        for p in partitions:
            check_partition(p)
        workers = current_workers(client) if workers is None else list(workers)
        if not workers:
            raise StoreUnavailable("no workers to host storage units")
        placed = [workers[i % len(workers)] for i in range(n_units)]
        spill = None if spill_directory is None else str(spill_directory)
        units, futures = start_pinned_actors(
            client, StorageUnit, placed, args=[(i, memory_limit, capacity, spill, partitions) for i in range(n_units)],
        )
        store = cls(units, placed, partitions)
        store._futures = futures
        return store

    @classmethod
    def from_checkpoint(cls, client, path: str, **start_kwargs: Any) -> "StagingStore":
        """A new store (``start(client, **start_kwargs)``) loaded from the checkpoint at ``path``."""
        store = cls.start(client, **start_kwargs)
        try:
            store.restore(path, client=client)
        except BaseException:
            store.close()
            raise
        return store

    def __getstate__(self) -> dict:
        # Actor futures stay with the creator; handles are enough to call the units.
        return {"units": self.units, "unit_workers": self.unit_workers, "partitions": self.partitions}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    # ---- planning (pure, shared by sync and async paths) ------------------------

    def _check_partition(self, partition: str) -> str:
        if self.__dict__.get("_closed") is not None:
            raise StoreUnavailable("this store is closed")
        return check_partition(partition, self.partitions)

    def _route(self, keys: Sequence[str]) -> tuple[np.ndarray, dict[str, tuple[str, str]]]:
        """Unit index per key (-1 for an unusable key) and the invalid keys' failures."""
        n_units = len(self.units)
        where = np.empty(len(keys), dtype=np.int64)
        failed: dict[str, tuple[str, str]] = {}
        for i, key in enumerate(keys):
            try:
                if not isinstance(key, str):
                    raise InvalidKey(f"key must be str, got {type(key).__name__}")
                where[i] = unit_for_key(key, n_units)
            except InvalidKey as e:
                where[i] = -1
                failed[key if isinstance(key, str) else repr(key)] = (INVALID_KEY, str(e))
        return where, failed

    def _plan_put(self, batch: PackedBatch) -> tuple[list[tuple[int, PackedBatch]], dict]:
        if not isinstance(batch, PackedBatch):
            raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
        for name, f in batch.fields.items():
            # A field that cannot be cut into rows fails the batch per key (the unit would
            # refuse it the same way), before row sizes are computed from its offsets.
            problem = field_problem(name, f, len(batch))
            if problem:
                return [], {k if isinstance(k, str) else repr(k): (INVALID_BATCH, problem) for k in batch.keys}
        where, failed = self._route(batch.keys)
        max_bytes = config.get_bytes("store.max-call-bytes")
        row_bytes = payload_bytes_per_row(batch)
        parts = []
        for u in range(len(self.units)):
            idx = np.flatnonzero(where == u)
            # Cap bytes per actor call: several calls in flight pipeline the transfer of
            # one with the unit's copy of another, and no call needs a huge fresh buffer.
            for chunk in _chunks_by_bytes(idx, row_bytes, max_bytes):
                if len(chunk) == len(batch):
                    parts.append((u, batch))  # one unit, one call: no copy
                elif chunk[-1] - chunk[0] + 1 == len(chunk):
                    parts.append((u, slice_rows(batch, int(chunk[0]), int(chunk[-1]) + 1)))  # a run: views
                else:
                    parts.append((u, take_rows([batch], np.zeros(len(chunk), np.int64), chunk)))
        return parts, failed

    def _plan_keys(self, keys: Sequence[str]) -> tuple[list[str], list[tuple[int, list[str]]], dict]:
        uniq = list(dict.fromkeys(keys))
        where, failed = self._route(uniq)
        parts = []
        for u in range(len(self.units)):
            idx = np.flatnonzero(where == u)
            if len(idx):
                parts.append((u, [uniq[i] for i in idx]))
        return uniq, parts, failed

    # ---- sync API -----------------------------------------------------------------

    def put_many(self, batch: PackedBatch, partition: str = DEFAULT_PARTITION, adopt: bool = False) -> StoreResult:
        """Stage every row of ``batch``; per-key results (see :class:`StoreResult`).

        ``adopt=True``: the caller hands the batch's buffers over and never modifies them
        afterwards, so a unit may keep rows as views of them instead of copying each row
        (see :meth:`StorageUnit.put_many`)."""
        self._check_partition(partition)
        parts, failed = self._plan_put(batch)
        futures = [self.units[u].put_many(partition, sub, adopt) for u, sub in parts]
        results = [self._settle(u, f.result, sub.keys, StoreResult) for (u, sub), f in zip(parts, futures)]
        result = StoreResult.merge(results)
        result.failed.update(failed)
        return result

    def get_many(
        self, keys: Sequence[str], fields: Sequence[str] | None = None, partition: str = DEFAULT_PARTITION
    ) -> GetResult:
        """Rows of ``keys`` as ONE packed batch in request order (duplicates repeated),
        with ``fields`` (``None``: every field the partition holds). Missing keys and
        absent fields are reported per key in ``failed``; the rest is served."""
        self._check_partition(partition)
        fields = self._check_fields(fields)
        _, parts, failed = self._plan_keys(keys)
        wire_fields = None if fields is None else pack_names(fields)
        futures = [self.units[u].get_many(partition, pack_names(ks), wire_fields) for u, ks in parts]
        results = [self._settle(u, f.result, ks, _empty_get) for (u, ks), f in zip(parts, futures)]
        return _merge_gets(keys, results, failed)

    def delete(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION) -> StoreResult:
        """Delete ``keys`` (ONE call per unit involved, whatever the number of keys); absent
        keys come back ``missing_key``. Keys whose unit has a store checkpoint open come
        back ``ok`` and also in ``deferred``: their rows go when the checkpoint ends."""
        self._check_partition(partition)
        _, parts, failed = self._plan_keys(keys)
        futures = [self.units[u].delete(partition, pack_names(ks)) for u, ks in parts]
        result = StoreResult.merge(self._settle(u, f.result, ks, StoreResult) for (u, ks), f in zip(parts, futures))
        result.failed.update(failed)
        return result

    def stats(self) -> list[dict]:
        """Per unit: rows, used/memory/spilled/disk bytes, puts, gets, per-partition counts."""
        futures = [u.stats() for u in self.units]
        return [f.result() for f in futures]

    def keys(self, partition: str = DEFAULT_PARTITION, prefix: str | None = None) -> list[str]:
        """Every key of ``partition`` (one call per unit, all at once), optionally only those
        starting with ``prefix``; unit order, then insertion order. Raises :class:`StoreError`
        naming the unit when one cannot be reached: a listing is never silently partial."""
        self._check_partition(partition)
        futures = [u.keys(partition) for u in self.units]
        out: list[str] = []
        for i, f in enumerate(futures):
            try:
                ks = f.result()
            except (OSError, RuntimeError, StoreError) as e:
                raise StoreUnavailable(f"storage unit {i} cannot list its keys: {type(e).__name__}: {e}") from e
            out.extend(ks if prefix is None else (k for k in ks if k.startswith(prefix)))
        return out

    def close(self) -> list[dict]:
        """Close every unit (drops rows, removes spill directories) and release the actors.
        Idempotent; any later call through this object raises :class:`StoreError`."""
        if self.__dict__.get("_closed") is not None:
            return self._closed
        futures = [u.close() for u in self.units]
        out = []
        for i, f in enumerate(futures):
            try:
                out.append(f.result())
            except Exception as e:  # a lost unit has nothing left to close
                out.append({"unit": i, "closed": False, "error": f"{type(e).__name__}: {e}"})
        # Drop the actors now, not whenever every handle copy (graph submissions make
        # some) is garbage-collected: a forced cancel ends the actor tasks on the
        # scheduler whoever still holds a future; a later call through any handle then
        # fails ("Worker holding Actor was lost") instead of reaching a closed unit.
        futures = self.__dict__.pop("_futures", None) or []
        if futures:
            try:
                futures[0].client.cancel(futures, force=True)
            except Exception:  # the cluster may already be gone; nothing left to free
                pass
        self._closed = out
        return out

    # ---- async twins (inside async actors / coroutines on a worker) ---------------

    async def put_many_async(self, batch: PackedBatch, partition: str = DEFAULT_PARTITION, adopt: bool = False) -> StoreResult:
        self._check_partition(partition)
        parts, failed = self._plan_put(batch)
        results = await asyncio.gather(*(self.units[u].put_many(partition, sub, adopt) for u, sub in parts), return_exceptions=True)
        result = StoreResult.merge(self._settle(u, r, sub.keys, StoreResult) for (u, sub), r in zip(parts, results))
        result.failed.update(failed)
        return result

    async def get_many_async(
        self, keys: Sequence[str], fields: Sequence[str] | None = None, partition: str = DEFAULT_PARTITION
    ) -> GetResult:
        self._check_partition(partition)
        fields = self._check_fields(fields)
        _, parts, failed = self._plan_keys(keys)
        # Keys and fields travel as one msgpack buffer each (pack_names: a list argument
        # costs Dask ~11 us per element per call).
        wire_fields = None if fields is None else pack_names(fields)
        if len(parts) == 1:
            # One unit (a restore's keys, a coalesced get): await its call directly, no
            # gather task per get. Failures settle exactly as gather's would.
            (u, ks), = parts
            try:
                outcome: Any = await self.units[u].get_many(partition, pack_names(ks), wire_fields)
            except Exception as e:  # noqa: BLE001 - _settle keeps unit failures, re-raises bugs
                outcome = e
            return _merge_gets(keys, [self._settle(u, outcome, ks, _empty_get)], failed)
        results = await asyncio.gather(
            *(self.units[u].get_many(partition, pack_names(ks), wire_fields) for u, ks in parts), return_exceptions=True
        )
        return _merge_gets(keys, [self._settle(u, r, ks, _empty_get) for (u, ks), r in zip(parts, results)], failed)

    async def delete_async(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION) -> StoreResult:
        self._check_partition(partition)
        _, parts, failed = self._plan_keys(keys)
        results = await asyncio.gather(*(self.units[u].delete(partition, pack_names(ks)) for u, ks in parts), return_exceptions=True)
        result = StoreResult.merge(self._settle(u, r, ks, StoreResult) for (u, ks), r in zip(parts, results))
        result.failed.update(failed)
        return result

    async def stats_async(self) -> list[dict]:
        return list(await asyncio.gather(*(u.stats() for u in self.units)))

    # ---- checkpoint -----------------------------------------------------------------

    def checkpoint(self, path: str, chunk_bytes: int | str | None = None) -> dict:
        """Atomically checkpoint every unit into directory ``path``; returns the manifest.

        ``chunk_bytes`` (default ``token-capture.store.checkpoint-chunk-bytes``) bounds
        each data file; it is a runtime knob, not part of the checkpoint's identity.
        """
        if chunk_bytes is None:
            chunk_bytes = config.get("store.checkpoint-chunk-bytes")
        return _checkpoint.save(self, path, config.parse_bytes(chunk_bytes))

    def restore(self, path: str, client=None) -> dict:
        """Load the checkpoint at ``path`` into this store (rows placed by ``unit_for_key``
        over THIS store's units). Refuses a corrupt checkpoint with
        :class:`~tasks.errors.CheckpointCorrupt` before loading anything."""
        return _checkpoint.restore(self, path, client=client)

    def __repr__(self) -> str:
        return f"<StagingStore units={len(self.units)} workers={sorted(set(self.unit_workers))}>"

    def _settle(self, u: int, outcome: Any, keys: Sequence[str], empty: Any) -> Any:
        """One unit's answer: ``outcome`` is the answer, an exception (async gather) or a
        zero-argument callable giving the answer (a sync future's ``result``). A unit that
        failed as a whole (worker lost, unit closed) fails only ITS keys, as
        ``unit_unavailable``; the other units' answers stand."""
        try:
            if callable(outcome):
                outcome = outcome()
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        except (OSError, RuntimeError, StoreError) as e:
            # Unreachable worker (OSError, incl. comm/timeouts), "Worker holding Actor
            # was lost" (RuntimeError), a closed unit (StoreError). A bug (TypeError, ...)
            # still raises: it must not pass for a lost unit.
            worker = self.unit_workers[u] if u < len(self.unit_workers) else "?"
            detail = f"storage unit {u} on {worker} is unavailable: {type(e).__name__}: {e}"
            out = empty()
            out.failed.update({k: (UNIT_UNAVAILABLE, detail) for k in keys})
            return out

    def _check_fields(self, fields: Sequence[str] | None) -> list[str] | None:
        if fields is None:
            return None
        if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
            raise InvalidStoreRequest(f"fields must be a list of field names, got {fields!r}")
        return list(dict.fromkeys(fields))


def _empty_get() -> GetResult:
    return GetResult(PackedBatch([], {}), {})


def _chunks_by_bytes(idx: np.ndarray, row_bytes: np.ndarray, max_bytes: int) -> list[np.ndarray]:
    """Split row indices ``idx`` into runs of at most ``max_bytes`` (a bigger row goes alone)."""
    if not len(idx):
        return []
    sizes = row_bytes[idx]
    if int(sizes.sum()) <= max_bytes:
        return [idx]
    chunks, start, acc = [], 0, 0
    for i, b in enumerate(sizes.tolist()):  # per row, not per token
        if acc and acc + b > max_bytes:
            chunks.append(idx[start:i])
            start, acc = i, 0
        acc += b
    chunks.append(idx[start:])
    return chunks


def _merge_gets(keys: Sequence[str], results: list[GetResult], failed: dict) -> GetResult:
    """Per-unit answers -> ONE batch in request order (duplicate requests repeat rows).

    Units pin dtypes independently, so a field may come back with different specs from
    different units: the first spec (in unit order) that has rows wins and rows of a
    disagreeing unit are refused ``dtype_mismatch`` rather than silently cast.
    """
    for r in results:
        failed.update(r.failed)
    batches = [r.batch for r in results if len(r.batch)]
    if not batches:
        return GetResult(PackedBatch([], {}), failed)
    names = list(dict.fromkeys(n for b in batches for n in b.fields))
    chosen: dict[str, tuple[np.dtype, tuple]] = {}
    for name in names:
        with_rows = [b.fields[name] for b in batches if name in b.fields and b.fields[name].any_present()]
        proto = with_rows[0] if with_rows else next(b.fields[name] for b in batches if name in b.fields)
        chosen[name] = (proto.values.dtype, proto.values.shape[1:])
    aligned = []
    for b in batches:
        fields = {}
        bad = None
        for name in names:
            f = b.fields.get(name)
            if f is None or not f.any_present():
                fields[name] = PackedField.absent(len(b), *chosen[name])
            elif (f.values.dtype, f.values.shape[1:]) != chosen[name]:
                bad = (
                    f"field {name!r}: {f.values.dtype.str}{list(f.values.shape[1:])} on one unit, "
                    f"{np.dtype(chosen[name][0]).str}{list(chosen[name][1])} on another"
                )
                break
            else:
                fields[name] = f
        if bad is not None:
            failed.update({k: (DTYPE_MISMATCH, bad) for k in b.keys})
            continue
        aligned.append(PackedBatch(b.keys, fields))
    if not aligned:
        return GetResult(PackedBatch([], {}), failed)
    # Where each served key sits: (source batch, row); duplicates in the request repeat.
    where = {k: (b, j) for b, batch in enumerate(aligned) for j, k in enumerate(batch.keys)}
    picks = [where[k] for k in keys if k in where]
    src = np.fromiter((p[0] for p in picks), dtype=np.int64, count=len(picks))
    rows = np.fromiter((p[1] for p in picks), dtype=np.int64, count=len(picks))
    if len(aligned) == 1 and np.array_equal(rows, np.arange(len(aligned[0]))):
        return GetResult(aligned[0], failed)  # already one batch in request order
    return GetResult(take_rows(aligned, src, rows), failed)

