"""The rollout driver: multi-turn rollouts on generation actors, cut and recovered.

:class:`RolloutDriver` runs rounds (:mod:`.core`), cuts every in-flight call at a
checkpoint (:mod:`.cut`) and recovers on fresh actors from the snapshot of a cut
(:mod:`.recovery`); finalized rows are bit-identical to an uninterrupted run.
"""
from tasks.cut.resume import CONTEXT_MISMATCH, NOT_CUT, RESUME_FAILED

from .core import RolloutDriver
from .cut import CutStats, cut_round
from .recovery import DriverSettings, DriverSnapshot, RecoveryStats
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
