"""The dashboard's knobs, read once when the state or the page is built, as frozen settings.

:class:`StateSettings` is what a :class:`~pipeline.dashboard.state.TokenCaptureState`
is built with (``dashboard.history``, ``dashboard.update-ms``, ``metrics.buckets-*``,
``scaling.window-s``); :class:`PageSettings` what the page is registered and refreshed
with (``dashboard.page``, ``dashboard.update-ms``). ``dask.config.set`` applies to states
and pages built afterwards. A state's settings travel with it when it is pickled (a
plugin registered from a client carries the client's).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import config


@dataclass(frozen=True)
class StateSettings:
    """``history``: events kept per ring, and storage units / restore workers kept (count,
    ``dashboard.history``); ``seconds_bounds``: latency bucket upper bounds (s,
    ``metrics.buckets-seconds``); ``call_bounds``: calls-per-rollout bucket upper bounds
    (calls, ``metrics.buckets-calls``); ``worker_sample_ms``: an unchanged worker count is
    sampled again after this long (ms, ``dashboard.update-ms``); ``window_s``: the scaling
    signal's default window (s, ``scaling.window-s``)."""

    history: int
    seconds_bounds: tuple[float, ...]
    call_bounds: tuple[float, ...]
    worker_sample_ms: float
    window_s: float

    @classmethod
    def from_config(cls, history: int | None = None) -> StateSettings:
        """The knobs read now, once; ``history`` given overrides ``dashboard.history``."""
        return cls(
            history=int(history if history is not None else config.get("dashboard.history")),
            seconds_bounds=tuple(float(b) for b in config.get("metrics.buckets-seconds")),
            call_bounds=tuple(float(b) for b in config.get("metrics.buckets-calls")),
            worker_sample_ms=float(config.get("dashboard.update-ms")),
            window_s=float(config.get("scaling.window-s")),
        )


@dataclass(frozen=True)
class PageSettings:
    """``path``: the page's path on the dashboard, without slashes (``dashboard.page``);
    ``update_ms``: how often an open page refreshes from the state (ms,
    ``dashboard.update-ms``)."""

    path: str
    update_ms: int

    @classmethod
    def from_config(cls) -> PageSettings:
        """The knobs read now, once."""
        return cls(path=str(config.get("dashboard.page")).strip("/"), update_ms=int(config.get("dashboard.update-ms")))
