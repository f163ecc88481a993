"""The checkpoint-cut transaction (SPEC section 7): freeze, batch, put, validate, seal.

Two pieces, both plain Python usable on a worker (inside the
:class:`~pipeline.generation.worker.GenerationWorker` actor) or in the controller (the
benchmark's 32 writer clients run exactly this code):

:class:`CallBuffer`
    One in-flight model call: its context, the generated tokens in three parts
    (``sealed`` chunks already durable, the ``frozen`` chunk a cut is writing, the
    ``active`` pieces decoding appends to) and a lifecycle lock (``threading.Lock``).
    Freezing swaps the active list for a fresh one under the lock, so decoding never
    waits on store I/O; sealing or rolling back re-takes the lock for a pointer move.
    The call's output is always ``context + sealed + frozen + active``: a call that
    finishes while its cut is in flight loses and doubles nothing.

:func:`run_cut`
    The transaction over a list of calls against a store with ``put_many`` / ``delete``
    (:class:`~pipeline.store.client.StagingStore` or a wrapper such as
    :class:`FaultyStore`). Calls are frozen lazily in inventory order and fed to a
    :class:`~tasks.cut.batching.BatchPlanner`; each batch it closes is put at once:

    1. one ``put_many`` per batch into the ``cut`` partition;
    2. a failed batch put (exception, or any key refused) deletes every key of the batch
       (earlier keys may be written) and retries one row per put, so one bad row fails
       only its call (a one-row batch is not retried: it already was one row per put);
    3. acks are validated for the whole batch (every key acknowledged ok, none refused),
       then each call is sealed; a failed ack or seal fails only its call, whose row is
       cleared (one ``delete`` per batch for all such rows);
    4. before every put the deadline is checked: past it, no put starts, pending frozen
       rows roll back and they, and every call not yet reached, are acknowledged
       ``durable_failure`` / ``control_deadline``;
    5. on an interruption (any ``BaseException`` escaping, e.g. a cancelled cut) every
       key written but not sealed is deleted and every frozen call rolled back before the
       exception propagates: no unsealed key is ever advertised.

Cut row format (documented choice): a prefix chunk is a :class:`~tasks.schema.StagedRow`
(packed by :func:`~tasks.cut.batching.pack_chunks`, byte-identical to
:func:`~tasks.packed.pack_rows`) keyed by
``tasks.keys.cut_key(checkpoint_id, rollout_id, model_call_id, seq)``. Reusing the staged
row keeps one wire format, one store registry and the finalizer's row decoder. Within a
cut row, lengths are relative to the call's prefix: ``prev_len`` is the prefix tokens in
earlier chunks, ``delta_len`` this chunk's, ``cum_len`` their sum. Chunk 0 carries the
call's context (mask 0, logprob 0) then its generated tokens (mask 1); later chunks only
newly generated tokens. ``chain_hash`` chains the chunks, ``cumulative_hash`` covers the
prefix through this chunk, ``digest`` is :func:`tasks.hashing.row_digest`; routed experts
ride along when the call has them.

Knobs (read at call time): ``cut.generation-prefix-batch-size`` (rows per put; 1 = one
put per call, the baseline), ``cut.generation-prefix-batch-max-tokens``,
``cut.generation-prefix-batch-max-bytes``, ``cut.deadline-s`` (seconds, when the
caller gives no deadline) and ``cut.cpu-slots`` (cuts of one process freezing/packing at
once; a cut waiting on the store holds no slot).

Cost per row on the batched path: one copy of its tokens (pieces -> the batch buffer,
:func:`~tasks.cut.batching.pack_chunks`), one SHA-256 pass for its digest over that buffer;
the batch goes out in rows ordered by storage unit (each unit gets a view of its run) with
``adopt=True`` (units keep views of the received buffers rather than copying each row).
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from tasks import hashing
from tasks.cut.batching import BatchLimits, BatchPlanner, PrefixChunk, pack_chunks
from tasks.cut.receipt import (
    COMPLETED,
    CONTROL_DEADLINE,
    CUT_ERROR,
    DURABLE_PREFIX,
    EMPTY_PREFIX,
    GENERATION_LOST,
    UNKNOWN_CALL,
    CallAck,
    CallId,
    CutReceipt,
    extend_prefix_digest,
    prefix_state,
)
from tasks.errors import InvalidCall
from tasks.keys import CUT_PARTITION, CUT_PREFIX, STAGING_PARTITION, check_id, unit_for_rollout
from tasks.packed import PackedBatch
from tasks.schema import StagedRow

from .. import config


ACTIVE = "active"
COMPLETED_STATE = "completed"
FAILED = "failed"

Clock = Callable[[], float]


def limits_from_config() -> BatchLimits:
    """The cut's per-put limits, read now from ``token-capture.cut``."""
    return BatchLimits(
        max_rows=int(config.get("cut.generation-prefix-batch-size")),
        max_tokens=int(config.get("cut.generation-prefix-batch-max-tokens")),
        max_bytes=int(config.get_bytes("cut.generation-prefix-batch-max-bytes")),
    )


