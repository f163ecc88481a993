"""Adaptive scaling of the finalize pool (from the finalize split timing) and the store.

A pure :func:`decide` turns one aggregator signal (verify/fetch shares, queue depth and
trend, idle time) into a frozen :class:`ScalingDecision`; :func:`~.storage.decide_storage`
turns the store's fill into a storage decision; :class:`TokenCaptureAdaptive` is the thin
``distributed.deploy.Adaptive`` shell that combines them. Use it through ``adapt``::

    cluster.adapt(Adaptive=TokenCaptureAdaptive, minimum=2, maximum=8)

Policy, event reporting and retirement rules: docs/design.md, "Scaling".
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from inspect import isawaitable
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Mapping, Sequence

from distributed.deploy.adaptive import Adaptive

if TYPE_CHECKING:
    from distributed.deploy import Cluster

from .. import config
from ..events import SCALE
from .storage import STORAGE_RESOURCE, StorageDecision, StorageScalingSettings, WorkerPlan, combine, decide_storage, pending, storage_worker_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScalingDecision:
    """One policy decision. ``target`` and ``current`` count workers; times in ms."""

    action: str  # "up", "down" or "hold"
    target: int
    current: int
    reason_code: str  # stable identifier: idle, verify-bound, fetch-bound, ...
    reason: str  # for people: the figures behind the decision
    verify_ms: float = 0.0
    fetch_ms: float = 0.0
    queue_depth: float = 0.0

    def payload(self) -> dict[str, str | int | float]:
        """The ``SCALE`` event (schema in ``pipeline.events``), ``kind`` ``finalize``."""
        return {"kind": "finalize", **asdict(self)}


@dataclass(frozen=True)
class ScalingSettings:
    """The policy's knobs (``token-capture.scaling``), read once by :meth:`from_config`."""

    idle_s: float  # no finalize event for this long and no task: scale down
    min_events: int  # finalize events a window needs before verify/fetch shares count
    verify_dominant_share: float  # verify share of finalize time that asks for workers
    fetch_dominant_share: float  # fetch share that says "batch more" instead
    queue_depth_high: float  # queue depth that counts as pressure even when flat
    step_up: int  # workers added per up decision (>= 1)
    window_s: float  # the aggregator's signal window; also the no-aggregator back-off

    @classmethod
    def from_config(cls) -> ScalingSettings:
        """The current ``dask.config`` values."""
        return cls(
            idle_s=float(config.get("scaling.idle-s")),
            min_events=int(config.get("scaling.min-events")),
            verify_dominant_share=float(config.get("scaling.verify-dominant-share")),
            fetch_dominant_share=float(config.get("scaling.fetch-dominant-share")),
            queue_depth_high=float(config.get("scaling.queue-depth-high")),
            step_up=max(1, int(config.get("scaling.step-up"))),
            window_s=float(config.get("scaling.window-s")),
        )


