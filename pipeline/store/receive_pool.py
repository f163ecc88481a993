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

The pool, its two knobs (read when the process's owner makes it, and again at
:meth:`ProcessState.reconfigure <pipeline.process_state.ProcessState.reconfigure>`) and
whether Dask's allocator is replaced are one :class:`ReceivePool` component of the
process's :class:`~pipeline.process_state.ProcessState`; releasing the owner (a worker's
teardown) hands Dask its own allocator back.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .. import config, dask_compat
from ..process_state import process_state
from .slab_pool import SlabPool


class ReceivePool:
    """This process's receive pool (a :class:`~pipeline.process_state.ProcessState` component).

    ``store.receive-buffer-bytes`` (the pool's cap) and ``store.receive-pool-min-bytes``
    (the smallest frame pooled) are read when it is made and at :meth:`reconfigure`.
    Thread-safe: installing, reconfiguring and suspending take its lock; the frame
    allocator itself (on the event loop) reads plain attributes and takes only the
    pool's lock.
    """

    # Frames a unit keeps as rows hold their slab for as long as the rows live: fine size
    # classes keep a slab's bytes past its frame's small (the unit counts them, see
    # :mod:`.adopted`), a free slab up to four classes larger serves a frame rather than
    # a fresh allocation.
    CLASSES_PER_OCTAVE = 32
    LARGER_CLASSES = 4

    def __init__(self) -> None:
        self.pool = SlabPool(0, classes_per_octave=self.CLASSES_PER_OCTAVE, larger_classes=self.LARGER_CLASSES)
        self.min_bytes = 1 << 20  # frames smaller than this get plain buffers (bytes)
        self.configured_bytes = 0  # ``store.receive-buffer-bytes``
        self.reserved = 0  # bytes storage units hosted here added to the cap (:meth:`reserve`)
        self.suspended = 0  # open suspended() blocks: plain buffers meanwhile
        self._lock = threading.Lock()
        self._plain: dask_compat.FrameAllocator | None = None  # Dask's allocator, once ours was installed
        self._installed = False
        self._closed = False  # released with its owner: never installs again
        self._allocate = self._frame  # the one bound method handed to Dask (compared by identity)
        self.reconfigure()

    def reconfigure(self) -> None:
        """Re-read both knobs (bytes); a cap of 0 gives plain buffers from now on."""
        size = config.get_bytes("store.receive-buffer-bytes")
        min_bytes = max(1, config.get_bytes("store.receive-pool-min-bytes"))
        with self._lock:
            self.configured_bytes = size
            self.pool.max_bytes = size + self.reserved if size > 0 else 0
            self.min_bytes = min_bytes
        self.pool.trim()

    def reserve(self, nbytes: int) -> None:
        """A storage unit hosted by this process keeps the frames of its puts as rows, up to
        its memory limit: ``nbytes`` more (negative: fewer, when it closes) of the pool's
        cap, so its puts land in, and its deletes give back, memory the process owns.
        No effect while the pool is off (``store.receive-buffer-bytes`` 0)."""
        with self._lock:
            self.reserved = max(0, self.reserved + int(nbytes))
            if self.configured_bytes > 0 and not self._closed:
                self.pool.max_bytes = self.configured_bytes + self.reserved
        self.pool.trim()

    def install(self) -> bool:
        """Have Dask's TCP comm read this process's large frames into the pool (once);
        whether the pool is in use (a cap above 0 and a Dask whose allocator can be replaced)."""
        with self._lock:
            if self._installed:
                return self.pool.max_bytes > 0
            if self.pool.max_bytes <= 0 or self._closed:
                return False
            plain = dask_compat.tcp_frame_allocator()
            if plain is None:  # a Dask that reads frames some other way: nothing to pool
                return False
            self._plain, self._installed = plain, True
            dask_compat.set_tcp_frame_allocator(self._allocate)
            return True

    def _frame(self, n: int) -> memoryview:
        plain = self._plain
        assert plain is not None  # set before Dask can call this
        if n < self.min_bytes or self.suspended or not self._installed or self.pool.max_bytes <= 0:
            return plain(n)
        with self.pool._lock:
            # Full of buffers the caller still holds: a fresh one, no garbage collection
            # on the event loop (the pool is an optimization, never a stall).
            slab = self.pool.take(n, collect=False)
        return slab[:n].data

    def suspend(self, by: int) -> None:
        """Open (``by=1``) or close (``by=-1``) a :func:`suspended` block."""
        with self._lock:
            self.suspended += by

    def close(self) -> None:
        """Dask's own allocator back (unless something replaced ours since), the pool emptied."""
        with self._lock:
            installed, self._installed, self._closed = self._installed, False, True
            if installed and self._plain is not None and dask_compat.tcp_frame_allocator() is self._allocate:
                dask_compat.set_tcp_frame_allocator(self._plain)
        self.pool.close()


def pool() -> SlabPool:
    """This process's receive pool (its counters: ``reused``, ``allocated``, ``unpooled``)."""
    return process_state().get(ReceivePool).pool


def install() -> bool:
    """Serve this process's large Dask frames from the receive pool, unless
    ``store.receive-buffer-bytes`` is 0 (both knobs are read when the process's owner
    makes the pool; ``process_state().reconfigure()`` re-reads them). Returns whether the
    pool is in use. Idempotent and cheap: the store client calls it at each get, in the
    controller and on workers (restore batchers, finalize fetches) alike."""
    return process_state().get(ReceivePool).install()


def host_unit(memory_limit: int) -> bool:
    """A storage unit starts in this process: serve its puts' frames from the pool, whose
    cap grows by the unit's ``memory_limit`` (bytes) until :func:`unhost_unit`. Returns
    whether the pool is in use."""
    receiver = process_state().get(ReceivePool)
    receiver.reserve(memory_limit)
    if receiver.install():
        return True
    receiver.reserve(-int(memory_limit))
    return False


def unhost_unit(memory_limit: int) -> None:
    """The unit of :func:`host_unit` closed: the cap shrinks back, idle slabs past it go."""
    process_state().get(ReceivePool).reserve(-int(memory_limit))


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Frames read meanwhile get fresh buffers, as plain Dask gives them (for measuring
    Dask itself, e.g. ``bench store``'s bare-actor ceiling)."""
    receiver = process_state().get(ReceivePool)
    receiver.suspend(1)
    try:
        yield
    finally:
        receiver.suspend(-1)
