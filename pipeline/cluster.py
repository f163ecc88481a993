"""Starting or attaching to the Dask cluster the pipeline runs on.

One place decides how a cluster is made, so every entry point (CLI, examples, benchmarks,
tests) binds to loopback and advertises the ``finalize`` resource the same way.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from distributed import Client, LocalCluster

from . import config


def finalize_resources() -> dict[str, float]:
    """The resources each worker advertises: ``finalize`` slots for verify tasks."""
    return {"finalize": float(config.get("finalize.slots-per-worker"))}


def local_cluster(**overrides: Any) -> LocalCluster:
    """A LocalCluster on loopback whose workers carry ``finalize`` slots.

    Keyword arguments override the ``token-capture.cluster`` config section. Workers the
    cluster adds later (``adapt``) reuse the same worker spec, so they carry the slots too.
    """
    from .dashboard.preload import PRELOAD

    kwargs: dict[str, Any] = dict(
        host=config.get("cluster.host"),
        # The token-capture page, /metrics series and downscaling protection.
        scheduler_kwargs={"preload": [PRELOAD]},
        dashboard_address=config.get("cluster.dashboard-address"),
        n_workers=config.get("cluster.n-workers"),
        threads_per_worker=config.get("cluster.threads-per-worker"),
        processes=config.get("cluster.processes"),
        resources=finalize_resources(),
    )
    kwargs.update(overrides)
    host = kwargs.get("host")
    dashboard = kwargs.get("dashboard_address")
    if host and isinstance(dashboard, str) and dashboard.startswith(":"):
        # A bare ":port" binds every interface; keep the dashboard on the cluster's host.
        kwargs["dashboard_address"] = f"{host}{dashboard}"
    if not kwargs.get("processes", True) and "protocol" not in kwargs:
        # In-process clusters talk over inproc://, which takes no host; only the
        # dashboard and each worker's HTTP server (":0" by default: every interface) open
        # sockets, so both are bound to the host explicitly.
        host = kwargs.pop("host", None) or "127.0.0.1"
        kwargs.setdefault("worker_dashboard_address", f"{host}:0")
    return LocalCluster(**kwargs)


def adapt(cluster: LocalCluster, minimum: int | None = None, maximum: int | None = None, **kwargs: Any) -> Any:
    """Scale ``cluster`` with the split-timing policy (:class:`TokenCaptureAdaptive`)."""
    from .scaling.adaptive import TokenCaptureAdaptive

    return cluster.adapt(
        Adaptive=TokenCaptureAdaptive,
        minimum=config.get("cluster.adaptive-minimum") if minimum is None else minimum,
        maximum=config.get("cluster.adaptive-maximum") if maximum is None else maximum,
        **kwargs,
    )


@contextlib.contextmanager
def connect(scheduler: str | None = None, **cluster_kwargs: Any) -> Iterator[tuple[Client, LocalCluster | None]]:
    """Attach to ``scheduler`` if given, else start an embedded :func:`local_cluster`.

    Yields ``(client, cluster)``; ``cluster`` is ``None`` when attached to an existing one.
    """
    if scheduler:
        from .dashboard.preload import install

        with Client(scheduler) as client:
            install(client)  # idempotent: a scheduler started with the preload keeps its plugins
            yield client, None
        return
    with local_cluster(**cluster_kwargs) as cluster, Client(cluster) as client:
        yield client, cluster


def dashboard_url(client: Client, path: str = "status") -> str | None:
    """The dashboard URL of the client's scheduler (``None`` if it serves none)."""
    link = client.dashboard_link
    if not link:
        return None
    base = link.rsplit("/", 1)[0]
    return f"{base}/{path}"
