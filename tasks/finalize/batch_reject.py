"""Rows a step batch rejects itself: the rules one group's assembly cannot decide.

Each group is assembled on its own; two rules need the whole step. ``step_batch`` applies
them, :func:`tasks.finalize.step_batch.batch_rejections` lists them (reason and detail),
and the first failing rule decides (the order of :mod:`tasks.reasons`):

- ``invalid_routes``: a routed row whose ``[L, K]`` is not the step's, the ``[L, K]``
  most of the step's routed rows have (ties: the first routed row's), as
  :func:`tasks.finalize.assemble.group_route_shape` decides within one group;
- ``stale``: with a ``trainer_version``, an accepted row whose lag ``trainer_version -
  weight_version_oldest`` leaves int64 (an absurd weight version: its ``weight_lag`` is
  saturated at int64's nearest bound, never wrapped).

A row rejected here becomes all padding with ``sample_mask`` 0 in the batch, like
assembly's rejections; its reward and weight versions stay as given, and the groups
themselves are never modified. Per-row Python only over the rows rejected.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import reasons as R
from .assemble import FinalizedGroup
from .lags import saturated_lags


@dataclass(frozen=True)
class BatchRejection:
    """One row the step batch rejected: its group (index in the step), its row in the
    group, its rollout id, the reason (:mod:`tasks.reasons`) and what was wrong."""

    group: int
    row: int
    rollout_id: str
    reason: str
    detail: str


def _routes_shape(g: FinalizedGroup) -> tuple[int, ...] | None:
    return None if g.routed_experts is None else tuple(int(s) for s in g.routed_experts.shape[2:])


def step_route_shape(groups: Sequence[FinalizedGroup]) -> tuple[int, ...] | None:
    """The routes ``[L, K]`` of most of the step's routed rows (``has_routes``); ties: the
    shape whose first routed row comes first. None when no group stores routes (a group
    storing routes but no routed row counts last, with 0 rows)."""
    count: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], int] = {}
    for gi, g in enumerate(groups):
        shape = _routes_shape(g)
        if shape is None:
            continue
        rows = int(g.has_routes.sum())
        count[shape] = count.get(shape, 0) + rows
        if rows and (shape not in first or first[shape] >= len(groups)):
            first[shape] = gi
        first.setdefault(shape, len(groups) + gi)
    if not count:
        return None
    return max(count, key=lambda s: (count[s], -first[s]))


def lag_overflow(trainer_version: int, oldest: torch.Tensor) -> torch.Tensor:
    """bool, ``oldest``'s shape: rows whose ``trainer_version - oldest`` leaves int64
    (:func:`~tasks.finalize.lags.saturated_lags`: never computed and wrapped)."""
    return torch.from_numpy(saturated_lags(trainer_version, oldest.numpy())[1])


def _rollout_id(g: FinalizedGroup, i: int) -> str:
    ids = g.rollout_ids
    return str(ids[i]) if isinstance(ids, Sequence) and i < len(ids) else ""


def _lag_detail(oldest: int, trainer_version: int) -> str:
    lag = trainer_version - oldest
    where = f"{lag} versions behind" if lag > 0 else f"{-lag} versions ahead of"
    return f"oldest weight_version {oldest} is {where} trainer_version {trainer_version}: its weight_lag leaves int64"


def rows_rejected(
    groups: Sequence[FinalizedGroup], route_shape: tuple[int, ...] | None, trainer_version: int | None,
) -> list[BatchRejection]:
    """The rows of well-formed ``groups`` the step batch rejects, in step order (see the
    module docstring); ``route_shape``: :func:`step_route_shape` of the groups."""
    out: list[BatchRejection] = []
    for gi, g in enumerate(groups):
        shape = _routes_shape(g)
        bad_routes = g.has_routes if shape is not None and shape != route_shape else torch.zeros_like(g.has_routes)
        over = torch.zeros_like(bad_routes)
        if trainer_version is not None:
            over = lag_overflow(trainer_version, g.weight_version_oldest) & (g.sample_mask > 0) & ~bad_routes
        for i in (bad_routes | over).nonzero()[:, 0].tolist():
            if bad_routes[i]:
                reason = R.INVALID_ROUTES
                detail = f"routes [L, K] = {list(shape)} (its group's), the step's routed rows mostly have {list(route_shape)}"
            else:
                reason, detail = R.STALE, _lag_detail(int(g.weight_version_oldest[i]), trainer_version)
            out.append(BatchRejection(gi, i, _rollout_id(g, i), reason, detail))
    return out
