"""Dask wiring of token capture: store actors, finalization graphs, cut/restore actors,
metrics, dashboard, scaling and the CLI (``python -m pipeline``)."""
from . import config  # noqa: F401  (loads dask-config.yaml defaults on import)
