"""StagingStore: the client of the storage-unit actors.

Picklable (only actor handles and addresses), so one object works on the controller, in
Dask tasks and in other actors. A request is split by ``unit_for_key``, ONE actor call
goes to each unit involved (puts capped at ``store.max-call-bytes`` bytes per call), all
concurrently, and the per-key answers are merged (gets back into request order as ONE
packed batch). Sync methods block on actor futures; ``*_async`` twins await them.
"""
from __future__ import annotations

import asyncio
import uuid
from typing import Any, Sequence

import numpy as np

from tasks.errors import InvalidStoreRequest, StoreError, StoreUnavailable
from tasks.keys import STAGING_PARTITION as DEFAULT_PARTITION, unit_for_key
from tasks.packed import PackedBatch, PackedField, gathered_nbytes, payload_bytes_per_row, slice_rows, take_rows

from .. import config
from ..actors import current_workers, local_call, start_pinned_actors
from . import checkpoint as _checkpoint
from . import receive_pool
from .protocol import (
    DTYPE_MISMATCH,
    INVALID_BATCH,
    UNIT_UNAVAILABLE,
    GetResult,
    StoreResult,
    check_partition,
    field_problem,
    pack_names,
    split_valid_keys,  # issue 11 #5
)
from .deadline import bounded, deadline, settle_all, waiter
from .directory import UnitDirectory, UnitTable
from .replication import merge_copies, merge_deletes, partners, replica_map, witness_map
from .slab_pool import SlabPool, process_pool
from .unit import StorageUnit


