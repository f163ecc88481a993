"""The staging store: storage-unit actors holding rows in memory and spill files.

``StagingStore`` (client.py) is the API; ``StorageUnit`` (unit.py) the Dask actor;
``SpillMapping`` (spill.py) its zict storage; ``registry.py`` pins field dtypes per
partition; ``checkpoint.py`` writes and restores atomic checkpoints.
"""
from tasks.errors import CheckpointCorrupt, CheckpointError, InvalidStoreRequest, StoreError, StoreUnavailable

from .client import StagingStore
from .unit import GetResult, StorageUnit, StoreResult

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "GetResult",
    "InvalidStoreRequest",
    "StagingStore",
    "StorageUnit",
    "StoreError",
    "StoreResult",
    "StoreUnavailable",
]
