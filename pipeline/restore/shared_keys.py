"""The keys the prefix read coalescer's shared reads hold: who asked, what is queued.

:class:`SharedKeys` maps every pending or in-flight key to its :class:`PendingKey`
(shared by every request that asked for it) and queues those not yet issued, per group
(:class:`~pipeline.restore.pending.PendingQueue`). A request joins its keys, and
releases them when it is answered or cancelled; a queued key nobody holds any more is
dropped before it is read. When keys go is the coalescer's call; no Dask here.
"""
from __future__ import annotations

import asyncio
from typing import Callable, Hashable

from .getter import KeyBatch
from .pending import PendingKey, PendingQueue, ReadRequest
from .stats import CoalescerStats


class SharedKeys:
    """The shared reads' keys: ``entries`` (every pending or in-flight key) and
    ``queue`` (those not yet issued). ``group_of(key)``: the key's group (None: one)."""

    __slots__ = ("entries", "queue", "_loop", "_group_of", "_stats")

    def __init__(self, loop: asyncio.AbstractEventLoop, group_of: Callable[[str], Hashable], stats: CoalescerStats) -> None:
        self.entries: dict[str, PendingKey] = {}
        self.queue = PendingQueue()
        self._loop = loop
        self._group_of = group_of
        self._stats = stats

    def join(self, keys: list[str], hints: list[int]) -> tuple[dict[str, PendingKey], ReadRequest, int]:
        """Each distinct key of a request (``hints``: tokens per key) joins its pending or
        in-flight read, or is queued (a new entry); returns (the request's entries, its
        waiter, how many keys were queued)."""
        mine: dict[str, PendingKey] = {}
        req = ReadRequest(self._loop)
        n_added = 0
        for k, t in zip(keys, hints):
            if k in mine:
                continue
            e = self.entries.get(k)
            if e is None:
                e = PendingKey(self._loop.create_future(), t, self._group_of(k))
                self.entries[k] = e
                self.queue.add(k, e)
                n_added += 1
            else:
                self._stats.keys_deduplicated += 1
                if not e.issued and t > e.tokens:
                    self.queue.grow(e, t)
            e.refs += 1
            mine[k] = e
            if not e.future.done():
                e.waiting.append(req)
                req.pending += 1
        self._stats.keys_requested += len(mine)
        return mine, req, n_added

    def release(self, mine: dict[str, PendingKey]) -> bool:
        """A request lets go of its keys; a queued key nobody wants any more is dropped.
        Returns whether any was dropped."""
        dropped = False
        for k, e in mine.items():
            e.refs -= 1
            if e.refs <= 0 and not e.issued and not e.future.done():
                # Nobody wants it any more and no get carries it yet: do not read it.
                self.queue.remove(k, e)
                self.entries.pop(k, None)
                e.future.cancel()
                self._stats.dropped_keys += 1
                dropped = True
        return dropped

    def next_batch(self, batch_size: int, max_tokens: int) -> KeyBatch:
        """Queued keys of one group in arrival order, up to ``batch_size`` keys and
        ``max_tokens`` tokens, marked issued."""
        batch = self.queue.pop_batch(batch_size, max_tokens)
        for _, e in batch:
            e.issued = True
        return batch

    def requeue(self, batch: KeyBatch) -> None:
        """An owner's cancelled get hands its unsettled keys back to the queue."""
        for key, e in batch:
            if not e.future.done():
                e.issued = False
                self.queue.add(key, e)

    def forget_issued(self, batch: KeyBatch) -> None:
        """A get is over: its issued keys leave ``entries`` (later reads get them anew)."""
        for key, e in batch:
            if e.issued and self.entries.get(key) is e:
                del self.entries[key]

    def drain(self) -> KeyBatch:
        """Every queued key, removed from the queue and ``entries`` (closing)."""
        queued = self.queue.drain()
        for k, _ in queued:
            self.entries.pop(k, None)
        return queued
