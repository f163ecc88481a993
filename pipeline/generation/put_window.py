"""A cut's puts in flight while its next batch packs: :class:`PutWindow`.

A cut with more rows than fit in one put holds the CPU for a batch (freeze, pack), then
waits on the store for it. With a window of ``size`` puts, batch k+1 freezes and packs
while batch k is on the wire: each put runs on a helper thread of the process (the
store's blocking API, bounded by the cut's deadline) and answers come back in the order
the puts were sent, so the cut seals batch by batch as before. ``size`` 1 is the serial
cut: the put runs on the cut's own thread and is answered before the next freeze. The
helpers are one process-wide pool (``cut-put`` threads, made as first needed, reused by
every later cut), so a cut makes no thread of its own; each put runs in its cut's
context (on a Dask worker, the context the store's actor handles find the worker by).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")  # what a put answers
K = TypeVar("K")  # what the cut keeps beside a put until it is answered (its batch's chunks)

MAX_HELPERS = 64  # puts of all the process's cuts on the wire at once, at most


class PutWindow(Generic[K, T]):
    """At most ``size`` puts outstanding, answered in the order they were sent.

    ``send(put, kept)`` starts ``put()`` (on a helper thread unless ``size`` is 1) and
    returns the ``(kept, answer)`` pairs that must be handled now, oldest first: every
    put beyond ``size - 1`` still outstanding, waited for. ``drain()`` waits for and
    returns every outstanding one; ``wait_all(timeout)`` only waits (an aborted cut,
    before it clears what the puts may have written). ``put`` must not raise: it
    answers its own failure.
    """

    def __init__(self, size: int, wait: Callable[[], None] | None = None):
        if size < 1:
            raise ValueError(f"a put window holds at least 1 put, got {size}")
        self.size = size
        self._before_wait = wait  # called before blocking on an answer (the cut leaves its CPU slot)
        self._outstanding: collections.deque[tuple[K, concurrent.futures.Future[T]]] = collections.deque()

    def __len__(self) -> int:
        return len(self._outstanding)

    def send(self, put: Callable[[], T], kept: K) -> list[tuple[K, T]]:
        if self.size == 1:  # on this thread (nothing is outstanding)
            self._waiting()
            return [(kept, put())]
        # In the caller's context: a helper on a worker then finds it as the caller does
        # (distributed's get_worker() reads a context variable; actor handles bind by it).
        self._outstanding.append((kept, _helpers().submit(contextvars.copy_context().run, put)))
        return self._answers(self.size - 1)

    def drain(self) -> list[tuple[K, T]]:
        return self._answers(0)

    def wait_all(self, timeout: float | None) -> None:
        """Wait (at most ``timeout`` s in all) for every outstanding put, keeping nothing."""
        futures = [f for _, f in self._outstanding]
        self._outstanding.clear()
        if futures:
            concurrent.futures.wait(futures, timeout=timeout)

    def _answers(self, keep: int) -> list[tuple[K, T]]:
        out: list[tuple[K, T]] = []
        while len(self._outstanding) > keep:
            kept, future = self._outstanding.popleft()
            if not future.done():
                self._waiting()
            out.append((kept, future.result()))
        return out

    def _waiting(self) -> None:
        if self._before_wait is not None:
            self._before_wait()


_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _helpers() -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of put helpers (made on first use; idle threads are reused)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(MAX_HELPERS, thread_name_prefix="cut-put")
        return _pool
