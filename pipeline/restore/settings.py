"""A prefix read coalescer's knobs, read once when it is built (``token-capture.restore.*``).

:meth:`CoalescerSettings.from_config` takes the constructor's overrides (``None``: the
config value) and reads the rest in one config read; the coalescer keeps the frozen
result for its lifetime. ``dask.config.set`` applies to coalescers built afterwards (a
:class:`~pipeline.restore.batcher.PrefixReadBatcher` builds its own on first use).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import config

# Config name (under token-capture.restore) of each constructor knob, in field order.
_CONFIG_NAMES = {
    "batch_size": "batch-size",
    "max_tokens": "max-tokens",
    "window_ms": "window-ms",
    "max_concurrent": "max-concurrent-gets",
    "timeout_s": "get-timeout-s",
    "eager_inflight": "eager-inflight",
}


@dataclass(frozen=True, slots=True)
class CoalescerSettings:
    """Every knob of one coalescer (see ``dask-config.yaml``, ``restore``)."""

    batch_size: int  # keys per get (restore.batch-size)
    max_tokens: int  # tokens per get, by the callers' hints (restore.max-tokens)
    window_s: float  # seconds a loaded queue coalesces at most (restore.window-ms, in ms there)
    max_concurrent: int  # gets in flight (restore.max-concurrent-gets)
    timeout_s: float  # seconds one get may take (restore.get-timeout-s)
    eager_inflight: int  # below this many gets in flight a request is issued at once (restore.eager-inflight)

    @classmethod
    def from_config(
        cls,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        window_ms: float | None = None,
        max_concurrent: int | None = None,
        timeout_s: float | None = None,
        eager_inflight: int | None = None,
    ) -> "CoalescerSettings":
        """The overrides given (``window_ms`` in ms), the rest from ``token-capture.restore``.

        Raises ``ValueError`` for an override out of range: every knob must be > 0, but
        ``eager_inflight`` >= 0 (0: never issue at once, always coalesce).
        """
        overrides = {
            "batch_size": batch_size, "max_tokens": max_tokens, "window_ms": window_ms,
            "max_concurrent": max_concurrent, "timeout_s": timeout_s, "eager_inflight": eager_inflight,
        }
        for arg, value in overrides.items():
            name = _CONFIG_NAMES[arg]
            if value is not None and not (value >= 0 if arg == "eager_inflight" else value > 0):
                raise ValueError(f"restore {name} must be {'>= 0' if arg == 'eager_inflight' else '> 0'}, got {value!r}")
        c = config.get("restore")
        v = {arg: c[_CONFIG_NAMES[arg]] if value is None else value for arg, value in overrides.items()}
        return cls(
            batch_size=int(v["batch_size"]),
            max_tokens=int(v["max_tokens"]),
            window_s=float(v["window_ms"]) / 1000.0,
            max_concurrent=int(v["max_concurrent"]),
            timeout_s=float(v["timeout_s"]),
            eager_inflight=int(v["eager_inflight"]),
        )
