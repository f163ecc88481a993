"""A step's staleness figures: how far behind the trainer its rollouts' weights were, by
rollout length, so a bias toward short rollouts (long ones sample longer, under older
weights, and are dropped ``stale`` more often) shows.

A row's lag is ``reference - weight_version_oldest`` (versions): ``reference`` is the
trainer version the step was submitted with, or, without one, the newest weight version
among the step's verified rows. Rows counted: every verified row, those dropped ``stale``
included; rows rejected for their data are not. Lengths are the rows' verified tokens.
A lag never wraps: one past int64 (a rollout at an int64-extreme weight version) is
saturated at int64's nearest bound, like the step batch's ``weight_lag``; sums are exact.
Vectorized over rows (numpy); one Python pass over the step's groups to gather them.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from .. import reasons as R
from .lags import I64_MAX, I64_MIN, saturated_lags

if TYPE_CHECKING:  # the scheduler's state reads the buckets: no torch import there
    from .assemble import FinalizedGroup

# (label, exclusive upper bound in tokens); the last bucket is open.
LENGTH_BUCKETS: tuple[tuple[str, float], ...] = (("<1k", 1024), ("1-4k", 4096), ("4-16k", 16384), (">=16k", float("inf")))
BUCKET_LABELS: tuple[str, ...] = tuple(label for label, _ in LENGTH_BUCKETS)


class BucketFigures(TypedDict):
    """One length bucket: verified rollouts, those dropped ``stale``, the lag summed over
    them (versions; the exact sum saturated at int64's bounds) and its mean (the exact
    sum over the rollouts, as a float; 0.0 without rollouts)."""

    bucket: str
    rollouts: int
    stale: int
    lag_sum: int
    mean_lag: float


class StalenessFigures(TypedDict):
    """A step's figures (the ``staleness`` key of its step event)."""

    trainer_version: int | None  # as submitted (None: not given)
    reference_version: int  # what lags are measured from
    max_staleness: int | None  # finalize.max-staleness in force (None: off, or no trainer_version)
    rollouts: int
    stale: int
    mean_lag: float
    max_lag: int
    buckets: list[BucketFigures]


def bucket_index(tokens: np.ndarray) -> np.ndarray:
    """Each length's bucket in :data:`LENGTH_BUCKETS` (int64, vectorized)."""
    bounds = np.array([b for _, b in LENGTH_BUCKETS[:-1]], dtype=np.float64)
    return np.searchsorted(bounds, np.asarray(tokens, dtype=np.float64), side="right").astype(np.int64)


def row_lags(reference: int, oldest: np.ndarray) -> np.ndarray:
    """``reference - oldest`` (int64, versions), each lag past int64 saturated at int64's
    nearest bound, never wrapped (:func:`~tasks.finalize.lags.saturated_lags`, the step
    batch's ``weight_lag`` rule)."""
    return saturated_lags(reference, oldest)[0]


def _exact_sum(values: np.ndarray) -> int:
    """The sum of int64 ``values`` as a Python int, never wrapped: the high and low 32 bits
    summed apart in int64 (exact below 2**31 values), then joined."""
    return (int((values >> 32).sum()) << 32) + int((values & 0xFFFFFFFF).sum())


def _saturate(n: int) -> int:
    return min(max(n, I64_MIN), I64_MAX)


def staleness_figures(
    tokens: np.ndarray, oldest: np.ndarray, stale: np.ndarray, *,
    reference: int, trainer_version: int | None, max_staleness: int | None,
) -> StalenessFigures:
    """Figures over verified rows: ``tokens`` (int [n]), ``oldest`` weight versions (int
    [n]) and whether each was dropped ``stale`` (bool [n]); lags from ``reference``.

    Never wrapped: each row's lag is :func:`row_lags` (saturated at int64's bounds),
    ``max_lag`` their max, ``lag_sum`` their exact sum saturated at int64's bounds and
    ``mean_lag`` their exact sum over the count, as a float."""
    tokens, oldest, stale = np.asarray(tokens, np.int64), np.asarray(oldest, np.int64), np.asarray(stale, bool)
    ref = int(reference)
    lag = row_lags(ref, oldest)
    which = bucket_index(tokens)
    n_b = len(LENGTH_BUCKETS)
    counts = np.bincount(which, minlength=n_b)
    stales = np.bincount(which, weights=stale.astype(np.float64), minlength=n_b)
    totals = [_exact_sum(lag[which == b]) for b in range(n_b)]
    buckets: list[BucketFigures] = [
        {"bucket": label, "rollouts": int(counts[b]), "stale": int(stales[b]), "lag_sum": _saturate(totals[b]),
         "mean_lag": totals[b] / int(counts[b]) if counts[b] else 0.0}
        for b, (label, _) in enumerate(LENGTH_BUCKETS)
    ]
    return {
        "trainer_version": None if trainer_version is None else int(trainer_version),
        "reference_version": ref,
        "max_staleness": max_staleness if trainer_version is not None else None,
        "rollouts": int(tokens.size),
        "stale": int(stale.sum()),
        "mean_lag": sum(totals) / lag.size if lag.size else 0.0,
        "max_lag": int(lag.max()) if lag.size else 0,
        "buckets": buckets,
    }


def step_staleness(
    groups: Sequence[FinalizedGroup], *, trainer_version: int | None, max_staleness: int | None,
) -> StalenessFigures:
    """:func:`staleness_figures` over a step's groups: their verified rows (accepted or
    dropped ``stale``), each with its verified tokens (``FinalizedGroup.verified_tokens``).
    Lags never wrap (saturated at int64's bounds, as :func:`staleness_figures` says)."""
    tokens, oldest, newest, stale = [], [], [], []
    for g in groups:
        status = np.array(g.status, dtype=object)
        keep = (status == R.OK) | (status == R.STALE)
        tokens.append(g.verified_tokens.numpy()[keep])
        oldest.append(g.weight_version_oldest.numpy()[keep])
        newest.append(g.weight_version_newest.numpy()[keep])
        stale.append(status[keep] == R.STALE)

    def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

    newest_all = cat(newest, np.int64)
    reference = trainer_version if trainer_version is not None else int(newest_all.max()) if newest_all.size else 0
    return staleness_figures(cat(tokens, np.int64), cat(oldest, np.int64), cat(stale, bool), reference=reference,
                             trainer_version=trainer_version, max_staleness=max_staleness)
