"""Deployment: the pipeline on clusters started from Dask's own command line.

``roles`` (generation, storage, finalize as worker resources), ``commands`` (the
``dask scheduler`` / ``dask worker`` command lines a deployment runs), ``worker_preload``
(the workers' ``--preload``), ``check`` (what a controller checks when it attaches),
``hosts`` (:class:`LocalHosts`: hosts of ``dask worker`` processes on this machine, each on
its own loopback address) and ``cli`` (``python -m pipeline cluster``). The recipes for
SLURM and Kubernetes: ``docs/deploy.md``.
"""
from __future__ import annotations

from .check import ClusterCheck, check_attached, check_cluster, require_configured
from .commands import HostSpec, display_command, scheduler_command, worker_commands
from .hosts import Host, LocalHosts
from .roles import ROLES, WORKER_PRELOAD, role_resources, roles_of, workers_with_role

__all__ = [
    "ROLES",
    "WORKER_PRELOAD",
    "ClusterCheck",
    "Host",
    "HostSpec",
    "LocalHosts",
    "check_attached",
    "check_cluster",
    "display_command",
    "require_configured",
    "role_resources",
    "roles_of",
    "scheduler_command",
    "worker_commands",
    "workers_with_role",
]
