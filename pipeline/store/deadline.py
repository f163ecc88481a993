"""Deadlines on store calls: a call given ``timeout`` seconds returns by then.

A unit that has not answered by the deadline fails its keys ``unit_unavailable`` (the
client's ``_settle`` turns the ``TimeoutError`` into that); the other units' answers
stand. Callers that accept any store (the cut, the finalize fetch) ask
:func:`takes_timeout` first: a wrapper without the parameter is called unbounded. Its
answers per class are cached in a :class:`TimeoutAnswers` component of the process's
:class:`~pipeline.process_state.ProcessState`.
"""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable

from ..process_state import process_state

# The least time a wait gets once the deadline has passed: an answer already in flight
# is still collected, nothing waits longer than a moment (seconds).
FLOOR_S = 1e-3


class TimeoutAnswers:
    """The process's cache for :func:`takes_timeout`: a class's function -> whether it
    takes ``timeout=``. A dict lookup and store, safe under the GIL (an answer inspected
    twice by racing threads is the same answer)."""

    def __init__(self) -> None:
        self.answers: dict[Callable, bool] = {}


def takes_timeout(method: Callable) -> bool:
    """Whether a store method accepts ``timeout=`` (a StagingStore does; some wrappers don't).

    A bound method answers for its class: its function's signature is inspected once per
    process (a cut asks at every cut); a plain callable is inspected every time."""
    func = getattr(method, "__func__", None)
    if func is None:
        return _inspect_timeout(method)
    answers = process_state().get(TimeoutAnswers).answers
    got = answers.get(func)
    if got is None:
        got = answers[func] = _inspect_timeout(method)
    return got


def _inspect_timeout(method: Callable) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "timeout" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def deadline(timeout: float | None) -> float | None:
    """``time.monotonic()`` seconds by which a call with ``timeout`` seconds must return."""
    return None if timeout is None else time.monotonic() + max(float(timeout), 0.0)


def left(end: float) -> float:
    """Seconds to ``end``, at least :data:`FLOOR_S`."""
    return max(end - time.monotonic(), FLOOR_S)


def waiter(future: Any, end: float | None) -> Callable[[], Any]:
    """A sync actor future's result, bounded by ``end`` (``TimeoutError`` past it)."""
    if end is None:
        return future.result
    return lambda: future.result() if future.done() else future.result(timeout=left(end))


async def bounded(awaitable: Any, end: float | None) -> Any:
    """Await an actor call, bounded by ``end`` (``TimeoutError`` past it; no extra task)."""
    if end is None:
        return await awaitable
    async with asyncio.timeout(left(end)):
        return await awaitable


def settle_all(futures: list, end: float | None = None) -> list:
    """Every future's result, or its exception (all awaited, none raised): the caller
    decides what a failure means (a lost unit, a checkpoint that does not count). With
    ``end`` (:func:`deadline`), a future not done by then counts as a ``TimeoutError``."""
    out = []
    for fut in futures:
        try:
            out.append(waiter(fut, end)())
        except Exception as e:  # noqa: BLE001 - returned, not swallowed
            out.append(e)
    return out
