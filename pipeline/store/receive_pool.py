"""Pooled receive buffers for the large Dask frames a process reads and drops again.

Dask's TCP comm reads every frame into a fresh buffer (its frame allocator, see
:func:`pipeline.dask_compat.tcp_frame_allocator`), whose pages fault in on first touch: on a
VM that hands freed memory back to its host, about as slowly as the wire itself. Most
large frames of this pipeline are read and dropped soon after: a get's answers (merged,
sliced into restores, verified), a finalized group. :func:`install` has frames of at least
``store.receive-pool-min-bytes`` carved out of one :class:`SlabPool` per process of at
most ``store.receive-buffer-bytes`` instead: memory the process already touched, handed
out again only when nothing refers to it. A frame something keeps (a put's rows, adopted
by a unit) holds its slab until the rows go; a full pool gives plain buffers, never stalls.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .slab_pool import SlabPool

_POOL = SlabPool(0)
_STATE = {"installed": False, "min_bytes": 1 << 20, "suspended": 0}
_LOCK = threading.Lock()


def pool() -> SlabPool:
    """This process's receive pool (its counters: ``reused``, ``allocated``, ``unpooled``)."""
    return _POOL


def install() -> bool:
    """Serve this process's large Dask frames from the receive pool, unless
    ``store.receive-buffer-bytes`` is 0; re-reads both knobs (bytes) each call. Returns
    whether the pool is in use. Idempotent and cheap: the store client calls it at each
    get, in the controller and on workers (restore batchers, finalize fetches) alike."""
    from .. import config

    size = config.get_bytes("store.receive-buffer-bytes")
    with _LOCK:
        _POOL.max_bytes = size
        _STATE["min_bytes"] = max(1, config.get_bytes("store.receive-pool-min-bytes"))
        if _STATE["installed"]:
            return size > 0
        if size <= 0:
            return False
        from .. import dask_compat

        plain = dask_compat.tcp_frame_allocator()
        if plain is None:  # a Dask that reads frames some other way: nothing to pool
            return False

        def pooled_frame(n: int) -> memoryview:
            if n < _STATE["min_bytes"] or _STATE["suspended"] or _POOL.max_bytes <= 0:
                return plain(n)
            with _POOL._lock:
                # Full of buffers the caller still holds: a fresh one, no garbage collection
                # on the event loop (the pool is an optimization, never a stall).
                slab = _POOL.take(n, collect=False)
            return slab[:n].data

        dask_compat.set_tcp_frame_allocator(pooled_frame)
        _STATE["installed"] = True
        return True


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Frames read meanwhile get fresh buffers, as plain Dask gives them (for measuring
    Dask itself, e.g. ``bench store``'s bare-actor ceiling)."""
    with _LOCK:
        _STATE["suspended"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["suspended"] -= 1
