"""The token-capture page on the Dask dashboard and the scheduler-side event aggregator.

Install on a scheduler with the preload (``dask scheduler --preload
pipeline.dashboard.preload``, or ``LocalCluster(scheduler_kwargs={"preload":
["pipeline.dashboard.preload"]})``) or, on a running cluster, with :func:`install`.
Modules depend one way: ``state`` <- ``page`` (and ``pipeline.metrics``) <- ``plugin`` <- ``preload``.
"""
from .state import Histogram, InvalidEvent, TokenCaptureState, parse_event  # noqa: F401
from .plugin import PLUGIN_NAME, TokenCaptureAggregator, get_aggregator, get_state  # noqa: F401
from .preload import PRELOAD, install  # noqa: F401