# ---- one call's buffer -----------------------------------------------------------------


class FrozenChunk:
    """What a cut froze of one call: the chunk to write and what sealing it will commit.

    ``parts`` are the generated pieces moved out of the call's active list (not copied);
    ``chunk`` describes the row (:class:`~tasks.cut.batching.PrefixChunk`), packed with
    its batch by :func:`~tasks.cut.batching.pack_chunks` (one copy, digest over the batch
    buffer). ``row`` builds the :class:`StagedRow` on demand (tools, not the cut path).
    """

    __slots__ = ("buffer", "seq", "key", "parts", "chunk", "prefix_tokens", "prefix_digest", "_chain_state",
                 "frozen_at", "tokens", "nbytes", "signature", "unit", "_row")

    def __init__(self, buffer: "CallBuffer", seq: int, parts: list, chain_state: Any):
        self.buffer = buffer
        self.seq = seq
        self.key = ""
        self.parts = parts  # generated (ids, logprobs, routes) pieces of this chunk, in order
        self.chunk: Optional[PrefixChunk] = None
        self.prefix_tokens = 0  # prefix length once sealed (tokens)
        self.prefix_digest = b""
        self._chain_state = chain_state  # the chunk's running chain state (for rollback)
        self.frozen_at = 0.0  # time.perf_counter() when frozen (s), for row-wait stats
        self.tokens = 0
        self.nbytes = 0
        self.signature: Any = None
        self.unit = 0  # storage unit of the row (orders a batch so the store splits it without copies)
        self._row: Optional[StagedRow] = None

    @property
    def row(self) -> StagedRow:
        """The prefix row as a :class:`StagedRow` (concatenated, digest set; built once)."""
        if self._row is None:
            self._row = self.chunk.to_row()
        return self._row

    @property
    def gen_ids(self) -> np.ndarray:
        return _concat_parts(self.parts, self.buffer.routes_shape)[0]

    @property
    def gen_logprobs(self) -> np.ndarray:
        return _concat_parts(self.parts, self.buffer.routes_shape)[1]

    @property
    def gen_routes(self) -> Optional[np.ndarray]:
        return _concat_parts(self.parts, self.buffer.routes_shape)[2]


