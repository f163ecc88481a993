"""Adaptive scaling of the finalize pool from the split timing and of the store from its
fill, and downscaling protection."""
from .adaptive import ScalingDecision, ScalingSettings, TokenCaptureAdaptive, decide, ensure_finalize_resource  # noqa: F401
from .protect import ProtectActorHosts  # noqa: F401
from .storage import (  # noqa: F401
    STORAGE_RESOURCE,
    StorageDecision,
    StorageScalingSettings,
    WorkerPlan,
    combine,
    decide_storage,
)
