"""The workers' preload: ``dask worker ... --preload pipeline.deploy.worker_preload``.

It records, on each worker, that the preload ran and which version of this package the
worker runs. A controller attaching reads the record (:func:`preload_record`, through
``client.run``): a worker without one was started without the preload, one with another
version runs other code than the controller (an out-of-date image), and both are named
(:mod:`pipeline.deploy.check`). Cheap on purpose (no imports beyond the package's
metadata): every cluster the pipeline starts (``pipeline.cluster.local_cluster``) carries it.
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
    """Preload hook (Dask calls it before the worker connects): record."""
    _records[worker] = {"preload": NAME, "version": package_version(), "pid": os.getpid()}


def preload_record(dask_worker: Worker) -> dict[str, str | int] | None:
    """``client.run`` target: what the preload recorded on this worker, or None (it
    never ran there)."""
    return _records.get(dask_worker)