class CallBuffer:
    """One in-flight model call's tokens, cut state and lifecycle lock.

    ``context_ids`` are the call's carried tokens (mask 0), generated tokens are appended
    with :meth:`append` (mask 1). ``routes_shape=(L, K)`` turns on routed experts: then
    ``context_routes`` (int16[len(context), L, K]) is required and every append carries
    routes. ``max_new_tokens`` (tokens, optional) completes the call when reached.
    """

    def __init__(
        self,
        rollout_id: str,
        model_call_id: str,
        context_ids: np.ndarray,
        *,
        parent_call_id: Optional[str] = None,
        weight_version: int = 0,
        routes_shape: Optional[tuple[int, int]] = None,
        context_routes: Optional[np.ndarray] = None,
        max_new_tokens: Optional[int] = None,
    ):
        self.rollout_id = check_id(rollout_id, "rollout_id")
        self.model_call_id = check_id(model_call_id, "model_call_id")
        self.parent_call_id = None if parent_call_id is None else check_id(parent_call_id, "parent_call_id")
        ctx = np.asarray(context_ids)
        if ctx.ndim != 1 or not (ctx.size == 0 or np.issubdtype(ctx.dtype, np.integer)):
            raise InvalidCall("invalid_argument", f"context_ids of {self.key}: need a 1-D integer array, got {ctx.dtype}{ctx.shape}")
        self.context_ids = np.ascontiguousarray(ctx, dtype="<i8")
        self.weight_version = int(weight_version)
        self.routes_shape = None if routes_shape is None else tuple(int(x) for x in routes_shape)
        if self.routes_shape is not None:
            want = (len(self.context_ids),) + self.routes_shape
            if context_routes is None or tuple(np.shape(context_routes)) != want:
                got = None if context_routes is None else tuple(np.shape(context_routes))
                raise InvalidCall("invalid_argument", f"context_routes of {self.key}: expected shape {want}, got {got}")
            self.context_routes = np.ascontiguousarray(context_routes, dtype="<i2")
        else:
            self.context_routes = None
        self.max_new_tokens = max_new_tokens
        self.lock = threading.Lock()
        self.state = ACTIVE
        self.failure: Optional[str] = None
        self.generated = 0  # tokens generated so far (all parts)
        # Generated tokens in three parts; each part a list of (ids, logprobs, routes).
        self._sealed: list[tuple] = []
        self._frozen: Optional[FrozenChunk] = None
        self._active: list[tuple] = []
        # Cut state: committed only on seal.
        self.cut_keys: list[str] = []
        self.cut_tokens = 0
        # Running hash states, fed on every append (so a freeze only reads them out):
        # the cumulative hash and prefix digest over every token so far, and the chain
        # hash of the chunk not yet sealed (chunk 0 starts with the context).
        self._prefix_digest = prefix_state().digest()  # of the sealed prefix
        self._run_cum = hashing.prefix_state()
        self._run_pdig = prefix_state()
        self._run_chain = _chain_state(None)
        self._feed(self.context_ids)

    @property
    def key(self) -> str:
        return f"{self.rollout_id}/{self.model_call_id}"

    @property
    def call(self) -> CallId:
        return (self.rollout_id, self.model_call_id)

    # ---- decoding side ----

    def append(self, ids: np.ndarray, logprobs: np.ndarray, routes: Optional[np.ndarray] = None) -> bool:
        """Append generated tokens under the lock; returns True if the call is now complete.

        Tokens past ``max_new_tokens`` are dropped. Raises :class:`InvalidCall` on shape or
        dtype mismatch, or if the call is no longer active.
        """
        ids = np.ascontiguousarray(ids, dtype="<i8")
        logprobs = np.ascontiguousarray(logprobs, dtype="<f4")
        if ids.ndim != 1 or logprobs.shape != ids.shape:
            raise InvalidCall("invalid_argument", f"{self.key}: ids {ids.shape} and logprobs {logprobs.shape} must be equal 1-D")
        if self.routes_shape is not None:
            if routes is None or tuple(np.shape(routes)) != (len(ids),) + self.routes_shape:
                raise InvalidCall("invalid_argument", f"{self.key}: routes must be int16{(len(ids),) + self.routes_shape}, got "
                                  f"{None if routes is None else np.shape(routes)}")
            routes = np.ascontiguousarray(routes, dtype="<i2")
        else:
            routes = None
        with self.lock:
            if self.state != ACTIVE:
                raise InvalidCall("not_active", f"{self.key} is {self.state}, cannot append")
            if self.max_new_tokens is not None:
                room = self.max_new_tokens - self.generated
                if len(ids) > room:
                    ids, logprobs = ids[:room], logprobs[:room]
                    routes = None if routes is None else routes[:room]
            if len(ids):
                self._active.append((ids, logprobs, routes))
                self.generated += len(ids)
                self._feed(ids)
            if self.max_new_tokens is not None and self.generated >= self.max_new_tokens:
                self.state = COMPLETED_STATE
            return self.state == COMPLETED_STATE

    def complete(self) -> None:
        """Terminal completion (e.g. end of sequence): no more tokens."""
        with self.lock:
            if self.state == ACTIVE:
                self.state = COMPLETED_STATE

    def fail(self, reason: str) -> None:
        """Terminal failure (generation error, abort): a cut in flight reports it lost."""
        with self.lock:
            if self.state == ACTIVE:
                self.state = FAILED
                self.failure = reason

    def output(self) -> dict[str, Any]:
        """The whole call: ``token_ids``, ``token_mask``, ``logprobs`` (and ``routed_experts``).

        Context first (mask 0, logprob 0), then sealed, frozen and active generated parts,
        each exactly once.
        """
        with self.lock:
            parts = list(self._sealed)
            if self._frozen is not None:
                parts += self._frozen.parts
            parts += self._active
            state = self.state
        n_ctx = len(self.context_ids)
        ids = np.concatenate([self.context_ids] + [p[0] for p in parts])
        mask = np.zeros(len(ids), dtype="<f4")
        mask[n_ctx:] = 1.0
        lps = np.concatenate([np.zeros(n_ctx, dtype="<f4")] + [p[1] for p in parts])
        out = {"rollout_id": self.rollout_id, "model_call_id": self.model_call_id, "state": state,
               "token_ids": ids, "token_mask": mask, "logprobs": lps, "context_tokens": n_ctx}
        if self.routes_shape is not None:
            out["routed_experts"] = np.concatenate([self.context_routes] + [p[2] for p in parts])
        return out

    def info(self) -> dict[str, Any]:
        """A token-free summary (for listing)."""
        with self.lock:
            return {
                "rollout_id": self.rollout_id,
                "model_call_id": self.model_call_id,
                "parent_call_id": self.parent_call_id,
                "state": self.state,
                "failure": self.failure,
                "context_tokens": len(self.context_ids),
                "generated": self.generated,
                "cut_tokens": self.cut_tokens,
                "cut_keys": list(self.cut_keys),
                "cutting": self._frozen is not None,
            }

    def restore_prefix(
        self,
        gen_ids: np.ndarray,
        gen_logprobs: np.ndarray,
        gen_routes: Optional[np.ndarray],
        keys: Sequence[str],
        chunk_lengths: Sequence[int],
        expected_digest: Optional[bytes] = None,
    ) -> None:
        """Mark ``context + gen_*`` as an already-sealed prefix (a resumed call).

        ``keys``/``chunk_lengths`` (tokens) are the prefix's chunks in chain order; the
        chain and digest states are rebuilt from them (one pass), so the next cut
        continues the chain at ``seq = len(keys)``. Call before the buffer is shared.
        """
        ids = np.concatenate([self.context_ids, np.ascontiguousarray(gen_ids, dtype="<i8")])
        lengths = [int(n) for n in chunk_lengths]
        if len(keys) != len(lengths) or sum(lengths) != len(ids) or any(n <= 0 for n in lengths):
            raise InvalidCall("invalid_prefix", f"{self.key}: {len(keys)} keys with chunk lengths {lengths[:8]} do not cover "
                              f"the {len(ids)}-token prefix")
        chain, start = None, 0
        cum, pdig = hashing.prefix_state(), prefix_state()
        pdigest = pdig.digest()
        for n in lengths:
            chunk = ids[start : start + n]
            chain = hashing.chain_hash(chain, chunk)
            hashing.extend_prefix(cum, chunk)
            pdigest = extend_prefix_digest(pdig, chunk)
            start += n
        if expected_digest is not None and expected_digest != pdigest:
            raise InvalidCall("prefix_mismatch", f"{self.key}: prefix digest mismatch (the saved prefix is not the one cut)")
        with self.lock:
            if len(gen_ids):
                self._sealed.append((np.ascontiguousarray(gen_ids, dtype="<i8"),
                                     np.ascontiguousarray(gen_logprobs, dtype="<f4"),
                                     None if self.routes_shape is None else np.ascontiguousarray(gen_routes, dtype="<i2")))
            self.generated = len(gen_ids)
            self._prefix_digest = pdigest
            self._run_cum, self._run_pdig, self._run_chain = cum, pdig, _chain_state(chain)
            self.cut_keys = list(keys)
            self.cut_tokens = len(ids)
            if self.max_new_tokens is not None and self.generated >= self.max_new_tokens:
                self.state = COMPLETED_STATE

    # ---- cut side ----

    def freeze(self, checkpoint_id: str) -> "FrozenChunk | CallAck":
        """Swap the active buffer out under the lock; build the prefix row outside it.

        Returns the :class:`FrozenChunk` to write, or an immediate :class:`CallAck` when
        there is nothing to write: the call already completed or failed, or nothing is new
        since its last sealed cut (its existing prefix is durable as is).
        """
        with self.lock:
            if self.state == COMPLETED_STATE:
                return self._completed_ack_locked()
            if self.state == FAILED:
                return CallAck.failure(self.call, GENERATION_LOST, f"call failed: {self.failure}")
            if self._frozen is not None:
                return CallAck.failure(self.call, CUT_ERROR, "another cut of this call is in flight")
            first = not self.cut_keys
            if not first and not self._active:
                return self._durable_ack_locked()
            if first and not len(self.context_ids) and not any(len(p[0]) for p in self._active):
                # A zero-token row would be advertised, then refused on restore: skip the put.
                return CallAck.failure(self.call, EMPTY_PREFIX, "no context and no generated token yet")
            parts, self._active = self._active, []
            seq = len(self.cut_keys)
            prev = self.cut_tokens
            # The running states already cover every token: reading them is O(1).
            chain = self._run_chain.digest()
            cumulative = self._run_cum.digest()
            pdigest = self._run_pdig.digest()
            chain_state, self._run_chain = self._run_chain, _chain_state(chain)  # next chunk extends this one
            frozen = self._frozen = FrozenChunk(self, seq, parts, chain_state)
        # Outside the lock: describe the row (no copy, no hashing: pack_chunks does both once).
        first_ctx = first and len(self.context_ids)
        # == cut_key(...): the ids were checked when the buffer was made, the checkpoint id here.
        frozen.key = f"{CUT_PREFIX}/{check_id(checkpoint_id, 'checkpoint_id')}/{self.rollout_id}/{self.model_call_id}/{seq}"
        frozen.chunk = PrefixChunk(
            key=frozen.key,
            rollout_id=self.rollout_id,
            model_call_id=self.model_call_id,
            parent_call_id=self.parent_call_id,
            prev_len=prev,
            weight_version=self.weight_version,
            context_ids=self.context_ids if first_ctx else None,
            context_routes=self.context_routes if first_ctx else None,
            parts=parts,
            routes_shape=self.routes_shape,
            chain_hash=chain,
            cumulative_hash=cumulative,
        )
        frozen.tokens = frozen.chunk.delta_len
        frozen.prefix_tokens = prev + frozen.tokens
        frozen.prefix_digest = pdigest
        frozen.nbytes = frozen.chunk.nbytes
        frozen.signature = frozen.chunk.signature
        frozen.frozen_at = time.perf_counter()
        return frozen

    def seal(self, frozen: FrozenChunk) -> CallAck:
        """Commit a written chunk: the call's prefix now ends with it.

        If the call completed or failed while its cut was in flight, nothing is committed
        (the chunk's tokens go back to the active part, so the output keeps them once) and
        the ack says so; the caller then clears the written row.
        """
        with self.lock:
            if self._frozen is not frozen:
                raise RuntimeError(f"{self.key}: sealing a chunk that is not the frozen one")
            if self.state != ACTIVE:
                self._rollback_locked(frozen)
                if self.state == COMPLETED_STATE:
                    return self._completed_ack_locked()
                return CallAck.failure(self.call, GENERATION_LOST, f"call failed during the cut: {self.failure}")
            self._sealed += frozen.parts
            self._frozen = None
            self.cut_keys.append(frozen.key)
            self.cut_tokens = frozen.prefix_tokens
            self._prefix_digest = frozen.prefix_digest
            return self._durable_ack_locked()

    def rollback(self, frozen: FrozenChunk) -> None:
        """Undo a freeze: the chunk's tokens rejoin the active part, before newer ones."""
        with self.lock:
            self._rollback_locked(frozen)

    def _rollback_locked(self, frozen: FrozenChunk) -> None:
        if self._frozen is frozen:
            # The unsealed chunk is again frozen + newer tokens: its chain state resumes
            # from the freeze and re-reads only the tokens appended since (failure path).
            state = frozen._chain_state.copy()
            for ids, _, _ in self._active:
                state.update(_bytes(ids))
            self._run_chain = state
            self._active[0:0] = frozen.parts
            self._frozen = None

    def _feed(self, ids: np.ndarray) -> None:
        b = _bytes(ids)
        self._run_cum.update(b)
        self._run_pdig.update(b)
        self._run_chain.update(b)

    def _durable_ack_locked(self) -> CallAck:
        return CallAck(self.rollout_id, self.model_call_id, DURABLE_PREFIX, tuple(self.cut_keys),
                       self.cut_tokens, self._prefix_digest)

    def _completed_ack_locked(self) -> CallAck:
        return CallAck(self.rollout_id, self.model_call_id, COMPLETED,
                       total_tokens=len(self.context_ids) + self.generated)


