"""The checkpoint-cut transaction: freeze, batch, put, validate, seal.

:func:`run_cut` writes the new tokens of many :class:`~pipeline.generation.call_buffer.CallBuffer`
calls as prefix rows of the ``cut`` partition, a batch of rows per ``put_many``, and
answers one :class:`~tasks.cut.receipt.CallAck` per call in a :class:`~tasks.cut.receipt.CutReceipt`.
Up to ``cut.puts-in-flight`` puts are on the wire while the next batch freezes and packs
(:class:`~pipeline.generation.put_window.PutWindow`).
A call's prefix is sealed only once its row is acknowledged; on failure, deadline or
interruption no unsealed key stays advertised. Batches pack into the process's pooled
slabs (:func:`pack_buffers`, ``cut.pack-buffer-bytes``): memory already mapped, no page
faults per batch. Plain Python: runs on a worker (inside the generation actor) or in a
controller. Deadlines are clock seconds; stats ms and bytes.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from tasks.cut.batching import BatchLimits, BatchPlanner, pack_chunks
from tasks.hashing import DIGEST_VERSION
from tasks.cut.receipt import (
    CONTROL_DEADLINE,
    CUT_ERROR,
    DURABLE_PREFIX,
    UNKNOWN_CALL,
    CallAck,
    CallId,
    CutReceipt,
)
from tasks.keys import CUT_PARTITION, check_id
from tasks.packed import PackedBatch
from tasks.placement_hash import default_unit_ids, primaries

from .. import config
from ..store.slab_pool import SlabPool, process_pool
from ..store.deadline import takes_timeout
from .call_buffer import CallBuffer, FrozenChunk, cut_key_root
from .cpu_gate import cpu_gate
from .put_window import PutWindow

if TYPE_CHECKING:
    from ..store.protocol import StoreResult

logger = logging.getLogger(__name__)
Clock = Callable[[], float]  # seconds
# A put's answer: (result or None if it raised, error, batch bytes, time.perf_counter() when answered).
_Answer = tuple["StoreResult | None", str, int, float]
# A packed batch: (batch or None, error, whether the store may adopt its buffers).
_Packed = tuple["PackedBatch | None", str, bool]


class CutStore(Protocol):
    """What a cut needs of a store: :class:`~pipeline.store.client.StagingStore` or a wrapper
    such as :class:`~pipeline.testing.faults.FaultyStore`. A ``units`` attribute, when
    present, orders each batch by storage unit."""

    def put_many(self, batch: PackedBatch, partition: str = ..., adopt: bool = ...) -> StoreResult: ...

    def delete(self, keys: Sequence[str], partition: str = ...) -> object: ...


@dataclass(frozen=True)
class CutSettings:
    """A generation worker's cut knobs, read once when it is built (``token-capture.cut``,
    and ``capture.digest``: the digest version its calls' chunks are hashed with)."""

    limits: BatchLimits  # rows, tokens and bytes per cut-time put
    deadline_s: float  # a cut without a deadline ends this long after it starts, s
    receipt_cache_size: int  # cut receipts kept for retried cuts (count)
    digest_version: int = DIGEST_VERSION  # tasks.digests: 1 SHA-256, 2 BLAKE3
    puts_in_flight: int = 2  # a cut's puts on the wire while its next batch freezes and packs (count; 1: serial)

    @classmethod
    def from_config(cls) -> CutSettings:
        return cls(limits_from_config(), float(config.get("cut.deadline-s")), int(config.get("cut.receipt-cache-size")),
                   config.digest_version(), puts_in_flight_from_config())


def limits_from_config() -> BatchLimits:
    """The cut's per-put limits (rows, tokens, bytes), read now from ``token-capture.cut``."""
    return BatchLimits(
        max_rows=int(config.get("cut.generation-prefix-batch-size")),
        max_tokens=int(config.get("cut.generation-prefix-batch-max-tokens")),
        max_bytes=int(config.get_bytes("cut.generation-prefix-batch-max-bytes")),
    )


