"""StagingStore: the store's handle, and (in the process that started it) its owner.

Picklable (unit actor handles, the placement, the settings), so one object works on the
controller, in Dask tasks and in other actors. Every key-routed operation is ONE path
(:mod:`~pipeline.store.operations`: plan, calls, settle, merge) driven synchronously or
asynchronously (:mod:`~pipeline.store.calls`): a request is split by
its :class:`~pipeline.store.placement.Placement` (rendezvous hashing of each key's rollout
id over stable unit ids), ONE actor call goes to each unit involved (puts capped
at ``store.max-call-bytes`` per call), all concurrently, and the per-key answers are
merged (gets back into request order as ONE packed batch). The creating process also
holds the :class:`~pipeline.store.owner.StoreOwner` (actor futures, repairer, close).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tasks.errors import InvalidStoreRequest, StoreError, StoreUnavailable
from tasks.keys import STAGING_PARTITION as DEFAULT_PARTITION
from tasks.packed import PackedBatch

from .. import config
from . import checkpoint as _checkpoint
from . import claim_calls, operations, receive_pool
from .calls import Operation, run_async, run_sync
from .deadline import deadline, settle_all
from .whole_store import every_unit_answered, listed_keys, moved_answer, table_rounds
from .directory import UnitDirectory, UnitTable
from .owner import StoreOwner, start_units, unit_args_from_config
from .moving import MovingTable
from .placement import Placement
from .protocol import GetResult, StoreResult, check_partition
from .settings import StoreSettings
from .slab_pool import SlabPool, process_pool
from .unit_health import unit_health

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor


class StagingStore:
    """Batched, write-once row store over :class:`~pipeline.store.unit.StorageUnit` actors.

    Build with :meth:`start` (or :meth:`from_checkpoint`); ``units[i]`` is an actor
    handle hosted on ``unit_workers[i]``. ``timeout`` (seconds, None: unbounded) bounds a
    whole call: a unit that has not answered by then fails its keys ``unit_unavailable``
    (detail: timeout); the other units' answers stand. With replicas=2 the read fail-over
    gets what is left of it.
    """

    def __init__(
        self,
        units: Sequence["Actor"],
        unit_workers: Sequence[str],
        partitions: Sequence[str] | None = None,
        *,
        placement: Placement | None = None,
        directory: UnitDirectory | None = None,
        settings: StoreSettings | None = None,
        owner: StoreOwner | None = None,
    ):
        """``units[u]`` on ``unit_workers[u]``; ``placement`` (default: version 0, ids
        ``"0".."n-1"``, one copy) must name the same workers."""
        self.units = list(units)
        if placement is None:
            placement = Placement(0, tuple(unit_workers))
        elif tuple(unit_workers) != placement.workers or len(self.units) != placement.n_units:
            raise InvalidStoreRequest(
                f"{len(self.units)} unit(s) on {list(unit_workers)} do not match the placement's {list(placement.workers)}"
            )
        self.placement = placement
        self.moving: MovingTable | None = None  # a move in progress (units: both tables'; see moving.py)
        self.partitions = None if partitions is None else list(partitions)
        self.directory = directory  # the shared unit table (replicas=2), see directory.py
        self.settings = settings or StoreSettings.from_config()
        self.owner = owner  # only in the creating process (never pickled)
        self.closed = False
        self.answer_row_bytes: dict[tuple, float] = {}  # gets' bytes per row: how big gets are split (operations.py)

    # ---- the placement, as the rest of the pipeline reads it ------------------------

    @property
    def unit_workers(self) -> list[str]:
        return list(self.placement.workers)

    @property
    def unit_ids(self) -> list[str]:
        """The units' stable names, by index (a replacement keeps its unit's)."""
        return list(self.placement.unit_ids)

    @property
    def replicas(self) -> int:
        """Copies of every key: 1, or 2 (``token-capture.store.replicas`` when started)."""
        return self.placement.replicas

    @property
    def replica(self) -> list[list[int]] | None:
        """replicas=2: ``replica[u]``, the units that may hold the other copy of a key with
        a copy on unit ``u`` (a derived view: each key's own replica is
        ``placement.copies_of([key])``); None with one copy."""
        if self.placement.replicas == 1:
            return None
        return [self.placement.partners(u) for u in range(self.placement.n_units)]

    @property
    def version(self) -> int:
        return self.placement.version

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
        *,
        hosted: bool = False,
        name: str | None = None,
    ) -> "StagingStore":
        """Create ``n_units`` storage units spread round-robin over ``workers``.

        Knobs left ``None`` come from config (``token-capture.store.units``,
        ``memory-limit`` and ``capacity`` in bytes or ``"256MiB"`` strings,
        ``spill-directory``; ``None`` there means each hosting worker's local directory).
        ``hosted``: the scheduler's store host starts and owns the store (it outlives
        this process, grows onto storage workers, drains before retirement) and publishes
        it as dataset ``name`` (:func:`pipeline.store.hosted.start_hosted`).
        """
        if hosted:
            from .hosted import start_hosted

            return start_hosted(client, name, n_units, memory_limit, capacity, spill_directory, workers)
        n_units = int(config.get("store.units") if n_units is None else n_units)
        args = unit_args_from_config(memory_limit, capacity, spill_directory)
        units, owner, placement, directory = start_units(client, n_units, args, workers)
        store = cls(units, placement.workers, args.partitions, placement=placement, directory=directory, owner=owner)
        if directory is not None:
            from .repair import Repairer

            directory.publish(client, store.table())
            owner.repairer = Repairer(store, client, args)
        return store

    @classmethod
    def from_checkpoint(cls, client, path: str, **start_kwargs: Any) -> "StagingStore":
        """A new store (``start(client, **start_kwargs)``) loaded from the checkpoint at ``path``
        (a directory or an fsspec URL such as ``s3://bucket/prefix``, see :meth:`restore`).

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
        # The owner stays with the creator; handles are enough to call the units.
        return {
            "units": self.units, "placement": self.placement, "moving": self.moving, "partitions": self.partitions,
            "directory": self.directory, "settings": self.settings, "closed": self.closed,
        }

    def __setstate__(self, state: dict) -> None:
        self.units = state["units"]
        self.placement = state["placement"]
        self.moving = state.get("moving")
        self.partitions = state["partitions"]
        self.directory = state["directory"]
        self.settings = state["settings"]
        self.closed = state["closed"]
        self.owner = None
        self.answer_row_bytes = {}

    def with_settings(self, **changes: int | bool) -> "StagingStore":
        """A handle on the same units with some :class:`StoreSettings` changed (it owns nothing)."""
        copy = StagingStore.__new__(StagingStore)
        copy.__setstate__({**self.__getstate__(), "settings": dataclasses.replace(self.settings, **changes)})
        return copy

    def buffers(self) -> SlabPool:
        """This process's pool for the buffers the client fills itself (see :func:`client_buffers`)."""
        return client_buffers()

    # ---- key-routed operations: one path each, sync and async drivers ----------------

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
        return run_sync(operations.put(self, batch, partition, adopt, None), self, deadline(timeout))

    async def put_many_async(
        self, batch: PackedBatch, partition: str = DEFAULT_PARTITION, adopt: bool = False, timeout: float | None = None
    ) -> StoreResult:
        self._check_partition(partition)
        return await run_async(operations.put(self, batch, partition, adopt, None), self, deadline(timeout))

    def put_claimed(
        self, batch: PackedBatch, claim: str, partition: str = DEFAULT_PARTITION, timeout: float | None = None
    ) -> StoreResult:
        """:meth:`put_many`, but the rows it creates stay provisional under ``claim`` (a
        restore's token) until :meth:`settle_claim`, so :meth:`release_claim` can take
        them back on every copy; a row another writer puts meanwhile is theirs and stays.
        Bounded by ``timeout`` s (default ``store.admin-call-timeout-s``: a hung unit fails
        its keys and the restore rolls back instead of waiting for it)."""
        self._check_partition(partition)
        if not isinstance(claim, str) or not claim:
            raise InvalidStoreRequest(f"claim must be a non-empty str, got {claim!r}")
        end = self._deadline(timeout)
        return run_sync(operations.put(self, batch, partition, False, claim), self, end)

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
        (one batched get per replica unit). A get on a unit's own worker runs in-process
        (``store.local-reads``: no socket, the answer is the unit's pooled buffer)."""
        return run_sync(self._get(keys, fields, partition), self, deadline(timeout))

    async def get_many_async(
        self,
        keys: Sequence[str],
        fields: Sequence[str] | None = None,
        partition: str = DEFAULT_PARTITION,
        timeout: float | None = None,
    ) -> GetResult:
        return await run_async(self._get(keys, fields, partition), self, deadline(timeout))

    def _get(self, keys: Sequence[str], fields: Sequence[str] | None, partition: str) -> Operation[GetResult]:
        """The checked get operation, either driver's to run."""
        self._check_partition(partition)
        checked = self._check_fields(fields)
        receive_pool.install()  # the answers' frames land in reused memory
        return operations.get(self, keys, checked, partition)

    def delete(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION, timeout: float | None = None) -> StoreResult:
        """Delete ``keys`` (ONE call per unit involved, whatever the number of keys; with
        replicas=2 each unit gets the keys of both copies it holds); absent keys come back
        ``missing_key``. Keys whose unit has a store checkpoint open come back ``ok`` and
        also in ``deferred``: their rows go when the checkpoint ends."""
        self._check_partition(partition)
        return run_sync(operations.delete(self, keys, partition), self, deadline(timeout))

    async def delete_async(self, keys: Sequence[str], partition: str = DEFAULT_PARTITION, timeout: float | None = None) -> StoreResult:
        self._check_partition(partition)
        return await run_async(operations.delete(self, keys, partition), self, deadline(timeout))

    # ---- claims (a restore's provisional rows) -------------------------------------

    def release_claim(self, keys: Sequence[str], claim: str, partition: str = DEFAULT_PARTITION) -> tuple[int, dict]:
        """Remove every copy of ``keys`` still provisional under ``claim`` (ONE call per unit
        holding a copy; during a move, under either table; a unit fenced by a newer table
        makes the handle take it and ask again). Returns (rows removed,
        ``{key: (reason, detail)}`` of the keys on units not reached: copies may remain)."""
        self._check_partition(partition)
        return claim_calls.release(self, keys, claim, partition)

    def settle_claim(self, claim: str) -> int:
        """Every row provisional under ``claim`` becomes an ordinary row (one call per unit,
        again on a newer table if a unit was fenced by one); returns how many. A unit that
        cannot be reached keeps its marks (they only let a release with this claim remove
        rows nobody else put)."""
        self._catch_up()
        return claim_calls.settle(self, claim)

    # ---- whole-store calls ----------------------------------------------------------

    def stats(self, timeout: float | None = None) -> list[dict]:
        """Per unit: rows, used/memory/spilled/disk bytes, puts, gets, per-partition counts.
        Raises :class:`StoreUnavailable` naming a unit that cannot be reached or has not
        answered within ``timeout`` seconds (default ``store.admin-call-timeout-s``); a
        unit fenced by a newer table makes the handle take it and ask again."""
        answers = self._ask_every_unit(lambda u, version: u.stats(version), timeout)
        return every_unit_answered(answers, "its figures")

    def keys(self, partition: str = DEFAULT_PARTITION, prefix: str | None = None, timeout: float | None = None) -> list[str]:
        """Every key of ``partition`` (one call per unit, all at once), optionally only those
        starting with ``prefix``; unit order, then insertion order. Raises :class:`StoreError`
        naming the unit when one cannot be reached (with replicas=2: when a unit and a unit
        holding the other copy of some of its keys both cannot): a listing is never silently
        partial. A key deleted while a store checkpoint is open is no longer listed, though
        reads still answer it until the checkpoint ends (its delete was deferred). A unit that
        has not answered within ``timeout`` seconds (default ``store.admin-call-timeout-s``)
        counts as one that cannot be reached. A unit fenced by a newer table than this
        handle's makes it take the newest table and list again."""
        self._check_partition(partition)
        answers = self._ask_every_unit(lambda u, version: u.keys(partition, version), timeout)
        return listed_keys(answers, prefix, self.placement, self.moving)

    def _deadline(self, timeout: float | None) -> float:
        """When a whole-store call gives up on a unit: ``timeout`` s from now, else the setting's."""
        return deadline(self.settings.admin_timeout_s if timeout is None else timeout)

    def _ask_every_unit(self, call: Callable[["Actor", int], Any], timeout: float | None) -> list:
        """``call(unit, table version)`` on every unit at once, each answer settled (an
        exception, or ``TimeoutError`` past ``timeout`` s, default the setting); a unit
        fenced by a newer table (``moved``) makes the handle take the newest table and ask
        every unit again (:func:`~.whole_store.table_rounds`)."""
        end = self._deadline(timeout)
        for version in table_rounds(self):
            answers = settle_all([call(u, version) for u in self.units], end)
            if not any(moved_answer(a) for a in answers):
                break
        return answers

    def close(self) -> list[dict]:
        """Close every unit (drops rows, removes spill directories) and, in the creating
        process, release the actors. Idempotent; any later call through this object
        raises :class:`StoreError`."""
        if self.owner is not None:
            return self.owner.close(self)
        return self.close_units()

    def close_units(self, timeout: float | None = None) -> list[dict]:
        """Close every unit; a lost unit, or one that has not answered within ``timeout``
        seconds (default ``store.admin-call-timeout-s``), is reported, not raised. Marks
        this handle closed. A handle that did not make the store first takes the newest
        table (a move may have added units since it was made)."""
        out = []
        end = self._deadline(timeout)
        if self.owner is None:
            self.refresh(self.version)
        for i, a in enumerate(settle_all([u.close() for u in self.units], end)):
            # A lost unit has nothing left to close.
            out.append({"unit": i, "closed": False, "error": f"{type(a).__name__}: {a}"} if isinstance(a, Exception) else a)
        self.closed = True
        return out

    # ---- units replaced (replicas=2): the shared table --------------------------------

    def table(self) -> UnitTable:
        return UnitTable(self.version, list(self.units), list(self.placement.workers),
                         placement=self.placement, moving=self.moving)

    def install_unit(self, u: int, handle: "Actor", worker: str) -> None:
        """Unit ``u`` now lives on ``worker`` behind ``handle`` (its replacement)."""
        units = list(self.units)
        units[u] = handle
        self.units, self.placement = units, self.placement.replaced(u, worker)

    def install_placement(self, placement: Placement, units: Sequence["Actor"]) -> None:
        """Take ``placement`` (units added or removed: ``units[u]`` serves its unit ``u``)
        and, in the creating process, publish it in the shared directory. Installing the
        current table again changes nothing; an older one is refused."""
        if not isinstance(placement, Placement) or len(units) != placement.n_units:
            raise InvalidStoreRequest(f"install_placement needs a Placement and one handle per unit, got {len(units)} handle(s)")
        if placement.version < self.version or (placement.version == self.version and placement != self.placement):
            raise InvalidStoreRequest(f"placement version {placement.version} is not newer than this store's {self.version}")
        changed = placement != self.placement or self.moving is not None
        self.units, self.placement, self.moving = list(units), placement, None
        if changed and self.owner is not None and self.directory is not None:
            self.directory.publish(self.owner.client, self.table())

    def install_moving(self, moving: MovingTable, units: Sequence["Actor"]) -> None:
        """A move begins: writes reach both tables' copies, reads fall back to the old
        holders (``units``: one handle per unit of ``moving.unit_ids``); published like
        :meth:`install_placement`. The move ends with :meth:`install_placement`."""
        if len(units) != len(moving.unit_ids) or moving.version <= self.version:
            raise InvalidStoreRequest(
                f"install_moving needs one handle per unit ({len(moving.unit_ids)}) and a version above {self.version}")
        self.units, self.placement, self.moving = list(units), moving.placement, moving
        if self.owner is not None and self.directory is not None:
            self.directory.publish(self.owner.client, self.table())

    def _take_table(self, table: UnitTable | None) -> bool:
        """Take ``table`` if it is newer than ours; True if the units changed. A table
        carrying its placement (unit ids, homes) is taken whole; one naming only workers
        keeps this handle's ids and homes, so it must have as many units."""
        if table is None or table.version <= self.version:
            return False
        p, carried = self.placement, getattr(table, "placement", None)
        if isinstance(carried, Placement):
            new = carried
        elif len(table.unit_workers) == p.n_units:
            new = Placement(table.version, tuple(table.unit_workers), p.unit_ids, p.replicas, p.homes)
        else:
            raise StoreUnavailable(
                f"the shared unit table (version {table.version}) has {len(table.unit_workers)} units, this handle "
                f"{p.n_units}, and does not say their ids: make a new handle"
            )
        self.units, self.placement, self.moving = list(table.units), new, getattr(table, "moving", None)
        return True

    def refresh(self, seen: int, moved: bool = False) -> bool:
        """After a call (planned with placement version ``seen``) found a unit unavailable:
        True if the units changed since, fetching the shared table (one round trip). The
        table fetched is remembered for the process's other handles (:meth:`_catch_up`).
        ``moved``: a unit refused the call as planned on an older table, so a newer one
        exists: the directory is asked until it gives it (:meth:`UnitDirectory.fetch_newer`)."""
        if self.version > seen:
            return True
        return self.directory is not None and self._take_fetched(self.directory.fetch_newer(self.version, moved))

    async def refresh_async(self, seen: int, moved: bool = False) -> bool:
        if self.version > seen:
            return True
        return self.directory is not None and self._take_fetched(await self.directory.fetch_newer_async(self.version, moved))

    def _take_fetched(self, table: UnitTable | None) -> bool:
        assert self.directory is not None
        unit_health().seen_table(self.directory.name, table)
        return self._take_table(table)

    def _catch_up(self) -> None:
        """Before planning: take the newest unit table another handle of this process
        fetched (no round trip), so a handle pickled with an old table (into a task) does
        not call the units it names that were replaced since. The creating process's
        handle makes the tables: it never takes one."""
        if self.directory is None or self.owner is not None:
            return
        table = unit_health().newest_table(self.directory.name, self.version)
        if table is not None:
            self._take_table(table)

    # ---- checkpoint -----------------------------------------------------------------

    def checkpoint(self, path: str, chunk_bytes: int | str | None = None) -> dict:
        """Write an atomic checkpoint of every unit into ``path``; returns the manifest.

        ``path`` is a local directory or any fsspec URL (``s3://bucket/prefix``; storage
        options from ``token-capture.store.checkpoint-storage-options``, credentials from
        the backend's usual places): each unit writes its files there from its own worker,
        the manifest is written last (docs/checkpoints.md).

        ``chunk_bytes`` (default ``token-capture.store.checkpoint-chunk-bytes``) bounds
        each data file; it is a runtime knob, not part of the checkpoint's identity. With
        ``token-capture.store.checkpoint-key`` set (a key file's path) the manifest is
        signed with HMAC-SHA256.
        """
        if chunk_bytes is None:
            chunk_bytes = config.get("store.checkpoint-chunk-bytes")
        return _checkpoint.save(self, path, config.parse_bytes(chunk_bytes))

    def restore(self, path: str, client=None, allow_older: bool = False) -> dict:
        """Load the checkpoint at ``path`` (a directory or an fsspec URL) into this store
        (rows placed by THIS store's placement, whatever its unit count), all or nothing.

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
        copies = "" if self.placement.replicas == 1 else " replicas=2"
        return f"<StagingStore units={len(self.units)}{copies} workers={sorted(set(self.placement.workers))}>"

    # ---- request checks ---------------------------------------------------------------

    def _check_partition(self, partition: str) -> str:
        """Every key-routed operation starts here: the handle open, ``partition`` valid,
        the newest table this process knows taken (:meth:`_catch_up`)."""
        if self.closed:
            raise StoreUnavailable("this store is closed")
        checked = check_partition(partition, self.partitions)
        self._catch_up()
        return checked

    def _check_fields(self, fields: Sequence[str] | None) -> list[str] | None:
        if fields is None:
            return None
        if isinstance(fields, str) or not all(isinstance(f, str) for f in fields):
            raise InvalidStoreRequest(f"fields must be a list of field names, got {fields!r}")
        return list(dict.fromkeys(fields))


def client_buffers() -> SlabPool:
    """This process's pool for the buffers a store client fills itself (a put's rows
    gathered per unit, a get's answers merged), ``store.client-buffer-bytes``."""
    return process_pool("store.client-buffer-bytes")