def _bytes(ids: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(ids, dtype="<i8")).cast("B")


def _chain_state(parent_chain: Optional[bytes]):
    """A running :func:`tasks.hashing.chain_hash` state for a chunk after ``parent_chain``:
    the same bytes as ``chain_hash(parent, ids)`` once the chunk's ids are fed to it."""
    h = hashlib.sha256(hashing.TAG_CHAIN)
    h.update(hashing.ROOT_MARKER if parent_chain is None else b"\x01" + parent_chain)
    return h


def _concat_parts(parts: list[tuple], routes_shape) -> tuple:
    if not parts:
        empty_routes = None if routes_shape is None else np.zeros((0,) + tuple(routes_shape), "<i2")
        return np.zeros(0, "<i8"), np.zeros(0, "<f4"), empty_routes
    if len(parts) == 1:
        return parts[0]
    routes = None if routes_shape is None else np.concatenate([p[2] for p in parts])
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), routes


# ---- the transaction -------------------------------------------------------------------


@dataclass
class CutStats:
    """Round trips and timing of one cut (ms, bytes, counts)."""

    put_calls: int = 0
    delete_calls: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    row_wait_ms: list = field(default_factory=list)  # per sealed-or-acked row: freeze -> ack
    deadline_passed: bool = False


# Cuts sharing a process (writer threads of one controller, several generation actors on
# one worker) share one GIL: packing and hashing them all at once only interleaves them,
# so every batch is ready late and the store sits idle meanwhile. A process-wide gate lets
# ``cut.cpu-slots`` cuts do their CPU-bound steps at a time; a cut leaves it while it waits
# on the store, so puts overlap the next cut's packing.
_GATES: dict[int, threading.Semaphore] = {}
_GATES_LOCK = threading.Lock()


