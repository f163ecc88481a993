"""The restore batcher's dispatch decision (pipeline/restore/dispatch.py): a pure function
of its load, so every case is one line here. The coalescer acting on it is exercised in
tests/test_restore_coalescer.py, the actor on a real cluster in tests/test_restore_batcher.py."""
from __future__ import annotations

import dataclasses

import pytest

from pipeline.restore.dispatch import Action, DispatchState


def state(**kw) -> DispatchState:
    base = dict(queued=1, inflight=0, max_concurrent=4, eager_inflight=4)
    return DispatchState(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, action",
    [
        (dict(queued=0), Action.IDLE),
        # Light load: below eager-inflight, a request goes at once (no window).
        (dict(inflight=0), Action.ISSUE),
        (dict(inflight=3), Action.ISSUE),
        # Saturated: every slot busy, whatever else holds.
        (dict(inflight=4), Action.WAIT_SLOT),
        (dict(inflight=4, queue_full=True, waited=True), Action.WAIT_SLOT),
        # Loaded (eager-inflight reached, a slot free): coalesce for a window...
        (dict(inflight=1, eager_inflight=1), Action.OPEN_WINDOW),
        (dict(inflight=1, eager_inflight=1, window_open=True), Action.WAIT_WINDOW),
        # ... unless the queue fills a get, or it has waited already.
        (dict(inflight=1, eager_inflight=1, queue_full=True), Action.ISSUE),
        (dict(inflight=1, eager_inflight=1, waited=True), Action.ISSUE),
        # eager-inflight 0: even a lone request on an idle batcher waits for the window.
        (dict(inflight=0, eager_inflight=0), Action.OPEN_WINDOW),
    ],
)
def test_decide(kw, action):
    assert state(**kw).decide() is action


def test_state_is_frozen():
    s = state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.inflight = 3  # type: ignore[misc]