def puts_in_flight_from_config() -> int:
    """``cut.puts-in-flight``, read now; a value below 1 is a :class:`ValueError` naming it."""
    n = int(config.get("cut.puts-in-flight"))
    if n < 1:
        raise ValueError(f"cut.puts-in-flight must be at least 1 (1: one put at a time), got {n}")
    return n


def pack_buffers() -> SlabPool:
    """This process's pool of slabs cut batches pack into (``cut.pack-buffer-bytes``).

    A batch's token buffers are views of one slab, handed out again only once nothing
    refers to it (its put done, the batch dropped): cut after cut, packing writes to
    memory already mapped instead of page-faulting a fresh allocation per batch.
    """
    return process_pool("cut.pack-buffer-bytes")


@dataclass
class CutStats:
    """Round trips and timing of one cut (ms, bytes, counts)."""

    put_calls: int = 0
    delete_calls: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    row_wait_ms: list[float] = field(default_factory=list)  # per sealed-or-acked row: freeze -> ack
    deadline_passed: bool = False


class _Cut:
    """One run of the transaction: its calls' frozen chunks, acks, written keys and stats."""

    def __init__(
        self, store: CutStore, checkpoint_id: str, deadline: float, clock: Clock, limits: BatchLimits, partition: str,
        puts_in_flight: int = 1,
    ):
        self.gate = cpu_gate()
        self.in_gate = False
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.key_root = cut_key_root(checkpoint_id)  # every key of the cut starts with it
        self.deadline = deadline
        self.clock = clock
        self.limits = limits
        self.partition = partition
        self.stats = CutStats()
        self.acks: dict[CallId, CallAck] = {}
        self.frozen: list[FrozenChunk] = []
        self.written: set[str] = set()  # keys the store accepted and nobody owns yet
        self.n_units = len(getattr(store, "units", None) or ())  # 0: a store without visible units
        self.unit_ids = default_unit_ids(self.n_units) if self.n_units > 1 else ()  # what rows are ordered by
        self.buffers = pack_buffers()  # batches pack into memory already mapped (no page faults)
        # Store calls are bounded by the time left to the deadline (a hung unit fails its
        # keys, so the cut and the worker's cut lock are released by the deadline).
        self.put_bounded = takes_timeout(store.put_many)
        self.delete_bounded = takes_timeout(store.delete)
        # Batch k+1 freezes and packs while batch k's put is on the wire (waiting leaves the CPU slot).
        self.window: PutWindow[Sequence[FrozenChunk], _Answer] = PutWindow(puts_in_flight, wait=self.leave_gate)

    def enter_gate(self) -> None:
        self.gate.acquire()
        self.in_gate = True

    def leave_gate(self) -> None:
        if self.in_gate:
            self.in_gate = False
            self.gate.release()

    def take_gate(self) -> None:
        """Hold a CPU slot for the next freeze or pack (no-op if already held)."""
        if not self.in_gate:
            self.enter_gate()

    @contextlib.contextmanager
    def _io(self) -> Iterator[None]:
        """Leave the CPU gate while waiting on the store (other cuts pack meanwhile). The
        cut takes a slot again only for its next freeze or pack (:meth:`take_gate`), not
        to seal what the store answered: a cut whose put is done is not queued behind
        every cut still packing (its rows' wait and its batch's slab end sooner)."""
        self.leave_gate()
        yield

    def time_left(self) -> float:
        """Seconds to the deadline (0 once passed); bounds each store call."""
        return max(self.deadline - self.clock(), 0.0)

    def past_deadline(self) -> bool:
        if self.clock() >= self.deadline:
            self.stats.deadline_passed = True
            return True
        return False

    # -- store round trips (each one call) --

    def _pack(self, chunks: Sequence[FrozenChunk]) -> _Packed:
        """``chunks`` packed for one put, in a CPU slot: (batch or None if packing raised,
        error, whether the store may adopt its buffers)."""
        # Rows ordered by storage unit: the store then sends each unit a contiguous slice
        # of the batch buffers (no re-split copy). One vectorized placement per batch (per
        # call it was a quarter of a 1,024-token cut's CPU).
        if self.n_units > 1:
            units = primaries([c.buffer.rollout_id for c in chunks], self.unit_ids)
            chunks = [chunks[i] for i in np.argsort(units, kind="stable").tolist()]
        pooled: list[bool] = []

        def allocate(sizes: Sequence[int]):
            out = self.buffers.allocator(sizes)
            pooled.append(out is not None)
            return out

        self.take_gate()
        try:
            batch = pack_chunks(chunks, allocate)  # a frozen chunk is packed as it is
        except Exception as e:  # a row that cannot be packed fails its batch, then itself alone
            logger.error("cut %s: packing %d rows raised (a bug: rows are valid by construction)",
                         self.checkpoint_id, len(chunks), exc_info=True)
            return None, f"packing raised {type(e).__name__}: {e}", False
        # Fresh buffers nobody else holds: a unit may keep views into them instead of
        # copying each row (adopt). A pooled slab is the next batches' memory once this
        # put is done: an in-process unit copies it (one over the wire keeps what it received).
        return batch, "", not any(pooled)

    def _send(self, batch: PackedBatch, adopt: bool) -> _Answer:
        """One ``put_many`` of ``batch``, bounded by the deadline; never raises. Runs on the
        cut's thread or a put helper's (:class:`PutWindow`): it touches no cut state."""
        try:
            bound = {"timeout": self.time_left()} if self.put_bounded else {}
            result = self.store.put_many(batch, partition=self.partition, adopt=adopt, **bound)
        except Exception as e:  # the whole put failed: no per-key answer
            return None, f"put_many raised {type(e).__name__}: {e}", batch.nbytes, time.perf_counter()
        return result, "", batch.nbytes, time.perf_counter()

    def _put(self, chunks: Sequence[FrozenChunk]) -> _Answer:
        """One ``put_many`` of ``chunks`` on this thread, answered before it returns."""
        batch, error, adopt = self._pack(chunks)
        if batch is None:
            return None, error, 0, time.perf_counter()
        return self._send_here(batch, adopt)

    def _send_here(self, batch: PackedBatch, adopt: bool) -> _Answer:
        """:meth:`_send` on this thread, out of the CPU slot while the store answers."""
        self.stats.put_calls += 1
        with self._io():
            return self._send(batch, adopt)

    def _delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        self.stats.delete_calls += 1
        try:
            with self._io():
                # Past the deadline a delete is still sent (healthy units apply it) but
                # not waited for beyond a moment: the cut returns by its deadline.
                bound = {"timeout": self.time_left()} if self.delete_bounded else {}
                self.store.delete(keys, partition=self.partition, **bound)
        except Exception:
            pass  # best effort: the keys stay unadvertised either way
        self.written.difference_update(keys)

    # -- steps --

    def put_batch(self, chunks: list[FrozenChunk], final: bool = False) -> bool:
        """Send one planned batch (up to ``puts_in_flight`` stay on the wire while the next
        batches freeze and pack; the ``final`` one is put from this thread) and handle the
        answers due; False if the deadline stopped it before its put, or stopped a failed
        batch's row-by-row retry."""
        if self.past_deadline():
            return False
        batch, error, adopt = self._pack(chunks)
        if batch is None:
            return self._answered(chunks, (None, error, 0, time.perf_counter()))
        if final:  # no work left for the put to overlap: the older answers, then this put here
            done = self.answer_outstanding()
            return self._answered(chunks, self._send_here(batch, adopt)) and done
        self.stats.put_calls += 1
        answered = self.window.send(functools.partial(self._send, batch, adopt), chunks)
        return all([self._answered(kept, answer) for kept, answer in answered])

    def answer_outstanding(self) -> bool:
        """Wait for and handle every put still on the wire; False if the deadline stopped a
        failed batch's row-by-row retry."""
        return all([self._answered(kept, answer) for kept, answer in self.window.drain()])

    def _answered(self, chunks: Sequence[FrozenChunk], answer: _Answer) -> bool:
        """Seal what a put acknowledged, or clear its keys and retry its rows one per put;
        False if the deadline stopped that retry."""
        result, error, nbytes, acked_at = answer
        keys = [c.key for c in chunks]
        if result is not None:
            self.written.update(set(keys).intersection(result.ok))
        if result is not None and not result.failed:
            self._ack_and_seal(chunks, result, nbytes, acked_at)
            return True
        # Failed batch: clear all its keys (some may be written), then one row per put.
        detail = error or "; ".join(f"{k}: {r} ({d})" for k, (r, d) in list(result.failed.items())[:3])
        self._delete(keys)
        if len(chunks) == 1:
            self._fail(chunks[0], CUT_ERROR, f"put failed: {detail}")
            return True
        for c in chunks:
            if self.past_deadline():
                return False  # this chunk and the rest stay pending: rolled back at the end
            result, error, nbytes, acked_at = self._put([c])
            if result is not None:
                self.written.update(k for k in result.ok if k == c.key)
            if result is None or result.failed:
                why = error or "; ".join(f"{r} ({d})" for r, d in result.failed.values())
                self._delete([c.key])
                self._fail(c, CUT_ERROR, f"row put failed after batch failure: {why}")
            else:
                self._ack_and_seal([c], result, nbytes, acked_at)
        return True

    def _ack_and_seal(self, chunks: Sequence[FrozenChunk], result: StoreResult, nbytes: int, acked_at: float) -> None:
        ok = set(result.ok)
        failed = result.failed or {}
        # 1. Validate every ack of the batch before sealing any call.
        if not failed and ok.issuperset([c.key for c in chunks]):
            good, clear = chunks, []  # the usual case: every row acknowledged
        else:
            good, clear = [], []
            for c in chunks:
                if c.key in failed or c.key not in ok:
                    clear.append(c.key)
                    self._fail(c, CUT_ERROR, "ack invalid: " + (f"{failed[c.key]}" if c.key in failed else "key not acknowledged"))
                else:
                    good.append(c)
        self.stats.rows_written += len(good)
        self.stats.bytes_written += nbytes
        # 2. Seal; a call that failed or completed meanwhile (or a failed seal) clears its row.
        waits, acks, sealed = self.stats.row_wait_ms, self.acks, []
        for c in good:
            waits.append((acked_at - c.frozen_at) * 1e3)
            buf = c.buffer
            try:
                ack = buf.seal(c)
            except Exception as e:
                buf.rollback(c)
                ack = CallAck.failure(buf.call, CUT_ERROR, f"seal failed: {type(e).__name__}: {e}")
            acks[buf.call] = ack
            (sealed if ack.status == DURABLE_PREFIX else clear).append(c.key)
        self.written.difference_update(sealed)
        self._delete(clear)

    def _fail(self, c: FrozenChunk, reason: str, detail: str) -> None:
        c.buffer.rollback(c)
        self.acks[c.buffer.call] = CallAck.failure(c.buffer.call, reason, detail)

    def run(self, calls: Sequence[tuple[CallId, CallBuffer | None]]) -> None:
        planner = BatchPlanner(self.limits)
        stopped = False
        reached = 0
        # Per call: a deadline check, a freeze and a planner step (names bound once: the
        # loop runs once per in-flight call of the worker).
        key_root, clock, deadline = self.key_root, self.clock, self.deadline
        frozen, acks, add = self.frozen, self.acks, planner.add
        for call_id, buf in calls:
            if buf is None:
                acks[call_id] = CallAck.failure(call_id, UNKNOWN_CALL, "no such call on this worker")
                reached += 1
                continue
            if clock() >= deadline:  # past_deadline(), inlined
                self.stats.deadline_passed = stopped = True
                break
            reached += 1
            if not self.in_gate:  # take_gate(), inlined: a put in between left the gate
                self.enter_gate()
            got = buf.freeze_under(key_root)
            if isinstance(got, CallAck):
                acks[call_id] = got
                continue
            idx = len(frozen)
            frozen.append(got)
            for b in add(idx, got.delta_len, got.nbytes, got.signature):
                # The last call's batch with nothing left to freeze or flush: no work for
                # its put to overlap, so it is put from this thread.
                final = reached == len(calls) and not planner.pending_rows
                if not self.put_batch([frozen[i] for i in b.rows], final):
                    stopped = True
                    break
            if stopped:
                break
        if not stopped:
            flushed = planner.flush()
            for n, b in enumerate(flushed, 1):
                if not self.put_batch([self.frozen[i] for i in b.rows], n == len(flushed)):
                    stopped = True
                    break
        self.answer_outstanding()  # puts still on the wire: sealed or failed like any other
        # Everything frozen but unanswered rolls back; unreached calls fail too.
        for c in self.frozen:
            if c.buffer.call not in self.acks:
                self._fail(c, CONTROL_DEADLINE, "cut deadline passed before this row was written")
        for call_id, buf in calls[reached:]:
            if call_id not in self.acks:
                self.acks[call_id] = CallAck.failure(call_id, CONTROL_DEADLINE, "cut deadline passed before this call was reached")

    def abort(self) -> None:
        """Interruption cleanup: roll back every unanswered freeze, delete unowned rows
        (after the puts still on the wire ended, so none lands after the delete)."""
        self.window.wait_all(self.time_left())
        for c in self.frozen:
            if c.buffer.call not in self.acks or self.acks[c.buffer.call].status != DURABLE_PREFIX:
                c.buffer.rollback(c)
        orphans = set(self.written)
        orphans.update(c.key for c in self.frozen if c.buffer.call not in self.acks)
        self._delete(sorted(orphans))