def _cpu_gate(slots: int) -> threading.Semaphore:
    """The process-wide semaphore admitting ``slots`` cuts to their CPU-bound steps."""
    with _GATES_LOCK:
        gate = _GATES.get(slots)
        if gate is None:
            gate = _GATES[slots] = threading.Semaphore(slots)
        return gate


class _Cut:
    def __init__(self, store, checkpoint_id: str, deadline: float, clock: Clock, limits: BatchLimits, partition: str):
        self.gate = _cpu_gate(max(1, int(config.get("cut.cpu-slots"))))
        self.in_gate = False
        self.store = store
        self.checkpoint_id = checkpoint_id
        self.deadline = deadline
        self.clock = clock
        self.limits = limits
        self.partition = partition
        self.stats = CutStats()
        self.acks: dict[CallId, CallAck] = {}
        self.frozen: list[FrozenChunk] = []
        self.written: set[str] = set()  # keys the store accepted and nobody owns yet
        self.n_units = len(getattr(store, "units", None) or ())  # 0: a store without visible units

    def enter_gate(self) -> None:
        self.gate.acquire()
        self.in_gate = True

    def leave_gate(self) -> None:
        if self.in_gate:
            self.in_gate = False
            self.gate.release()

    @contextlib.contextmanager
    def _io(self):
        """Leave the CPU gate while waiting on the store (other cuts pack meanwhile)."""
        self.leave_gate()
        try:
            yield
        finally:
            self.enter_gate()

    def past_deadline(self) -> bool:
        if self.clock() >= self.deadline:
            self.stats.deadline_passed = True
            return True
        return False

    # -- store round trips (each one call) --

    def _put(self, chunks: Sequence[FrozenChunk]):
        # Rows ordered by storage unit: the store then sends each unit a contiguous slice
        # of the batch buffers (no re-split copy). Freshly packed buffers nobody else holds:
        # the units may keep views into them instead of copying each row (adopt).
        if self.n_units > 1:
            chunks = sorted(chunks, key=lambda c: c.unit)
        batch = pack_chunks([c.chunk for c in chunks])
        self.stats.put_calls += 1
        try:
            with self._io():
                result = self.store.put_many(batch, partition=self.partition, adopt=True)
        except Exception as e:  # the whole put failed: no per-key answer
            return None, f"put_many raised {type(e).__name__}: {e}", batch.nbytes
        return result, "", batch.nbytes

    def _delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if not keys:
            return
        self.stats.delete_calls += 1
        try:
            with self._io():
                self.store.delete(keys, partition=self.partition)
        except Exception:
            pass  # best effort: the keys stay unadvertised either way
        self.written.difference_update(keys)

    # -- steps --

    def put_batch(self, chunks: list[FrozenChunk]) -> bool:
        """Write one planned batch; False if the deadline stopped it before its put."""
        if self.past_deadline():
            return False
        result, error, nbytes = self._put(chunks)
        keys = [c.key for c in chunks]
        if result is not None:
            wanted = set(keys)
            self.written.update(k for k in result.ok if k in wanted)
        if result is not None and not result.failed:
            self._ack_and_seal(chunks, result, nbytes)
            return True
        # Failed batch: clear all its keys (some may be written), then one row per put.
        detail = error or "; ".join(f"{k}: {r} ({d})" for k, (r, d) in list(result.failed.items())[:3])
        self._delete(keys)
        if len(chunks) == 1:
            self._fail(chunks[0], CUT_ERROR, f"put failed: {detail}")
            return True
        for i, c in enumerate(chunks):
            if self.past_deadline():
                return False  # this chunk and the rest stay pending: rolled back at the end
            result, error, nbytes = self._put([c])
            if result is not None:
                self.written.update(k for k in result.ok if k == c.key)
            if result is None or result.failed:
                why = error or "; ".join(f"{r} ({d})" for r, d in result.failed.values())
                self._delete([c.key])
                self._fail(c, CUT_ERROR, f"row put failed after batch failure: {why}")
            else:
                self._ack_and_seal([c], result, nbytes)
        return True

    def _ack_and_seal(self, chunks: list[FrozenChunk], result, nbytes: int) -> None:
        ok = set(result.ok)
        failed = result.failed or {}
        acked_at = time.perf_counter()
        # 1. Validate every ack of the batch before sealing any call.
        good: list[FrozenChunk] = []
        clear: list[str] = []
        for c in chunks:
            if c.key in failed or c.key not in ok:
                clear.append(c.key)
                self._fail(c, CUT_ERROR, "ack invalid: " + (f"{failed[c.key]}" if c.key in failed else "key not acknowledged"))
            else:
                good.append(c)
        self.stats.rows_written += len(good)
        self.stats.bytes_written += nbytes
        # 2. Seal; a call that failed or completed meanwhile (or a failed seal) clears its row.
        for c in good:
            self.stats.row_wait_ms.append((acked_at - c.frozen_at) * 1e3)
            try:
                ack = c.buffer.seal(c)
            except Exception as e:
                c.buffer.rollback(c)
                ack = CallAck.failure(c.buffer.call, CUT_ERROR, f"seal failed: {type(e).__name__}: {e}")
            self.acks[c.buffer.call] = ack
            if ack.status == DURABLE_PREFIX:
                self.written.discard(c.key)
            else:
                clear.append(c.key)
        self._delete(clear)

    def _fail(self, c: FrozenChunk, reason: str, detail: str) -> None:
        c.buffer.rollback(c)
        self.acks[c.buffer.call] = CallAck.failure(c.buffer.call, reason, detail)

    def run(self, calls: Sequence[tuple[CallId, Optional[CallBuffer]]]) -> None:
        planner = BatchPlanner(self.limits)
        stopped = False
        reached = 0
        for call_id, buf in calls:
            if buf is None:
                self.acks[call_id] = CallAck.failure(call_id, UNKNOWN_CALL, "no such call on this worker")
                reached += 1
                continue
            if self.past_deadline():
                stopped = True
                break
            reached += 1
            got = buf.freeze(self.checkpoint_id)
            if isinstance(got, CallAck):
                self.acks[call_id] = got
                continue
            idx = len(self.frozen)
            if self.n_units > 1:
                got.unit = unit_for_rollout(buf.rollout_id, self.n_units)
            self.frozen.append(got)
            for b in planner.add(idx, got.tokens, got.nbytes, got.signature):
                if not self.put_batch([self.frozen[i] for i in b.rows]):
                    stopped = True
                    break
            if stopped:
                break
        if not stopped:
            for b in planner.flush():
                if not self.put_batch([self.frozen[i] for i in b.rows]):
                    stopped = True
                    break
        # Everything frozen but unanswered rolls back; unreached calls fail too.
        for c in self.frozen:
            if c.buffer.call not in self.acks:
                self._fail(c, CONTROL_DEADLINE, "cut deadline passed before this row was written")
        for call_id, buf in calls[reached:]:
            if call_id not in self.acks:
                self.acks[call_id] = CallAck.failure(call_id, CONTROL_DEADLINE, "cut deadline passed before this call was reached")

    def abort(self) -> None:
        """Interruption cleanup: roll back every unanswered freeze, delete unowned rows."""
        for c in self.frozen:
            if c.buffer.call not in self.acks or self.acks[c.buffer.call].status != DURABLE_PREFIX:
                c.buffer.rollback(c)
        orphans = set(self.written)
        orphans.update(c.key for c in self.frozen if c.buffer.call not in self.acks)
        self._delete(sorted(orphans))


