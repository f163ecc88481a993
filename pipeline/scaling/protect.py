"""Never retire a worker that hosts state: storage units, generation actors, pins.

:class:`ProtectActorHosts` is a ``SchedulerPlugin`` implementing distributed's
``valid_workers_downscaling(scheduler, workers)`` hook, which
``Scheduler.workers_to_close`` consults before suggesting workers to retire (the path
``Adaptive.recommendations`` takes). A worker is protected when

* it hosts an actor: the scheduler tracks each actor task's home in ``WorkerState.actors``
  (storage units and generation/restore actors are all Dask actors), so protection is
  derived from live scheduler state with no registration; or
* it was pinned explicitly (the ``token_capture_protect`` RPC handler or :meth:`pin`),
  for state that lives outside actors.

``token_capture_protected()`` (RPC) lists the protected workers so the adaptive policy can
re-check right before retiring (``TokenCaptureAdaptive.scale_down``): a worker may have
received an actor between the suggestion and the retirement.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, TypedDict

from distributed.diagnostics.plugin import SchedulerPlugin

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import WorkerState

logger = logging.getLogger(__name__)

PLUGIN_NAME = "token-capture-protect"


class ProtectedWorkers(TypedDict):
    """The ``token_capture_protected`` RPC's answer."""

    addresses: list[str]
    names: list[str]
    reasons: dict[str, str]  # address -> why it is protected


class ProtectActorHosts(SchedulerPlugin):
    """Removes actor hosts and pinned workers from downscaling candidates."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.pinned: set[str] = set()
        self.scheduler: Scheduler | None = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["token_capture_protected"] = self._handle_protected
        scheduler.handlers["token_capture_protect"] = self._handle_protect

    def pin(self, address: str) -> None:
        """Protect ``address`` until :meth:`unpin` (or until it leaves)."""
        self.pinned.add(address)

    def unpin(self, address: str) -> None:
        self.pinned.discard(address)

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: object) -> None:
        self.pinned.discard(worker)  # a pin must not outlive its worker

    def is_protected(self, ws: WorkerState) -> bool:
        """True when worker state ``ws`` hosts an actor or is pinned."""
        return bool(ws.actors) or ws.address in self.pinned

    def protected(self, scheduler: Scheduler) -> dict[str, str]:
        """``{address: reason}`` of every protected worker on ``scheduler``."""
        out: dict[str, str] = {}
        for ws in scheduler.workers.values():
            if ws.actors:
                out[ws.address] = f"hosts {len(ws.actors)} actor(s)"
            elif ws.address in self.pinned:
                out[ws.address] = "pinned"
        return out

    def valid_workers_downscaling(self, scheduler: Scheduler, workers: list[WorkerState]) -> list[WorkerState]:
        keep = [ws for ws in workers if not self.is_protected(ws)]
        if len(keep) != len(workers):
            logger.debug(
                "not retiring protected workers %s",
                [ws.address for ws in workers if self.is_protected(ws)],
            )
        return keep

    def _handle_protected(self) -> ProtectedWorkers:
        s = self.scheduler
        prot = self.protected(s)
        return {
            "addresses": sorted(prot),
            "names": sorted(str(s.workers[a].name) for a in prot),
            "reasons": prot,
        }

    def _handle_protect(self, addresses: Iterable[str] = (), pin: bool = True) -> list[str]:
        for a in addresses:
            (self.pin if pin else self.unpin)(a)
        return sorted(self.pinned)
