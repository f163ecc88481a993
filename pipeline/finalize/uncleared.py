"""Staged rows a step's clear could not delete, asked again with later clears.

A step's clear (``tc-clear``: :func:`~pipeline.finalize.controller.clear_rows`) meets a unit
that does not answer in time, or one being moved, and those keys' rows stay staged: a leak
that grows with every such clear and, in a bounded store, ends in refused puts.
:class:`UnclearedRows` reads each clear's answer once its future is done, keeps the keys it
could not delete and hands them to the next clear, until they failed ``max_attempts``
clears; a key a clear answers ``missing_key`` for is gone already. Thread-safe; counts in
keys.
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Collection, Mapping

from ..store.protocol import MISSING_KEY

if TYPE_CHECKING:
    from distributed import Future

logger = logging.getLogger(__name__)


class UnclearedRows:
    """Keys whose delete failed, each with the clears it has been in (count), and the
    clears not answered yet. Answers are read when keys are taken (:meth:`take`) or
    counted, never on a callback thread: a clear's outcome is its future's result."""

    def __init__(self, max_attempts: int):
        self.max_attempts = max(1, int(max_attempts))  # clears a key is in before it is given up
        self._attempts: dict[str, int] = {}  # key -> clears it failed in (insertion order: oldest first)
        self._watched: list[tuple[list[str], Future]] = []  # clears submitted, answer not read yet
        self._taken: set[str] = set()  # kept keys in a clear not answered yet (not taken twice)
        self._given_up = 0  # keys dropped after max_attempts failed clears
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Keys a finished clear could not delete, waiting for the next one (count)."""
        self._read_answers()
        with self._lock:
            return len(self._attempts)

    @property
    def given_up(self) -> int:
        """Keys dropped after ``max_attempts`` failed clears: they stay staged (count)."""
        self._read_answers()
        with self._lock:
            return self._given_up

    def watch(self, keys: list[str], future: Future) -> None:
        """A clear of ``keys`` was submitted: its answer is read once it is done."""
        with self._lock:
            self._watched.append((keys, future))

    def owed(self) -> set[str]:
        """Every key not known deleted yet: in a clear not answered, or kept for the next."""
        self._read_answers()
        with self._lock:
            return {k for keys, _ in self._watched for k in keys} | set(self._attempts)

    def unanswered(self) -> list[Future]:
        """The clears submitted whose answer has not been read (to wait for them)."""
        with self._lock:
            return [f for _, f in self._watched]

    def take(self, skip: Collection[str] = ()) -> list[str]:
        """The kept keys to put in the clear being submitted now, oldest first (its answer
        forgets those it deleted); not those in a clear not answered yet, nor ``skip``:
        another step in flight reads them, so a later clear takes them."""
        self._read_answers()
        with self._lock:
            out = [k for k in self._attempts if k not in skip and k not in self._taken]
            self._taken.update(out)
            return out

    def _read_answers(self) -> None:
        done, waiting = [], []
        with self._lock:
            for keys, f in self._watched:  # one look at each future: one finishing now is in one list
                (done if f.done() else waiting).append((keys, f))
            self._watched = waiting
        for keys, future in done:
            self._answered(keys, _failed_keys(set(keys), future))

    def _answered(self, keys: list[str], failed: dict[str, str]) -> None:
        """Keep the keys a clear did not delete for the next one; forget the others."""
        with self._lock:
            self._taken.difference_update(keys)
            for k in keys:
                if k not in failed:
                    self._attempts.pop(k, None)
                    continue
                n = self._attempts.get(k, 0) + 1
                if n >= self.max_attempts:
                    self._attempts.pop(k, None)
                    self._given_up += 1
                else:
                    self._attempts[k] = n
            dropped = [k for k in failed if k not in self._attempts]
        if failed:
            logger.warning("clear of %d staged row(s) failed for %d (kept for the next clear): e.g. %s",
                           len(keys), len(failed), _example(failed))
        if dropped:
            logger.error("gave up deleting %d staged row(s) after %d failed clears each (they stay staged): e.g. %s",
                         len(dropped), self.max_attempts, dropped[0])


def _failed_keys(keys: set[str], future: Future) -> dict[str, str]:
    """Key -> why its row may still be staged: every key of a clear task that raised or
    was cancelled; else each key the store's answer failed, but ``missing_key`` (gone)."""
    if future.status != "finished":
        return dict.fromkeys(keys, f"the clear task {future.status}")
    counts = future.result()
    failed: Mapping[str, tuple[str, str]] = counts.get("failed", {})
    return {k: f"{reason}: {detail}" for k, (reason, detail) in failed.items() if reason != MISSING_KEY and k in keys}


def _example(failed: Mapping[str, str]) -> str:
    key, why = next(iter(failed.items()))
    return f"{key} ({why})"
