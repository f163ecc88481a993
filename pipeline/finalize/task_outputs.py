"""What travels between a step's Dask tasks: a fetch task's pieces and a verify task's results.

Their weights as Dask sees them are registered in :mod:`pipeline.finalize.serializers`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tasks.finalize.verify import RolloutResult
from tasks.packed import PackedBatch

if TYPE_CHECKING:
    from .timing import FetchTiming, VerifyTiming


@dataclass
class Piece:
    """The fetched rows one verify task needs, rollout after rollout.

    ``bounds[r] = (start, end)``: rows ``start:end`` of ``batch`` are rollout ``r``'s (``r``
    is the rollout's index in the step plan). ``row_bytes`` is each row's payload bytes.
    ``failed`` maps a key the store could not serve to its ``(reason, detail)``;
    ``timing`` is the fetch's figures (shared by the pieces of one fetch).
    """

    batch: PackedBatch
    bounds: dict[int, tuple[int, int]]
    row_bytes: np.ndarray
    failed: dict[str, tuple[str, str]]
    timing: FetchTiming


@dataclass
class VerifyOut:
    """A verify task's results and figures, keyed by rollout index in the step plan
    (``verify_ms`` in milliseconds, ``bytes_fetched`` in payload bytes)."""

    task: int
    results: dict[int, RolloutResult]
    verify_ms: dict[int, float]
    bytes_fetched: dict[int, int]
    timing: VerifyTiming
    fetch_timings: list[FetchTiming] = field(default_factory=list)