def resolve_deadline(deadline: Optional[float], clock: Clock) -> float:
    """``deadline`` (absolute, clock seconds) or now + ``cut.deadline-s``."""
    if deadline is None:
        return clock() + float(config.get("cut.deadline-s"))
    return float(deadline)


def run_cut(
    calls: Sequence[tuple[CallId, Optional[CallBuffer]]],
    store,
    *,
    checkpoint_id: str,
    inventory_digest: bytes,
    deadline: Optional[float] = None,
    clock: Clock = time.time,
    limits: Optional[BatchLimits] = None,
    partition: str = CUT_PARTITION,
    worker: str = "",
) -> tuple[CutReceipt, CutStats]:
    """Cut ``calls`` (``(call id, buffer or None if unknown)`` in inventory order).

    ``deadline`` is absolute, in ``clock`` seconds (None: now + ``cut.deadline-s``);
    ``limits`` default to the config knobs. Returns the receipt (acks in ``calls``
    order) and the cut's stats. An interruption cleans up and re-raises.
    """
    check_id(checkpoint_id, "checkpoint_id")
    t0 = time.perf_counter()
    cut = _Cut(store, checkpoint_id, resolve_deadline(deadline, clock), clock, limits or limits_from_config(), partition)
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
        mean_row_wait_ms=float(np.mean(s.row_wait_ms)) if s.row_wait_ms else 0.0,
    )
    return receipt, s


