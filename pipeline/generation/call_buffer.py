"""One in-flight model call's captured tokens: :class:`CallBuffer`.

A buffer holds a call's context and generated tokens (sealed, frozen, active parts) under
a lifecycle lock, plus running hash states fed on every append, so a checkpoint cut
freezes a chunk (:class:`~pipeline.generation.frozen_chunk.FrozenChunk`) in O(1) under
the lock and describes its row outside it. The cut
transaction that writes frozen chunks is :func:`pipeline.generation.cut.run_cut`.
Lengths are in tokens; hashes are 32-byte digests of the buffer's digest version
(:mod:`tasks.digests`: BLAKE3 by default, SHA-256 under ``capture.digest: sha256``).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Literal, Sequence

import numpy as np

from tasks import digests, hashing
from tasks.cut.batching import ROW_FIXED_BYTES, CallIdentity, Part, chunk_signature, token_nbytes
from tasks.cut.receipt import (
    COMPLETED,
    CUT_ERROR,
    DURABLE_PREFIX,
    EMPTY_PREFIX,
    GENERATION_LOST,
    CallAck,
    CallId,
    extend_prefix_digest,
    prefix_state,
)
from tasks.errors import InvalidCall
from tasks.keys import CUT_PREFIX, check_id
from tasks.schema import ROUTES_DTYPE, routes_encoding_of

from .frozen_chunk import FrozenChunk

# A call's lifecycle state: plain strings (they appear as such in ``info()``/``output()``).
CallLifecycle = Literal["active", "completed", "failed"]
ACTIVE: CallLifecycle = "active"
COMPLETED_STATE: CallLifecycle = "completed"  # not COMPLETED: that is the ack status
FAILED: CallLifecycle = "failed"


class CallBuffer:
    """One in-flight model call's tokens, cut state and lifecycle lock.

    ``context_ids`` are the call's carried tokens (mask 0), generated tokens are appended
    with :meth:`append` (mask 1). ``routes_shape=(L, K)`` turns on routed experts: then
    ``context_routes`` ([len(context), L, K]) is required and every append carries
    routes, kept in ``routes_dtype`` (int16, or uint8 for a model of at most 256 experts:
    the cut rows' routes encoding; ids that do not fit it are refused). ``max_new_tokens`` (tokens, optional) completes the call when reached.
    ``digest_version`` (:mod:`tasks.digests`) hashes the call's chunks, chain and prefix
    digest; a resumed call passes its prefix's.
    """

    def __init__(
        self,
        rollout_id: str,
        model_call_id: str,
        context_ids: np.ndarray,
        *,
        parent_call_id: str | None = None,
        weight_version: int = 0,
        routes_shape: tuple[int, int] | None = None,
        context_routes: np.ndarray | None = None,
        max_new_tokens: int | None = None,
        digest_version: int = hashing.DIGEST_VERSION,
        routes_dtype: np.dtype | str = ROUTES_DTYPE,
    ):
        self.rollout_id = check_id(rollout_id, "rollout_id")
        self.digest_version = v = digests.scheme(digest_version).version
        self.model_call_id = check_id(model_call_id, "model_call_id")
        self.parent_call_id = None if parent_call_id is None else check_id(parent_call_id, "parent_call_id")
        self._call: CallId = (self.rollout_id, self.model_call_id)
        ctx = np.asarray(context_ids)
        if ctx.ndim != 1 or not (ctx.size == 0 or np.issubdtype(ctx.dtype, np.integer)):
            raise InvalidCall("invalid_argument", f"context_ids of {self.key}: need a 1-D integer array, got {ctx.dtype}{ctx.shape}")
        self.context_ids = np.ascontiguousarray(ctx, dtype="<i8")
        self.weight_version = int(weight_version)
        self.routes_shape = None if routes_shape is None else tuple(int(x) for x in routes_shape)
        self.routes_dtype = np.dtype(routes_dtype)
        if routes_encoding_of(self.routes_dtype) is None:
            raise InvalidCall("invalid_argument", f"routes_dtype of {self.key}: int16 or uint8, got {self.routes_dtype}")
        if self.routes_shape is not None:
            want = (len(self.context_ids),) + self.routes_shape
            if context_routes is None or tuple(np.shape(context_routes)) != want:
                got = None if context_routes is None else tuple(np.shape(context_routes))
                raise InvalidCall("invalid_argument", f"context_routes of {self.key}: expected shape {want}, got {got}")
            self.context_routes = self._routes(context_routes)
        else:
            self.context_routes = None
        self.max_new_tokens = max_new_tokens
        self.lock = threading.Lock()
        self.state: CallLifecycle = ACTIVE
        self.failure: str | None = None
        self.generated = 0  # tokens generated so far (all parts)
        # Generated tokens in three parts; each part a list of (ids, logprobs, routes).
        self._sealed: list[Part] = []
        self._frozen: FrozenChunk | None = None
        self._active: list[Part] = []
        # Cut state: committed only on seal.
        self.cut_keys: list[str] = []
        self.cut_tokens = 0
        # Running hash states, fed on every append (so a freeze only reads them out):
        # the cumulative hash and prefix digest over every token so far, and the chain
        # hash of the chunk not yet sealed (chunk 0 starts with the context).
        self._prefix_digest = prefix_state(v).digest()  # of the sealed prefix
        self._run_cum = hashing.prefix_state(None, v)
        self._run_pdig = prefix_state(v)
        self._run_chain: digests.Hasher | None = hashing.chain_state(None, v)  # None: made by the next append
        self._chain_parent: bytes | None = None  # the chain hash the next chunk extends
        self._feed(self.context_ids)
        # Field-digest layout (digest version 3): the open chunk's field digests (ids,
        # mask, logprobs[, routes]), fed on every append, so a cut hashes no token again
        # (None: no token since the last freeze, or a version without field digests).
        self._field_new = digests.scheme(v).field_new
        self._run_fields = self._refed_field_states()  # the first chunk starts with the context
        # What every chunk of the call shares, made once (a freeze only reads them).
        self.identity = CallIdentity.of(self.rollout_id, self.model_call_id, self.parent_call_id, v)
        self._key_stem = f"{self.rollout_id}/{self.model_call_id}/"  # cut key after the checkpoint root
        self.signature = chunk_signature(self.routes_shape, self.routes_dtype)
        self._token_nbytes = token_nbytes(self.routes_shape, self.routes_dtype.itemsize)  # bytes per token of a packed row
        self._row_fixed_nbytes = self.identity.id_nbytes + ROW_FIXED_BYTES  # bytes of a packed row besides its tokens

    def _routes(self, routes: np.ndarray) -> np.ndarray:
        """``routes`` as a contiguous array of ``routes_dtype``; ids that do not fit it
        are refused (``invalid_argument``), never wrapped."""
        a = np.asarray(routes)
        if a.dtype != self.routes_dtype and a.size:
            if a.dtype.kind not in "iu":
                raise InvalidCall("invalid_argument", f"{self.key}: routes must be integer expert ids, got {a.dtype}")
            info = np.iinfo(self.routes_dtype)
            if int(a.min()) < info.min or int(a.max()) > info.max:
                raise InvalidCall("invalid_argument", f"{self.key}: expert ids outside {self.routes_dtype.name} (the call's routes dtype)")
        return np.ascontiguousarray(a, dtype=self.routes_dtype)

    @property
    def key(self) -> str:
        return f"{self.rollout_id}/{self.model_call_id}"

    @property
    def call(self) -> CallId:
        """``(rollout_id, model_call_id)``: made once (a cut keys its acks by it per row)."""
        return self._call

    # ---- decoding side ----

    def append(self, ids: np.ndarray, logprobs: np.ndarray, routes: np.ndarray | None = None) -> bool:
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
                raise InvalidCall("invalid_argument", f"{self.key}: routes must be {(len(ids),) + self.routes_shape} integers, got "
                                  f"{None if routes is None else np.shape(routes)}")
            routes = self._routes(routes)
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
                fields = self._run_fields
                if fields is None and self._field_new is not None:  # the chunk's first tokens
                    fields = self._run_fields = self._new_field_states()
                if fields is not None:
                    self._feed_fields(fields, _bytes(ids), _ones(len(ids)), memoryview(logprobs).cast("B"), routes)
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
        gen_routes: np.ndarray | None,
        keys: Sequence[str],
        chunk_lengths: Sequence[int],
        expected_digest: bytes | None = None,
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
        chain, start, v = None, 0, self.digest_version
        cum, pdig = hashing.prefix_state(None, v), prefix_state(v)
        pdigest = pdig.digest()
        for n in lengths:
            chunk = ids[start : start + n]
            chain = hashing.chain_hash(chain, chunk, v)
            hashing.extend_prefix(cum, chunk)
            pdigest = extend_prefix_digest(pdig, chunk)
            start += n
        if expected_digest is not None and expected_digest != pdigest:
            raise InvalidCall("prefix_mismatch", f"{self.key}: prefix digest mismatch (the saved prefix is not the one cut)")
        with self.lock:
            if len(gen_ids):
                self._sealed.append((np.ascontiguousarray(gen_ids, dtype="<i8"),
                                     np.ascontiguousarray(gen_logprobs, dtype="<f4"),
                                     None if self.routes_shape is None else self._routes(gen_routes)))
            self.generated = len(gen_ids)
            self._prefix_digest = pdigest
            self._run_cum, self._run_pdig, self._run_chain = cum, pdig, hashing.chain_state(chain, v)
            self._run_fields = None  # the next chunk starts after the prefix (made by its first append)
            self.cut_keys = list(keys)
            self.cut_tokens = len(ids)
            if self.max_new_tokens is not None and self.generated >= self.max_new_tokens:
                self.state = COMPLETED_STATE

    # ---- cut side ----

    def freeze(self, checkpoint_id: str) -> FrozenChunk | CallAck:
        """Swap the active buffer out under the lock; build the prefix row outside it.

        Returns the :class:`FrozenChunk` to write, or an immediate :class:`CallAck` when
        there is nothing to write: the call already completed or failed, or nothing is new
        since its last sealed cut (its existing prefix is durable as is).
        """
        return self.freeze_under(cut_key_root(checkpoint_id))

    def freeze_under(self, key_root: str) -> FrozenChunk | CallAck:
        """:meth:`freeze` with the checkpoint's key root already made by
        :func:`cut_key_root` (a cut checks its checkpoint id once, not per call)."""
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
            n_ctx = len(self.context_ids) if first else 0
            tokens = n_ctx
            for p in self._active:  # a few pieces per call
                tokens += len(p[0])
            if first and not tokens:
                # A zero-token row would be advertised, then refused on restore: skip the put.
                return CallAck.failure(self.call, EMPTY_PREFIX, "no context and no generated token yet")
            parts, self._active = self._active, []
            seq = len(self.cut_keys)
            # The running states already cover every token: reading them is O(1). The next
            # chunk's chain state (extending this one) and field digests start with its
            # first append: a call that gets no new token makes neither.
            chain_state, self._run_chain = self._run_chain, None
            chain = self._chain_parent = chain_state.digest()
            run_fields, self._run_fields = self._run_fields, None
            fields = None if run_fields is None else tuple([f.digest() for f in run_fields])  # None: pack_chunks hashes the slices
            # (buffer, seq, parts, chain state, prev_len, delta_len, with_context, chain,
            # cumulative, field digests, prefix digest)
            frozen = self._frozen = FrozenChunk(self, seq, parts, chain_state, self.cut_tokens, tokens, n_ctx > 0, chain,
                                                self._run_cum.digest(), fields, self._run_pdig.digest())
        # Outside the lock. Its pieces are valid by construction (converted on append): no
        # re-check. The key == cut_key(...): ids checked when the buffer was made, the
        # checkpoint's in key_root.
        frozen.key = f"{key_root}{self._key_stem}{seq}"
        frozen.nbytes = tokens * self._token_nbytes + self._row_fixed_nbytes
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
            self.cut_tokens = frozen.prev_len + frozen.delta_len  # the prefix once sealed
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
            self._run_fields = self._refed_field_states()  # field digests: the whole chunk again

    def _feed(self, ids: np.ndarray) -> None:
        b = _bytes(ids)
        self._run_cum.update(b)
        self._run_pdig.update(b)
        if self._run_chain is None:  # the chunk's first tokens: its chain extends the last frozen one
            self._run_chain = hashing.chain_state(self._chain_parent, self.digest_version)
        self._run_chain.update(b)

    def _refed_field_states(self) -> list[digests.Hasher] | None:
        """The open chunk's field digests fed again from its tokens (a rolled-back
        chunk: the context if it is the call's first, then every active part)."""
        states = self._new_field_states()
        if states is not None:
            if not self.cut_keys:
                zeros = memoryview(np.zeros(len(self.context_ids), dtype="<f4")).cast("B")
                self._feed_fields(states, _bytes(self.context_ids), zeros, zeros, self.context_routes)
            for ids, lps, routes in self._active:
                self._feed_fields(states, _bytes(ids), _ones(len(ids)), memoryview(lps).cast("B"), routes)
        return states

    def _new_field_states(self) -> list[digests.Hasher] | None:
        """Fresh field digests for a chunk (ids, mask, logprobs[, routes]); None unless
        the call's digest version has the field-digest layout."""
        if self._field_new is None:
            return None
        return [self._field_new() for _ in range(3 if self.routes_shape is None else 4)]

    @staticmethod
    def _feed_fields(states: list[digests.Hasher], ids: memoryview, mask: memoryview, lps: memoryview,
                     routes: np.ndarray | None) -> None:
        states[0].update(ids)
        states[1].update(mask)
        states[2].update(lps)
        if routes is not None:
            states[3].update(memoryview(routes.reshape(-1)).cast("B"))

    def _durable_ack_locked(self) -> CallAck:
        return CallAck.durable_prefix(self.rollout_id, self.model_call_id, tuple(self.cut_keys), self.cut_tokens,
                                      self._prefix_digest, self.digest_version)

    def _completed_ack_locked(self) -> CallAck:
        return CallAck(self.rollout_id, self.model_call_id, COMPLETED,
                       total_tokens=len(self.context_ids) + self.generated)


def cut_key_root(checkpoint_id: str) -> str:
    """``"__cut__/{checkpoint_id}/"``: what every cut key of the checkpoint starts with
    (:func:`~tasks.keys.cut_key`); raises :class:`~tasks.errors.InvalidKey` for a bad id."""
    return f"{CUT_PREFIX}/{check_id(checkpoint_id, 'checkpoint_id')}/"


def _bytes(ids: np.ndarray) -> memoryview:
    """The ids' ``<i8`` bytes (a view; copies only if not already contiguous ``<i8``)."""
    return memoryview(np.ascontiguousarray(ids, dtype="<i8")).cast("B")


_ONES = np.ones(4096, dtype="<f4")  # the generated tokens' mask bytes, shared (read-only)


def _ones(n: int) -> memoryview:
    """``n`` tokens of mask 1 as ``<f4`` bytes (a view of a shared buffer, grown once if short)."""
    global _ONES
    ones = _ONES
    if len(ones) < n:
        ones = _ONES = np.ones(max(n, 2 * len(ones)), dtype="<f4")
    return memoryview(ones[:n]).cast("B")
