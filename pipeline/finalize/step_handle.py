"""One submitted finalization step: :class:`StepHandle`.

A handle holds the step's Dask futures (:class:`~pipeline.finalize.graph.StepGraph`);
:meth:`StepHandle.result` gathers and assembles its groups, publishes its metrics and
(acknowledged) delivers it: the journal records it delivered and, with
``finalize.clear-staged``, its rows' clear is submitted, never earlier.
:meth:`StepHandle.resubmit` submits a failed step again under its own id. Made by
:meth:`pipeline.finalize.controller.Finalizer.submit_step`.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from tasks.finalize.plan import ReceiptLike
from tasks.finalize.staleness import step_staleness

from .. import events
from . import collect, serializers, timing, transfers
from .graph import FinalizeError, StepGraph, submit_assembly
from .kept_rows import kept_rollouts
from .step_result import StepResult

if TYPE_CHECKING:
    from distributed import Client, Future

    from tasks.finalize.assemble import FinalizedGroup

    from .settings import FinalizeSettings


class StepOwner(Protocol):
    """What a step handle reads of the :class:`~pipeline.finalize.controller.Finalizer`
    that submitted it."""

    client: Client
    settings: FinalizeSettings
    measures_transfers: bool

    @property
    def queue_depth(self) -> int: ...

    def _resubmit(self, handle: StepHandle) -> StepHandle: ...

    def submit_clear(self, keys: Sequence[str], token: str, span: Mapping[str, Any] | None = None) -> Future | None: ...

    def _deliver(self, handle: StepHandle) -> set[str]: ...

    def _journal_delivered(self, step_id: str, keys: Sequence[str]) -> None: ...

    def _journal_owes(self, step_id: str, keys: Sequence[str]) -> None: ...


class StepHandle:
    """One submitted step: Dask futures of its verify tasks; :meth:`result` gathers them,
    assembles the groups in the caller's process (:mod:`pipeline.finalize.collect`) and,
    with ``clear``, submits the step's clear once the groups are here (never from the
    tasks' completion alone). :attr:`group_futures` assembles them on the cluster instead."""

    def __init__(self, finalizer: StepOwner, graph: StepGraph, *, clear: bool = False, rejected_keys: Sequence[str] = (),
                 receipts: Mapping[str, Sequence[ReceiptLike]] | None = None, check_groups: bool = True,
                 trainer_version: int | None = None) -> None:
        self._finalizer = finalizer
        self.graph = graph
        self.step_id = graph.step_id
        # What the step was submitted with, for resubmit(): group id -> receipts, whether
        # the group ids were the caller's (checked against the receipts), the trainer version.
        self.receipts = dict(receipts or {})
        self.check_groups = check_groups
        self.trainer_version = trainer_version
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

    def resubmit(self) -> StepHandle:
        """Submit this step again after it :meth:`failed` (a task failed or was cancelled,
        e.g. the store unreachable past ``finalize.retries``, or :meth:`result` raised
        assembling it): the same receipts, step id and trainer version, so the same
        tensors. This handle leaves the Finalizer's steps in flight; with a journal the
        step keeps its one record (a controller that dies now has it resumed once, not
        once per attempt). :class:`FinalizeError` for a step that has not failed (running,
        or collected: it would deliver twice); ``cancel()`` a step to give up on it first."""
        with self._lock:
            if self._result is not None or not self.failed():
                state = "collected" if self._result is not None else "still running (cancel() it first to give up on it)"
                raise FinalizeError(f"step {self.step_id!r} has not failed, it is {state}: only a failed step is submitted again")
        return self._finalizer._resubmit(self)

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
