"""The scheduler plugin that keeps the token-capture state and serves it.

:class:`TokenCaptureAggregator` owns a :class:`~pipeline.dashboard.state.TokenCaptureState`,
feeds it every event the scheduler logs, samples the scheduler's workers and load for it,
answers the ``token_capture_state`` / ``token_capture_signal`` RPCs, and on start mounts
the dashboard page, attaches the Prometheus collector and registers the worker plugin that
holds each worker's :class:`~pipeline.process_state.ProcessState`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from distributed.diagnostics.plugin import SchedulerPlugin

from ..events import SCALE
from ..metrics.prometheus import attach, detach
from ..process_state import register_on_workers
from .page import register_page
from .state import TokenCaptureState

if TYPE_CHECKING:
    from distributed import Scheduler

    from .snapshot import StateSnapshot

logger = logging.getLogger(__name__)

PLUGIN_NAME = "token-capture-aggregator"


def scheduler_load(scheduler: Scheduler) -> dict[str, int]:
    """The scheduler's load as :meth:`TokenCaptureState.signal` takes it.

    ``tasks`` (processing + queued + unrunnable), ``workers``, ``finalize_slots`` (sum of
    the workers' ``finalize`` resource) and ``actor_hosts`` (workers hosting actors).
    """
    workers = scheduler.workers.values()
    return {
        "tasks": sum(len(ws.processing) for ws in workers) + len(scheduler.queued) + len(scheduler.unrunnable),
        "workers": len(scheduler.workers),
        "finalize_slots": sum(ws.resources.get("finalize", 0) for ws in workers),
        "actor_hosts": sum(1 for ws in workers if ws.actors),
    }


class TokenCaptureAggregator(SchedulerPlugin):
    """Keeps a :class:`TokenCaptureState` on the scheduler and serves it.

    ``history`` (events per ring, default ``dashboard.history``) is the state's bound.
    """

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, history: int | None = None) -> None:
        self.state = TokenCaptureState(history)
        self.scheduler: Scheduler | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["token_capture_state"] = self._handle_state
        scheduler.handlers["token_capture_signal"] = self._handle_signal
        attach(self.state)
        try:
            register_page(scheduler, get_state)
        except Exception:  # a missing dashboard must not stop the scheduler
            logger.warning("token-capture dashboard page not registered", exc_info=True)
        try:
            await register_on_workers(scheduler)
        except Exception:  # workers then make their process state lazily
            logger.warning("token-capture worker plugin not registered", exc_info=True)

    async def close(self) -> None:
        detach(self.state)

    # ------------------------------------------------------------------ events
    def log_event(self, topic: str, msg: object) -> None:
        """Fold one event into the state (other topics ignored, malformed ones counted)."""
        if self.state.ingest(topic, msg) and topic == SCALE:
            self.sample_workers()

    def sample_workers(self) -> None:
        """Record the scheduler's current worker count in the state (throttled there)."""
        if self.scheduler is None:
            return
        self.state.sample_workers(len(self.scheduler.workers))

    # ------------------------------------------------------------------ queries
    def signal(self, window_s: float | None = None) -> dict[str, float]:
        """:meth:`TokenCaptureState.signal` with this scheduler's current load."""
        load = scheduler_load(self.scheduler) if self.scheduler is not None else None
        return self.state.signal(window_s, load)

    def snapshot(self) -> StateSnapshot:
        """:meth:`TokenCaptureState.snapshot`: all state as JSON-able data."""
        return self.state.snapshot()

    def _handle_state(self) -> StateSnapshot:
        return self.snapshot()

    def _handle_signal(self, window_s: float | None = None) -> dict[str, float]:
        return self.signal(window_s)


def get_aggregator(scheduler: Scheduler) -> TokenCaptureAggregator | None:
    """The aggregator plugin registered on ``scheduler``, if any."""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    return plugin if isinstance(plugin, TokenCaptureAggregator) else None


def get_state(scheduler: Scheduler) -> TokenCaptureState | None:
    """The token-capture state kept on ``scheduler``, if the aggregator is installed."""
    agg = get_aggregator(scheduler)
    return agg.state if agg is not None else None
