"""Scheduler preload: the token-capture aggregator (with its dashboard page and ``/metrics``
series), downscaling protection and the store host (stores that outlive their creator),
in one line.

Command line::

    dask scheduler --preload pipeline.dashboard.preload
    dask worker tcp://127.0.0.1:8786 --resources "finalize=2"

In Python::

    LocalCluster(scheduler_kwargs={"preload": [PRELOAD]}, resources={"finalize": 2})

On a scheduler that is already running, :func:`install` does the same from a client.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .plugin import TokenCaptureAggregator

if TYPE_CHECKING:
    from distributed import Client, Scheduler
    from distributed.diagnostics.plugin import SchedulerPlugin

PRELOAD = "pipeline.dashboard.preload"


def _plugins() -> list[SchedulerPlugin]:
    from ..scaling.protect import ProtectActorHosts
    from ..store.host import StoreHost

    return [TokenCaptureAggregator(), ProtectActorHosts(), StoreHost()]


def dask_setup(scheduler: Scheduler) -> None:
    """Preload hook: add the plugins; the scheduler starts them right after preloads."""
    for plugin in _plugins():
        scheduler.add_plugin(plugin, idempotent=True)


def install(client: Client) -> None:
    """Install the same plugins on the client's running scheduler (idempotent).

    The aggregator's ``start`` registers the dashboard page and the Prometheus
    collector on the scheduler, so nothing else is needed.
    """
    for plugin in _plugins():
        client.register_plugin(plugin)  # plugins are idempotent
