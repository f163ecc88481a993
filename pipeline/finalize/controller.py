"""The finalization controller: submit steps, keep several in flight, collect results.

:class:`Finalizer` submits each step as a Dask graph (:mod:`pipeline.finalize.graph`) and
tracks queue depth from the futures' client-side status; :meth:`StepHandle.result`
gathers the groups, computes the step's metrics and publishes its finalize event.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tasks import reasons
from tasks.keys import STAGING_PARTITION

from .. import config, events
from ..store.protocol import PlacedStoreLike, StoreLike
from . import timing
from .graph import FinalizeError, StepGraph, affinity, submit_graph

Groups = Mapping[str, Sequence[Any]] | Sequence[Sequence[Any]]


@dataclass
class StepResult:
    """A finalized step: ``groups`` (group id -> FinalizedGroup, submission order) and the
    step's ``metrics`` (the ``kind: "step"`` event of :mod:`pipeline.finalize.timing`)."""

    step_id: str
    groups: dict[str, Any]
    metrics: dict[str, Any]

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected rollouts per reason (internal errors not included)."""
        return dict(self.metrics.get("rejected", {}))

    @property
    def internal_errors(self) -> int:
        """Rollouts the verifier failed on (bugs, logged on the workers; not rejections)."""
        return int(self.metrics.get("internal_errors", 0))


def clear_rows(store: StoreLike, keys: list[str], partition: str = STAGING_PARTITION) -> dict[str, Any]:
    """Delete staged rows (one batched call); returns counts, never raises on per-key failure."""
    res = store.delete(keys, partition=partition)
    return {"deleted": len(res.ok), "failed": dict(res.failed)}


class StepHandle:
    """One submitted step: Dask futures per group; :meth:`result` collects a StepResult."""

    def __init__(self, finalizer: Finalizer, graph: StepGraph) -> None:
        self._finalizer = finalizer
        self.graph = graph
        self.step_id = graph.step_id
        self.group_ids = list(graph.group_ids)
        self.group_futures: dict[str, Any] = dict(graph.group_futures)
        self.clear_future: Any | None = None
        self._result: StepResult | None = None
        self._lock = threading.Lock()

    @property
    def futures(self) -> list[Any]:
        """The per-group futures (each resolves to a FinalizedGroup); empty once collected."""
        return list(self.group_futures.values())

    def pending_groups(self) -> int:
        """Groups of this step whose assemble task has not finished (or failed)."""
        return sum(not f.done() for f in self.group_futures.values())

    def done(self) -> bool:
        return self.pending_groups() == 0

    def cancel(self) -> None:
        g = self.graph
        self._finalizer.client.cancel(self.futures + g.verify_futures + g.piece_futures + g.fetch_futures)

    def result(self, timeout: float | None = None) -> StepResult:
        """Wait for every group, compute and publish the step metrics (once) and return them.

        Raises the task's exception if a group failed for a non-data reason (e.g. the store
        was unreachable after ``finalize.retries`` retries); bad data never raises.
        """
        with self._lock:
            if self._result is not None:
                return self._result
            client = self._finalizer.client
            groups = client.gather(self.futures, errors="raise") if timeout is None else _gather_timeout(client, self.futures, timeout)
            by_id = dict(zip(self.group_ids, groups))
            collected_s = timing.wall_s()
            metrics = timing.step_metrics(
                step_id=self.step_id,
                group_metrics={gid: g.metrics for gid, g in by_id.items()},
                submitted_s=self.graph.submitted_s,
                collected_s=collected_s,
                queue_depth=self.graph.queue_depth,
                queue_depth_after=self._finalizer.queue_depth,
            )
            try:
                client.log_event(events.FINALIZE, metrics)
            except Exception:  # metrics never fail the work they describe
                pass
            if config.get("finalize.clear-staged"):
                self.clear_future = self._submit_clear(by_id)
            self._result = StepResult(self.step_id, by_id, metrics)
            # Free the cluster side: the groups are here now.
            self.group_futures = {}
            self.graph.fetch_futures, self.graph.piece_futures, self.graph.verify_futures = [], [], []
            self.graph.group_futures = {}
            self._finalizer._forget(self)
            return self._result

    def _submit_clear(self, groups: Mapping[str, Any]) -> Any | None:
        """Delete the rows of accepted rollouts (rejected ones stay for inspection)."""
        plan = self.graph.plan
        keys: list[str] = []
        for gid, slots in self.graph.slots.items():
            statuses = list(getattr(groups[gid], "status", []))
            for slot, status in zip(slots, statuses):
                if slot.index is not None and status == reasons.OK:
                    keys.extend(plan.rollouts[slot.index].all_keys)
        if not keys:
            return None
        store = self._finalizer.store
        return self._finalizer.client.submit(
            clear_rows, store, keys, key=f"tc-clear-{self.graph.token}", pure=False,
            workers=affinity(store, keys) or None, allow_other_workers=True,
            retries=int(config.get("finalize.retries")),
        )


def _gather_timeout(client: Any, futures: list[Any], timeout: float) -> list[Any]:
    from distributed import wait

    wait(futures, timeout=timeout)
    return client.gather(futures, errors="raise")


class Finalizer:
    """Submits finalization steps as Dask graphs on ``client`` against ``store``.

    ``vocab_size`` / ``num_experts`` default to ``policy.vocab-size`` / ``policy.experts``
    (read at submit time). ``keep_intermediates`` holds each step's fetch, piece and
    verify futures until it is collected (debugging; costs cluster memory). The cluster's workers must advertise the ``finalize`` resource
    (``pipeline.cluster.finalize_resources()``); a cluster whose workers all lack it is
    refused at construction, because verify tasks would wait forever.
    """

    def __init__(
        self,
        client: Any,
        store: PlacedStoreLike,
        *,
        vocab_size: int | None = None,
        num_experts: int | None = None,
        check_resources: bool = True,
        keep_intermediates: bool = False,
    ) -> None:
        self.client = client
        self.store = store
        self.keep_intermediates = keep_intermediates
        self._vocab_size = vocab_size
        self._num_experts = num_experts
        self._seq = itertools.count()
        self._in_flight: list[StepHandle] = []
        self._lock = threading.Lock()
        if check_resources:
            self._check_resources()

    def _check_resources(self) -> None:
        try:
            info = self.client.scheduler_info(n_workers=-1)  # all workers, not the first few
        except TypeError:  # older distributed
            info = self.client.scheduler_info()
        workers = info.get("workers", {})
        if workers and not any(w.get("resources", {}).get("finalize", 0) > 0 for w in workers.values()):
            raise FinalizeError(
                "no worker advertises the 'finalize' resource; start workers with "
                "resources=pipeline.cluster.finalize_resources() (e.g. LocalCluster(resources={'finalize': 2}))"
            )

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

    def submit_step(self, groups: Groups, *, step_id: str | None = None) -> StepHandle:
        """Plan and submit one training step (one or many groups); returns immediately.

        ``groups``: group id -> receipts, or a list of receipt lists (ids ``"g0"``, ...).
        Receipts are :class:`tasks.receipts.Receipt` or their dicts; a malformed one becomes
        its row's ``invalid_receipt``, never an exception.
        """
        if isinstance(groups, Mapping):
            named = {str(k): v for k, v in groups.items()}
            if len(named) != len(groups):
                raise FinalizeError("group ids collide once converted to str")
        elif isinstance(groups, Sequence) and not isinstance(groups, (str, bytes)):
            named = {f"g{i}": g for i, g in enumerate(groups)}
        else:
            raise FinalizeError(f"groups must be a mapping or a list of receipt lists, got {type(groups).__name__}")
        seq = next(self._seq)
        step_id = f"step-{seq}" if step_id is None else str(step_id)
        depth = self.queue_depth + len(named)
        graph = submit_graph(
            self.client,
            self.store,
            named,
            step_id=step_id,
            vocab_size=int(config.get("policy.vocab-size") if self._vocab_size is None else self._vocab_size),
            num_experts=self._num_experts if self._num_experts is not None else config.get("policy.experts"),
            queue_depth=depth,
            priority=-seq,  # older steps first when several are in flight
            keep_intermediates=self.keep_intermediates,
        )
        handle = StepHandle(self, graph)
        with self._lock:
            self._in_flight.append(handle)
        return handle

    def drain(self, timeout: float | None = None) -> list[StepResult]:
        """Collect every in-flight step, oldest first."""
        return [h.result(timeout) for h in self.in_flight]

    def _forget(self, handle: StepHandle) -> None:
        with self._lock:
            if handle in self._in_flight:
                self._in_flight.remove(handle)
