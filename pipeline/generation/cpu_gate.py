"""The process-wide CPU gate of checkpoint cuts (config ``cut.cpu-slots``).

Cuts sharing a process (writer threads of one controller, several generation actors on
one worker) share one GIL: packing and hashing them all at once only interleaves them,
so every batch is ready late and the store sits idle meanwhile. The gate admits
``cut.cpu-slots`` cuts to their CPU-bound steps (freezing, packing) at a time; a cut
leaves it while it waits on the store, so puts overlap the next cut's packing.
"""
from __future__ import annotations

import threading

from .. import config

_GATES: dict[int, threading.Semaphore] = {}  # one semaphore per slot count, for the process
_GATES_LOCK = threading.Lock()


def cpu_gate() -> threading.Semaphore:
    """The process-wide semaphore for the current ``cut.cpu-slots`` (read now; at least 1).

    Every cut of the process asking with the same slot count gets the same semaphore.
    """
    slots = max(1, int(config.get("cut.cpu-slots")))
    with _GATES_LOCK:
        gate = _GATES.get(slots)
        if gate is None:
            gate = _GATES[slots] = threading.Semaphore(slots)
        return gate
