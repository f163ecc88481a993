"""When an arriving request runs its own get, bypassing the shared queue: one pure check.

The first request of an event-loop turn, finding nothing queued, issues its get itself
(as a per-request get would: no shared bookkeeping, no wake-up turn) when
:meth:`~pipeline.restore.dispatch.DispatchState.decide` would issue its keys now and they
fit one get: at most ``batch-size`` keys and ``max-tokens`` tokens (by the callers'
hints), one group (storage unit), none already pending or in flight (it joins that read
instead). The coalescer checks its own flags (the turn, the queue, closed) first. No
asyncio, no Dask, no config here.
"""
from __future__ import annotations

from typing import Callable, Collection, Hashable

from .dispatch import Action, DispatchState
from .settings import CoalescerSettings


def own_get_keys(
    keys: list[str],
    hints: list[int],
    settings: CoalescerSettings,
    inflight: int,
    pending: Collection[str],
    group_of: Callable[[str], Hashable] | None,
) -> list[str] | None:
    """The request's distinct keys (first-seen order) when it runs its own get now, else
    None (it goes through the queue).

    ``hints``: tokens per key (a duplicate counts its last hint); ``inflight``: gets
    running now; ``pending``: keys pending or in flight; ``group_of``: ``key -> group``,
    or None (one group).
    """
    distinct = keys if len(keys) == 1 else list(dict.fromkeys(keys))
    n = len(distinct)
    tokens = sum(hints) if n == len(keys) else sum(dict(zip(keys, hints)).values())
    s = settings
    state = DispatchState(queued=n, inflight=inflight, max_concurrent=s.max_concurrent,
                          eager_inflight=s.eager_inflight, queue_full=n >= s.batch_size or tokens >= s.max_tokens)
    if state.decide() is not Action.ISSUE or n > s.batch_size or (n > 1 and tokens > s.max_tokens):
        return None
    if pending and any(x in pending for x in distinct):
        return None  # it joins a read in flight instead
    if n > 1 and group_of is not None and len({group_of(x) for x in distinct}) > 1:
        return None
    return distinct
