"""Adaptive scaling of the finalize pool from the split timing, and downscaling protection."""
from .adaptive import ScalingDecision, ScalingSettings, TokenCaptureAdaptive, decide, ensure_finalize_resource  # noqa: F401
from .protect import ProtectActorHosts  # noqa: F401
