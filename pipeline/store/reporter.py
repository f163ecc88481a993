"""A storage unit publishing its own figures: one ``token-capture-store`` event every
``store.report-interval-s`` seconds, from its worker's event loop, with no call from the
controller (the dashboard and ``/metrics`` show the store by themselves)."""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Protocol

from .. import dask_compat

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Worker
    from tornado.ioloop import PeriodicCallback

logger = logging.getLogger(__name__)


class Reporting(Protocol):
    """What a reporter needs of the unit it reports: its figures, read on the actor thread."""

    closed: bool
    worker_address: str | None

    def report_figures(self) -> dict | None: ...


class StoreReporter:
    """Publishes a unit's :meth:`StorageUnit.report_figures` as ``STORE`` events every
    ``interval_s`` seconds from its worker's event loop (a tornado ``PeriodicCallback``).

    The figures are read on the worker's actor thread (the one thread that runs the
    unit's methods), so a report never sees a half-applied put or delete. It holds the
    unit and the worker weakly and stops by itself once the unit is closed or gone, or
    the worker is closing. :meth:`start` and :meth:`stop` may be called from any thread.
    """

    def __init__(self, unit: Reporting, worker: "Worker", interval_s: float) -> None:
        self._unit = weakref.ref(unit)
        self._worker = weakref.ref(worker)
        self.interval_s = float(interval_s)
        self._callback: PeriodicCallback | None = None
        self._stopped = False
        self.published = 0

    def start(self) -> None:
        worker = self._worker()
        if worker is not None:
            worker.loop.add_callback(self._start_on_loop)

    def stop(self) -> None:
        self._stopped = True
        worker = self._worker()
        if worker is not None:
            try:
                worker.loop.add_callback(self._stop_on_loop)
            except RuntimeError:  # the loop is already closed: nothing runs any more
                pass

    def _start_on_loop(self) -> None:
        from tornado.ioloop import PeriodicCallback

        if self._stopped or self._callback is not None:
            return
        self._callback = PeriodicCallback(self.report, self.interval_s * 1000.0)
        self._callback.start()
        asyncio.ensure_future(self.report())  # the first figures now, not one interval later

    def _stop_on_loop(self) -> None:
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    async def report(self) -> bool:
        """Publish the unit's figures once (on the worker's loop); False once stopped."""
        from distributed.core import Status

        unit, worker = self._unit(), self._worker()
        if self._stopped or unit is None or unit.closed or worker is None or worker.status not in (Status.running, Status.paused):
            self._stopped = True
            self._stop_on_loop()
            return False
        try:
            figures = await asyncio.get_running_loop().run_in_executor(dask_compat.actor_executor(worker), unit.report_figures)
        except RuntimeError:  # the actor executor shut down with the worker
            self._stopped = True
            self._stop_on_loop()
            return False
        del unit
        if figures is None or self._stopped:
            return False
        from ..events import STORE

        try:
            worker.log_event(STORE, figures)
        except Exception:  # noqa: BLE001 - metrics must not fail the store
            logger.debug("store report not published", exc_info=True)
            return False
        self.published += 1
        return True


def start_reporter(unit: Reporting, interval_s: float) -> tuple[str | None, StoreReporter | None]:
    """On a worker: its address and a started reporter for ``unit`` (None when
    ``interval_s`` is 0); outside a worker (in-process use): (None, None)."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:
        return None, None
    if interval_s <= 0:
        return worker.address, None
    unit.worker_address = worker.address  # before the first tick reads it
    reporter = StoreReporter(unit, worker, interval_s)
    reporter.start()
    return worker.address, reporter
