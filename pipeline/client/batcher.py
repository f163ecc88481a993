"""The capture client's row queue: staged rows of every rollout, put in ONE call per flush.

Engine threads :meth:`RowBatcher.add` rows; one background thread flushes every queued
row as ONE ``put_many`` once ``capture-client.flush-calls`` rows are queued or
``capture-client.flush-ms`` milliseconds after the oldest queued row, whichever comes
first (or at once on :meth:`flush` / :meth:`close`); rollouts whose routes differ in
``[L, K]`` cannot share a packed field, so such a flush puts once per ``[L, K]``
(:func:`packable_parts`). While a put is in flight new rows queue for the next one. Each row's outcome (stored, refused, or its put raised) is
reported to the row's owner; a put that raises fails only its own batch. A batcher never
closed is closed at interpreter exit (its rows are put, with a warning naming the fix):
the process's open batchers are an :class:`OpenBatchers` component of its
:class:`~pipeline.process_state.ProcessState`.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

from tasks.errors import InvalidInput
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from tasks.schema import StagedRow

from .. import config
from ..process_state import process_state
from ..store.protocol import StoreLike
from .refusals import Refusal, put_error, refusals_of

logger = logging.getLogger(__name__)


class OpenBatchers:
    """The process's batchers whose flusher runs and that were not closed: closed at
    interpreter exit (a :class:`~pipeline.process_state.ProcessState` component).

    The flusher is a daemon thread (it must not keep a process alive), so without this a
    program that forgot :meth:`RowBatcher.close` would lose its queued rows. The exit
    handler is registered when the first flusher starts, after the store's Dask client
    exists, so it runs before Dask's own exit handlers (last registered, first run): the
    store is reachable. It stays registered when the owner is released (a batcher still
    open then is closed at exit all the same). Thread-safe (its lock).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batchers: weakref.WeakSet[RowBatcher] = weakref.WeakSet()
        self._at_exit = False  # the exit handler is registered

    def add(self, batcher: RowBatcher) -> None:
        """Record a batcher whose flusher just started (registers the exit handler once)."""
        with self._lock:
            self._batchers.add(batcher)
            if not self._at_exit:
                atexit.register(self.close_all)
                self._at_exit = True

    def discard(self, batcher: RowBatcher) -> None:
        """Forget a batcher being closed."""
        with self._lock:
            self._batchers.discard(batcher)

    def close_all(self) -> None:
        """Put every row a batcher that was never closed still holds (interpreter exit)."""
        with self._lock:
            still_open = list(self._batchers)
        for batcher in still_open:
            batcher.close_at_exit()


def close_open_batchers() -> None:
    """Interpreter exit: put every row a batcher of this process that was never closed
    still holds (:meth:`OpenBatchers.close_all`, which runs at exit by itself)."""
    process_state().get(OpenBatchers).close_all()


class RowOwner(Protocol):
    """Who is told each row's outcome (a rollout's capture). Called with the batcher's
    lock held: it must only record, never block or call back into the batcher."""

    def _row_settled(self, key: str, refusal: Refusal | None) -> None: ...


@dataclass
class _Queued:
    row: StagedRow
    owner: RowOwner
    seq: int
    nbytes: int


def row_bytes(row: StagedRow) -> int:
    """Payload bytes of one staged row's token fields (what dominates a put)."""
    n = row.token_ids.nbytes + row.token_mask.nbytes + row.logprobs.nbytes
    return n + (0 if row.routed_experts is None else row.routed_experts.nbytes)


def packable_parts(rows: Sequence[StagedRow]) -> list[list[StagedRow]]:
    """``rows`` split so each part packs into one batch: a packed routes field holds one
    ``[L, K]``, so routed rows go by theirs; unrouted rows join the first part. One part
    (all of ``rows``) when every routed row shares its ``[L, K]``."""
    by_shape: dict[tuple[int, ...] | None, list[StagedRow]] = {}
    for row in rows:
        shape = None if row.routed_experts is None else tuple(row.routed_experts.shape[1:])
        by_shape.setdefault(shape, []).append(row)
    unrouted = by_shape.pop(None, [])
    parts = list(by_shape.values()) or [[]]
    parts[0].extend(unrouted)
    return parts


