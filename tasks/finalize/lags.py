"""Weight-version lags that never wrap: ``reference - oldest`` per row, saturated at int64.

A rollout at an int64-extreme weight version makes the difference leave int64; numpy and
torch would wrap it silently. :func:`saturated_lags` says which rows overflow (compared
against bounds that fit int64, never computed and wrapped) and saturates their lag at
int64's nearest bound. The step batch's ``weight_lag`` (and its ``stale`` rejection of such
rows) and the step's staleness figures both use it. Pure numpy; lags in versions.
"""
from __future__ import annotations

import numpy as np

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def saturated_lags(reference: int, oldest: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lag, over): ``reference - oldest`` (int64, ``oldest``'s shape) with each lag past
    int64 saturated at int64's nearest bound, and whether it was (bool). Any int ``reference``."""
    oldest = np.asarray(oldest, np.int64)
    ref = int(reference)
    # Modulo 2**64 the difference is exact, so it is right wherever the true lag fits int64.
    lag = (np.uint64(ref % 2**64) - oldest.view(np.uint64)).view(np.int64)
    too_big = _below(oldest, ref - I64_MAX)  # lag > int64 max  <=>  oldest < reference - max
    too_small = _above(oldest, ref - I64_MIN)  # lag < int64 min  <=>  oldest > reference - min
    lag[too_big] = I64_MAX
    lag[too_small] = I64_MIN
    return lag, too_big | too_small


def _below(values: np.ndarray, bound: int) -> np.ndarray:
    """``values < bound`` for any int ``bound`` (one outside int64 decides for all)."""
    if bound > I64_MAX or bound <= I64_MIN:
        return np.full(values.shape, bound > I64_MAX)
    return values < bound


def _above(values: np.ndarray, bound: int) -> np.ndarray:
    """``values > bound`` for any int ``bound`` (one outside int64 decides for all)."""
    if bound < I64_MIN or bound >= I64_MAX:
        return np.full(values.shape, bound < I64_MIN)
    return values > bound
