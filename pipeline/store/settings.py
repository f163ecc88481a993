"""A store handle's knobs, read once when the handle is built (``token-capture.store.*``).

The creator's settings travel with every pickled copy of the handle, so all its copies
behave alike wherever they run; :meth:`~pipeline.store.client.StagingStore.with_settings`
makes a copy with some changed. ``dask.config.set`` applies to handles built afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.errors import InvalidInput

from .. import config


@dataclass(frozen=True)
class StoreSettings:
    """``max_call_bytes``: payload bytes per put call (``store.max-call-bytes``);
    ``local_reads``: a get on a unit's own worker runs in-process (``store.local-reads``);
    ``max_answer_bytes``: row bytes a unit answers per get call, a bigger get is split
    (``store.max-answer-bytes``; 0: one call per unit, whatever its size);
    ``calls_in_flight``: a put's or a split get's calls in flight per unit (``store.calls-in-flight``);
    ``skip_unreachable_s``: seconds a unit found unreachable is not called again by this
    process (``store.skip-unreachable-s``; 0: always called, see :mod:`.unit_health`);
    ``admin_timeout_s``: seconds ``stats()``, ``keys()``, ``close()``, a restore's puts and
    claim calls wait for the units
    (``store.admin-call-timeout-s``): a unit that has not answered by then counts as unreachable;
    ``read_failover_s``: with replicas 2, a primary that has not answered a get within this
    long is read from the other copy instead (``store.read-failover-s``; 0: only once it
    failed or the get's own deadline passed)."""

    max_call_bytes: int
    local_reads: bool
    max_answer_bytes: int = 0
    calls_in_flight: int = 4
    skip_unreachable_s: float = 10.0
    admin_timeout_s: float = 30.0
    read_failover_s: float = 0.0

    @classmethod
    def from_config(cls) -> "StoreSettings":
        return cls(
            config.get_bytes("store.max-call-bytes"),
            bool(config.get("store.local-reads")),
            config.get_bytes("store.max-answer-bytes"),
            max(1, int(config.get("store.calls-in-flight"))),
            max(0.0, float(config.get("store.skip-unreachable-s"))),
            _positive_seconds("store.admin-call-timeout-s"),
            max(0.0, float(config.get("store.read-failover-s"))),
        )


def _positive_seconds(name: str) -> float:
    """The setting ``name`` as seconds > 0, or :class:`~tasks.errors.InvalidInput` naming it."""
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidInput(f"token-capture.{name} is {value!r}; set a number of seconds > 0")
    return float(value)


@dataclass(frozen=True)
class UnitSettings:
    """A unit's knobs, read once when it is built (``token-capture.store.*``)."""

    answer_buffer_bytes: int  # pooled get answers, bytes (``answer-buffer-bytes``)
    lease_s: float  # an open checkpoint older than this ends by itself, s; 0: never
    report_interval_s: float  # figures published every this many s; 0: never
    adopt_received: bool  # keep a batch received off the wire as the rows

    @classmethod
    def from_config(cls, adopt_received: bool | None = None) -> "UnitSettings":
        return cls(
            config.get_bytes("store.answer-buffer-bytes"),
            float(config.get("store.checkpoint-lease-s")),
            float(config.get("store.report-interval-s")),
            bool(config.get("store.adopt-received") if adopt_received is None else adopt_received),
        )
