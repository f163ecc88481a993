"""When the prefix read coalescer issues a get: one pure decision on the batcher's load.

:meth:`DispatchState.decide` looks at the queue and the gets in flight and answers an
:class:`Action`; the coalescer asks on every arrival, window end and finished get.

* Light load (fewer than ``eager-inflight`` gets in flight): issue at once, as a
  per-request get would (later arrivals of the same event-loop turn share one get).
* Loaded (``eager-inflight`` or more in flight, a slot free): coalesce, at most
  ``window-ms``; a finished get ends the wait sooner (the load dropped).
* Saturated (``max-concurrent-gets`` in flight): queue; when a slot frees, everything
  queued goes at once (it has waited already: no window on top).
* A queue that fills a get (``batch-size`` keys or ``max-tokens`` tokens) never waits.

Defaults (eager-inflight = max-concurrent-gets = 4): no request waits while a slot is
free, so light load costs what per-request gets cost, and requests merge exactly when
every slot is busy (the store is behind); a lower eager-inflight trades latency for
fewer gets. No asyncio, no Dask, no config here: the coalescer fills in the numbers.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Action(enum.Enum):
    """What the coalescer does with its queued keys now."""

    IDLE = "idle"  # nothing queued
    ISSUE = "issue"  # issue the queued keys now (as many gets as free slots allow)
    OPEN_WINDOW = "open_window"  # coalesce: wait window-ms for more requests, then issue
    WAIT_WINDOW = "wait_window"  # a window is open: keep coalescing until it ends
    WAIT_SLOT = "wait_slot"  # every slot is busy: the queue goes when one frees


@dataclass(frozen=True)
class DispatchState:
    """The coalescer's load at one moment (counts of keys and gets)."""

    queued: int  # distinct keys waiting for a get
    inflight: int  # gets running now (a reserved, about-to-start one included)
    max_concurrent: int  # get slots (restore.max-concurrent-gets)
    eager_inflight: int  # below this many gets in flight, queued keys go at once (restore.eager-inflight)
    queue_full: bool = False  # some group's queued keys already fill a whole get
    window_open: bool = False  # a coalescing window is running
    waited: bool = False  # the queued keys already waited (their window ended, or slots were full)

    def decide(self) -> Action:
        """The action for this state (see the module docstring)."""
        if self.queued <= 0:
            return Action.IDLE
        if self.inflight >= self.max_concurrent:
            return Action.WAIT_SLOT
        if self.inflight < self.eager_inflight or self.queue_full or self.waited:
            return Action.ISSUE
        return Action.WAIT_WINDOW if self.window_open else Action.OPEN_WINDOW
