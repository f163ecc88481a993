"""The rollout driver: multi-turn rollouts on generation actors, cut and recovered.

:class:`RolloutDriver` (:mod:`.core`) composes an actor pool (:mod:`.pool`), a rollout book
(:mod:`.book`) and the round loop (:mod:`.rounds`); it cuts every in-flight call at a
checkpoint (:mod:`.cut`) and recovers on fresh actors from the snapshot of a cut
(:mod:`.snapshot`, :mod:`.recovery`); finalized rows are bit-identical to an uninterrupted run.
"""
from tasks.cut.resume import CONTEXT_MISMATCH, NOT_CUT, RESUME_FAILED

from .core import RolloutDriver
from .cut import CutStats, cut_round
from .recovery import RecoveryStats
from .snapshot import DriverSettings, DriverSnapshot
from .state import RolloutState

__all__ = [
    "CONTEXT_MISMATCH",
    "NOT_CUT",
    "RESUME_FAILED",
    "CutStats",
    "DriverSettings",
    "DriverSnapshot",
    "RecoveryStats",
    "RolloutDriver",
    "RolloutState",
    "cut_round",
]
