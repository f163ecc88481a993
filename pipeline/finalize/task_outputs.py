"""What travels between a step's Dask tasks: a fetch task's pieces and a verify task's results.

Their weights as Dask sees them are registered in :mod:`pipeline.finalize.serializers`.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tasks.finalize.plan import RolloutPlan
from tasks.finalize.verify import RolloutResult
from tasks.packed import PackedBatch

if TYPE_CHECKING:
    from .timing import FetchTiming, VerifyTiming


@dataclass(frozen=True)
class ShippedPlans:
    """A verify task's ``(rollout index, plan)`` pairs, pickled once by the controller.

    Task arguments are unpickled and pickled again by the scheduler on their way to a
    worker; a step's plans (every receipt's call records: ~1,000 objects a step) cost it
    more than the rest of the graph. As bytes they pass through untouched and are read
    once, in the verify task (:meth:`load`).
    """

    blob: bytes

    @classmethod
    def pack(cls, plans: Sequence[tuple[int, RolloutPlan]]) -> ShippedPlans:
        return cls(pickle.dumps(list(plans), protocol=pickle.HIGHEST_PROTOCOL))

    def load(self) -> list[tuple[int, RolloutPlan]]:
        return pickle.loads(self.blob)


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
