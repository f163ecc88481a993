"""Starting or attaching to the Dask cluster the pipeline runs on.

One place decides how a cluster is made, so every entry point (CLI, examples, benchmarks,
tests) binds to loopback and advertises the ``finalize`` resource the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any, Iterator

from distributed import Client, LocalCluster

from . import config

if TYPE_CHECKING:
    from distributed import Worker

    from .scaling.adaptive import TokenCaptureAdaptive


def finalize_resources() -> dict[str, float]:
    """The resources each worker advertises: ``finalize`` slots for verify tasks."""
    return {"finalize": float(config.get("finalize.slots-per-worker"))}


def local_cluster(**overrides: object) -> LocalCluster:
    """A LocalCluster on loopback whose workers carry ``finalize`` slots.

    Keyword arguments override the ``token-capture.cluster`` config section. Workers the
    cluster adds later (``adapt``) reuse the same worker spec, so they carry the slots too.
    """
    from .dashboard.preload import PRELOAD

    kwargs: dict[str, Any] = dict(  # LocalCluster's keyword arguments, each of its own type
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
    if kwargs.get("processes", True):
        # Worker processes leave Ctrl-C to this process (see dask_setup below).
        import dask.config

        preload = kwargs.get("preload") or dask.config.get("distributed.worker.preload") or []
        from .deploy.roles import WORKER_PRELOAD  # the deployment's worker preload too (docs/deploy.md)

        kwargs["preload"] = [*([preload] if isinstance(preload, str) else preload), __name__, WORKER_PRELOAD]
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


def dask_setup(worker: Worker) -> None:
    """Worker preload of :func:`local_cluster`'s worker processes: ignore SIGINT.

    A Ctrl-C in a terminal reaches every process of the foreground group, the embedded
    cluster's worker processes included; they would die mid-task while this process is
    still closing them in order (the demo stops on Ctrl-C, closes its store, then the
    cluster). The owning process alone decides; in-process workers are untouched.
    """
    import multiprocessing
    import signal
    import threading

    if multiprocessing.parent_process() is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def adapt(cluster: LocalCluster, minimum: int | None = None, maximum: int | None = None, **kwargs: object) -> TokenCaptureAdaptive:
    """Scale ``cluster`` with the split-timing policy (:class:`TokenCaptureAdaptive`)."""
    from .scaling.adaptive import TokenCaptureAdaptive

    return cluster.adapt(
        Adaptive=TokenCaptureAdaptive,
        minimum=config.get("cluster.adaptive-minimum") if minimum is None else minimum,
        maximum=config.get("cluster.adaptive-maximum") if maximum is None else maximum,
        **kwargs,
    )


def connect_timeout_s(value: float | None = None) -> float:
    """``value``, or the ``cluster.connect-timeout-s`` default (seconds)."""
    return float(config.get("cluster.connect-timeout-s") if value is None else value)


def _probe(address: str, timeout: float) -> None:
    """One comm handshake with ``address`` (``ValueError``: malformed; ``OSError``: nothing
    answered within ``timeout``). Done before ``Client(address)`` because a Client whose
    connection failed complains again from its finalizer."""
    import asyncio
    import threading

    from distributed.comm import connect as comm_connect
    from distributed.security import Security

    async def handshake() -> None:
        comm = await comm_connect(address, timeout=timeout, **Security().get_connection_args("client"))
        await comm.close()

    error: list[BaseException] = []

    def run() -> None:  # a thread of its own: works whether or not this thread runs a loop
        try:
            asyncio.run(handshake())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    t = threading.Thread(target=run, name="token-capture-probe", daemon=True)
    t.start()
    t.join()
    if error:
        raise error[0]


def attach(scheduler: str, timeout: float | None = None, *, wait_for_workers: bool = True) -> Client:
    """A :class:`~distributed.Client` on the running ``scheduler``.

    Waits at most ``timeout`` seconds (default ``cluster.connect-timeout-s``) for the
    scheduler to answer and, with ``wait_for_workers``, for one worker to join. Raises
    :class:`~tasks.errors.InvalidSchedulerAddress` for an address that does not parse and
    :class:`~tasks.errors.ClusterUnavailable` when nothing answers or no worker joins; both
    messages say what to do.
    """
    from tasks.errors import ClusterUnavailable, InvalidSchedulerAddress

    from .scheduler_security import check_scheduler_security

    check_scheduler_security(scheduler)  # tls:// without its settings: say which keys
    timeout = connect_timeout_s(timeout)
    unavailable = (
        f"no Dask scheduler answered at {scheduler} within {timeout:g} s; start one with "
        f"`dask scheduler --host 127.0.0.1 --preload {_preload_name()}`, check the address, "
        "or wait longer with --connect-timeout SECONDS"
    )
    try:
        _probe(scheduler, timeout)
    except (ValueError, TypeError) as e:
        raise InvalidSchedulerAddress(
            f"{scheduler!r} is not a scheduler address ({e}); pass --scheduler tcp://HOST:PORT, e.g. tcp://127.0.0.1:8786"
        ) from None
    except (OSError, asyncio.TimeoutError):
        raise ClusterUnavailable(unavailable) from None
    try:
        client = Client(scheduler, timeout=timeout)
    except (OSError, asyncio.TimeoutError):
        raise ClusterUnavailable(unavailable) from None
    if wait_for_workers:
        try:
            client.wait_for_workers(1, timeout=timeout)
        except (TimeoutError, asyncio.TimeoutError):
            client.close()
            raise ClusterUnavailable(
                f"the scheduler at {scheduler} has no workers (none joined within {timeout:g} s); start one with "
                f'`dask worker {scheduler} --host 127.0.0.1 --resources "finalize={config.get("finalize.slots-per-worker")}"`'
            ) from None
    return client


def _preload_name() -> str:
    from .dashboard.preload import PRELOAD

    return PRELOAD


@contextlib.contextmanager
def connect(
    scheduler: str | None = None, *, connect_timeout: float | None = None, **cluster_kwargs: object
) -> Iterator[tuple[Client, LocalCluster | None]]:
    """Attach to ``scheduler`` if given (:func:`attach`, waiting at most
    ``connect_timeout`` seconds), else start an embedded :func:`local_cluster`.

    Yields ``(client, cluster)``; ``cluster`` is ``None`` when attached to an existing one.
    """
    if scheduler:
        from .dashboard.preload import install
        from .deploy.check import check_attached

        with attach(scheduler, connect_timeout) as client:
            install(client)  # idempotent: a scheduler started with the preload keeps its plugins
            check_attached(client)  # workers without the worker preload or a role, by name (hosts.attach-check)
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
