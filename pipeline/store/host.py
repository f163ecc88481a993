"""The store host: the scheduler process owns staging stores, so no client process has to.

A store started by :meth:`StagingStore.start <pipeline.store.client.StagingStore.start>`
belongs to the process that called it: that process holds the units' actor futures and,
with replicas=2, the thread re-replicating lost units. When it dies, the scheduler drops
the actors and nothing repairs. :class:`StoreHost` is a ``SchedulerPlugin`` (installed by
the ``pipeline.dashboard.preload`` preload, or :func:`~pipeline.dashboard.preload.install`)
that starts stores on request, from its own Dask client inside the scheduler process: the
units' futures, the repairer and the close live as long as the scheduler, whichever
controller, engine or trainer asked. The handle is published as a Dask named dataset, so
:func:`~pipeline.client.discovery.lookup_store` finds it from any process.

Requests arrive as scheduler RPCs (``token_capture_store_start``, ``..._close``,
``..._list``); the blocking work (starting actors, closing them) runs on one thread of the
plugin, never on the scheduler's event loop. The client side is
:mod:`pipeline.store.hosted`.

A change refused StoreBusy is retried every 0.5 s for up to ``store.rebalance-retry-s``;
an interrupted move is resumed before the next change and at every watch tick; a
replicas=1 unit lost with its worker is counted (``lost_rows``) and logged with the fix.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado.ioloop import PeriodicCallback

from tasks.errors import InvalidStoreRequest, StoreBusy, StoreUnavailable

from .. import config
from ..events import STORE
from .host_messages import HostedStoreInfo, StartRequest
from .rebalance import RETRY_INTERVAL_S, RebalanceSettings, Rebalancer

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client, Scheduler

    from .client import StagingStore

logger = logging.getLogger(__name__)

PLUGIN_NAME = "token-capture-store-host"
STORAGE_RESOURCE = "storage"  # a worker advertising it (> 0) gets a unit of every hosted store
T = TypeVar("T")


class StoreHost(SchedulerPlugin):
    """Starts, lists and closes stores owned by the scheduler process (module docstring)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.stores: dict[str, StagingStore] = {}
        self.requests: dict[str, StartRequest] = {}
        self.started_s: dict[str, float] = {}
        self.published_version: dict[str, int] = {}  # the table version each dataset holds
        self._watch: PeriodicCallback | None = None
        self._background: set[asyncio.Task] = set()
        self.rebalancers: dict[str, Rebalancer] = {}
        self.waiting: dict[str, dict[str, str]] = {}  # store -> change retried while StoreBusy -> why
        self.unit_rows: dict[str, dict[str, int]] = {}  # store -> unit id -> last known rows
        self.lost: dict[str, list[dict]] = {}  # store -> units lost with their worker (replicas=1)
        self.retry_s = 60.0  # store.rebalance-retry-s, read at start
        self._resume_error: dict[str, str] = {}  # the last failure of a resume, per store (logged once)
        self._client: Client | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made in start: the plugin pickles

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="token-capture-store-host")
        scheduler.handlers["token_capture_store_start"] = self._handle_start
        scheduler.handlers["token_capture_store_close"] = self._handle_close
        scheduler.handlers["token_capture_store_list"] = self._handle_list
        scheduler.handlers["token_capture_store_drain"] = self._handle_drain
        # Retiring a worker drains its storage units first, whoever asks (a client's
        # retire_workers, the adaptive policy's scale-down): the handler is wrapped.
        scheduler.handlers["retire_workers"] = self._draining_retire(scheduler.handlers["retire_workers"])
        self.retry_s = RebalanceSettings.from_config().retry_s
        self._watch = PeriodicCallback(self._tick, 1000 * float(config.get("store.repair-interval-s")))
        self._watch.start()

    async def close(self) -> None:
        """The scheduler is closing: stop repairing; the units go with the cluster."""
        if self._watch is not None:
            self._watch.stop()
        for store in list(self.stores.values()):
            repairer = store.owner.repairer if store.owner is not None else None
            if repairer is not None:
                repairer.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- RPC handlers (event loop): the work runs on the plugin's thread ------------

    async def _handle_start(self, **msg: object) -> HostedStoreInfo:
        request = StartRequest.from_message(dict(msg))
        return await self._run(lambda: self.start_store(request))

    async def _handle_close(self, name: str) -> list[dict]:
        return await self._run(lambda: self.close_store(name))

    async def _handle_drain(self, workers: list[str]) -> list[dict]:
        return await self._drain(list(workers))

    def _draining_retire(self, retire: Callable[..., Awaitable[dict]]) -> Callable[..., Awaitable[dict]]:
        async def retire_workers(*args: object, workers: list[str] | None = None, names: list | None = None, **kwargs: object) -> dict:
            addresses = self._addresses(workers, names)
            if addresses and self._hosting(addresses):
                await self._drain(addresses)
                await self._released(addresses)
            if workers is not None:
                kwargs["workers"] = workers
            if names is not None:
                kwargs["names"] = names
            return await retire(*args, **kwargs)

        return retire_workers

    async def _released(self, addresses: list[str], timeout_s: float = 10.0) -> None:
        """Wait until the drained units' actor tasks are gone from the scheduler (Dask
        refuses to retire a worker that hosts an actor)."""
        assert self.scheduler is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not any(ws.actors for a, ws in self.scheduler.workers.items() if a in addresses):
                return
            await asyncio.sleep(0.05)

    def _addresses(self, workers: list[str] | None, names: list | None) -> list[str]:
        """The addresses a retire request names (by address or by worker name)."""
        assert self.scheduler is not None
        if workers is not None:  # addresses, or names (SpecCluster.scale_down passes names)
            by_name = {str(ws.name): a for a, ws in self.scheduler.workers.items()}
            return [w if w in self.scheduler.workers else by_name[str(w)]
                    for w in workers if w in self.scheduler.workers or str(w) in by_name]
        if names is not None:
            wanted = {str(n) for n in names}
            return [a for a, ws in self.scheduler.workers.items() if str(ws.name) in wanted]
        return []

    def _hosting(self, addresses: list[str]) -> bool:
        return any(w in addresses for st in self.stores.values() for _, w in units_of(st))

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        """A worker joined: one with the storage role gets a unit of every hosted store
        (keys rebalanced onto it in the background; the hook never waits for that)."""
        ws = scheduler.workers.get(worker)
        if ws is None or float((ws.resources or {}).get(STORAGE_RESOURCE, 0)) <= 0 or not self.stores:
            return
        task = asyncio.get_running_loop().create_task(self._grow(worker))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: object) -> None:
        """A worker left. A replicas=1 store's unit still on it (not drained: its worker
        died) took its rows with it: counted and said, with the fix."""
        for name, store in list(self.stores.items()):
            if store.replicas != 1:
                continue  # replicas=2: the repairer copies the unit back
            held = store.moving.previous if store.moving is not None else store.placement  # a move's new units hold copies only
            for uid, w in zip(held.unit_ids, held.workers):
                if w == worker:
                    self._record_lost(name, uid, worker)

    def _record_lost(self, name: str, uid: str, worker: str) -> None:
        rows = self.unit_rows.get(name, {}).get(uid)
        self.lost.setdefault(name, []).append(
            {"unit": uid, "worker": worker, "rows": int(rows or 0), "known": rows is not None, "noticed_s": time.time()})
        logger.warning(
            "store %r lost storage unit %s with its worker %s: %s row(s) gone (store.replicas=1 keeps one copy of each "
            "key; counted from the unit's last report); set token-capture.store.replicas: 2 so a lost worker's rows are "
            "re-replicated", name, uid, worker, "an unknown number of" if rows is None else rows)

    def log_event(self, topic: str, msg: object) -> None:
        """A unit's STORE report: its row count, the figure a loss is counted from (a
        report matching units of two stores is ambiguous and left out)."""
        if topic != STORE or not isinstance(msg, dict) or not isinstance(msg.get("rows"), int):
            return
        hits = [(name, uid) for name, st in list(self.stores.items()) for uid, w in units_of(st)
                if w == msg.get("worker") and uid == str(msg.get("unit"))]
        if len(hits) == 1:
            name, uid = hits[0]
            self.unit_rows.setdefault(name, {})[uid] = int(msg["rows"])

    def _handle_list(self) -> list[HostedStoreInfo]:
        return [self.info(n) for n in sorted(self.stores)]

    async def _tick(self) -> None:
        """The watch: resume interrupted moves, then republish changed tables."""
        for name in [n for n, rb in list(self.rebalancers.items()) if rb.interrupted is not None]:
            try:
                await self._run(lambda name=name: self.resume_store(name))
                self._resume_error.pop(name, None)
            except Exception as e:  # noqa: BLE001 - tried again next tick; said once per distinct failure
                why = f"{type(e).__name__}: {e}"
                if self._resume_error.get(name) != why:
                    self._resume_error[name] = why
                    log = logger.info if isinstance(e, StoreBusy) else logger.warning
                    log("store %r: the interrupted move is not resumed yet (%s); retrying every tick", name, why)
        await self._republish_changed()

    async def _retry_busy(self, name: str, what: str, work: Callable[[], T]) -> T:
        """``work`` on the plugin thread; while it is refused StoreBusy, again every
        0.5 s for up to ``store.rebalance-retry-s`` (then the StoreBusy is raised). The
        host record's ``waiting`` says what waits and why meanwhile."""
        deadline = time.monotonic() + self.retry_s
        waiting = self.waiting.setdefault(name, {})
        try:
            while True:
                try:
                    return await self._run(work)
                except StoreBusy as e:
                    if time.monotonic() >= deadline or name not in self.stores:
                        raise
                    waiting[what] = str(e)
                    await asyncio.sleep(RETRY_INTERVAL_S)
        finally:
            waiting.pop(what, None)

    async def _grow(self, worker: str) -> None:
        """A unit of every hosted store on ``worker``, each retried while busy."""
        for name in list(self.stores):
            try:
                await self._retry_busy(name, f"add on {worker}", lambda name=name: self.grow_store(name, worker))
            except Exception:  # noqa: BLE001 - one store's failure must not stop the others
                logger.exception("could not add a unit of store %r on %s (after up to store.rebalance-retry-s of "
                                 "retries while busy)", name, worker)

    async def _drain(self, workers: list[str]) -> list[dict]:
        """Drain every hosted store's units on ``workers``, each retried while busy; a
        refusal (the last unit, one failure domain left, still busy) is raised."""
        out: list[dict] = []
        for name in [n for n, st in list(self.stores.items()) if any(w in workers for _, w in units_of(st))]:
            out.extend(await self._retry_busy(name, f"drain {sorted(workers)}", lambda name=name: self.drain_store(name, workers)))
        return out

    async def _republish_changed(self) -> None:
        """A repair replaced units: publish the handle again, so a new lookup starts
        from the current table (older handles catch up through the unit directory)."""
        stale = [n for n, st in self.stores.items() if st.version != self.published_version.get(n)]
        if stale:
            await self._run(lambda: [self._publish(n) for n in stale if n in self.stores])

    def _publish(self, name: str) -> None:
        store = self.stores[name]
        self.client().publish_dataset(store, name=name, override=True)
        self.published_version[name] = store.version

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._as_host(work))

    def _as_host(self, work: Callable[[], T]) -> Callable[[], T]:
        """``work`` run with the plugin's client as the thread's current client: actor
        handles used there bind to it (a scheduler process has no other client)."""
        def run() -> T:
            with self.client().as_current():
                return work()

        return run

    # ---- the work (plugin thread) ---------------------------------------------------

    def client(self) -> Client:
        """The plugin's own client of this scheduler (made on first use, on this thread)."""
        if self._client is None:
            from distributed import Client

            assert self.scheduler is not None, "the plugin is not started"
            self._client = Client(self.scheduler.address, security=self.scheduler.security,
                                  set_as_default=False, name="token-capture-store-host")
        return self._client

    def start_store(self, request: StartRequest) -> HostedStoreInfo:
        """Start the store of ``request`` (refused if one of that name is hosted) and
        publish its handle as the named dataset ``request.name``."""
        import dataclasses

        import dask

        from .client import StagingStore

        if request.name in self.stores:
            raise InvalidStoreRequest(f"a store named {request.name!r} is already hosted; close it first or use another name")
        client = self.client()
        with dask.config.set({"token-capture.store.replicas": request.replicas}):
            store = StagingStore.start(
                client, n_units=request.n_units, memory_limit=request.memory_limit, capacity=request.capacity,
                spill_directory=request.spill_directory, workers=None if request.workers is None else list(request.workers),
            )
        if request.store_settings:
            store.settings = dataclasses.replace(store.settings, **request.store_settings)
        self.stores[request.name] = store
        self.requests[request.name] = request
        # Every hosted store can change: the rebalancer gives it a unit directory if it has none.
        self.rebalancers[request.name] = Rebalancer(store, client, store.owner.unit_args)
        self.unit_rows[request.name] = dict.fromkeys(store.unit_ids, 0)
        self.started_s[request.name] = time.time()
        self._publish(request.name)
        logger.info("hosting store %r: %d units on %s", request.name, len(store.units), sorted(set(store.unit_workers)))
        return self.info(request.name)

    def grow_store(self, name: str, worker: str) -> dict | None:
        """Add a unit of store ``name`` on ``worker`` unless it has one there (or the
        worker or store is gone); an interrupted move is completed first."""
        store = self.stores.get(name)
        if store is None or self.scheduler is None or worker not in self.scheduler.workers:
            return None
        self.resume_store(name)
        if worker in store.unit_workers:
            return None
        record = self.rebalancers[name].add_unit(worker)
        self._note_rows(name)
        return {"store": name, **record}

    def drain_store(self, name: str, workers: list[str]) -> list[dict]:
        """Drain every unit of store ``name`` on ``workers`` (keys moved, unit closed); an
        interrupted move is completed first."""
        store = self.stores.get(name)
        if store is None:
            return []
        self.resume_store(name)
        out = [{"store": name, **self.rebalancers[name].drain_unit(unit_id)}
               for unit_id, w in list(zip(store.placement.unit_ids, store.unit_workers)) if w in workers]
        if out:
            self._note_rows(name)
        return out

    def resume_store(self, name: str) -> dict | None:
        """Complete store ``name``'s interrupted move, if it has one (the rebalancer's record)."""
        store, rebalancer = self.stores.get(name), self.rebalancers.get(name)
        if store is None or rebalancer is None or store.moving is None:
            return None
        record = rebalancer.resume()
        if record is not None:
            logger.info("store %r: the interrupted %s of unit %s completed", name, record["kind"], record["unit"])
            self._note_rows(name)
        return record

    def _note_rows(self, name: str) -> None:
        """Every unit's row count now (after a change), the figure a loss is counted from."""
        store = self.stores.get(name)
        try:
            stats = store.stats() if store is not None else []
        except Exception:  # noqa: BLE001 - a unit just lost: its reports stand
            return
        self.unit_rows[name] = {uid: int(s["rows"]) for uid, s in zip(store.unit_ids, stats)}

    def close_store(self, name: str) -> list[dict]:
        """Close the hosted store ``name`` (units, repairer, actors) and withdraw its dataset."""
        store = self.stores.pop(name, None)
        if store is None:
            raise StoreUnavailable(f"no store named {name!r} is hosted on this scheduler")
        self.started_s.pop(name, None)
        self.requests.pop(name, None)
        self.published_version.pop(name, None)
        self.rebalancers.pop(name, None)
        for book in (self.waiting, self.unit_rows, self.lost, self._resume_error):
            book.pop(name, None)
        out = store.close()
        client = self.client()
        if name in client.list_datasets():
            client.unpublish_dataset(name)
        return out

    def info(self, name: str) -> HostedStoreInfo:
        store = self.stores[name]
        repairer = store.owner.repairer if store.owner is not None else None
        return HostedStoreInfo(
            name=name, units=len(store.units), workers=list(store.unit_workers),
            replicas=self.requests[name].replicas, version=store.version,
            started_s=self.started_s.get(name, 0.0), repaired=list(repairer.repaired) if repairer else [],
            changes=list(self.rebalancers[name].changes), interrupted=self.rebalancers[name].interrupted,
            waiting=dict(self.waiting.get(name, {})), unit_rows=dict(self.unit_rows.get(name, {})),
            lost_rows=sum(r["rows"] for r in self.lost.get(name, [])), lost_units=list(self.lost.get(name, [])),
        )


def units_of(store: StagingStore) -> list[tuple[str, str]]:
    """(unit id, worker) of every unit of ``store``, a draining one included while it moves."""
    tables = [store.placement] + ([store.moving.previous] if store.moving is not None else [])
    return list(dict.fromkeys((u, w) for t in tables for u, w in zip(t.unit_ids, t.workers)))
