"""The capture client: stage model calls from an engine outside this project.

``publish_store`` on the controller; ``CaptureClient.connect(scheduler)`` in the engine;
``open`` a :class:`RolloutCapture` per rollout, ``stage`` each call, ``finish`` for the
receipt. docs/design.md, "The capture client".
"""
from .capture import CaptureClient
from .discovery import lookup_store, publish_store, unpublish_store
from .rollout import RolloutCapture

__all__ = ["CaptureClient", "RolloutCapture", "lookup_store", "publish_store", "unpublish_store"]