class StagingStore:
    """Batched, write-once row store over :class:`StorageUnit` actors.

    Build with :meth:`start` (or :meth:`from_checkpoint`); ``units[i]`` is an actor
    handle hosted on ``unit_workers[i]``.
    """

    def __init__(
        self,
        units: Sequence[Any],
        unit_workers: Sequence[str],
        partitions: Sequence[str] | None = None,
        replica: Sequence[int] | None = None,
        directory: UnitDirectory | None = None,
        version: int = 0,
        witness: Sequence[int | None] | None = None,
    ):
        self.units = list(units)
        self.unit_workers = list(unit_workers)
        self.partitions = None if partitions is None else list(partitions)
        # replicas=2: replica[u] is the unit holding the second copy of unit u's keys.
        self.replica = None if replica is None else list(replica)
        self.directory = directory  # the shared unit table (replicas=2), see directory.py
        self.version = int(version)
        # replicas=2: witness[p] records the names of unit p's keys (replication.witness_map).
        self.witness = None if witness is None else list(witness)

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
        replicas = int(config.get("store.replicas"))
        if replicas not in (1, 2):
            raise InvalidStoreRequest(f"token-capture.store.replicas must be 1 or 2, got {replicas}")
        replica = replica_map(placed) if replicas == 2 else None  # refuses a single worker
        spill = None if spill_directory is None else str(spill_directory)
        # Read here, once: every unit of this store (replacements included) keeps it.
        adopt_received = bool(config.get("store.adopt-received"))
        unit_args = (memory_limit, capacity, spill, partitions, adopt_received)
        units, futures = start_pinned_actors(client, StorageUnit, placed, args=[(i, *unit_args) for i in range(n_units)])
        if replica is None:
            store = cls(units, placed, partitions)
            store._futures = futures
            return store
        from .repair import Repairer

        directory = UnitDirectory(f"token-capture-units-{uuid.uuid4().hex[:12]}")
        store = cls(units, placed, partitions, replica, directory, witness=witness_map(placed, replica))
        store._futures = futures
        store.directory.publish(client, store._table())
        store._repairer = Repairer(store, client, unit_args)
        return store

    @classmethod
    def from_checkpoint(cls, client, path: str, **start_kwargs: Any) -> "StagingStore":
        """A new store (``start(client, **start_kwargs)``) loaded from the checkpoint at ``path``.

        All or nothing (see :meth:`restore`): if any row cannot be placed (e.g. the new
        store's capacity is too small) it raises :class:`~tasks.errors.RestoreIncomplete`
        and the new store is closed; a corrupt checkpoint raises ``CheckpointCorrupt``."""
        store = cls.start(client, **start_kwargs)
        try:
            store.restore(path, client=client)
        except BaseException:
            store.close()
            raise
        return store

    def __getstate__(self) -> dict:
        # Actor futures stay with the creator; handles are enough to call the units.
        return {
            "units": self.units, "unit_workers": self.unit_workers, "partitions": self.partitions,
            "replica": self.replica, "directory": self.directory, "version": self.version,
            "witness": self.witness,
        }

    def __setstate__(self, state: dict) -> None:
        state.setdefault("replica", None)
        state.setdefault("directory", None)
        state.setdefault("version", 0)
        state.setdefault("witness", None)
        self.__dict__.update(state)

    # ---- planning (pure, shared by sync and async paths) ------------------------

    def _check_partition(self, partition: str) -> str:
        if self.__dict__.get("_closed") is not None:
            raise StoreUnavailable("this store is closed")
        return check_partition(partition, self.partitions)

    def _route(self, keys: Sequence[str]) -> tuple[np.ndarray, dict[str, tuple[str, str]]]:
        """Unit index per key (-1 for an unusable key) and the invalid keys' failures."""
        n_units = len(self.units)
        where = np.full(len(keys), -1, dtype=np.int64)
        # issue 11 #5: bad keys (lone surrogates, over the byte limits, malformed) fail per
        # key here, so they never reach crc32 or pack_names (which raise for the batch).
        valid, failed = split_valid_keys(keys)
        for i in valid:
            where[i] = unit_for_key(keys[i], n_units)
        return where, failed

    def _plan_put(self, batch: PackedBatch) -> tuple[list[tuple[int, np.ndarray]], dict, dict[int, list[str]]]:
        """(unit, batch row indices) per actor call, the keys failed before any call, and
        the names each witness unit records (replicas=2).

        The sub-batches are cut by :meth:`_part` as each call is sent, so the copy of one
        overlaps the transfer of the previous one (see :meth:`_put_once`)."""
        if not isinstance(batch, PackedBatch):
            raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
        for name, f in batch.fields.items():
            # A field that cannot be cut into rows fails the batch per key (the unit would
            # refuse it the same way), before row sizes are computed from its offsets.
            problem = field_problem(name, f, len(batch))
            if problem:
                return [], {k if isinstance(k, str) else repr(k): (INVALID_BATCH, problem) for k in batch.keys}, {}
        where, failed = self._route(batch.keys)
        max_bytes = config.get_bytes("store.max-call-bytes")
        row_bytes = payload_bytes_per_row(batch)
        parts = []
        copy = self._replica_of(where)
        for u in range(len(self.units)):
            # With replicas=2 one call per unit carries its primary AND its replica rows.
            idx = np.flatnonzero(where == u) if copy is None else np.flatnonzero((where == u) | (copy == u))
            # Cap bytes per actor call: several calls in flight pipeline the transfer of
            # one with the unit's copy of another, and no call needs a huge fresh buffer.
            parts.extend((u, chunk) for chunk in _chunks_by_bytes(idx, row_bytes, max_bytes))
        return parts, failed, self._witness_names(batch.keys, where)

    def _witness_names(self, keys: Sequence[str], where: np.ndarray) -> dict[int, list[str]]:
        """Witness unit -> the names of ``keys`` it records (``where``: primary per key, -1
        unusable); empty without witnesses."""
        if self.witness is None:
            return {}
        wit = np.asarray([-1 if w is None else w for w in self.witness], dtype=np.int64)
        per_key = np.where(where >= 0, wit[np.maximum(where, 0)], -1)
        return {int(w): [keys[i] for i in np.flatnonzero(per_key == w)] for w in np.unique(per_key[per_key >= 0])}

    def _witness_only(self, partition: str, names: dict[int, list[str]], drop: bool) -> list[tuple[int, Any]]:
        """One ``witness`` call per witness unit not otherwise called (names to add or drop)."""
        return [
            (w, self.units[w].witness(partition, None, pack_names(ks)) if drop else self.units[w].witness(partition, pack_names(ks)))
            for w, ks in names.items()
        ]

    def _settle_witness(self, calls: list[tuple[int, Any]], end: float | None) -> None:
        """Wait for witness-only calls. A witness that cannot be reached fails no key (the
        copies decide a put); it only cannot tell a later loss of both copies."""
        for w, f in calls:
            self._settle(w, waiter(f, end), [], StoreResult)

    @staticmethod
    def _part(batch: PackedBatch, chunk: np.ndarray) -> PackedBatch:
        """Rows ``chunk`` (ascending) of ``batch``: the batch itself, a view of a run, or a gather."""
        if len(chunk) == len(batch):
            # One unit, one call: no copy. A new batch object, so a batch the caller itself
            # received never reaches a unit in-process still marked ``received``.
            return PackedBatch(batch.keys, batch.fields)
        if chunk[-1] - chunk[0] + 1 == len(chunk):
            return slice_rows(batch, int(chunk[0]), int(chunk[-1]) + 1)  # a run: views
        # Gathered into pooled memory: a fresh buffer per call page-faults on every put.
        out = client_buffers().allocator(gathered_nbytes(batch, chunk))
        return take_rows([batch], np.zeros(len(chunk), np.int64), chunk, out=out)

    def _plan_keys(self, keys: Sequence[str]) -> tuple[list[str], list[tuple[int, list[str]]], dict]:
        uniq = list(dict.fromkeys(keys))
        where, failed = self._route(uniq)
        parts = []
        for u in range(len(self.units)):
            idx = np.flatnonzero(where == u)
            if len(idx):
                parts.append((u, [uniq[i] for i in idx]))
        return uniq, parts, failed

    def _replica_of(self, where: np.ndarray) -> np.ndarray | None:
        """Replica unit per routed key (-1 where ``where`` is -1); None without replicas."""
        if self.replica is None:
            return None
        rep = np.asarray(self.replica, dtype=np.int64)
        return np.where(where >= 0, rep[np.maximum(where, 0)], -1)

    def _plan_all_copies(self, keys: Sequence[str]) -> tuple[list[str], list[tuple[int, list[str]]], dict]:
        """Like :meth:`_plan_keys`, but each unit gets every key it holds a copy of."""
        if self.replica is None:
            return self._plan_keys(keys)
        uniq = list(dict.fromkeys(keys))
        where, failed = self._route(uniq)
        copy = self._replica_of(where)
        parts = []
        for u in range(len(self.units)):
            idx = np.flatnonzero((where == u) | (copy == u))
            if len(idx):
                parts.append((u, [uniq[i] for i in idx]))
        return uniq, parts, failed

    # ---- sync API -----------------------------------------------------------------
    #
    # ``timeout`` (seconds, None: unbounded) bounds the whole call: a unit that has not
    # answered by then fails its keys ``unit_unavailable`` (detail: timeout); the other
    # units' answers stand. With replicas=2 the read fail-over gets what is left of it.

    def put_many(
        self, batch: PackedBatch, partition: str = DEFAULT_PARTITION, adopt: bool = False, timeout: float | None = None
    ) -> StoreResult:
        """Stage every row of ``batch``; per-key results (see :class:`StoreResult`).

        ``adopt=True``: the caller hands the batch's buffers over and never modifies them
        afterwards, so a unit may keep rows as views of them instead of copying each row
        (see :meth:`StorageUnit.put_many`). With replicas=2 a key is ``ok`` only when both
        of its copies are; a copy written while the other failed stays (a retry completes
        it: keys are write-once, an identical re-put is ok) and the key reports the failure."""
        self._check_partition(partition)
        end, v0 = deadline(timeout), self.version
        result = self._put_once(batch, partition, adopt, end)
        if _unavailable(result.failed) and self._refresh(v0):
            result = _splice(result, self._put_once(_failed_rows(result, batch), partition, adopt, end))
        return result

    def _put_once(
        self, batch: PackedBatch, partition: str, adopt: bool, end: float | None, claim: str | None = None
    ) -> StoreResult:
        plan, failed, names = self._plan_put(batch)
        calls = []
        for u, chunk in plan:
            # Each call is sent as soon as its rows are cut: the event loop serializes and
            # writes it while this thread gathers the next unit's rows. The first call to a
            # unit also carries the names it witnesses.
            sub = self._part(batch, chunk)
            calls.append((u, sub.keys, self.units[u].put_many(partition, sub, adopt, claim, _packed(names.pop(u, None)))))
        extra = self._witness_only(partition, names, drop=False)
        results = [self._settle(u, waiter(f, end), keys, StoreResult) for u, keys, f in calls]
        self._settle_witness(extra, end)
        return self._merge_puts(batch, results, failed)

    def get_many(
        self,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        partition: str = DEFAULT_PARTITION,
        timeout: float | None = None,
    ) -> GetResult:
        """Rows of ``keys`` as ONE packed batch in request order (duplicates repeated),
        with ``fields`` (``None``: every field the partition holds). Missing keys and
        absent fields are reported per key in ``failed``; the rest is served. With
        replicas=2, keys whose primary unit is unavailable are re-read from their replica
        (one batched get per replica unit)."""
        self._check_partition(partition)
        fields = self._check_fields(fields)
        receive_pool.install()  # the answers' frames land in reused memory (not on workers)
        end, v0 = deadline(timeout), self.version
        wire_fields = None if fields is None else pack_names(fields)
        _, parts, failed = self._plan_keys(keys)
        results = self._get_parts(parts, partition, wire_fields, end)
        lost = _unavailable_keys(results)
        if lost and self._refresh(v0):
            _, parts, _ = self._plan_keys(lost)
            results = _drop_failed(results, lost) + self._get_parts(parts, partition, wire_fields, end)
        return _merge_gets(keys, results, failed)

    def _get_parts(self, parts, partition: str, wire_fields, end: float | None) -> list[GetResult]:
        futures = [self._get_call(u)(partition, pack_names(ks), wire_fields) for u, ks in parts]
        results = [self._settle(u, waiter(f, end), ks, _empty_get) for (u, ks), f in zip(parts, futures)]
        if self.replica is None:
            return results
        again = self._failover_parts(results)
        if not again:
            return results
        futures = [self.units[r].get_many(partition, pack_names(ks), wire_fields) for r, ks in again]
        second = [self._settle(r, waiter(f, end), ks, _empty_get) for (r, ks), f in zip(again, futures)]
        return _after_failover(results, second)

    def _get_call(self, u: int) -> Any:
        """Unit ``u``'s ``get_many``: in-process on its actor thread when this code runs on
        the unit's own worker (``store.local-reads``; no socket, no serialization, the answer
        is the unit's pooled buffer itself), else the actor call."""
        if config.get("store.local-reads"):
            local = local_call(self.units[u], "get_many")
            if local is not None:
                return local
        return self.units[u].get_many

    def delete(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION, timeout: float | None = None) -> StoreResult:
        """Delete ``keys`` (ONE call per unit involved, whatever the number of keys; with
        replicas=2 each unit gets the keys of both copies it holds); absent keys come back
        ``missing_key``. Keys whose unit has a store checkpoint open come back ``ok`` and
        also in ``deferred``: their rows go when the checkpoint ends."""
        self._check_partition(partition)
        end, v0 = deadline(timeout), self.version
        result = self._delete_once(keys, partition, end)
        if _unavailable(result.failed) and self._refresh(v0):
            again = self._delete_once([k for k, (r, _) in result.failed.items() if r == UNIT_UNAVAILABLE], partition, end)
            result = _splice(result, again)
        return result

    def _delete_once(self, keys: Sequence[str], partition: str, end: float | None) -> StoreResult:
        uniq, parts, failed = self._plan_all_copies(keys)
        names = self._witness_names(uniq, self._route(uniq)[0])
        futures = [self.units[u].delete(partition, pack_names(ks), _packed(names.pop(u, None))) for u, ks in parts]
        extra = self._witness_only(partition, names, drop=True)
        results = [self._settle(u, waiter(f, end), ks, StoreResult) for (u, ks), f in zip(parts, futures)]
        self._settle_witness(extra, end)
        result = StoreResult.merge(results) if self.replica is None else merge_deletes(results, uniq)
        result.failed.update(failed)
        return result

    # ---- provisional puts (restore): all or nothing per key, across copies -------------

    def put_claimed(
        self, batch: PackedBatch, claim: str, partition: str = DEFAULT_PARTITION, timeout: float | None = None
    ) -> StoreResult:
        """:meth:`put_many`, but the rows it creates stay provisional under ``claim`` (a
        restore's token) until :meth:`settle_claim`, so :meth:`release_claim` can take
        them back on every copy; a row another writer puts meanwhile is theirs and stays."""
        self._check_partition(partition)
        if not isinstance(claim, str) or not claim:
            raise InvalidStoreRequest(f"claim must be a non-empty str, got {claim!r}")
        end, v0 = deadline(timeout), self.version
        result = self._put_once(batch, partition, False, end, claim)
        if _unavailable(result.failed) and self._refresh(v0):
            result = _splice(result, self._put_once(_failed_rows(result, batch), partition, False, end, claim))
        return result

    def release_claim(self, keys: Sequence[str], claim: str, partition: str = DEFAULT_PARTITION) -> tuple[int, dict]:
        """Remove every copy of ``keys`` still provisional under ``claim`` (ONE call per unit
        holding a copy). Returns (rows removed, ``{key: (reason, detail)}`` of the keys on
        units that could not be reached, whose copies may remain)."""
        self._check_partition(partition)
        _, parts, _ = self._plan_all_copies(keys)
        futures = [self.units[u].release_claim(partition, pack_names(ks), claim) for u, ks in parts]
        removed, failed = 0, {}
        for (u, ks), f in zip(parts, futures):
            try:
                removed += f.result()["removed"]
            except Exception as e:  # noqa: BLE001 - the unit's copies stay; the caller says so
                failed.update({k: (UNIT_UNAVAILABLE, f"unit {u}: {type(e).__name__}: {e}") for k in ks})
        return removed, failed

    def settle_claim(self, claim: str) -> int:
        """Every row provisional under ``claim`` becomes an ordinary row (one call per unit);
        returns how many. A unit that cannot be reached keeps its marks (they only let a
        release with this claim remove rows nobody else put)."""
        futures = [u.settle_claim(claim) for u in self.units]
        return sum(r for r in settle_all(futures) if isinstance(r, int))

    def stats(self) -> list[dict]:
        """Per unit: rows, used/memory/spilled/disk bytes, puts, gets, per-partition counts."""
        futures = [u.stats() for u in self.units]
        return [f.result() for f in futures]

    def keys(self, partition: str = DEFAULT_PARTITION, prefix: str | None = None) -> list[str]:
        """Every key of ``partition`` (one call per unit, all at once), optionally only those
        starting with ``prefix``; unit order, then insertion order. Raises :class:`StoreError`
        naming the unit when one cannot be reached (with replicas=2: when a unit and a unit
        holding the other copy of some of its keys both cannot): a listing is never silently
        partial."""
        self._check_partition(partition)
        futures = [u.keys(partition) for u in self.units]
        out: list[str] = []
        lost: dict[int, str] = {}
        for i, f in enumerate(futures):
            try:
                ks = f.result()
            except (OSError, RuntimeError, StoreError) as e:
                lost[i] = f"storage unit {i} cannot list its keys: {type(e).__name__}: {e}"
                continue
            out.extend(ks if prefix is None else (k for k in ks if k.startswith(prefix)))
        for i, why in lost.items():
            if self.replica is None or any(p in lost for p in partners(i, self.replica)):
                raise StoreUnavailable(why)
        return out if self.replica is None else list(dict.fromkeys(out))

    def close(self) -> list[dict]:
        """Close every unit (drops rows, removes spill directories) and release the actors.
        Idempotent; any later call through this object raises :class:`StoreError`."""
        if self.__dict__.get("_closed") is not None:
            return self._closed
        repairer = self.__dict__.pop("_repairer", None)
        if repairer is not None:
            repairer.stop()
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
        futures = futures + (self.__dict__.pop("_old_futures", None) or [])
        if futures:
            try:
                futures[0].client.cancel(futures, force=True)
            except Exception:  # the cluster may already be gone; nothing left to free
                pass
            if self.directory is not None:
                self.directory.delete(futures[0].client)
        self._closed = out
        return out

    # ---- async twins (inside async actors / coroutines on a worker) ---------------

    async def put_many_async(
        self, batch: PackedBatch, partition: str = DEFAULT_PARTITION, adopt: bool = False, timeout: float | None = None
    ) -> StoreResult:
        self._check_partition(partition)
        end, v0 = deadline(timeout), self.version
        result = await self._put_once_async(batch, partition, adopt, end)
        if _unavailable(result.failed) and await self._refresh_async(v0):
            again = await self._put_once_async(_failed_rows(result, batch), partition, adopt, end)
            result = _splice(result, again)
        return result

    async def _put_once_async(self, batch: PackedBatch, partition: str, adopt: bool, end: float | None) -> StoreResult:
        plan, failed, names = self._plan_put(batch)
        parts = [(u, self._part(batch, chunk), names.pop(u, None)) for u, chunk in plan]
        extra = self._witness_only(partition, names, drop=False)
        results = await asyncio.gather(
            *(bounded(self.units[u].put_many(partition, sub, adopt, None, _packed(wit)), end) for u, sub, wit in parts),
            *(bounded(f, end) for _, f in extra),
            return_exceptions=True,
        )
        return self._merge_puts(
            batch, [self._settle(u, r, sub.keys, StoreResult) for (u, sub, _), r in zip(parts, results)], failed
        )

    async def get_many_async(
        self,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        partition: str = DEFAULT_PARTITION,
        timeout: float | None = None,
    ) -> GetResult:
        self._check_partition(partition)
        fields = self._check_fields(fields)
        receive_pool.install()
        end, v0 = deadline(timeout), self.version
        _, parts, failed = self._plan_keys(keys)
        # Keys and fields travel as one msgpack buffer each (pack_names: a list argument
        # costs Dask ~11 us per element per call).
        wire_fields = None if fields is None else pack_names(fields)
        results = await self._get_parts_async(parts, partition, wire_fields, end)
        lost = _unavailable_keys(results)
        if lost and await self._refresh_async(v0):
            _, parts, _ = self._plan_keys(lost)
            results = _drop_failed(results, lost) + await self._get_parts_async(parts, partition, wire_fields, end)
        return _merge_gets(keys, results, failed)

    async def _get_parts_async(self, parts, partition: str, wire_fields, end: float | None) -> list[GetResult]:
        if len(parts) == 1:
            # One unit (a restore's keys, a coalesced get): await its call directly, no
            # gather task per get. Failures settle exactly as gather's would.
            (u, ks), = parts
            try:
                outcome: Any = await bounded(self.units[u].get_many(partition, pack_names(ks), wire_fields), end)
            except Exception as e:  # noqa: BLE001 - _settle keeps unit failures, re-raises bugs
                outcome = e
            results = [self._settle(u, outcome, ks, _empty_get)]
        else:
            outs = await asyncio.gather(
                *(bounded(self.units[u].get_many(partition, pack_names(ks), wire_fields), end) for u, ks in parts),
                return_exceptions=True,
            )
            results = [self._settle(u, r, ks, _empty_get) for (u, ks), r in zip(parts, outs)]
        if self.replica is None:
            return results
        again = self._failover_parts(results)
        if not again:
            return results
        outs = await asyncio.gather(
            *(bounded(self.units[r].get_many(partition, pack_names(ks), wire_fields), end) for r, ks in again),
            return_exceptions=True,
        )
        return _after_failover(results, [self._settle(r, o, ks, _empty_get) for (r, ks), o in zip(again, outs)])

    async def delete_async(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION, timeout: float | None = None) -> StoreResult:
        self._check_partition(partition)
        end, v0 = deadline(timeout), self.version
        result = await self._delete_once_async(keys, partition, end)
        if _unavailable(result.failed) and await self._refresh_async(v0):
            again = await self._delete_once_async([k for k, (r, _) in result.failed.items() if r == UNIT_UNAVAILABLE], partition, end)
            result = _splice(result, again)
        return result

    async def _delete_once_async(self, keys: Sequence[str], partition: str, end: float | None) -> StoreResult:
        uniq, parts, failed = self._plan_all_copies(keys)
        names = self._witness_names(uniq, self._route(uniq)[0])
        calls = [(u, ks, names.pop(u, None)) for u, ks in parts]
        extra = self._witness_only(partition, names, drop=True)
        outs = await asyncio.gather(
            *(bounded(self.units[u].delete(partition, pack_names(ks), _packed(wit)), end) for u, ks, wit in calls),
            *(bounded(f, end) for _, f in extra),
            return_exceptions=True,
        )
        results = [self._settle(u, r, ks, StoreResult) for (u, ks), r in zip(parts, outs)]
        result = StoreResult.merge(results) if self.replica is None else merge_deletes(results, uniq)
        result.failed.update(failed)
        return result

    async def stats_async(self) -> list[dict]:
        return list(await asyncio.gather(*(u.stats() for u in self.units)))

    # ---- replication: copies, fail-over, the shared unit directory -------------------

    def _merge_puts(self, batch: PackedBatch, results: list[StoreResult], failed: dict) -> StoreResult:
        if self.replica is None:
            result = StoreResult.merge(results)
        else:
            result = merge_copies(results, [k for k in batch.keys if isinstance(k, str) and k not in failed])
        result.failed.update(failed)
        return result

    def _failover_parts(self, results: list[GetResult]) -> list[tuple[int, list[str]]]:
        """Keys whose primary answered ``unit_unavailable``, grouped by replica unit (their
        failures stay in ``results`` until :func:`_after_failover` replaces them)."""
        n = len(self.units)
        by_replica: dict[int, list[str]] = {}
        for r in results:
            for k, (reason, _) in r.failed.items():
                if reason == UNIT_UNAVAILABLE:
                    by_replica.setdefault(self.replica[unit_for_key(k, n)], []).append(k)
        return sorted(by_replica.items())

    def _table(self) -> UnitTable:
        return UnitTable(self.version, list(self.units), list(self.unit_workers), self.replica)

    def _adopt(self, table: UnitTable | None) -> bool:
        """Take ``table`` if it is newer than ours; True if the units changed."""
        if table is None or table.version <= self.version:
            return False
        self.units, self.unit_workers, self.version = list(table.units), list(table.unit_workers), table.version
        return True

    def _refresh(self, seen: int) -> bool:
        """After a call (made with table version ``seen``) found a unit unavailable: True
        if the units changed since, fetching the shared table (one round trip) unless this
        is the creator, whose repairer updates this object itself."""
        if self.version > seen:
            return True
        if self.directory is None or self.__dict__.get("_repairer") is not None:
            return False
        return self._adopt(self.directory.fetch())

    async def _refresh_async(self, seen: int) -> bool:
        if self.version > seen:
            return True
        if self.directory is None or self.__dict__.get("_repairer") is not None:
            return False
        return self._adopt(await self.directory.fetch_async())

    def _replace_unit(self, u: int, handle: Any, worker: str, future: Any) -> None:
        """Install a re-replicated unit ``u`` (the repairer, creator only) and publish."""
        units, workers = list(self.units), list(self.unit_workers)
        units[u], workers[u] = handle, worker
        futures = list(self.__dict__.get("_futures") or [])
        if u < len(futures):
            self.__dict__.setdefault("_old_futures", []).append(futures[u])
            futures[u] = future
        self._futures = futures
        self.units, self.unit_workers = units, workers
        self.version += 1
        self.directory.publish(future.client, self._table())

    # ---- checkpoint -----------------------------------------------------------------

    def checkpoint(self, path: str, chunk_bytes: int | str | None = None) -> dict:
        """Atomically checkpoint every unit into directory ``path``; returns the manifest.

        ``chunk_bytes`` (default ``token-capture.store.checkpoint-chunk-bytes``) bounds
        each data file; it is a runtime knob, not part of the checkpoint's identity. With
        ``token-capture.store.checkpoint-key`` set (a key file's path) the manifest is
        signed with HMAC-SHA256.
        """
        if chunk_bytes is None:
            chunk_bytes = config.get("store.checkpoint-chunk-bytes")
        return _checkpoint.save(self, path, config.parse_bytes(chunk_bytes))

    def restore(self, path: str, client=None, allow_older: bool = False) -> dict:
        """Load the checkpoint at ``path`` into this store (rows placed by ``unit_for_key``
        over THIS store's units), all or nothing.

        Refuses a corrupt checkpoint (a file failing its digest or decode, a file name
        outside ``path``, an unsigned or wrongly signed manifest when
        ``store.checkpoint-key`` is set) with :class:`~tasks.errors.CheckpointCorrupt`
        before loading anything. If any key then fails to load, the rows it added are
        removed again and it raises :class:`~tasks.errors.RestoreIncomplete` (``failed``:
        key -> (reason, detail)); rows this store held before are never changed. With
        a key set, a signed checkpoint older than the newest saved or restored for this
        store name raises :class:`~tasks.errors.CheckpointReplayed` unless ``allow_older``."""
        return _checkpoint.restore(self, path, client=client, allow_older=allow_older)

    def __repr__(self) -> str:
        copies = "" if self.replica is None else " replicas=2"
        return f"<StagingStore units={len(self.units)}{copies} workers={sorted(set(self.unit_workers))}>"

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
        except TimeoutError:
            # A hung (alive) unit: its keys fail like a lost unit's, the call returns.
            worker = self.unit_workers[u] if u < len(self.unit_workers) else "?"
            out = empty()
            detail = f"storage unit {u} on {worker} is unavailable: timeout: no answer by the call's deadline"
            out.failed.update({k: (UNIT_UNAVAILABLE, detail) for k in keys})
            return out
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


