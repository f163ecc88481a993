"""Prometheus export of the token-capture figures (``token_capture_*`` on ``/metrics``)."""
from .prometheus import TokenCaptureCollector, attach, collector, detach  # noqa: F401