def decide(
    signal: Mapping[str, float], current: int, minimum: int, maximum: float,
    settings: ScalingSettings | None = None,
) -> ScalingDecision:
    """The policy: a pure function of the aggregator's signal, the cluster size and its knobs.

    ``signal`` is :meth:`TokenCaptureAggregator.signal`'s dict; ``settings`` default to
    :meth:`ScalingSettings.from_config` (read at this call).
    """
    s = ScalingSettings.from_config() if settings is None else settings
    idle_s, min_events, depth_high, step = s.idle_s, s.min_events, s.queue_depth_high, s.step_up
    verify_share_min, fetch_share_min = s.verify_dominant_share, s.fetch_dominant_share

    fetch, verify, assemble = (float(signal.get(k, 0.0)) for k in ("fetch_ms", "verify_ms", "assemble_ms"))
    first, last = float(signal.get("queue_depth_first", 0.0)), float(signal.get("queue_depth_last", 0.0))
    events = int(signal.get("events", 0))
    age = float(signal.get("last_event_age_s", math.inf))
    tasks = int(signal.get("tasks", 0))
    actor_hosts = int(signal.get("actor_hosts", 0))
    figures = dict(verify_ms=verify, fetch_ms=fetch, queue_depth=last)

    def hold(code: str, why: str) -> ScalingDecision:
        return ScalingDecision("hold", current, current, code, f"{code}: {why}", **figures)

    if tasks == 0 and age >= idle_s:
        floor = max(int(minimum), actor_hosts)
        since = "no finalize events yet" if math.isinf(age) else f"no finalize event for {age:.1f}s"
        if current > floor:
            kept = f"; {actor_hosts} worker(s) host actors and stay" if actor_hosts > minimum else ""
            return ScalingDecision("down", floor, current, "idle", f"idle: {since} and no tasks{kept}", **figures)
        return hold("idle-at-floor", f"{since}; already at {current} (minimum {minimum}, actor hosts {actor_hosts})")

    total = fetch + verify + assemble
    if events < min_events or total <= 0:
        return hold("no-signal", f"{events} finalize event(s) in the window, need {min_events}")
    verify_share, fetch_share = verify / total, fetch / total
    rising = last > first
    pressure = rising or last >= depth_high
    depth = f"queue depth {first:g} -> {last:g}"
    if verify_share >= verify_share_min:
        if not pressure:
            return hold("verify-bound-no-queue", f"verify {verify_share:.0%} of finalize time but {depth} is not rising")
        if current >= maximum:
            return hold("at-maximum", f"verify {verify_share:.0%} of finalize time, {depth}; at maximum {maximum:g}")
        target = int(min(maximum, current + step))
        return ScalingDecision(
            "up", target, current, "verify-bound",
            f"verify-bound: verify {verify_share:.0%} of finalize time and {depth}", **figures,
        )
    if fetch_share >= fetch_share_min:
        return hold(
            "fetch-bound",
            f"fetch {fetch_share:.0%} of finalize time ({depth}): batch more, more workers would not help",
        )
    return hold("balanced", f"fetch {fetch_share:.0%}, verify {verify_share:.0%}, {depth}")


