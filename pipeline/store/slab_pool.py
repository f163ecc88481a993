"""Pooled slabs: memory a process already touched, for buffers it fills again and again.

:class:`SlabPool` keeps reusable ``uint8`` slabs (sizes in bytes, at most ``max_bytes``
of them) and carves one slab per batch into its big fields, so a storage unit's get
answers, the store client's put gathers and get merges, and a cut's packed batches are
written into memory already mapped instead of a fresh allocation per field (which page-
faults). A slab is reused only once nothing refers to it any more (its reference count).
:func:`process_pool` is the one pool per config key shared by a process: a
:class:`ConfiguredPool` component of the process's :class:`~pipeline.process_state.ProcessState`.
"""
from __future__ import annotations

import gc
import sys
import threading
from typing import Iterable

import numpy as np

from tasks.packed import Allocator

from .. import config
from ..process_state import process_state


class SlabPool:
    """Reusable slabs (bytes) for packed batches' values, at most ``max_bytes`` of them.

    A slab is handed out again only when nothing refers to it any more: every field
    value is a numpy view whose ``base`` is the slab, and every later view, memoryview or
    pickle buffer of it (Dask's send path) holds such a view, so the slab's reference
    count tells when the answer has been sent and dropped (or, in-process, when the
    caller let go of it). Slabs come in size classes; each class is scanned oldest-handed-
    out first, so a free one is usually the first looked at (a get pays O(1), not a scan
    of every slab). The pool tracks at most ``max_bytes`` (in use or idle; idle slabs of
    other classes are released to make room); an answer beyond that is a plain allocation.
    """

    ALIGN = 64  # bytes; every field starts on a cache line (and on its dtype's alignment)
    FIELD_MIN_BYTES = 1 << 14  # smaller fields (ids, scalars, hashes) are plain allocations:
    # a caller keeping one of them must not pin a whole slab
    SCAN = 64  # slabs of a class looked at per take (bounds a get's cost when all are in use)

    def __init__(self, max_bytes: int, min_bytes: int = 1 << 17, classes_per_octave: int = 8, larger_classes: int = 0):
        self.max_bytes = int(max_bytes)  # bytes of slabs the pool may keep (0: no pooling)
        self.min_bytes = int(min_bytes)  # answers (big fields) smaller than this are plain allocations
        # Size classes per power of two (a power of two): a slab is at most 1/classes larger
        # than what it was taken for. ``larger_classes``: when no slab of a request's own
        # class is free, a free one of up to this many classes above serves it (memory the
        # process already holds beats a fresh allocation; its extra bytes are the caller's
        # to account for, see :func:`root_nbytes`).
        self.classes_per_octave = int(classes_per_octave)
        self.larger_classes = int(larger_classes)
        self._tick = 0  # hand-outs so far; a slab's stamp is the tick it was last handed out at
        self._stamps: dict[int, int] = {}  # id(slab) -> stamp: idle slabs go least recently used first
        self._classes: dict[int, list[np.ndarray]] = {}  # size -> slabs, least recently handed out first
        self.held_bytes = 0  # bytes of every slab the pool keeps (in use or idle)
        self.reused = 0  # answers packed into a reused slab
        self.allocated = 0  # slabs allocated for the pool
        self.unpooled = 0  # answers packed into a plain allocation (the pool was full)
        self.collections = 0  # garbage collections run because the pool was full
        # References a slab has when only this pool holds it, measured through the same
        # code path as the check (robust to how the interpreter counts argument refs).
        probe = [np.empty(0, np.uint8)]
        self._free_refs = self._refs(probe, 0)
        self._lock = threading.Lock()  # a client process may merge gets on several threads

    @staticmethod
    def _refs(slabs: list, i: int) -> int:
        return sys.getrefcount(slabs[i])

    @staticmethod
    def size_class(nbytes: int, classes_per_octave: int = 8) -> int:
        """``classes_per_octave`` classes per power of two (eight: at most 12.5% slack;
        32: at most 3.1%): similar sizes share slabs."""
        shift = classes_per_octave.bit_length() - 1
        granule = 1 << max(0, (nbytes - 1).bit_length() - 1 - shift)
        return -(-nbytes // granule) * granule

    def _free_in(self, cap: int) -> np.ndarray | None:
        """A free slab of class ``cap`` (now the most recently handed out), or None."""
        slabs = self._classes.get(cap)
        if not slabs:
            return None
        # The oldest handed out are the likeliest free; past SCAN of them, all are taken.
        for i in range(min(len(slabs), self.SCAN)):
            if self._refs(slabs, i) <= self._free_refs:
                slab = slabs.pop(i)
                slabs.append(slab)
                self.reused += 1
                self._stamp(slab)
                return slab
        return None

    def _stamp(self, slab: np.ndarray) -> None:
        self._tick += 1
        self._stamps[id(slab)] = self._tick

    def _free_slab(self, cap: int) -> np.ndarray | None:
        """A free slab of class ``cap``, else of one of the ``larger_classes`` above it."""
        slab = self._free_in(cap)
        for _ in range(self.larger_classes):
            if slab is not None:
                break
            cap = self.size_class(cap + 1, self.classes_per_octave)
            slab = self._free_in(cap)
        return slab

    def take(self, nbytes: int, collect: bool = True) -> np.ndarray:
        """A ``uint8`` buffer of at least ``nbytes`` that nothing else refers to.

        ``collect=False``: when the pool is full of slabs in use, a plain allocation at
        once, without the young-generation collection that might free some."""
        cap = self.size_class(max(self.min_bytes, int(nbytes)), self.classes_per_octave)
        slabs = self._classes.setdefault(cap, [])
        slab = self._free_slab(cap)
        if slab is not None:
            return slab
        if self.held_bytes + cap > self.max_bytes:
            self._release_idle(self.held_bytes + cap - self.max_bytes, but=cap)
        if self.held_bytes + cap > self.max_bytes and collect:
            # Full of slabs something still refers to: often only a finished actor call's
            # arguments waiting in a reference cycle. One young-generation collection frees
            # those (milliseconds), then idle slabs can go or be reused.
            gc.collect(1)
            self.collections += 1
            slab = self._free_slab(cap)
            if slab is not None:
                return slab
            self._release_idle(self.held_bytes + cap - self.max_bytes, but=cap)
        if self.held_bytes + cap <= self.max_bytes:
            slab = np.empty(cap, dtype=np.uint8)
            slabs.append(slab)
            self.held_bytes += cap
            self.allocated += 1
            self._stamp(slab)
        else:
            slab = np.empty(max(1, int(nbytes)), dtype=np.uint8)
            self.unpooled += 1  # kept by nobody but its answer: freed with it
        return slab

    def trim(self) -> None:
        """Release idle slabs until the pool keeps at most ``max_bytes`` (after its cap shrank)."""
        with self._lock:
            if self.held_bytes > self.max_bytes:
                self._release_idle(self.held_bytes - self.max_bytes, but=-1)

    def _release_idle(self, need: int, but: int) -> None:
        """Drop idle slabs of classes other than ``but``, least recently handed out first,
        until ``need`` bytes are freed or none is idle."""
        idle = []
        for cap, slabs in self._classes.items():
            if cap == but:
                continue  # just scanned: none of them is free
            for i in range(len(slabs)):
                if self._refs(slabs, i) <= self._free_refs:
                    idle.append((self._stamps.get(id(slabs[i]), 0), cap, i))
        freed = 0
        gone: dict[int, set] = {}
        for _, cap, i in sorted(idle):
            if freed >= need:
                break
            gone.setdefault(cap, set()).add(i)
            freed += cap
        for cap, ix in gone.items():
            for i in ix:
                self._stamps.pop(id(self._classes[cap][i]), None)
            self._classes[cap] = [s for i, s in enumerate(self._classes[cap]) if i not in ix]
        self.held_bytes -= freed

    def carver(self, cols: dict[str, list]) -> Allocator | None:
        """``out(dtype, shape)`` for :meth:`PackedField.from_arrays`, handing out consecutive views of
        one slab sized for every big field of ``cols``; ``None`` for a small answer."""
        return self.allocator(sum(a.nbytes for a in arrays if a is not None) for arrays in cols.values())

    def allocator(self, field_nbytes: Iterable[int]) -> Allocator | None:
        """``out(dtype, shape)`` handing out consecutive views of ONE slab sized for the
        fields of ``field_nbytes`` (bytes each) big enough to pool; ``None`` for a small
        answer or with pooling off. A request the slab has no room for (never, when the
        sizes were right) is a plain allocation."""
        if self.max_bytes <= 0:
            return None  # pooling off: plain allocations
        total = 0
        for nb in field_nbytes:
            if nb >= self.FIELD_MIN_BYTES:
                total += -(-nb // self.ALIGN) * self.ALIGN
        if total < self.min_bytes:
            return None
        with self._lock:
            slab = self.take(total)
        pos = 0

        def out(dtype: np.dtype, shape: tuple) -> np.ndarray:
            nonlocal pos
            nb = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if nb < self.FIELD_MIN_BYTES or pos + nb > slab.nbytes:  # small field (or no room left)
                return np.empty(shape, dtype=dtype)
            view = slab[pos : pos + nb].view(dtype).reshape(shape)
            pos += -(-nb // self.ALIGN) * self.ALIGN
            return view

        return out

    def close(self) -> None:
        """Stop pooling and forget every slab: idle ones are freed, ones in use live on
        with what refers to them (the owner's release, see :mod:`pipeline.process_state`)."""
        with self._lock:
            self.max_bytes = 0
            self._classes = {}
            self._stamps = {}
            self.held_bytes = 0


class ConfiguredPool(SlabPool):
    """A process's :class:`SlabPool` capped by ``token-capture.<config_key>`` (bytes), read
    when the pool is made and again at :meth:`reconfigure` (the owner's
    :meth:`~pipeline.process_state.ProcessState.reconfigure`), never per call."""

    # Its buffers live for one call: a free slab up to twice the size serves a request
    # rather than a fresh allocation (which page-faults).
    LARGER_CLASSES = 8

    def __init__(self, config_key: str) -> None:
        super().__init__(config.get_bytes(config_key), larger_classes=self.LARGER_CLASSES)
        self.config_key = config_key

    def reconfigure(self) -> None:
        """Re-read the cap (a smaller cap releases idle slabs at the next take)."""
        self.max_bytes = config.get_bytes(self.config_key)


def process_pool(config_key: str) -> SlabPool:
    """This process's pool capped by ``token-capture.<config_key>`` (bytes, read when the
    pool is made; :meth:`ProcessState.reconfigure <pipeline.process_state.ProcessState.reconfigure>`
    applies a changed cap): one per key, shared by every caller in the process (the store
    client's gathers and merges, the cut's packing), so each keeps writing to memory the
    process already touched."""
    return process_state().get(ConfiguredPool, config_key)
