"""The staging store: storage-unit actors holding rows in memory and spill files.

``client.py`` (:class:`StagingStore`, the API); ``unit.py`` (:class:`StorageUnit`, the
Dask actor); ``protocol.py`` (per-key results and reasons, request checks,
:class:`StoreLike`); ``slab_pool.py`` (pooled slabs: get answers, gathers, merges);
``adopted.py`` (rows kept as views of adopted put buffers); ``spill.py`` (zict storage:
memory up to a byte limit, then disk); ``registry.py`` (field dtypes pinned per
partition); ``batch_file.py`` (the packed batch file format); ``checkpoint.py``
(atomic checkpoints); ``report.py`` (stats events). The client and the unit load on
first use, so importing :mod:`pipeline.store.protocol` pulls in no ``distributed``.
"""
from tasks.errors import (
    CheckpointCorrupt,
    CheckpointError,
    InvalidStoreRequest,
    RestoreIncomplete,
    StoreError,
    StoreUnavailable,
)

from .protocol import GetResult, StoreLike, StoreResult

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "GetResult",
    "InvalidStoreRequest",
    "RestoreIncomplete",
    "StagingStore",
    "StorageUnit",
    "StoreError",
    "StoreLike",
    "StoreResult",
    "StoreUnavailable",
]


def __getattr__(name):  # the client and the unit pull in distributed: import them when asked for
    if name == "StagingStore":
        from .client import StagingStore

        return StagingStore
    if name == "StorageUnit":
        from .unit import StorageUnit

        return StorageUnit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
