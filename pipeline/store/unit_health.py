"""What this process learned about the store's units: unreachable units and the newest table.

Store handles are pickled into every task with the unit table they were made with, so a
table a task's copy refreshed is thrown away with the task. The process's
:class:`UnitHealth` component (see :mod:`pipeline.process_state`) keeps instead:

- units a call could not reach or found closed (by actor key and worker: a replacement
  is a new actor): for ``store.skip-unreachable-s`` seconds calls to them are not sent,
  their keys fail ``unit_unavailable`` at once (reads fail over, deletes apply on the
  live copies); a call that reaches the unit, or the end of that time, lets calls through;
- the newest unit table any handle of the process fetched per unit directory, which
  every handle takes before planning (no round trip), and when a get that read from
  replicas last asked the directory (asked again after ``store.skip-unreachable-s``);
- counters (:meth:`UnitHealth.figures`): calls that could not reach their unit, found it
  closed, skipped, past their deadline; tables taken, fetched; refreshes spared.

Thread safe: one lock around every update. Design notes: docs/reliability.md
(Deadlines on store calls).
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from tasks.errors import SlowRead

from ..process_state import process_state
from .call_outcome import Outcome, classify

if TYPE_CHECKING:  # pragma: no cover
    from .directory import UnitTable


def unit_id(handle: Any, worker: str) -> tuple[str, str]:
    """The identity a mark is kept under: the actor's key and the worker it is on."""
    return (str(getattr(handle, "key", id(handle))), worker)


class UnitHealth:
    """The process's memory of unreachable units and newest tables (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[tuple[str, str], float] = {}  # unit -> time.monotonic() it was found unreachable or closed
        self._tables: dict[str, "UnitTable"] = {}  # unit directory name -> newest table fetched
        self._asked: dict[str, float] = {}  # unit directory name -> time.monotonic() of its last learn-only refresh
        self.counters = {"unreachable": 0, "closed": 0, "skipped": 0, "timeouts": 0, "slow_reads": 0,
                         "tables_taken": 0, "tables_fetched": 0, "refreshes_spared": 0}

    # ---- unreachable units ---------------------------------------------------------

    def skip(self, unit: tuple[str, str], skip_s: float) -> bool:
        """Whether a call to ``unit`` is not to be sent (found unreachable or closed under ``skip_s`` s ago)."""
        if skip_s <= 0:
            return False
        with self._lock:
            since = self._down.get(unit)
            if since is None or time.monotonic() - since >= skip_s:
                return False
            self.counters["skipped"] += 1
            return True

    def outcome(self, unit: tuple[str, str], outcome: object) -> None:
        """Record how a call sent to ``unit`` ended (:func:`~.call_outcome.classify`):
        could not reach it (UNREACHABLE) or found it closed (CLOSED, for good): remembered
        as not to be called; ran out of its deadline: counted, not remembered (a slow unit
        is not a lost one); reached it (an answer, even an error of the unit's): forgotten;
        not sent (SKIPPED): nothing."""
        kind = classify(outcome)
        with self._lock:
            if kind is Outcome.DEADLINE:
                self.counters["timeouts"] += 1
                self.counters["slow_reads"] += isinstance(outcome, SlowRead)  # given up for the other copy
            elif kind in (Outcome.UNREACHABLE, Outcome.CLOSED):
                self.counters[kind.value] += 1
                self._down[unit] = time.monotonic()
            elif kind is not Outcome.SKIPPED:
                self._down.pop(unit, None)

    # ---- newest tables ---------------------------------------------------------------

    def seen_table(self, directory: str, table: "UnitTable | None") -> None:
        """Count a fetch of unit directory ``directory`` (one round trip) and remember
        ``table``, what it gave (None: unreachable), if it is the newest."""
        with self._lock:
            self.counters["tables_fetched"] += 1
            if table is None:
                return
            known = self._tables.get(directory)
            if known is None or table.version > known.version:
                self._tables[directory] = table

    def refresh_due(self, directory: str, window_s: float) -> bool:
        """Whether a refresh asked only to learn of replaced units (a get that read from
        replicas) is to fetch ``directory``: not when one did under ``window_s`` seconds
        ago (``store.skip-unreachable-s``: the time a unit found down is not called
        anyway; 0: always). True stamps the time."""
        with self._lock:
            now = time.monotonic()
            last = self._asked.get(directory)
            if window_s > 0 and last is not None and now - last < window_s:
                self.counters["refreshes_spared"] += 1
                return False
            self._asked[directory] = now
            return True

    def newest_table(self, directory: str, above: int) -> "UnitTable | None":
        """The newest table of ``directory`` this process fetched, if its version is above ``above``."""
        with self._lock:
            table = self._tables.get(directory)
            if table is None or table.version <= above:
                return None
            self.counters["tables_taken"] += 1
            return table

    def figures(self) -> dict[str, int]:
        """A copy of the counters (calls unreachable, closed, skipped, past their deadline;
        tables taken from the process's memory, fetched from a directory; learn-only refreshes
        not sent to the directory)."""
        with self._lock:
            return dict(self.counters)


def unit_health() -> UnitHealth:
    """This process's :class:`UnitHealth`."""
    return process_state().get(UnitHealth)
