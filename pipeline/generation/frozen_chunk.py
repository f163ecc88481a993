"""What a checkpoint cut froze of one in-flight call: :class:`FrozenChunk`.

A frozen chunk is the row a cut writes, described by its pieces (nothing concatenated)
and read straight by :func:`~tasks.cut.packing.pack_chunks` (it has every attribute of
:class:`~tasks.cut.packing.PackableChunk`: one object per call per cut), plus what sealing
it commits to its :class:`~pipeline.generation.call_buffer.CallBuffer`. What every chunk of
a call shares (identity, routes shape and dtype, weight version) is read from the buffer.
Lengths in tokens, sizes in bytes.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from tasks import digests
from tasks.cut.batching import CallIdentity, Part, PrefixChunk, Signature
from tasks.schema import ROUTES_DTYPE, StagedRow


class ChunkOwner(Protocol):
    """What a frozen chunk reads of its call (a :class:`~pipeline.generation.call_buffer.CallBuffer`)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    weight_version: int
    context_ids: np.ndarray
    context_routes: np.ndarray | None
    routes_shape: tuple[int, int] | None
    routes_dtype: np.dtype
    identity: CallIdentity  # the ids encoded once
    signature: Signature  # what batches group chunks by


class FrozenChunk:
    """One call's frozen chunk: the row to write and what sealing it will commit.

    ``parts`` are the generated pieces moved out of the call's active list (not copied);
    the call's first chunk also carries its context (``context_ids``/``context_routes``,
    mask 0). ``chain_hash``/``cumulative_hash``/``field_digests`` are the running states
    read at the freeze; ``prefix_tokens``/``prefix_digest`` what the call's prefix becomes
    once sealed. ``chunk`` and ``row`` build the :class:`PrefixChunk` / :class:`StagedRow`
    on demand (tools and tests, not the cut path).
    """

    __slots__ = ("buffer", "seq", "key", "parts", "prev_len", "delta_len", "context_ids", "context_routes",
                 "chain_hash", "cumulative_hash", "field_digests", "prefix_digest", "_chain_state", "frozen_at",
                 "nbytes", "identity", "weight_version", "routes_shape", "routes_dtype", "signature", "_chunk", "_row")

    def __init__(self, buffer: ChunkOwner, seq: int, parts: list[Part], chain_state: digests.Hasher,
                 prev_len: int, delta_len: int, with_context: bool, chain_hash: bytes, cumulative_hash: bytes,
                 field_digests: tuple[bytes, ...] | None, prefix_digest: bytes):
        # Positional and plain attributes: a cut makes one per in-flight call, and
        # pack_chunks reads the call-wide ones (identity, routes) of every row.
        self.buffer = buffer
        self.seq = seq
        self.key = ""
        self.parts = parts  # generated (ids, logprobs, routes) pieces of this chunk, in order
        self.prev_len = prev_len  # tokens sealed before this chunk
        self.delta_len = delta_len  # tokens in this chunk (context included on the first)
        self.context_ids = buffer.context_ids if with_context else None
        self.context_routes = buffer.context_routes if with_context else None
        self.chain_hash = chain_hash
        self.cumulative_hash = cumulative_hash
        self.field_digests = field_digests  # field-digest layout: (ids, mask, logprobs[, routes]); else None
        self.prefix_digest = prefix_digest  # prefix digest through this chunk (committed on seal)
        self._chain_state = chain_state  # the chunk's running chain state (for rollback)
        self.frozen_at = 0.0  # time.perf_counter() when frozen (s), for row-wait stats
        self.nbytes = 0  # packed row size (bytes), for batch limits
        # What every chunk of the call shares, read once from the buffer.
        self.identity: CallIdentity = buffer.identity
        self.weight_version: int = buffer.weight_version
        self.routes_shape: tuple[int, int] | None = buffer.routes_shape
        self.routes_dtype: np.dtype = buffer.routes_dtype
        self.signature: Signature = buffer.signature  # what batches group chunks by
        self._chunk: PrefixChunk | None = None
        self._row: StagedRow | None = None

    @property
    def tokens(self) -> int:
        """Tokens in this chunk (= ``delta_len``)."""
        return self.delta_len

    @property
    def prefix_tokens(self) -> int:
        """The call's prefix length once this chunk is sealed (tokens)."""
        return self.prev_len + self.delta_len

    @property
    def rollout_id(self) -> str:
        return self.buffer.rollout_id

    @property
    def model_call_id(self) -> str:
        return self.buffer.model_call_id

    @property
    def chunk(self) -> PrefixChunk:
        """The chunk as a :class:`PrefixChunk` (same row when packed; built once)."""
        if self._chunk is None:
            b = self.buffer
            self._chunk = PrefixChunk.trusted(
                self.key, b.rollout_id, b.model_call_id, b.parent_call_id, self.prev_len, b.weight_version,
                self.context_ids, self.context_routes, self.parts, b.routes_shape, self.chain_hash,
                self.cumulative_hash, self.delta_len, b.identity, b.routes_dtype, self.field_digests,
            )
        return self._chunk

    @property
    def row(self) -> StagedRow:
        """The prefix row as a :class:`StagedRow` (concatenated, digest set; built once)."""
        if self._row is None:
            self._row = self.chunk.to_row()
        return self._row

    def _gen(self, i: int) -> np.ndarray | None:
        return concat_parts(self.parts, self.buffer.routes_shape, self.buffer.routes_dtype)[i]

    @property
    def gen_ids(self) -> np.ndarray:
        return self._gen(0)

    @property
    def gen_logprobs(self) -> np.ndarray:
        return self._gen(1)

    @property
    def gen_routes(self) -> np.ndarray | None:
        return self._gen(2)


def concat_parts(parts: Sequence[Part], routes_shape: tuple[int, int] | None, routes_dtype: np.dtype = ROUTES_DTYPE) -> Part:
    """The parts as one (ids, logprobs, routes) triple (the part itself when only one)."""
    if not parts:
        empty_routes = None if routes_shape is None else np.zeros((0,) + tuple(routes_shape), routes_dtype)
        return np.zeros(0, "<i8"), np.zeros(0, "<f4"), empty_routes
    if len(parts) == 1:
        return parts[0]
    routes = None if routes_shape is None else np.concatenate([p[2] for p in parts])
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), routes

