"""The page's panel builders, one per chart group; each builds its Bokeh models (charts,
tables, their "no data yet" notes) once and redraws them from a state snapshot.

``finalize`` (split timing per step, outcomes, rejections), ``queue`` (queue depth, wait,
calls per rollout), ``scaling`` (workers and decisions), ``cuts``, ``restores``,
``store`` and ``trainer`` (staleness by rollout length, the mismatch monitor). The page (:mod:`pipeline.dashboard.page`) lays them out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from .cuts import CutPanels
from .finalize import FinalizePanels
from .queue import QueuePanels
from .restores import RestorePanels
from .scaling import ScalingPanels
from .store import StorePanels
from .trainer import TrainerPanels

if TYPE_CHECKING:
    from ..snapshot import StateSnapshot

__all__ = ["CutPanels", "FinalizePanels", "Panel", "QueuePanels", "RestorePanels", "ScalingPanels", "StorePanels",
           "TrainerPanels"]


class Panel(Protocol):
    """A panel group of the page: redraws its models from a state snapshot."""

    def update(self, snap: StateSnapshot) -> None: ...
