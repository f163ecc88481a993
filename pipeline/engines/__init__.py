"""Dask wiring of the engines of :mod:`tasks.engines` (optional extras)."""
