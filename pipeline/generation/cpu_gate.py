"""The process-wide CPU gate of checkpoint cuts (config ``cut.cpu-slots``).

Cuts sharing a process (writer threads of one controller, several generation actors on
one worker) share one GIL: packing and hashing them all at once only interleaves them,
so every batch is ready late and the store sits idle meanwhile. The gate admits
``cut.cpu-slots`` cuts (default 1) to their CPU-bound steps (freezing, packing) at a
time; a cut leaves it while it waits on the store, so puts overlap the next cut's packing.

The semaphores are a :class:`CpuGates` component of the process's
:class:`~pipeline.process_state.ProcessState`.
"""
from __future__ import annotations

import threading

from .. import config
from ..process_state import process_state


class CpuGates:
    """One semaphore per slot count for the process, and the current ``cut.cpu-slots``
    (read when made and at :meth:`reconfigure`). Thread-safe (its lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gates: dict[int, threading.Semaphore] = {}
        self.slots = 1
        self.reconfigure()

    def reconfigure(self) -> None:
        """Re-read ``cut.cpu-slots`` (at least 1): cuts starting from now on share its gate."""
        self.slots = max(1, int(config.get("cut.cpu-slots")))

    def gate(self) -> threading.Semaphore:
        """The semaphore of the current slot count (the same one for every cut asking with it)."""
        slots = self.slots
        with self._lock:
            gate = self._gates.get(slots)
            if gate is None:
                gate = self._gates[slots] = threading.Semaphore(slots)
            return gate


def cpu_gate() -> threading.Semaphore:
    """The process-wide semaphore for ``cut.cpu-slots`` (at least 1; read when the process's
    owner makes its gates, re-read at ``process_state().reconfigure()``).

    Every cut of the process asking with the same slot count gets the same semaphore.
    """
    return process_state().get(CpuGates).gate()