class RowBatcher:
    """Thread-safe queue of staged rows flushed by one background thread.

    ``flush_calls`` (rows) / ``flush_ms`` (ms) override ``capture-client.flush-calls`` /
    ``flush-ms``. Those, ``max-queued-bytes`` and ``exit-timeout-s`` are read once, when
    the batcher is built.
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        partition: str = STAGING_PARTITION,
        flush_calls: int | None = None,
        flush_ms: float | None = None,
    ) -> None:
        self.store = store
        self.partition = partition
        calls = config.get("capture-client.flush-calls") if flush_calls is None else flush_calls
        ms = config.get("capture-client.flush-ms") if flush_ms is None else flush_ms
        self._flush_calls = max(1, int(calls))  # rows
        self._flush_s = max(0.0, float(ms)) / 1000.0  # seconds
        self._max_queued_bytes = config.get_bytes("capture-client.max-queued-bytes")
        self._exit_timeout_s = float(config.get("capture-client.exit-timeout-s"))
        self._cond = threading.Condition()
        self._queue: list[_Queued] = []
        self._queued_bytes = 0
        self._oldest: float | None = None  # monotonic time the oldest queued row arrived
        self._next_seq = 0  # seq of the next row added
        self._settled_seq = 0  # every row with seq < this has its outcome
        self._flush_to = 0  # flush now every row with seq < this
        self._closing = False
        self._thread: threading.Thread | None = None
        self._open: OpenBatchers | None = None  # the process's record of open batchers, once the flusher runs
        self.counters = {"rows": 0, "puts": 0, "bytes": 0, "refused": 0, "failed_puts": 0}

    # ---- engine side ------------------------------------------------------------------

    def add(self, row: StagedRow, owner: RowOwner) -> None:
        """Queue ``row``; blocks while ``capture-client.max-queued-bytes`` are queued."""
        nbytes = row_bytes(row)
        limit = self._max_queued_bytes
        with self._cond:
            if self._closing:
                raise InvalidInput("this capture client is closed; no row can be staged")
            # Back-pressure: wait for the flusher to take the queue (a row bigger than the
            # limit still goes in alone).
            while self._queue and self._queued_bytes + nbytes > limit and not self._closing:
                self._cond.wait()
            if self._closing:
                raise InvalidInput("this capture client was closed while the row waited for room")
            if not self._queue:
                self._oldest = time.monotonic()
            self._queue.append(_Queued(row, owner, self._next_seq, nbytes))
            self._next_seq += 1
            self._queued_bytes += nbytes
            self._ensure_thread()
            if len(self._queue) == 1 or len(self._queue) >= self._limit_calls():
                self._cond.notify_all()

    @property
    def lock(self) -> threading.Condition:
        """The lock guarding every owner's outcome counters (see :class:`RowOwner`)."""
        return self._cond

    def flush(self, timeout_s: float | None = None) -> bool:
        """Put every row queued so far now and wait for their outcomes; False on timeout."""
        with self._cond:
            target = self._next_seq
            if self._settled_seq >= target:
                return True
            self._flush_to = max(self._flush_to, target)
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._settled_seq >= target, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush every queued row, then stop the thread (no row is dropped). Idempotent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, open_batchers = self._thread, self._open
        if open_batchers is not None:
            open_batchers.discard(self)
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def close_at_exit(self) -> bool:
        """:meth:`close` for a batcher its owner never closed (see :func:`close_open_batchers`),
        waiting at most ``capture-client.exit-timeout-s`` seconds; says what it did."""
        with self._cond:
            unsettled = self._next_seq - self._settled_seq
        if unsettled:
            logger.warning(
                "a capture client was never closed: putting its %d unsettled row(s) at interpreter exit; "
                "call close() or use it as a context manager", unsettled,
            )
        done = self.close(self._exit_timeout_s)
        if not done:
            with self._cond:
                lost = self._next_seq - self._settled_seq
            logger.error("capture client: %d row(s) were not stored before interpreter exit (put still running)", lost)
        return done

    def stats(self) -> dict[str, int]:
        """Counters (rows and bytes put, puts, refused rows, failed puts) and queue depth."""
        with self._cond:
            return {**self.counters, "queued": len(self._queue), "queued_bytes": self._queued_bytes}

    # ---- the flusher thread -----------------------------------------------------------

    def _limit_calls(self) -> int:
        return self._flush_calls

    def _limit_s(self) -> float:
        return self._flush_s

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="token-capture-flusher", daemon=True)
            self._thread.start()
            self._open = process_state().get(OpenBatchers)
            self._open.add(self)

    def _take(self) -> list[_Queued] | None:
        """Wait until a flush is due; take the whole queue (``None``: closed and empty)."""
        with self._cond:
            while True:
                if not self._queue:
                    if self._closing:
                        return None
                    self._cond.wait()
                    continue
                due = self._oldest + self._limit_s()
                now = time.monotonic()
                if (
                    self._closing
                    or len(self._queue) >= self._limit_calls()
                    or self._flush_to > self._queue[0].seq
                    or now >= due
                ):
                    taken, self._queue = self._queue, []
                    self._queued_bytes, self._oldest = 0, None
                    self._cond.notify_all()  # room for engines blocked on back-pressure
                    return taken
                self._cond.wait(due - now)

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            outcome: dict[str, Refusal] | Refusal = put_error(RuntimeError("flusher stopped"))
            raised = 0
            try:
                outcome, raised = self._put_parts([q.row for q in taken])
            except BaseException as e:  # noqa: BLE001 - fails this flush only
                logger.warning("capture client: a flush of %d rows failed: %s: %s", len(taken), type(e).__name__, e)
                outcome, raised = put_error(e), 1
            finally:
                self._settle(taken, outcome, raised)

    def _put_parts(self, rows: Sequence[StagedRow]) -> tuple[dict[str, Refusal], int]:
        """One put per :func:`packable_parts` part of ``rows`` (one part unless routes
        differ in ``[L, K]``); the refusals per key, and how many puts raised (a put that
        raises fails its own part only)."""
        failed: dict[str, Refusal] = {}
        raised = 0
        for part in packable_parts(rows):
            try:
                failed.update(self._put(part))
            except Exception as e:  # noqa: BLE001 - a put that raises fails its part only
                logger.warning("capture client: a put of %d rows failed: %s: %s", len(part), type(e).__name__, e)
                failed.update(dict.fromkeys((r.staging_key for r in part), put_error(e)))
                raised += 1
        return failed, raised

    def _put(self, rows: Sequence[StagedRow]) -> dict[str, Refusal]:
        """ONE put of ``rows``; the refusals per key (a key without an answer is refused)."""
        batch = pack_rows(rows)
        # The batch is ours alone and never changes: units may keep views of it.
        result = self.store.put_many(batch, partition=self.partition, adopt=True)
        failed = refusals_of(batch.keys, result.ok, result.failed)
        with self._cond:
            self.counters["puts"] += 1
            self.counters["bytes"] += batch.nbytes
        return failed

    def _settle(self, taken: Sequence[_Queued], outcome: dict[str, Refusal] | Refusal, raised: int) -> None:
        with self._cond:
            whole = outcome if isinstance(outcome, tuple) else None
            refused = 0
            for q in taken:
                refusal = whole if whole is not None else outcome.get(q.row.staging_key)
                refused += refusal is not None
                q.owner._row_settled(q.row.staging_key, refusal)
            self.counters["rows"] += len(taken) - refused
            self.counters["refused"] += refused
            self.counters["failed_puts"] += raised
            self._settled_seq = taken[-1].seq + 1
            self._cond.notify_all()
