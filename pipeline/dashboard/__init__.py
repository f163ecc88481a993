"""The token-capture page on the Dask dashboard and the scheduler-side event aggregator.

Install on a scheduler with the preload (``dask scheduler --preload
pipeline.dashboard.preload``, or ``LocalCluster(scheduler_kwargs={"preload":
["pipeline.dashboard.preload"]})``) or, on a running cluster, with :func:`install`.
"""
from .aggregator import (  # noqa: F401
    PLUGIN_NAME,
    InvalidEvent,
    TokenCaptureAggregator,
    get_aggregator,
    parse_event,
)
from .preload import PRELOAD, install  # noqa: F401