# ---- failure injection (tests and benchmarks; no mocks of Dask) ------------------------


class ManualClock:
    """A clock (seconds) that moves only when told: ``clock.advance(dt)``. Picklable."""

    def __init__(self, start: float = 1_000.0):
        self.t = float(start)

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        self.t += float(seconds)
        return self.t


class InjectedStoreError(RuntimeError):
    """Raised by :class:`FaultyStore` where its rules say a put fails outright."""


@dataclass
class FaultRules:
    """What a :class:`FaultyStore` breaks. Keys match by substring; puts count from 1.

    fail_keys: put_many refuses these keys (reason ``injected_fault``) and writes the rest,
        like a store that rejects single rows.
    raise_on_puts: these puts raise :class:`InjectedStoreError` before writing anything.
    drop_ack_keys: written, but missing from the put's acknowledgement (a lost ack).
    interrupt_after_put: after this put is applied, raise ``asyncio.CancelledError``
        (an interruption: rows written that no call has received).
    advance_after_put: {put number: seconds}: advance ``clock`` once that put is applied.
    pause_put / event_prefix: before applying that put, set the ``distributed.Event``
        ``{prefix}-started`` and wait (up to ``pause_timeout_s``) for ``{prefix}-release``.
    """

    fail_keys: tuple[str, ...] = ()
    raise_on_puts: tuple[int, ...] = ()
    drop_ack_keys: tuple[str, ...] = ()
    interrupt_after_put: Optional[int] = None
    advance_after_put: dict = field(default_factory=dict)
    pause_put: Optional[int] = None
    event_prefix: str = "faulty-store"
    pause_timeout_s: float = 30.0