# ---- deadlines and the splicing of retried keys -------------------------------------------


def _unavailable(failed: dict) -> bool:
    return any(r == UNIT_UNAVAILABLE for r, _ in failed.values())


def _unavailable_keys(results: list[GetResult]) -> list[str]:
    return [k for r in results for k, (reason, _) in r.failed.items() if reason == UNIT_UNAVAILABLE]


def _drop_failed(results: list[GetResult], keys: Sequence[str]) -> list[GetResult]:
    drop = set(keys)
    return [GetResult(r.batch, {k: f for k, f in r.failed.items() if k not in drop}) for r in results]


def _after_failover(first: list[GetResult], second: list[GetResult]) -> list[GetResult]:
    """Primary answers with the re-read keys' failures replaced by their replicas' answers;
    a key failing on both keeps both details."""
    primary = {k: f for r in first for k, f in r.failed.items() if f[0] == UNIT_UNAVAILABLE}
    for r in second:
        for k, (reason, detail) in list(r.failed.items()):
            if reason == UNIT_UNAVAILABLE and k in primary:
                r.failed[k] = (reason, f"primary: {primary[k][1]}; replica: {detail}")
    return _drop_failed(first, list(primary)) + second


def _packed(names: list[str] | None) -> bytes | None:
    return None if not names else pack_names(names)


