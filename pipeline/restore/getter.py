"""The prefix read coalescer's gets: one ``get_many`` call, and what its outcome does to
the keys it carried.

:class:`KeyGetter` calls ``get_many`` (bounded by ``get-timeout-s`` seconds, counted in
the stats) and settles each carried key's shared future: its row (a slice of the get's
:class:`~pipeline.restore.answer.GetAnswer`) or a :class:`KeyReadFailure`. A failed get of
several keys re-reads each alone, so a bad row fails only its own requesters. When gets
run is the coalescer's call; no Dask here.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from tasks.errors import KeyReadFailure
from tasks.packed import PackedBatch

from ..store.protocol import ABSENT_FIELD, GetResult
from .answer import GetAnswer
from .pending import PendingKey, notify
from .stats import CoalescerStats

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

# (keys) -> GetResult; bounded: (keys, timeout seconds) -> GetResult.
GetMany = Callable[..., Awaitable[GetResult]]
# Keys one get carries, with their shared entries, in the get's order.
KeyBatch = list[tuple[str, PendingKey]]

# Store reasons for which the row is still served (e.g. a row without routed_experts):
# the prefix verifier decides whether the missing field matters.
SERVED_REASONS = frozenset({ABSENT_FIELD})


class KeyGetter:
    """``get_many`` calls for the coalescer, and the settling of the keys they carry.

    ``bounded``: ``get_many(keys, timeout_s)`` enforces the timeout itself, so no timer
    is set here per get; else each call runs under ``asyncio.timeout(timeout_s)``.
    """

    __slots__ = ("_get_many", "_bounded", "_stats")

    def __init__(self, get_many: GetMany, *, bounded: bool, stats: CoalescerStats) -> None:
        self._get_many = get_many
        self._bounded = bounded
        self._stats = stats

    async def get(self, keys: list[str], timeout_s: float) -> GetResult:
        """One ``get_many`` for ``keys`` (counted), within ``timeout_s`` seconds; raises
        what it raises, ``TimeoutError`` past the timeout, ``TypeError`` for a result that
        is no GetResult."""
        self._stats.gets += 1
        self._stats.keys_fetched += len(keys)
        if self._bounded:
            result = await self._get_many(list(keys), timeout_s)
        elif _timeout is not None:  # no extra task around the get (wait_for makes one)
            async with _timeout(timeout_s):
                result = await self._get_many(list(keys))
        else:
            result = await asyncio.wait_for(self._get_many(list(keys)), timeout_s)
        return checked_result(result)

    async def settle_failed_get(self, batch: KeyBatch, exc: Exception, timeout_s: float) -> None:
        """After the get of ``batch`` raised ``exc`` (counted): one key fails with its
        reason, several are re-read alone (:meth:`reread_alone`)."""
        self._stats.failed_gets += 1
        if isinstance(exc, asyncio.TimeoutError):
            self._stats.timeouts += 1
        if len(batch) == 1:
            self.fail(batch, *failure_of(exc, timeout_s))
        else:
            await self.reread_alone(batch, timeout_s)

    async def reread_alone(self, batch: KeyBatch, timeout_s: float) -> None:
        """Each key of a failed batch once, on its own, so a bad row fails only its requesters.

        The solo gets run concurrently (each under ``timeout_s`` seconds) inside the failed
        batch's slot: an outage costs N + 1 gets and at most twice the timeout.
        """
        self._stats.solo_rereads += len(batch)

        async def one(key: str, e: PendingKey) -> None:
            try:
                result = await self.get([key], timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - this key's failure
                await self.settle_failed_get([(key, e)], exc, timeout_s)
            else:
                self.deliver([(key, e)], result)

        await asyncio.gather(*(one(key, e) for key, e in batch))

    def deliver(self, batch: KeyBatch, result: GetResult) -> None:
        """Settle ``batch``'s keys from a get's ``result``: each its row (a slice of one
        shared :class:`GetAnswer`), or its failure (a row missing, or failed for a reason
        the row is not served with)."""
        rows = GetAnswer(result.batch)  # sliced by every request it serves: prepared once
        failed = result.failed
        index = {k: i for i, k in enumerate(rows.batch.keys)}
        for k, e in batch:
            if e.future.done():
                continue
            i = index.get(k)
            problem = failed.get(k)
            if problem is not None and not (i is not None and problem[0] in SERVED_REASONS):
                self.fail([(k, e)], str(problem[0]), str(problem[1]))
            elif i is None:
                self.fail([(k, e)], "incomplete_get", "the store returned neither the row nor a failure for it")
            else:
                e.future.set_result((rows, i))
                notify(e)

    def fail(self, batch: KeyBatch, reason: str, detail: str) -> None:
        """Fail every unsettled key of ``batch`` with ``reason`` and ``detail`` (counted)."""
        for _, e in batch:
            if not e.future.done():
                self._stats.failed_keys += 1
                e.future.set_exception(KeyReadFailure(reason, detail))
                e.future.exception()  # seen: every requester may be gone (cancelled) already
                notify(e)


def checked_result(result: object) -> GetResult:
    """``result`` if it is a GetResult (``batch``, ``failed``), else ``TypeError``."""
    if not isinstance(getattr(result, "batch", None), PackedBatch) or not isinstance(getattr(result, "failed", None), dict):
        raise TypeError(f"get_many returned {type(result).__name__}, expected a GetResult (batch, failed)")
    return result  # type: ignore[return-value] - any object with batch and failed will do


def failure_of(exc: BaseException, timeout_s: float) -> tuple[str, str]:
    """``(reason, detail)`` of a get that raised ``exc`` (``read_timeout`` past
    ``timeout_s`` seconds, else ``read_failed``)."""
    if isinstance(exc, asyncio.TimeoutError):
        return "read_timeout", f"get ran past get-timeout-s ({timeout_s} s)"
    return "read_failed", f"{type(exc).__name__}: {exc}"
