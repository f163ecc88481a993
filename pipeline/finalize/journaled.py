"""The Finalizer's journal side: recording steps, resuming a dead controller's.

:class:`JournaledSteps` is a mixin of :class:`~pipeline.finalize.controller.Finalizer`
(it uses its ``journal``, ``uncleared``, ``in_flight``, ``submit_step``, ``submit_clear``
and lock): a step is recorded before it is submitted, its record replaced by the keys its
clear owes once delivered and removed once no clear owes them (:mod:`.journal`); a
replacement controller's :meth:`JournaledSteps.resume` submits the recorded steps again
and clears the owed keys.
"""
from __future__ import annotations

import itertools
import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from tasks.errors import FinalizeError

from .journal import StepJournal
from .uncleared import UnclearedRows

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)


class SubmittedStep(Protocol):
    """What the journal side reads of a submitted step (the controller's ``StepHandle``)."""

    step_id: str


class JournaledSteps:
    """The journal calls of a Finalizer (module docstring)."""

    journal: StepJournal | None
    uncleared: UnclearedRows
    _lock: threading.Lock
    _retries: itertools.count
    _journal_tag: str  # in this finalizer's own step ids
    _owed_steps: dict[str, set[str]]  # delivered step -> keys its journal record owes

    @property
    def in_flight(self) -> list[SubmittedStep]: ...  # pragma: no cover - the Finalizer's

    def submit_step(self, groups: Any, *, step_id: str | None = None, trainer_version: int | None = None) -> SubmittedStep: ...  # pragma: no cover

    def submit_clear(self, keys: Sequence[str], token: str, span: Any = None) -> "Future | None": ...  # pragma: no cover

    def resume(self) -> list[SubmittedStep]:
        """Take over a dead controller's journal (the one this Finalizer was built with):
        submit again every step it recorded and did not deliver (oldest first, same step
        ids, receipts and trainer versions: the same tensors), then clear the rows its
        delivered steps still owed. Returns the resubmitted steps' handles."""
        if self.journal is None:
            raise FinalizeError("resume() needs a journal: Finalizer(..., journal=<directory or URL>) or "
                                "token-capture.finalize.journal, the location the previous controller wrote")
        state = self.journal.read()
        handles = []
        for s in state.steps:
            try:
                handles.append(self.submit_step(s.groups, step_id=s.step_id, trainer_version=s.trainer_version))
            except FinalizeError as e:  # one bad record never stops the others
                logger.error("resume: step %r from the journal is skipped: %s", s.step_id, e)
        owed = [k for keys in state.owed.values() for k in keys]
        if owed:
            self.submit_clear(owed, f"resume-{next(self._retries)}")
        for sid, keys in state.owed.items():
            self._journal_owes(sid, keys)
        logger.info("resumed from %s: %d step(s) submitted again, %d row(s) cleared, %d record(s) unreadable",
                    self.journal.location.url, len(handles), len(owed), len(state.unreadable))
        return handles

    def _journal_delivered(self, step_id: str, keys: Sequence[str]) -> None:
        """A delivered step's journal record now owes ``keys`` (no more receipts); written
        before its clear is submitted, so a resume clears them and never resubmits it."""
        if self.journal is not None:
            self.journal.delivered(step_id, keys)

    def _journal_owes(self, step_id: str, keys: Sequence[str]) -> None:
        """The clear of a delivered step's ``keys`` is submitted (watched): its record goes
        once none of them is owed any more (:meth:`_settle_journal`)."""
        if self.journal is not None and keys:
            with self._lock:
                self._owed_steps[step_id] = set(keys)

    def _settle_journal(self) -> None:
        """Remove the records of delivered steps none of whose keys a clear still owes."""
        if self.journal is None or not self._owed_steps:
            return
        owed = self.uncleared.owed()
        with self._lock:
            done = [sid for sid, keys in self._owed_steps.items() if owed.isdisjoint(keys)]
            for sid in done:
                del self._owed_steps[sid]
        self.journal.cleared(done)

    def _record(self, step_id: str | None, seq: int, named: dict[str, Any], trainer_version: int | None) -> str:
        """The step's id (``step-<seq>``; with a journal ``step-<this finalizer>-<seq>``,
        so a replacement's own steps never take a dead controller's ids), recorded in the
        journal; with a journal an id already in flight here is refused."""
        if self.journal is None:
            return f"step-{seq}" if step_id is None else str(step_id)
        step_id = f"step-{self._journal_tag}-{seq}" if step_id is None else str(step_id)
        if any(h.step_id == step_id for h in self.in_flight):
            raise FinalizeError(f"step id {step_id!r} is already in flight; with a journal every step in flight needs its own id")
        self.journal.submitted(step_id, named, trainer_version)
        return step_id
