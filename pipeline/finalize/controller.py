"""The finalization controller: submit steps, keep several in flight, collect results.

:class:`Finalizer` submits each step as a Dask graph (:mod:`pipeline.finalize.graph`) and
tracks queue depth from the futures' client-side status; :meth:`StepHandle.result`
gathers the groups, computes the step's metrics and publishes its finalize event.

With ``finalize.clear-staged`` a step's staged rows (every key of its rollouts, rejected
ones included, but for rows a later step may still finalize: :mod:`.kept_rows`) are
deleted in ONE batched delete (one call per storage unit), decided and submitted by
:meth:`StepHandle.result` only AFTER the groups' tensors were gathered into the
caller's process: a controller that dies before delivering a step leaves all of
its rows staged, so the same receipts can be resubmitted (by another Finalizer, in
another process: :meth:`Finalizer.attach`) and give the same tensors. A step whose
groups failed or were cancelled clears nothing; keys another in-flight step of the same
Finalizer still reads (or could still deliver) are kept for that step to clear.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypedDict

from tasks.errors import MissingFinalizeResource
from tasks.finalize.layout import HostMap
from tasks.finalize.plan import ReceiptLike
from tasks.finalize.step_batch import check_version
from tasks.keys import STAGING_PARTITION

from .. import config
from ..actors import workers_now
from ..store.protocol import PlacedStoreLike, StoreLike
from . import transfers
from .graph import CLEAR, FinalizeError, StepGraph, affinity, submit_graph, task_key
from .journal import StepJournal
from .journaled import JournaledSteps
from .kept_rows import rejected_receipt_keys
from .settings import FinalizeSettings
from .step_handle import StepHandle
from .step_result import StepResult
from .uncleared import UnclearedRows

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from distributed import Client, Future

Groups = Mapping[str, Sequence[ReceiptLike]] | Sequence[Sequence[ReceiptLike]]
__all__ = ["ClearCounts", "Finalizer", "StepHandle", "StepResult", "clear_rows"]


class ClearCounts(TypedDict):
    """What :func:`clear_rows` did: rows deleted (deferred ones included), deferred, failed."""

    deleted: int
    deferred: int
    failed: dict[str, tuple[str, str]]


def clear_rows(store: StoreLike, keys: list[str], partition: str = STAGING_PARTITION, timeout_s: float | None = None) -> ClearCounts:
    """Delete staged rows (ONE batched ``store.delete``: one call per unit); returns counts
    (``deleted`` includes rows ``deferred`` behind an open store checkpoint), never raises
    on per-key failure. Bounded by ``timeout_s`` (the finalizer passes its fetch timeout;
    None: ``finalize.fetch-timeout-s`` of the process it runs in)."""
    if timeout_s is None:
        timeout_s = float(config.get("finalize.fetch-timeout-s"))
    res = store.delete(keys, partition=partition, timeout=timeout_s)
    return {"deleted": len(res.ok), "deferred": len(getattr(res, "deferred", ())), "failed": dict(res.failed)}


class Finalizer(JournaledSteps):
    """Submits finalization steps as Dask graphs on ``client`` against ``store``.

    Its knobs (:class:`~pipeline.finalize.settings.FinalizeSettings`: ``finalize.*``, and
    ``vocab_size`` / ``num_experts`` defaulting to ``policy.vocab-size`` /
    ``policy.experts``) are read once, here; :meth:`with_settings` changes them for later
    steps. ``keep_intermediates`` holds each step's fetch, piece and
    verify futures until it is collected (debugging; costs cluster memory). The cluster's workers must advertise the ``finalize`` resource
    (``pipeline.cluster.finalize_resources()``); a cluster whose workers all lack it is
    refused at construction, because verify tasks would wait forever. ``journal`` (default
    ``finalize.journal``; a directory or fsspec URL) keeps each step's receipts until it is
    delivered and the keys its clear owes (:mod:`.journal`): a replacement controller built
    on the same journal calls :meth:`resume`.
    """

    def __init__(
        self,
        client: Client,
        store: PlacedStoreLike,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        check_resources: bool = True,
        keep_intermediates: bool = False,
        settings: FinalizeSettings | None = None,
        journal: str | os.PathLike | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.keep_intermediates = keep_intermediates
        self.settings = settings or FinalizeSettings.from_config(vocab_size=vocab_size, num_experts=num_experts)
        self._seq = itertools.count()
        self._in_flight: list[StepHandle] = []
        self._lock = threading.Lock()
        self._workers: dict[str, bool] = {}  # worker -> takes finalize work (last scheduler answer)
        if check_resources:
            self._check_resources()
        # Each step's worker-to-worker bytes across hosts, measured on the scheduler.
        self.measures_transfers = transfers.install(client)
        # Keys a clear could not delete: the next clears ask again.
        self.uncleared = UnclearedRows(self.settings.clear_attempts)
        self._retries = itertools.count()
        # The durable record of steps not delivered and rows owed a clear (None: none kept).
        where = config.get("finalize.journal") if journal is None else journal
        self.journal = StepJournal(where) if where else None
        self._journal_tag = uuid.uuid4().hex[:8]  # in this finalizer's own step ids (with a journal)
        self._owed_steps: dict[str, set[str]] = {}  # delivered step -> keys its journal record owes

    @classmethod
    def attach(cls, client: Client, name: str | None = None, **kwargs: object) -> Finalizer:
        """A Finalizer on the store published as ``name`` on ``client``'s scheduler (default
        ``capture-client.store-name``; :func:`pipeline.client.lookup_store`), e.g. in a
        controller that replaced one that died. ``kwargs`` go to the constructor.

        Raises :class:`~tasks.errors.StoreUnavailable` naming the dataset and the fix when
        no store is published under that name."""
        from ..client.discovery import lookup_store

        return cls(client, lookup_store(client, name), **kwargs)  # type: ignore[arg-type]

    def _check_resources(self) -> None:
        workers = workers_now(self.client)  # all workers, asked now (not the client's cache)
        self._workers = {a: w.get("resources", {}).get("finalize", 0) > 0 for a, w in workers.items()}
        if workers and not any(w.get("resources", {}).get("finalize", 0) > 0 for w in workers.values()):
            address = getattr(getattr(self.client, "scheduler", None), "address", None) or "<scheduler>"
            slots = f"{self.settings.slots_per_worker:g}"
            raise MissingFinalizeResource(
                f"no worker of {address} advertises the 'finalize' resource that verify tasks need; "
                f'start workers with `dask worker {address} --resources "finalize={slots}"` '
                "(in Python: LocalCluster(resources=pipeline.cluster.finalize_resources()))"
            )

    def host_map(self) -> HostMap | None:
        """Where the store's workers and the finalize workers are, when they span more than
        one host (one host: nothing can cross hosts, placement stays by worker). The
        workers' resources are asked of the scheduler again only when the store names a
        worker not seen before (one round trip, not one per step)."""
        units = list(getattr(self.store, "unit_workers", None) or ())
        if any(w not in self._workers for w in units):
            try:
                self._check_resources()
            except MissingFinalizeResource:
                pass
        everyone = set(self._workers) | set(units)
        hosts = {w: transfers.host_of(w) for w in everyone}
        if len(set(hosts.values())) < 2:
            return None
        return HostMap(hosts, frozenset(w for w, takes in self._workers.items() if takes))

    def with_settings(self, **changes: object) -> FinalizeSettings:
        """Change some knobs (``FinalizeSettings`` field names) from the next submitted step
        on; returns the previous settings. Steps already submitted keep theirs."""
        previous = self.settings
        self.settings = replace(previous, **changes)
        return previous

    @property
    def queue_depth(self) -> int:
        """Groups submitted and not finished (a finished-but-uncollected group counts as done)."""
        with self._lock:
            return sum(h.pending_groups() for h in self._in_flight)

    @property
    def in_flight(self) -> list[StepHandle]:
        """Steps submitted and not yet collected, oldest first."""
        with self._lock:
            return list(self._in_flight)

    def submit_step(self, groups: Groups, *, step_id: str | None = None, trainer_version: int | None = None) -> StepHandle:
        """Plan and submit one training step (one or many groups); returns immediately.

        ``groups``: group id -> receipts, or a list of receipt lists (ids ``"g0"``, ...).
        Receipts are :class:`tasks.receipts.Receipt` or their dicts; a malformed one becomes
        its row's ``invalid_receipt``, never an exception.

        ``trainer_version``: the weight version the trainer is at (int). The step event's
        staleness figures measure lags from it; with ``finalize.max-staleness`` set,
        verified rollouts whose oldest ``weight_version`` lags it by more are rejected
        ``stale`` (kept out of the batch; their rows cleared with the step's, at
        :meth:`StepHandle.result`, never earlier).
        """
        if trainer_version is not None:
            check_version(trainer_version, "submit_step: trainer_version", FinalizeError)
        if isinstance(groups, Mapping):
            named = {str(k): v for k, v in groups.items()}
            if len(named) != len(groups):
                raise FinalizeError("group ids collide once converted to str")
        elif isinstance(groups, Sequence) and not isinstance(groups, (str, bytes)):
            named = {f"g{i}": g for i, g in enumerate(groups)}
        else:
            raise FinalizeError(f"groups must be a mapping or a list of receipt lists, got {type(groups).__name__}")
        seq = next(self._seq)
        step_id = self._record(step_id, seq, named, trainer_version)
        return self._submit(named, step_id, seq, isinstance(groups, Mapping), trainer_version, first=True)

    def _resubmit(self, handle: StepHandle) -> StepHandle:
        """:meth:`StepHandle.resubmit` once the handle found its step failed: the step
        submitted again, under its own id, in place of ``handle``."""
        handle.cancel()
        with self._lock:
            if handle in self._in_flight:
                self._in_flight.remove(handle)
        try:
            return self._submit(handle.receipts, handle.step_id, next(self._seq), handle.check_groups,
                                handle.trainer_version, first=False)
        except BaseException:
            with self._lock:  # not submitted: the failed step is still this Finalizer's to settle
                self._in_flight.append(handle)
            raise

    def _submit(self, named: dict[str, Any], step_id: str, seq: int, check_groups: bool, trainer_version: int | None,
                *, first: bool) -> StepHandle:
        """Submit a recorded step's graph and track its handle. A first submission that
        raises leaves no journal record (nothing to resume); a resubmission's stays."""
        depth = self.queue_depth + len(named)
        try:
            graph = self._submit_graph(named, step_id, seq, depth, check_groups, trainer_version)
        except BaseException:
            if first and self.journal is not None:  # never submitted: nothing to resume
                self.journal.cleared([step_id])
            raise
        clear = self.settings.clear_staged
        handle = StepHandle(self, graph, clear=clear, rejected_keys=rejected_receipt_keys(named, graph.plan.rejected) if clear else (),
                            receipts=named, check_groups=check_groups, trainer_version=trainer_version)
        with self._lock:
            self._in_flight.append(handle)
        return handle

    def _submit_graph(self, named: dict[str, Any], step_id: str, seq: int, depth: int, check_groups: bool,
                      trainer_version: int | None) -> StepGraph:
        return submit_graph(
            self.client,
            self.store,
            named,
            step_id=step_id,
            settings=self.settings,
            queue_depth=depth,
            priority=-seq,  # older steps first when several are in flight
            keep_intermediates=self.keep_intermediates,
            check_groups=check_groups,  # list-form ids are made up: nothing to compare
            hosts=self.host_map(),
            trainer_version=trainer_version,
        )

    def drain(self, timeout: float | None = None) -> list[StepResult]:
        """Collect every in-flight step, oldest first (acknowledging those not collected
        yet; one collected with ``acknowledge=False`` stays unacknowledged); then ask once
        more for rows earlier clears could not delete (:meth:`retry_clears`), waiting up to
        ``timeout`` s for it."""
        from distributed import wait

        # A step the caller collected without acknowledging stays in flight (its rows kept).
        out = [h.result(timeout, acknowledge=not h.collected) for h in self.in_flight]
        try:
            wait(self.uncleared.unanswered(), timeout=timeout)  # the steps' clears, answered
            retry = self.retry_clears()
            if retry is not None:
                wait([retry], timeout=timeout)
        except TimeoutError:  # a clear still running: its keys are asked for again later
            logger.warning("drain: a clear of staged rows was not answered within %s s", timeout)
        self._settle_journal()
        return out

    def submit_clear(self, keys: Sequence[str], token: str, span: Mapping[str, Any] | None = None) -> Future | None:
        """ONE ``tc-clear`` task: :func:`clear_rows` over ``keys`` and the rows earlier
        clears could not delete that no in-flight step reads (each key once), next to the
        storage units, in the step ``token``'s task group and ``span``; keys it cannot
        delete are kept in :attr:`uncleared` for the next clear. None: nothing to clear.
        A controller clearing rows itself (``clear_staged`` off) calls it with its keys."""
        import dask

        with self._lock:
            still_read = self._keys_read_in_flight()
        keys = list(dict.fromkeys([*keys, *self.uncleared.take(skip=still_read)]))
        if not keys:
            return None
        with dask.annotate(**({"span": span} if span else {})):
            future = self.client.submit(
                clear_rows, self.store, keys, STAGING_PARTITION, self.settings.fetch_timeout_s,
                key=task_key(CLEAR, token), pure=False,
                workers=affinity(self.store, keys) or None, allow_other_workers=True,
                retries=self.settings.retries,
            )
        self.uncleared.watch(keys, future)
        self._settle_journal()
        return future

    def retry_clears(self) -> Future | None:
        """Submit a clear of the rows earlier clears could not delete (none in flight
        reads them), now rather than with the next step's; None if there are none."""
        return self.submit_clear([], f"retry-{next(self._retries)}")

    def _keys_read_in_flight(self, exclude: StepHandle | None = None) -> set[str]:
        """Keys the in-flight steps (other than ``exclude``) read, derived from their plans,
        unless the step failed (caller holds ``_lock``). A complete but undelivered step
        counts: should this controller die before delivering it, a resubmission reads them."""
        return {k for h in self._in_flight if h is not exclude and not h.failed() for k in h.reads_keys}

    def _deliver(self, handle: StepHandle) -> set[str]:
        """``handle`` was delivered: forget it and return the keys the other in-flight steps
        still read, in one step under the lock (of two steps sharing keys and delivered
        at once, exactly one finds the other gone, and clears them)."""
        with self._lock:
            if handle in self._in_flight:
                self._in_flight.remove(handle)
            return self._keys_read_in_flight()
