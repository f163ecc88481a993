"""The prefix read coalescer's pending-key bookkeeping: keys, requests, the queue.

A :class:`PendingKey` is one distinct key waiting for or in a get, shared by every
:class:`ReadRequest` that asked for it; the :class:`PendingQueue` holds the keys not
yet issued, per group (storage unit), and keeps each group's token total (tokens are
the callers' hints). No scheduling here (the coalescer decides when keys go), no Dask.
"""
from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

if TYPE_CHECKING:
    from .answer import GetAnswer


@dataclass
class PendingKey:
    """One distinct key pending or in flight, shared by every request that asked for it.

    ``tokens`` is its token hint (the largest any requester gave while it was queued),
    ``refs`` the number of requests holding it.
    """

    future: asyncio.Future[tuple[GetAnswer, int]]  # -> (answer of its get, row index), or a key failure
    tokens: int
    group: Hashable = None
    refs: int = 0
    issued: bool = False  # a get carries it (it left the queue)
    waiting: list[ReadRequest] = field(default_factory=list)  # requests to tell when this resolves


class ReadRequest:
    """One read's private waiter: completed (synchronously) when its last key resolves.

    Requests never await the shared key futures: cancelling a request cancels only this
    waiter, and a resolved get wakes its requesters in one loop turn. ``pending`` counts
    the request's distinct keys not yet resolved.
    """

    __slots__ = ("waiter", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.waiter: asyncio.Future[None] = loop.create_future()
        self.pending = 0

    def key_done(self) -> None:
        self.pending -= 1
        if self.pending <= 0 and not self.waiter.done():
            self.waiter.set_result(None)


class PendingQueue:
    """Keys waiting for a get, per group, in arrival order; token totals kept up to date.

    ``len()`` is the number of queued keys; ``tokens[group]`` the sum of its keys' hints.
    """

    def __init__(self) -> None:
        # group -> {key: entry}; groups in the order they have waited (oldest first).
        self.groups: collections.OrderedDict[Hashable, collections.OrderedDict[str, PendingKey]] = collections.OrderedDict()
        self.tokens: dict[Hashable, int] = {}
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def add(self, key: str, e: PendingKey) -> None:
        self.groups.setdefault(e.group, collections.OrderedDict())[key] = e
        self.tokens[e.group] = self.tokens.get(e.group, 0) + e.tokens
        self.n += 1

    def grow(self, e: PendingKey, tokens: int) -> None:
        """A later request hints more tokens for a queued key."""
        self.tokens[e.group] += tokens - e.tokens
        e.tokens = tokens

    def remove(self, key: str, e: PendingKey) -> None:
        q = self.groups.get(e.group)
        if q is None or q.pop(key, None) is None:
            return
        self.n -= 1
        self.tokens[e.group] -= e.tokens
        if not q:
            del self.groups[e.group], self.tokens[e.group]

    def full(self, batch_size: int, max_tokens: int) -> bool:
        """Some group already fills a get (``batch_size`` keys or ``max_tokens`` tokens)."""
        return any(len(q) >= batch_size or self.tokens[g] >= max_tokens for g, q in self.groups.items())

    def pop_batch(self, batch_size: int, max_tokens: int) -> list[tuple[str, PendingKey]]:
        """From the longest-waiting group, its oldest keys up to the limits; an oversized
        key goes alone. The group, if keys remain, waits behind the others (round robin)."""
        g, q = next(iter(self.groups.items()))
        out: list[tuple[str, PendingKey]] = []
        total = 0
        while q and len(out) < batch_size:
            k, e = next(iter(q.items()))
            if out and total + e.tokens > max_tokens:
                break
            q.popitem(last=False)
            out.append((k, e))
            total += e.tokens
        self.n -= len(out)
        self.tokens[g] -= total
        if q:
            self.groups.move_to_end(g)
        else:
            del self.groups[g], self.tokens[g]
        return out

    def drain(self) -> list[tuple[str, PendingKey]]:
        """Every queued key (the queue is left empty)."""
        out = [(k, e) for q in self.groups.values() for k, e in q.items()]
        self.groups.clear()
        self.tokens.clear()
        self.n = 0
        return out


def token_hints(keys: list[str], tokens: None | int | Sequence[int]) -> list[int]:
    """Per-key token hints from a read's ``tokens``: one int per key, or the request's
    total spread evenly over its keys, or ``None`` (every key counts 0 tokens).

    Raises ``ValueError`` for a negative count or a list of the wrong length."""
    n = len(keys)
    if tokens is None:
        return [0] * n
    if n == 1 and type(tokens) is int and tokens >= 0:  # a one-chunk restore: every read's path
        return [tokens]
    if isinstance(tokens, (int, np.integer)):
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        # Spread a request's total over its keys (chunks of one prefix are similar in size).
        base, extra = divmod(int(tokens), max(n, 1))
        return [base + (1 if i < extra else 0) for i in range(n)]
    hints = [int(t) for t in tokens]
    if len(hints) != n:
        raise ValueError(f"{len(hints)} token counts for {n} keys")
    if any(t < 0 for t in hints):
        raise ValueError("token counts must be >= 0")
    return hints


def notify(e: PendingKey) -> None:
    """Tell the requests waiting on ``e`` that it resolved (once: the list is emptied)."""
    waiting, e.waiting = e.waiting, []
    for req in waiting:
        req.key_done()
