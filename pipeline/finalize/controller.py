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
from tasks.finalize.staleness import step_staleness
from tasks.finalize.step_batch import check_version
from tasks.keys import STAGING_PARTITION

from .. import config, events
from ..actors import workers_now
from ..store.protocol import PlacedStoreLike, StoreLike
from . import collect, serializers, timing, transfers
from .graph import CLEAR, FinalizeError, StepGraph, affinity, submit_assembly, submit_graph, task_key
from .journal import StepJournal
from .journaled import JournaledSteps
from .kept_rows import kept_rollouts, rejected_receipt_keys
from .settings import FinalizeSettings
from .step_result import StepResult
from .uncleared import UnclearedRows

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from distributed import Client, Future

    from tasks.finalize.assemble import FinalizedGroup

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


class StepHandle:
    """One submitted step: Dask futures of its verify tasks; :meth:`result` gathers them,
    assembles the groups in the caller's process (:mod:`pipeline.finalize.collect`) and,
    with ``clear``, submits the step's clear once the groups are here (never from the
    tasks' completion alone). :attr:`group_futures` assembles them on the cluster instead."""

    def __init__(self, finalizer: Finalizer, graph: StepGraph, *, clear: bool = False, rejected_keys: Sequence[str] = ()) -> None:
        self._finalizer = finalizer
        self.graph = graph
        self.step_id = graph.step_id
        self.group_ids = list(graph.group_ids)
        self.clear = bool(clear)  # the finalizer's clear_staged when the step was submitted
        self.rejected_keys = list(rejected_keys)  # rows of receipts rejected at plan time
        self.clear_future: Future | None = None  # the tc-clear task, once result() delivered
        self.kept_keys: list[str] = []  # keys left for another in-flight step to clear
        self._result: StepResult | None = None
        self.acknowledged = False  # delivered: the journal says so and the rows' clear was submitted
        self._assembly_failed = False  # assembling its groups here raised: it will never deliver
        self._lock = threading.Lock()

    @property
    def reads_keys(self) -> list[str]:
        """Keys this step's graph reads (fetched rows): a resubmission of its receipts
        reads the same ones."""
        return list(self.graph.plan.staging_keys)

    def clear_keys(self) -> list[str]:
        """Every staged key of the step: all calls of every planned rollout (off-chain
        ones and rejected rollouts included, but not those of internal errors or of rows
        the store could not read: :func:`~pipeline.finalize.kept_rows.kept_rollouts`) and
        the rows of receipts rejected at plan time."""
        kept = kept_rollouts(self._result.groups.values() if self._result is not None else ())
        keys = dict.fromkeys(k for p in self.graph.plan.rollouts if p.rollout_id not in kept for k in p.all_keys)
        keys.update(dict.fromkeys(self.rejected_keys))
        return list(keys)

    def failed(self) -> bool:
        """Some task of this (uncollected) step failed or was cancelled, or assembling its
        groups raised: it will never deliver, so it neither clears its rows nor keeps
        another step from clearing them."""
        return self._assembly_failed or any(f.status in ("error", "cancelled") for f in self.graph.futures)

    def _clear_delivered(self) -> None:
        """The groups are in the caller's process: forget the step and submit its clear
        (keys another in-flight step still reads stay, in :attr:`kept_keys`)."""
        fin = self._finalizer
        still_read = fin._deliver(self)
        keys = self.clear_keys() if self.clear else []
        self.kept_keys = [k for k in keys if k in still_read]
        keys = [k for k in keys if k not in still_read]
        fin._journal_delivered(self.step_id, keys)
        if self.clear:
            self.clear_future = fin.submit_clear(keys, self.graph.token, self.graph.span)
            fin._journal_owes(self.step_id, keys)

    @property
    def futures(self) -> list[Future]:
        """What :meth:`result` waits for: the verify tasks' futures (each resolves to a
        :class:`~pipeline.finalize.task_outputs.VerifyOut`), and the groups' once
        :attr:`group_futures` assembled them on the cluster; empty once collected."""
        return self.graph.futures

    @property
    def group_futures(self) -> dict[str, Future]:
        """Group id -> future of its FinalizedGroup, assembled ON THE CLUSTER (one assemble
        task per group, submitted at the first access: for work that runs next to the
        groups, e.g. fidelity checks); :meth:`result` then gathers these. Empty once
        collected. Without this, the groups are assembled in the caller's process."""
        with self._lock:
            g = self.graph
            if not g.group_futures and self._result is None and g.verify_futures:
                g.group_futures = submit_assembly(self._finalizer.client, g)
            return dict(g.group_futures)

    def pending_groups(self) -> int:
        """Groups of this step not computed yet: some verify task of theirs (or their
        assemble task, on the cluster) has not finished (or failed)."""
        g = self.graph
        if g.layout is None or not g.verify_futures:
            return 0
        if g.group_futures:
            return sum(not f.done() for f in g.group_futures.values())
        return sum(any(not g.verify_futures[t].done() for t in group.tasks) for group in g.layout.groups)

    def done(self) -> bool:
        return self.pending_groups() == 0

    def cancel(self) -> None:
        g = self.graph
        self._finalizer.client.cancel(g.futures + g.piece_futures + g.fetch_futures)

    def result(self, timeout: float | None = None, *, acknowledge: bool = True) -> StepResult:
        """Wait for the step's verify tasks, gather their rows into this process, assemble
        the groups here (or gather the groups :attr:`group_futures` assembled), compute
        and publish the step metrics (once), :meth:`acknowledge` the step and return them.

        ``acknowledge=False``: the step is returned but not delivered yet: its journal
        record keeps its receipts and its rows stay staged until :meth:`acknowledge` (call
        it once the batch is consumed, e.g. after the optimizer step or the trainer's own
        checkpoint): a controller that dies before then leaves the step for
        :meth:`Finalizer.resume` to finalize again. Raises the task's exception if a task
        failed for a non-data reason (e.g. the store was unreachable after
        ``finalize.retries`` retries), or ``TimeoutError`` past ``timeout`` (s); either
        way nothing is cleared. Bad data never raises.
        """
        with self._lock:
            if self._result is not None:
                if acknowledge:
                    self._acknowledge()
                return self._result
            client = self._finalizer.client
            on_cluster = bool(self.graph.group_futures)
            with timing.Stopwatch() as gathered:
                by_id, group_events, collected_bytes = self._collect(client, timeout)
            collected_s = timing.wall_s()
            graph = self.graph
            staleness = step_staleness(
                list(by_id.values()), trainer_version=graph.trainer_version,
                max_staleness=graph.staleness.max_staleness if graph.staleness is not None else None)
            metrics = timing.step_metrics(
                step_id=self.step_id,
                group_metrics={gid: g.metrics for gid, g in by_id.items()},
                submitted_s=self.graph.submitted_s,
                collected_s=collected_s,
                queue_depth=self.graph.queue_depth,
                queue_depth_after=self._finalizer.queue_depth,
                crossing_tasks=self.graph.layout.crossing_tasks() if self.graph.layout is not None and on_cluster else (),
                collect_ms=gathered.ms,
                collected_bytes=collected_bytes,
                assembled_on="cluster" if on_cluster else "controller",
                staleness=staleness,
            )
            # One round trip: the scheduler's measure of the bytes that crossed hosts, and
            # the step's events logged there (the step's with that measure filled in).
            measured = transfers.collected(client, self.graph.token, events.FINALIZE, group_events + [metrics]) \
                if self._finalizer.measures_transfers else None
            if measured is None:
                collect.publish(client, events.FINALIZE, group_events + [metrics])
            else:
                metrics = timing.with_cross_host(metrics, measured["bytes"])  # type: ignore[assignment]
            self._result = StepResult(self.step_id, by_id, metrics, client, self._finalizer.settings.mismatch_eps)
            if acknowledge:  # delivered: now (and only now) the step's rows may go
                self._acknowledge()
            # Free the cluster side: the groups are here now.
            self.graph.fetch_futures, self.graph.piece_futures, self.graph.verify_futures = [], [], []
            self.graph.group_futures = {}
            return self._result

    @property
    def collected(self) -> bool:
        """:meth:`result` has returned the step (acknowledged or not)."""
        return self._result is not None

    def acknowledge(self) -> None:
        """The caller has consumed the step's batch: record it delivered in the journal
        and submit the clear of its rows (``clear``). Once only; :class:`FinalizeError`
        before :meth:`result` returned."""
        with self._lock:
            if self._result is None:
                raise FinalizeError(f"step {self.step_id!r} cannot be acknowledged before result() returned it")
            self._acknowledge()

    def _acknowledge(self) -> None:
        if not self.acknowledged:
            self.acknowledged = True
            self._clear_delivered()

    def _collect(self, client: Client, timeout: float | None) -> tuple[dict[str, FinalizedGroup], list[dict[str, object]], int]:
        """The step's groups in this process, the group events still to publish and the
        bytes gathered: the groups from the cluster when :attr:`group_futures` assembled
        them there (their events published there), else the verify outputs, each gathered
        as soon as its task is done, and the groups assembled here."""
        direct = self._finalizer.settings.gather_direct
        g = self.graph
        if g.group_futures:
            groups = collect.gather(client, [g.group_futures[gid] for gid in self.group_ids], timeout, direct)
            return dict(zip(self.group_ids, groups)), [], sum(serializers.group_bytes(grp) for grp in groups)
        outs = collect.gather_as_done(client, g.verify_futures, timeout, direct)
        try:
            by_id = collect.assemble_step(g, outs, collect.pooled_buffers())
        except Exception:
            self._assembly_failed = True  # a bug, not the data: this step will never deliver
            raise
        return by_id, [timing.public(grp.metrics) for grp in by_id.values()], sum(serializers.verify_out_bytes(o) for o in outs)


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
        depth = self.queue_depth + len(named)
        try:
            graph = self._submit_graph(named, step_id, seq, depth, isinstance(groups, Mapping), trainer_version)
        except BaseException:
            if self.journal is not None:  # never submitted: nothing to resume
                self.journal.cleared([step_id])
            raise
        clear = self.settings.clear_staged
        handle = StepHandle(self, graph, clear=clear, rejected_keys=rejected_receipt_keys(named, graph.plan.rejected) if clear else ())
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