def _failed_rows(result: StoreResult, batch: PackedBatch) -> PackedBatch:
    """The rows of ``batch`` whose keys failed ``unit_unavailable`` (to retry them)."""
    idx = [i for i, k in enumerate(batch.keys) if isinstance(k, str) and result.failed.get(k, ("",))[0] == UNIT_UNAVAILABLE]
    return batch.take(np.asarray(idx, dtype=np.int64))


def _splice(result: StoreResult, again: StoreResult) -> StoreResult:
    """``result`` with the keys it failed ``unit_unavailable`` answered by ``again``."""
    redone = {k for k, (r, _) in result.failed.items() if r == UNIT_UNAVAILABLE}
    out = StoreResult()
    out.ok = result.ok + [k for k in again.ok if k in redone]
    out.failed = {k: f for k, f in result.failed.items() if k not in redone}
    out.failed.update({k: f for k, f in again.failed.items() if k in redone})
    out.deferred = result.deferred + [k for k in again.deferred if k in redone]
    return out


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
    # The merged values go into a pooled slab: memory this process has already touched,
    # not a fresh mapping that page-faults on every get (the merge's main cost otherwise).
    sizes = (sum(b.fields[n].values.nbytes for b in aligned) for n in names)
    return GetResult(take_rows(aligned, src, rows, out=client_buffers().allocator(sizes)), failed)


def client_buffers() -> SlabPool:
    """This process's pool for the buffers a store client fills itself (a put's rows
    gathered per unit, a get's answers merged), ``store.client-buffer-bytes``."""
    return process_pool("store.client-buffer-bytes")