def _matches(key: str, patterns: Sequence[str]) -> bool:
    return any(p in key for p in patterns)


class FaultyStore:
    """A store wrapper that breaks chosen puts (see :class:`FaultRules`); picklable.

    Everything else is passed through to the wrapped store. ``clock`` is the clock the
    rules advance; a :class:`~pipeline.generation.worker.GenerationWorker` built on this
    store uses it when given no clock of its own. ``puts`` / ``deletes`` record each
    call's keys (in this process's copy).
    """

    def __init__(self, store, rules: Optional[FaultRules] = None, clock: Optional[ManualClock] = None):
        self.store = store
        self.rules = rules or FaultRules()
        self.clock = clock
        self.puts: list[list[str]] = []
        self.deletes: list[list[str]] = []

    def put_many(self, batch: PackedBatch, partition: str = STAGING_PARTITION, adopt: bool = False):
        r = self.rules
        self.puts.append(list(batch.keys))
        n = len(self.puts)
        if r.pause_put == n:
            from distributed import Event

            Event(f"{r.event_prefix}-started").set()
            if not Event(f"{r.event_prefix}-release").wait(timeout=r.pause_timeout_s):
                raise InjectedStoreError(f"put {n}: pause was never released")
        if n in r.raise_on_puts:
            raise InjectedStoreError(f"put {n} failed (injected)")
        refused = [i for i, k in enumerate(batch.keys) if _matches(k, r.fail_keys)]
        if refused:
            keep = np.setdiff1d(np.arange(len(batch)), refused)
            if len(keep):
                result = self.store.put_many(batch.take(keep), partition=partition, adopt=True)
            else:
                from ..store.unit import StoreResult

                result = StoreResult()
            for i in refused:
                result.failed[batch.keys[i]] = ("injected_fault", f"put {n} refuses {batch.keys[i]!r}")
        else:
            result = self.store.put_many(batch, partition=partition, adopt=adopt)
        if r.drop_ack_keys:
            result.ok = [k for k in result.ok if not _matches(k, r.drop_ack_keys)]
        if n in r.advance_after_put and self.clock is not None:
            self.clock.advance(r.advance_after_put[n])
        if r.interrupt_after_put == n:
            import asyncio

            raise asyncio.CancelledError(f"cut interrupted after put {n}")
        return result

    def delete(self, keys: Sequence[str], partition: str = STAGING_PARTITION):
        self.deletes.append(list(keys))
        return self.store.delete(keys, partition=partition)

    def __getattr__(self, name: str):
        if name in ("store", "rules", "clock", "puts", "deletes"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.store, name)