def resolve_deadline(deadline: float | None, clock: Clock, deadline_s: float | None = None) -> float:
    """``deadline`` (absolute, clock seconds) or now + ``deadline_s`` (default ``cut.deadline-s``)."""
    if deadline is None:
        return clock() + float(config.get("cut.deadline-s") if deadline_s is None else deadline_s)
    return float(deadline)


def run_cut(
    calls: Sequence[tuple[CallId, CallBuffer | None]],
    store: CutStore,
    *,
    checkpoint_id: str,
    inventory_digest: bytes,
    deadline: float | None = None,
    clock: Clock = time.time,
    limits: BatchLimits | None = None,
    deadline_s: float | None = None,
    partition: str = CUT_PARTITION,
    worker: str = "",
    puts_in_flight: int | None = None,
) -> tuple[CutReceipt, CutStats]:
    """Cut ``calls`` (``(call id, buffer or None if unknown)`` in inventory order).

    ``deadline`` is absolute, in ``clock`` seconds (None: now + ``deadline_s``);
    ``limits`` (rows, tokens, bytes per put), ``deadline_s`` and ``puts_in_flight`` (puts
    on the wire while the next batch packs; 1: serial) default to ``token-capture.cut`` read now (a generation worker passes its own
    :class:`CutSettings`); the process's CPU gate is sized once by ``cut.cpu-slots``. Returns the receipt (acks in
    ``calls`` order) and the cut's stats. An interruption cleans up and re-raises.
    """
    check_id(checkpoint_id, "checkpoint_id")
    t0 = time.perf_counter()
    window = puts_in_flight_from_config() if puts_in_flight is None else puts_in_flight
    cut = _Cut(store, checkpoint_id, resolve_deadline(deadline, clock, deadline_s), clock, limits or limits_from_config(),
               partition, window)
    try:
        cut.enter_gate()
        try:
            cut.run(list(calls))
        except BaseException:
            cut.abort()
            raise
    finally:
        cut.leave_gate()
    s = cut.stats
    receipt = CutReceipt(
        checkpoint_id=checkpoint_id,
        inventory_digest=inventory_digest,
        acks=tuple(cut.acks[c] for c, _ in calls),
        worker=worker,
        put_calls=s.put_calls,
        delete_calls=s.delete_calls,
        rows_written=s.rows_written,
        bytes_written=s.bytes_written,
        wall_ms=(time.perf_counter() - t0) * 1e3,
        deadline_passed=s.deadline_passed,
        mean_row_wait_ms=fmean(s.row_wait_ms) if s.row_wait_ms else 0.0,
    )
    return receipt, s
