"""Pacing a background copy to a byte rate, and timing its phases.

A store move copies rows while puts and gets go on; :class:`Pacer` keeps its average
rate at or under ``rate_bytes_s`` (``store.rebalance-rate-bytes-s``) so the copy takes a
bounded share of the wire, the memory bandwidth and the units' actor threads.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Pacer:
    """Bytes sent since it was built vs ``rate_bytes_s`` (bytes per second; 0: no limit)."""

    rate_bytes_s: float
    clock: Callable[[], float] = time.monotonic  # seconds
    sent_bytes: int = 0
    started: float = field(default=0.0)

    def __post_init__(self) -> None:
        if self.rate_bytes_s < 0:
            raise ValueError(f"rate_bytes_s must be >= 0 (0: no limit), got {self.rate_bytes_s}")
        self.started = self.clock()

    def sent(self, nbytes: int) -> float:
        """Record ``nbytes`` more sent; the seconds to wait before the next send so the
        average since the start stays at or under the rate (0.0 when unpaced or behind)."""
        self.sent_bytes += int(nbytes)
        if not self.rate_bytes_s:
            return 0.0
        due = self.started + self.sent_bytes / self.rate_bytes_s
        return max(0.0, due - self.clock())


@dataclass
class PhaseClock:
    """Seconds spent in each named phase of a long operation (laps add up per name)."""

    clock: Callable[[], float] = time.perf_counter  # seconds
    laps: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    last: float = 0.0

    def __post_init__(self) -> None:
        self.started = self.last = self.clock()

    def lap(self, name: str) -> float:
        """Add the seconds since the previous lap (or the start) to phase ``name``; them."""
        now = self.clock()
        took, self.last = now - self.last, now
        self.laps[name] = round(self.laps.get(name, 0.0) + took, 4)
        return took

    def total(self) -> float:
        """Seconds since the start."""
        return self.clock() - self.started
