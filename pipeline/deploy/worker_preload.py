"""The workers' preload: ``dask worker ... --preload pipeline.deploy.worker_preload``.

At worker start it imports what the pipeline's tasks and actors run (the storage unit,
the finalize task bodies, the generation worker: torch included), so a worker whose
environment cannot run them fails at start, in its own log, instead of at its first
task, and no step pays the imports; then it records that it ran, with this package's
version. A controller attaching reads the record (:func:`preload_record`, through
``client.run``): a worker without one was started without the preload
(:mod:`pipeline.deploy.check`).
"""
from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distributed import Worker

NAME = "pipeline.deploy.worker_preload"
PACKAGE = "dask-token-capture"
_records: weakref.WeakKeyDictionary[Worker, dict[str, str | int]] = weakref.WeakKeyDictionary()


def package_version() -> str:
    """This process's installed version of the package (``"unknown"`` when not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "unknown"


def dask_setup(worker: Worker) -> None:
    """Preload hook (Dask calls it before the worker connects): import, then record."""
    import pipeline.finalize.worker_tasks  # noqa: F401 - the verify/assemble bodies (torch)
    import pipeline.generation.worker  # noqa: F401 - the generation actor
    import pipeline.store.unit  # noqa: F401 - the storage unit actor

    _records[worker] = {"preload": NAME, "version": package_version(), "pid": os.getpid()}


def preload_record(dask_worker: Worker) -> dict[str, str | int] | None:
    """``client.run`` target: what the preload recorded on this worker, or None (it
    never ran there)."""
    return _records.get(dask_worker)
