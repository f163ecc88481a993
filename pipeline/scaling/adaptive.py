"""Adaptive scaling of the finalize pool, driven by the finalize split timing.

A pure :func:`decide` turns one aggregator signal (verify/fetch shares, queue depth and
trend, idle time) into a frozen :class:`Decision`; :class:`TokenCaptureAdaptive` is the thin
``distributed.deploy.Adaptive`` shell around it. Use it through the cluster's own ``adapt``::

    cluster.adapt(Adaptive=TokenCaptureAdaptive, minimum=2, maximum=8)

Policy, event reporting and retirement rules: docs/design.md, "Scaling".
"""
from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from distributed.deploy.adaptive import Adaptive

if TYPE_CHECKING:
    from distributed.deploy import Cluster

from .. import config
from ..events import SCALE

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
        """The ``SCALE`` event (schema in ``pipeline.events``)."""
        return asdict(self)


def decide(signal: Mapping[str, float], current: int, minimum: int, maximum: float) -> ScalingDecision:
    """The policy: a pure function of the aggregator's signal and the cluster size.

    ``signal`` is :meth:`TokenCaptureAggregator.signal`'s dict; knobs are read now from
    ``token-capture.scaling``.
    """
    idle_s = float(config.get("scaling.idle-s"))
    min_events = int(config.get("scaling.min-events"))
    verify_share_min = float(config.get("scaling.verify-dominant-share"))
    fetch_share_min = float(config.get("scaling.fetch-dominant-share"))
    depth_high = float(config.get("scaling.queue-depth-high"))
    step = max(1, int(config.get("scaling.step-up")))

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
    """``Adaptive`` whose target follows the finalize split; see the module docstring.

    Extra attributes: ``decisions`` (the last ``dashboard.history`` decisions, newest
    last) and ``last_decision``.
    """

    def __init__(self, cluster: Cluster | None = None, *args: object, **kwargs: object) -> None:
        super().__init__(cluster, *args, **kwargs)
        self.decisions: deque[ScalingDecision] = deque(maxlen=int(config.get("dashboard.history")))
        self.last_decision: ScalingDecision | None = None
        self._last_published: tuple[str, str, int] | None = None
        self._probe_after = 0.0  # monotonic s; skip the signal RPC until then
        if cluster is not None and config.get("scaling.ensure-finalize-resource"):
            ensure_finalize_resource(cluster)

    async def target(self) -> int:
        current = len(self.plan)
        signal: object = None
        if time.monotonic() >= self._probe_after:
            try:
                signal = await self.scheduler.token_capture_signal(window_s=None)
            except Exception:
                signal = None
        if not isinstance(signal, dict):
            # No aggregator on this scheduler (an unknown RPC answers None): never guess,
            # and ask again only after a signal window, not every interval.
            self._probe_after = time.monotonic() + float(config.get("scaling.window-s"))
            decision = ScalingDecision(
                "hold", current, current, "no-aggregator",
                "no-aggregator: the scheduler has no token-capture aggregator; start it with "
                "the preload 'pipeline.dashboard.preload' or pipeline.dashboard.install(client)",
            )
        else:
            decision = decide(signal, current, self.minimum, self.maximum)
        await self._record(decision)
        return decision.target

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
        try:
            await self.scheduler.log_event(topic=SCALE, msg=decision.payload())
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


def ensure_finalize_resource(cluster: Cluster) -> bool:
    """Make the cluster's worker template advertise ``finalize`` slots.

    Returns True if the template (``SpecCluster.new_spec["options"]["resources"]``) now
    carries ``finalize``; False when the cluster has no such template (e.g. workers
    started by hand: give them ``--resources "finalize=N"``).
    """
    spec = getattr(cluster, "new_spec", None)
    if not isinstance(spec, dict) or not isinstance(spec.get("options"), dict):
        return False
    resources = dict(spec["options"].get("resources") or {})
    if "finalize" not in resources:
        resources["finalize"] = float(config.get("finalize.slots-per-worker"))
        # copy: specs of running workers may share the old options dict
        cluster.new_spec = {**spec, "options": {**spec["options"], "resources": resources}}
        logger.info("adaptive workers will carry resources %s", resources)
    return True
