"""One cut row described by its pieces, before it is packed. Pure.

A :class:`PrefixChunk` is a call's cut row as the writer holds it: context and generated
pieces (nothing concatenated), the running hash states read at freeze time and the call's
identity encoded once (:class:`~tasks.cut.packing.CallIdentity`, shared by every chunk
of the call). :func:`~tasks.cut.packing.pack_chunks` packs a batch of them;
:meth:`PrefixChunk.to_row` is one packed on its own. Checked per piece, never per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InvalidChunk
from ..schema import HASH_BYTES, ROUTES_DTYPE, TOKEN_FIELDS, StagedRow, routes_encoding_of
from .packing import CallIdentity, Part, pack_chunks
from .row_cost import ROW_FIXED_BYTES, Signature, chunk_signature, token_nbytes

_IDS = TOKEN_FIELDS["token_ids"]
_LOGPROBS = TOKEN_FIELDS["logprobs"]


@dataclass(eq=False)
class PrefixChunk:
    """One cut row described by its pieces (nothing concatenated yet).

    ``context_ids`` (and ``context_routes``) are set on a call's first chunk only: its
    carried tokens, written with mask 0 and logprob 0. ``parts`` are the generated pieces
    (mask 1) in order. ``prev_len`` (tokens) is the prefix already sealed before this
    chunk; ``chain_hash``/``cumulative_hash`` are the running states read at freeze time.
    Arrays are little-endian and contiguous (``CallBuffer`` guarantees it). ``identity``
    encodes the ids as given at construction: a chunk's ids are not reassigned after it.
    ``routes_dtype``: the dtype of every routes piece, int16 or uint8 (a routes encoding's,
    :data:`tasks.schema.ROUTES_ENCODINGS`): the row is staged in that encoding.
    ``field_digests``: the row's field digests (ids, mask, logprobs[, routes]) when the
    writer fed them as tokens arrived (field-digest layout); None: computed when packed.
    """

    key: str
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    weight_version: int
    context_ids: np.ndarray | None
    context_routes: np.ndarray | None
    parts: Sequence[Part]
    routes_shape: tuple[int, int] | None
    chain_hash: bytes
    cumulative_hash: bytes
    delta_len: int = 0  # tokens (filled by __post_init__)
    identity: CallIdentity | None = field(default=None, repr=False)  # the ids encoded (filled by __post_init__)
    routes_dtype: np.dtype = ROUTES_DTYPE
    field_digests: tuple[bytes, ...] | None = None

    @classmethod
    def trusted(
        cls,
        key: str,
        rollout_id: str,
        model_call_id: str,
        parent_call_id: str | None,
        prev_len: int,
        weight_version: int,
        context_ids: np.ndarray | None,
        context_routes: np.ndarray | None,
        parts: Sequence[Part],
        routes_shape: tuple[int, int] | None,
        chain_hash: bytes,
        cumulative_hash: bytes,
        delta_len: int,
        identity: CallIdentity,
        routes_dtype: np.dtype = ROUTES_DTYPE,
        field_digests: tuple[bytes, ...] | None = None,
    ) -> "PrefixChunk":
        """A chunk built without :meth:`__post_init__`'s checks, for a writer whose pieces
        are valid by construction (:class:`~pipeline.generation.call_buffer.CallBuffer`
        converts every piece on append): ``delta_len`` (tokens) and ``identity`` given,
        ``field_digests`` as the writer fed them (it vouches for them: a wrong one makes
        a row that fails verification, never a silent change)."""
        # Plain attribute stores: the instance keeps its values inline (reading
        # ``__dict__`` would allocate a dict per chunk, one more object for the GC).
        self = object.__new__(cls)
        self.key, self.rollout_id, self.model_call_id, self.parent_call_id = key, rollout_id, model_call_id, parent_call_id
        self.prev_len, self.weight_version, self.context_ids, self.context_routes = prev_len, weight_version, context_ids, context_routes
        self.parts, self.routes_shape, self.chain_hash, self.cumulative_hash = parts, routes_shape, chain_hash, cumulative_hash
        self.delta_len, self.identity, self.routes_dtype = delta_len, identity, routes_dtype
        self.field_digests = field_digests
        return self

    def __post_init__(self) -> None:
        # Checked per piece (a few per call, never per token): pack_chunks copies with
        # numpy's casting rules, which would silently convert a wrong dtype.
        try:
            rdt = self.routes_dtype = np.dtype(self.routes_dtype)
        except TypeError:
            rdt = None
        if rdt is None or routes_encoding_of(rdt) is None:
            raise InvalidChunk(f"{self.key}: routes_dtype must be int16 or uint8, got {self.routes_dtype!r}")
        rs = self.routes_shape
        if rs is not None and not (type(rs) is tuple and len(rs) == 2 and type(rs[0]) is int and type(rs[1]) is int
                                   and rs[0] > 0 and rs[1] > 0):
            rs = tuple(rs) if isinstance(rs, (tuple, list)) else ()
            if len(rs) != 2 or not all(isinstance(x, (int, np.integer)) and x > 0 for x in rs):
                raise InvalidChunk(f"{self.key}: routes_shape must be (layers, top_k) positive ints, got {self.routes_shape!r}")
            rs = (int(rs[0]), int(rs[1]))
        n = 0
        ctx, ctx_routes = self.context_ids, self.context_routes
        if ctx is not None:
            try:  # fast path (numpy's dtypes are singletons); the slow one names the problem
                ok = ctx.dtype is _IDS and ctx.ndim == 1 and (
                    ctx_routes is None if rs is None
                    else ctx_routes.dtype == rdt and ctx_routes.shape[1:] == rs and len(ctx_routes) == len(ctx))
            except (TypeError, ValueError, AttributeError):
                ok = False
            if not ok:
                self._check("context_ids", ctx, _IDS, None)
                self._check_routes("context_routes", ctx_routes, len(ctx), rs)
            n = len(ctx)
        for j, p in enumerate(self.parts):  # a few pieces per call
            try:
                ids, lps, routes = p
                ok = ids.dtype is _IDS and lps.dtype is _LOGPROBS and ids.ndim == 1 and lps.shape == ids.shape and (
                    routes is None if rs is None
                    else routes.dtype == rdt and routes.shape[1:] == rs and len(routes) == len(ids))
            except (TypeError, ValueError, AttributeError):
                ok = False
            if not ok:  # say exactly what is wrong
                if not isinstance(p, (tuple, list)) or len(p) != 3:
                    raise InvalidChunk(f"{self.key}: parts[{j}] must be an (ids, logprobs, routes) tuple")
                k = self._check(f"parts[{j}] ids", p[0], _IDS, None)
                self._check(f"parts[{j}] logprobs", p[1], _LOGPROBS, k)
                self._check_routes(f"parts[{j}] routes", p[2], k, rs)
            n += len(ids)
        for name, h in (("chain_hash", self.chain_hash), ("cumulative_hash", self.cumulative_hash)):
            if type(h) is not bytes or len(h) != HASH_BYTES:
                raise InvalidChunk(f"{self.key}: {name} must be {HASH_BYTES} bytes, got {type(h).__name__} "
                                   f"of length {len(h) if isinstance(h, (bytes, bytearray)) else '?'}")
        self.delta_len = n
        if self.identity is None:
            self.identity = CallIdentity.of(self.rollout_id, self.model_call_id, self.parent_call_id)

    def _check(self, what: str, a: object, dtype: np.dtype, length: int | None) -> int:
        """Length (tokens) of ``a`` if it is a 1-D ``dtype`` array of ``length``, else raise."""
        if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != dtype:
            got = f"{a.dtype.str}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise InvalidChunk(f"{self.key}: {what} must be 1-d {dtype.str}, got {got}")
        if length is not None and len(a) != length:
            raise InvalidChunk(f"{self.key}: {what} has {len(a)} tokens, its ids {length}")
        return len(a)

    def _check_routes(self, what: str, a: object, n: int, rs: tuple[int, int] | None) -> None:
        """``a`` is ``n`` tokens of routes in ``rs``, or None when ``rs`` is None; else raise."""
        if rs is None:
            if a is not None:
                raise InvalidChunk(f"{self.key}: {what} given but routes_shape is None")
            return
        if not isinstance(a, np.ndarray) or a.dtype != self.routes_dtype or a.shape != (n,) + rs:
            got = f"{a.dtype.str}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise InvalidChunk(f"{self.key}: {what} must be {self.routes_dtype.str}{[n, *rs]}, got {got}")

    @property
    def signature(self) -> Signature:
        """Same value as :func:`row_signature` of the row this chunk packs to."""
        return chunk_signature(self.routes_shape, self.routes_dtype)

    @property
    def nbytes(self) -> int:
        """Same value as :func:`put_nbytes` of the row this chunk packs to (bytes)."""
        return self.delta_len * token_nbytes(self.routes_shape, self.routes_dtype.itemsize) + self.identity.id_nbytes + ROW_FIXED_BYTES

    def to_row(self) -> StagedRow:
        """The chunk as a :class:`StagedRow` (concatenated, digest set): what a put stores."""
        from ..packed import unpack_rows

        return unpack_rows(pack_chunks([self]))[0]
