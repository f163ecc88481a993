"""What a controller checks when it attaches: every worker runs the worker preload with
this package's version and advertises a role, and the scheduler runs the pipeline's
plugins. :func:`check_cluster` reports, naming workers; :func:`require_configured`
raises :class:`~tasks.errors.ClusterMisconfigured`; :func:`check_attached` does what
``hosts.attach-check`` says (warn, error, off).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tasks.errors import ClusterMisconfigured

from ..actors import workers_now
from .roles import ROLES, WORKER_PRELOAD, roles_of
from .settings import attach_check_mode
from .worker_preload import package_version, preload_record

if TYPE_CHECKING:
    from distributed import Client

logger = logging.getLogger(__name__)

def scheduler_plugins() -> dict[str, str]:
    """The scheduler plugins the preload ``pipeline.dashboard.preload`` installs: name -> what it is."""
    from ..dashboard.plugin import PLUGIN_NAME as AGGREGATOR
    from ..store.host import PLUGIN_NAME as STORE_HOST

    return {AGGREGATOR: "the token-capture page and /metrics", STORE_HOST: "the store host"}


@dataclass(frozen=True)
class WorkerStatus:
    """One worker as the check sees it."""

    address: str
    name: str
    roles: tuple[str, ...]  # from its resources
    preloaded: bool  # the worker preload ran there
    version: str | None  # the package version it runs (None: unknown, no preload)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.address})" if self.name != self.address else self.address


@dataclass(frozen=True)
class ClusterCheck:
    """The result: every worker's status, the scheduler plugins missing, this process's version."""

    scheduler: str
    workers: tuple[WorkerStatus, ...]
    missing_plugins: tuple[str, ...]
    version: str

    @property
    def without_preload(self) -> list[WorkerStatus]:
        return [w for w in self.workers if not w.preloaded]

    @property
    def without_role(self) -> list[WorkerStatus]:
        """Workers without a role, in a cluster whose other workers have one (when none
        has any, the finalizer's missing-``finalize`` error says what to do)."""
        if not any(w.roles for w in self.workers):
            return []
        return [w for w in self.workers if not w.roles]

    @property
    def other_version(self) -> list[WorkerStatus]:
        return [w for w in self.workers if w.preloaded and w.version != self.version]

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        """One line per kind of problem, naming the workers and the fix."""
        out = []
        if self.missing_plugins:
            known = scheduler_plugins()
            what = ", ".join(f"{p} ({known.get(p, p)})" for p in self.missing_plugins)
            out.append(f"the scheduler at {self.scheduler} lacks {what}; start it with "
                       "`dask scheduler --preload pipeline.dashboard.preload` or call pipeline.dashboard.install(client)")
        if self.without_preload:
            out.append(f"{_names(self.without_preload)} started without the worker preload {WORKER_PRELOAD}; restart "
                       f"{'it' if len(self.without_preload) == 1 else 'them'} with `dask worker {self.scheduler} --preload {WORKER_PRELOAD} ...`")
        if self.without_role:
            out.append(f"{_names(self.without_role)} advertise{'s' if len(self.without_role) == 1 else ''} no role resource "
                       f"({', '.join(ROLES)}); restart with e.g. `dask worker {self.scheduler} --resources \"finalize=2,storage=1\"`")
        if self.other_version:
            versions = ", ".join(f"{w.label}: {w.version}" for w in self.other_version)
            out.append(f"worker(s) run another version of dask-token-capture than this process ({self.version}): {versions}; "
                       "install the same version everywhere")
        return out


def _names(workers: list[WorkerStatus]) -> str:
    return f"{len(workers)} worker(s): " + ", ".join(w.label for w in workers)


def check_cluster(client: Client) -> ClusterCheck:
    """Ask every worker for its preload record and the scheduler for its plugins."""
    connected = workers_now(client)
    records = client.run(preload_record, on_error="return") if connected else {}
    workers = []
    for address, w in sorted(connected.items()):
        record = records.get(address)
        record = record if isinstance(record, dict) else None  # an error or None: no preload record
        workers.append(WorkerStatus(address=address, name=str(w.get("name", address)), roles=roles_of(w.get("resources")),
                                    preloaded=record is not None, version=None if record is None else str(record.get("version"))))
    plugins = set(client.run_on_scheduler(_plugin_names))
    missing = tuple(p for p in scheduler_plugins() if p not in plugins)
    return ClusterCheck(scheduler=client.scheduler.address, workers=tuple(workers), missing_plugins=missing, version=package_version())


def _plugin_names(dask_scheduler: object) -> list[str]:
    return sorted(getattr(dask_scheduler, "plugins", {}))


def require_configured(client: Client) -> ClusterCheck:
    """:func:`check_cluster`, raising :class:`ClusterMisconfigured` (its problems, one
    line) when anything is missing."""
    result = check_cluster(client)
    if not result.ok:
        raise ClusterMisconfigured("; ".join(result.problems()))
    return result


def check_attached(client: Client, mode: str | None = None) -> ClusterCheck | None:
    """The attach-time check, as ``mode`` (default ``hosts.attach-check``) says: ``warn``
    logs its problems as ONE warning line, ``error`` raises, ``off`` skips."""
    mode = attach_check_mode() if mode is None else mode
    if mode == "off":
        return None
    if mode == "error":
        return require_configured(client)
    result = check_cluster(client)
    if not result.ok:
        logger.warning("warning: %s", "; ".join(result.problems()))
    return result
