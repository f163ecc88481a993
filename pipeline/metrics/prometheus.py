"""``token_capture_*`` series on the scheduler's ``/metrics`` endpoint.

One :class:`TokenCaptureCollector` per process, registered in ``prometheus_client.REGISTRY``
(which distributed serves on ``/metrics``), formats the attached
:class:`~pipeline.dashboard.state.TokenCaptureState` at scrape time with
:func:`~pipeline.metrics.families.metric_families`; it computes nothing itself. The
aggregator plugin attaches its state on start and detaches it on close. The collector's
registration is a :class:`CollectorRegistration` component of the process's
:class:`~pipeline.process_state.ProcessState`, which an attached state holds (the
collector and its registration live while something is served); releasing the owner
unregisters the collector.

Conventions (those of Prometheus and of Dask's own series on the same endpoint): base
units in the name (``_seconds``, ``_bytes``; counters end in ``_total``), latencies as
histograms, and every label value of a fixed vocabulary (rejection reasons, cut failure
reasons) served at 0 from the start, so a rate or an alert has a series before the first
event.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..process_state import acquire, process_state, release
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


class CollectorRegistration:
    """The process's collector, registered with ``prometheus_client.REGISTRY`` while this
    component lives (unregistered at :meth:`close`, the owner's release), and the
    attached states holding the owner. Thread-safe (its lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.collector = TokenCaptureCollector()
        self._holds: weakref.WeakKeyDictionary[TokenCaptureState, int] = weakref.WeakKeyDictionary()
        prometheus_client.REGISTRY.register(self.collector)

    def attach(self, state: TokenCaptureState) -> None:
        """Serve ``state`` from now on; one hold of the owner more for it."""
        with self._lock:
            self.collector._ref = weakref.ref(state)
            self._holds[state] = self._holds.get(state, 0) + 1

    def detach(self, state: TokenCaptureState) -> bool:
        """Stop serving ``state`` (if it is the one served); whether it held the owner."""
        with self._lock:
            if self.collector.state is state:
                self.collector._ref = None
            held = self._holds.pop(state, 0)
            if held > 1:
                self._holds[state] = held - 1
            return held > 0

    def close(self) -> None:
        """Take the collector off ``/metrics``."""
        with contextlib.suppress(KeyError):
            prometheus_client.REGISTRY.unregister(self.collector)


def collector() -> TokenCaptureCollector:
    """The process's collector, registered with ``prometheus_client.REGISTRY`` once."""
    return process_state().get(CollectorRegistration).collector


def attach(state: TokenCaptureState) -> None:
    """Serve ``state`` on ``/metrics`` from now on (the last attached one wins); the
    process's owner (and so the collector) is held until :func:`detach`."""
    owner = acquire()
    try:
        owner.get(CollectorRegistration).attach(state)
    except BaseException:
        release(owner)
        raise


def detach(state: TokenCaptureState) -> None:
    """Stop serving ``state`` (no-op if another one was attached since); lets go of the
    owner :func:`attach` held for it."""
    owner = process_state()
    if owner.get(CollectorRegistration).detach(state):
        release(owner)
