"""``token_capture_*`` series on the scheduler's ``/metrics`` endpoint.

One :class:`TokenCaptureCollector` per process, registered in ``prometheus_client.REGISTRY``
(which distributed serves on ``/metrics``), formats the attached
:class:`~pipeline.dashboard.state.TokenCaptureState` at scrape time with
:func:`~pipeline.metrics.families.metric_families`; it computes nothing itself. The
aggregator plugin attaches its state on start and detaches it on close.

Conventions (those of Prometheus and of Dask's own series on the same endpoint): base
units in the name (``_seconds``, ``_bytes``; counters end in ``_total``), latencies as
histograms, and every label value of a fixed vocabulary (rejection reasons, cut failure
reasons) served at 0 from the start, so a rate or an alert has a series before the first
event.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .families import PREFIX, metric_families  # noqa: F401  (PREFIX: re-exported)

if TYPE_CHECKING:  # types only: importing pipeline.dashboard at run time would import the plugin, a cycle
    from ..dashboard.state import TokenCaptureState


class TokenCaptureCollector(Collector):
    """Formats the attached state as Prometheus metric families (nothing when none)."""

    def __init__(self, state: TokenCaptureState | None = None) -> None:
        self._ref: weakref.ReferenceType[TokenCaptureState] | None = None
        if state is not None:
            self._ref = weakref.ref(state)

    @property
    def state(self) -> TokenCaptureState | None:
        """The attached state (held weakly), if any."""
        return self._ref() if self._ref is not None else None

    def collect(self) -> Iterator[Metric]:
        """The attached state's ``token_capture_*`` families (see :mod:`.families`)."""
        agg = self.state
        if agg is None:
            return
        yield from metric_families(agg)


_lock = threading.Lock()
_collector: TokenCaptureCollector | None = None


def collector() -> TokenCaptureCollector:
    """The process's collector, registered with ``prometheus_client.REGISTRY`` once."""
    global _collector
    with _lock:
        if _collector is None:
            _collector = TokenCaptureCollector()
            prometheus_client.REGISTRY.register(_collector)
        return _collector


def attach(state: TokenCaptureState) -> None:
    """Serve ``state`` on ``/metrics`` from now on (the last attached one wins)."""
    collector()._ref = weakref.ref(state)


def detach(state: TokenCaptureState) -> None:
    """Stop serving ``state`` (no-op if another one was attached since)."""
    c = collector()
    if c.state is state:
        c._ref = None
