"""The command lines a deployment runs: ``dask scheduler`` with the pipeline's scheduler
preload and ``dask worker`` per host with its address, roles (resources), the worker
preload and its own local directory. Pure: argument lists, nothing started here.
"""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from .roles import WORKER_PRELOAD, resources_arg, role_resources

DASK = (sys.executable, "-m", "dask")  # the `dask` console script of this interpreter


@dataclass(frozen=True)
class HostSpec:
    """One host: ``workers`` ``dask worker`` processes (single-process under a nanny with
    ``--nworkers``, or one ``--no-nanny`` process each) bound to ``address``, with the
    resources of ``roles``, sharing ``local_directory`` and nothing else."""

    name: str  # e.g. "host1"; its workers are "<name>-0", "<name>-1", ... ("<name>" when it has one)
    address: str  # its loopback address, e.g. "127.0.0.2"
    roles: tuple[str, ...]  # some of generation, storage, finalize
    workers: int  # worker processes
    threads: int  # --nthreads per worker
    nanny: bool  # --nworkers under nannies (True) or --no-nanny processes (False)
    local_directory: str  # the host's own directory (workers' scratch space, spill files)
    finalize_slots: float  # the finalize role's slots per worker
    death_timeout_s: float  # a worker closes after this long without its scheduler (s)
    extra_args: tuple[str, ...] = ()  # more `dask worker` flags, appended

    @property
    def worker_names(self) -> list[str]:
        """The names its workers register under (as ``--name`` with ``--nworkers`` gives
        them: the host's name alone for a single worker)."""
        return [self.name] if self.workers == 1 else [f"{self.name}-{i}" for i in range(self.workers)]

    @property
    def resources(self) -> dict[str, float]:
        return role_resources(self.roles, self.finalize_slots)


def scheduler_command(host: str, port: int, dashboard_address: str, scheduler_file: str) -> list[str]:
    """``dask scheduler`` on ``host:port`` with the pipeline's scheduler preload (the
    token-capture page, /metrics series, downscaling protection, the store host)."""
    from ..dashboard.preload import PRELOAD  # imported here: the page's modules are heavy

    return [
        *DASK, "scheduler", "--host", host, "--port", str(port), "--dashboard-address", dashboard_address,
        "--scheduler-file", scheduler_file, "--preload", PRELOAD,
    ]


def worker_commands(spec: HostSpec, scheduler: str) -> list[list[str]]:
    """The ``dask worker`` command line(s) of host ``spec`` against ``scheduler``: one
    with ``--nworkers`` under nannies, else one ``--no-nanny`` line per worker."""
    common = [
        "--host", spec.address, "--nthreads", str(spec.threads), "--resources", resources_arg(spec.resources),
        "--preload", WORKER_PRELOAD, "--local-directory", spec.local_directory,
        # Without the dashboard a worker still serves HTTP (/health, /metrics), on every
        # interface unless told: keep it on the host's address.
        "--no-dashboard", "--dashboard-address", f"{spec.address}:0",
        "--death-timeout", f"{spec.death_timeout_s:g}",
    ]
    if spec.nanny:
        return [[*DASK, "worker", scheduler, "--name", spec.name, "--nworkers", str(spec.workers), *common, *spec.extra_args]]
    return [[*DASK, "worker", scheduler, "--name", name, "--no-nanny", *common, *spec.extra_args] for name in spec.worker_names]


def display_command(argv: Sequence[str]) -> str:
    """``argv`` as a shell line, with this interpreter's ``-m dask`` shown as ``dask``."""
    args = list(argv)
    if tuple(args[: len(DASK)]) == DASK:
        args = ["dask", *args[len(DASK):]]
    return shlex.join(args)
