"""The prefix read coalescer's counters, and their flat summary for events and benchmarks."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np


@dataclass
class CoalescerStats:
    """Counters (counts; ``latencies_ms`` in milliseconds) since the coalescer started."""

    requests: int = 0
    keys_requested: int = 0  # sum over requests of their distinct keys
    keys_deduplicated: int = 0  # keys that joined an already pending or in-flight read
    gets: int = 0  # get_many calls, solo re-reads included
    keys_fetched: int = 0  # keys over all get_many calls
    immediate_gets: int = 0  # issued as their request arrived (light load: no window, no slot wait)
    window_waits: int = 0  # coalescing windows opened (loaded: eager-inflight gets or more in flight)
    slot_waits: int = 0  # times the queue waited for a free slot (saturated: max-concurrent-gets in flight)
    failed_gets: int = 0  # multi- or single-key gets that raised or timed out
    timeouts: int = 0
    solo_rereads: int = 0
    failed_keys: int = 0
    failed_requests: int = 0
    cancelled_requests: int = 0
    dropped_keys: int = 0  # queued keys dropped because every requester cancelled
    max_inflight: int = 0
    # Request latencies (ms), the latest ones only (the coalescer sets the bound).
    latencies_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=4096))

    def summary(self) -> dict[str, int | float]:
        """Flat numbers for events and benchmarks (``*_ms`` in milliseconds)."""
        lat = np.fromiter(self.latencies_ms, dtype=np.float64)
        out = {k: v for k, v in self.__dict__.items() if k != "latencies_ms"}
        out["keys_per_get"] = self.keys_fetched / self.gets if self.gets else 0.0
        out["p50_ms"] = float(np.percentile(lat, 50)) if lat.size else 0.0
        out["p99_ms"] = float(np.percentile(lat, 99)) if lat.size else 0.0
        return out