class TokenCaptureAdaptive(Adaptive):
    """``Adaptive`` whose target follows the finalize split and the store's fill; see the
    module docstring.

    Extra attributes: ``decisions`` (the last ``dashboard.history`` finalize decisions,
    newest last), ``last_decision``, ``storage_decisions`` / ``last_storage_decision``
    (the same for the store), ``settings`` (:class:`ScalingSettings`) and
    ``storage_settings`` (:class:`~.storage.StorageScalingSettings`), both read once when
    built; :meth:`with_settings` / :meth:`with_storage_settings` change them live (e.g. for
    a demo's own thresholds).
    """

    def __init__(self, cluster: Cluster | None = None, *args: object, **kwargs: object) -> None:
        super().__init__(cluster, *args, **kwargs)
        self.settings = ScalingSettings.from_config()
        self.storage_settings = StorageScalingSettings.from_config()
        self._slots_per_worker = float(config.get("finalize.slots-per-worker"))
        history = int(config.get("dashboard.history"))
        self.decisions: deque[ScalingDecision] = deque(maxlen=history)
        self.last_decision: ScalingDecision | None = None
        self.storage_decisions: deque[StorageDecision] = deque(maxlen=history)
        self.last_storage_decision: StorageDecision | None = None
        self.worker_plan: WorkerPlan | None = None  # this round's combined target
        self._last_published: tuple[str, str, int] | None = None
        self._last_storage_published: tuple[str, str, int] | None = None
        self._storage_pending: tuple[int, float] | None = None  # (units at the last up, monotonic deadline)
        self._retire_names: list[str | int] = []  # the drained storage worker a storage down retires
        self._drain_task: asyncio.Future[None] | None = None  # the store host draining a storage worker
        self._drain_pending: tuple[int, float] | None = None  # (units at the last drain, monotonic deadline)
        self._probe_after = 0.0  # monotonic s; skip the signal RPC until then
        if cluster is not None and config.get("scaling.ensure-finalize-resource"):
            ensure_finalize_resource(cluster, self._slots_per_worker)

    def with_settings(self, **changes: float | int) -> ScalingSettings:
        """Replace some knobs from the next decision on; returns the previous settings
        (hand them back to ``restore_settings``)."""
        previous = self.settings
        self.settings = replace(previous, **changes)
        return previous

    def restore_settings(self, settings: ScalingSettings) -> None:
        """Put back settings returned by :meth:`with_settings`."""
        self.settings = settings

    def with_storage_settings(self, **changes: float | int) -> StorageScalingSettings:
        """Replace some storage knobs from the next decision on (checked as when read);
        returns the previous ones (hand them back to ``restore_storage_settings``)."""
        previous = self.storage_settings
        self.storage_settings = replace(previous, **changes)
        return previous

    def restore_storage_settings(self, settings: StorageScalingSettings) -> None:
        """Put back settings returned by :meth:`with_storage_settings`."""
        self.storage_settings = settings

    async def target(self) -> int:
        current = len(self.plan)
        signal = await self._signal()
        if signal is None:
            decision = ScalingDecision(
                "hold", current, current, "no-aggregator",
                "no-aggregator: the scheduler has no token-capture aggregator; start it with "
                "the preload 'pipeline.dashboard.preload' or pipeline.dashboard.install(client)",
            )
            self.worker_plan = None
            await self._record(decision)
            return decision.target
        decision = decide(signal, current, self.minimum, self.maximum, self.settings)
        plan = self.worker_plan = await self._storage_plan(signal, decision, current)
        await self._record(decision)
        await self._record_storage(plan.storage, current)
        return plan.target

    async def _signal(self) -> dict[str, float] | None:
        """The aggregator's signal, or None when the scheduler has none (asked again only
        after a signal window then, not every interval: never guess)."""
        signal: object = None
        if time.monotonic() >= self._probe_after:
            try:
                signal = await self.scheduler.token_capture_signal(window_s=None)
            except Exception:
                signal = None
        if not isinstance(signal, dict):  # an unknown RPC answers None
            self._probe_after = time.monotonic() + self.settings.window_s
            return None
        return signal

    async def _storage_plan(self, signal: dict[str, float], decision: ScalingDecision, current: int) -> WorkerPlan:
        """The storage decision for ``signal`` joined with the finalize ``decision``: an up
        waits while the last up's unit has not reported (until ``settle_s``); a down asks
        the store host to drain a storage worker's units and retires a storage worker
        only once it hosts no unit any more."""
        storage = decide_storage(signal, self.storage_settings)
        if storage.action == "up" and self._storage_pending is not None:
            units_at_up, deadline = self._storage_pending
            if storage.units <= units_at_up and time.monotonic() < deadline:
                storage = pending(storage, units_at_up)
        if storage.reason_code != "storage-up-pending":
            self._storage_pending = None
        drained: list[str | int] = []
        if storage.action == "down" and decision.action != "up" and not (self.requested - self.observed):
            drained, hosting = await self._storage_workers()
            if not drained and hosting:
                self._request_drain(hosting[-1], storage.units)
        plan = combine(decision.action, decision.target, storage, current, self.minimum, self.maximum, bool(drained))
        self._retire_names = drained[:1] if plan.retire_storage_worker else []
        if plan.add_storage_worker:
            self._storage_pending = (storage.units, time.monotonic() + self.storage_settings.settle_s)
        return plan

    async def _storage_workers(self) -> tuple[list[str | int], list[str]]:
        """The workers with the storage role: names of those hosting no actor (drained) and
        not pinned, and addresses of the protected ones (hosting units), both ordered by
        name; none when the scheduler cannot say."""
        try:
            info = await self.scheduler.identity()
            prot = await self.scheduler.token_capture_protected()
        except Exception:
            return [], []
        protected = set(prot["addresses"])
        storage = sorted(
            ((str(w["name"]), w["name"], addr) for addr, w in info["workers"].items()
             if float((w.get("resources") or {}).get(STORAGE_RESOURCE, 0)) > 0),
            key=lambda t: t[0],
        )
        return [name for _, name, addr in storage if addr not in protected], [addr for _, _, addr in storage if addr in protected]

    def _request_drain(self, address: str, units: int) -> None:
        """Ask the scheduler's store host to drain the units on ``address`` (keys moved,
        units closed), in the background and one drain at a time: the next waits until
        the signal counts fewer than ``units`` units or ``settle_s`` passed."""
        now = time.monotonic()
        if self._drain_task is not None and not self._drain_task.done():
            return
        if self._drain_pending is not None:
            units_at, deadline = self._drain_pending
            if units >= units_at and now < deadline:
                return
        self._drain_pending = (units, now + self.storage_settings.settle_s)
        self._drain_task = asyncio.ensure_future(self._drain(address))

    async def _drain(self, address: str) -> None:
        try:
            drained = await self.scheduler.token_capture_store_drain(workers=[address])
        except Exception as e:  # no store host (or the drain failed): the down waits
            logger.info("storage scaling: could not drain the units on %s: %s", address, e)
            return
        logger.info("storage scaling: drained %d unit(s) on %s", len(drained or ()), address)

    async def workers_to_close(self, target: int) -> list[str | int]:
        """Names to retire: in a storage down's round only the drained storage worker, else
        distributed's choice (which never offers a protected worker)."""
        plan = self.worker_plan
        if plan is not None and plan.retire_storage_worker:
            return list(self._retire_names)
        return await super().workers_to_close(target)

    async def scale_up(self, n: int) -> None:
        """Grow to ``n`` workers; when the storage side asked, the first new one takes the
        storage role (``scaling.ensure-storage-resource``), the others the plain template."""
        plan = self.worker_plan
        if plan is not None and plan.add_storage_worker and self.storage_settings.storage_resource:
            await self._add_storage_worker()
        await super().scale_up(n)

    async def _add_storage_worker(self) -> bool:
        """One more worker from the cluster's template with ``storage: 1`` added; False
        when the cluster has no such template (then the new worker is a plain one)."""
        cluster = self.cluster
        spec = storage_worker_spec(getattr(cluster, "new_spec", None))
        worker_spec = getattr(cluster, "worker_spec", None)
        if spec is None or not isinstance(worker_spec, dict):
            return False
        template = cluster.new_spec
        cluster.new_spec = spec
        try:
            f = cluster.scale(len(worker_spec) + 1)  # adds the spec at once, starts it later
        finally:
            cluster.new_spec = template
        if isawaitable(f):
            await f
        logger.info("the next worker takes the storage role (resource %r)", STORAGE_RESOURCE)
        return True

    async def _record(self, decision: ScalingDecision) -> None:
        self.last_decision = decision
        self.decisions.append(decision)
        key = (decision.action, decision.reason_code, decision.target)
        # Holds repeat every interval: record one per change, and every up/down.
        if decision.action == "hold" and key == self._last_published:
            return
        if decision.action == "down" and key == self._last_published:
            return  # a down blocked by wait_count or protection is the same decision
        self._last_published = key
        if decision.action != "hold":
            logger.info("scaling %s to %d: %s", decision.action, decision.target, decision.reason)
        await self._publish(decision.payload())

    async def _record_storage(self, decision: StorageDecision, current: int) -> None:
        """Keep the storage decision; publish it only when it changed (action, reason
        code or the worker count it asks for), not every interval."""
        self.last_storage_decision = decision
        self.storage_decisions.append(decision)
        key = (decision.action, decision.reason_code, decision.asked(current))
        if key == self._last_storage_published:
            return
        self._last_storage_published = key
        if decision.action != "hold":
            logger.info("storage scaling %s: %s", decision.action, decision.reason)
        await self._publish(decision.payload(current))

    async def _publish(self, msg: dict[str, str | int | float]) -> None:
        try:
            await self.scheduler.log_event(topic=SCALE, msg=msg)
        except Exception:  # metrics must not fail scaling
            logger.debug("could not record scaling decision", exc_info=True)

    async def scale_down(self, workers: Sequence[str | int]) -> None:
        """Retire ``workers`` (names) except any that became protected meanwhile."""
        if not workers:
            return
        try:
            prot = await self.scheduler.token_capture_protected()
            protected = {str(n) for n in prot["names"]} | set(prot["addresses"])
        except Exception:
            protected = set()
        keep = [w for w in workers if str(w) in protected]
        if keep:
            logger.info("not retiring protected workers %s", keep)
        workers = [w for w in workers if str(w) not in protected]
        await super().scale_down(workers)


def ensure_finalize_resource(cluster: Cluster, slots_per_worker: float | None = None) -> bool:
    """Make the cluster's worker template advertise ``finalize`` slots
    (``slots_per_worker``, default ``finalize.slots-per-worker``).

    Returns True if the template (``SpecCluster.new_spec["options"]["resources"]``) now
    carries ``finalize``; False when the cluster has no such template (e.g. workers
    started by hand: give them ``--resources "finalize=N"``).
    """
    spec = getattr(cluster, "new_spec", None)
    if not isinstance(spec, dict) or not isinstance(spec.get("options"), dict):
        return False
    resources = dict(spec["options"].get("resources") or {})
    if "finalize" not in resources:
        slots = config.get("finalize.slots-per-worker") if slots_per_worker is None else slots_per_worker
        resources["finalize"] = float(slots)
        # copy: specs of running workers may share the old options dict
        cluster.new_spec = {**spec, "options": {**spec["options"], "resources": resources}}
        logger.info("adaptive workers will carry resources %s", resources)
    return True
