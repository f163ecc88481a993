"""How a store call to one unit ended: the ONE classification both its users read.

:func:`~pipeline.store.calls.settle` turns an outcome into the call's answer (a unit that
failed as a whole fails its keys ``unit_unavailable``; anything else raises) and
:meth:`~pipeline.store.unit_health.UnitHealth.outcome` into the process's memory of the
unit (remembered as not to be called, counted, or cleared). Both ask :func:`classify`.
"""
from __future__ import annotations

import enum

from tasks.errors import StoreError, StoreUnavailable, UnitSkipped


class Outcome(enum.Enum):
    """What ended a call to a unit."""

    ANSWERED = "answered"  # the unit answered (the answer itself, not an exception)
    SKIPPED = "skipped"  # not sent: the unit was unreachable or closed moments ago (UnitSkipped)
    DEADLINE = "timeout"  # no answer by the call's deadline (TimeoutError): maybe alive, only slow
    UNREACHABLE = "unreachable"  # worker lost, connection refused/closed, connect timeout
    CLOSED = "closed"  # the unit answered that it is closed (StoreUnavailable): for good
    ERROR = "error"  # anything else: a bug or a refused request, the caller's to see

    @property
    def unit_unavailable(self) -> bool:
        """Whether the unit failed as a whole: the call's keys fail ``unit_unavailable``."""
        return self not in (Outcome.ANSWERED, Outcome.ERROR)


def classify(outcome: object) -> Outcome:
    """What ended a call whose outcome (its answer, or the exception it raised) is ``outcome``.

    In this order: :class:`UnitSkipped` (an ``OSError`` too) is SKIPPED; ``TimeoutError``
    (an ``OSError`` too; a connect timeout is a plain ``OSError``) DEADLINE;
    :class:`StoreUnavailable` (a ``RuntimeError`` too) CLOSED; any other
    :class:`StoreError` (an invalid request, a busy store) ERROR; ``OSError`` (comm closed,
    connection refused, connect timeout) and ``RuntimeError`` ("Worker holding Actor was
    lost") UNREACHABLE; any other exception ERROR; anything else ANSWERED."""
    if not isinstance(outcome, BaseException):
        return Outcome.ANSWERED
    if isinstance(outcome, UnitSkipped):
        return Outcome.SKIPPED
    if isinstance(outcome, TimeoutError):
        return Outcome.DEADLINE
    if isinstance(outcome, StoreUnavailable):
        return Outcome.CLOSED
    if isinstance(outcome, StoreError):
        return Outcome.ERROR
    if isinstance(outcome, (OSError, RuntimeError)):
        return Outcome.UNREACHABLE
    return Outcome.ERROR
