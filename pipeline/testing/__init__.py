"""Test doubles shipped with the package (as ``distributed.utils_test`` is).

Actors unpickle these on workers, so they live in the package, not under ``tests/``.
"""
