"""Pack a batch of cut chunks straight into one put's buffers, digests included. Pure.

:func:`pack_chunks` copies each chunk's pieces once, into one buffer per token field
(optionally views of a pooled slab), and digests each row over its slices of those
buffers, from its call's identity encoded once (:class:`CallIdentity`: the digest
header up to its lengths, the one layout written here beside tasks/hashing.py, and the
hash constructor of the call's digest version). Under the field-digest layout (digest
version 3) a chunk brings its fields' digests, fed as its tokens arrived: its row's
digest is then one small hash, no token byte read again.
Per-row Python only, never per token: a copy is one ``concatenate`` per field, the mask
one vectorized fill, a digest a few ``update`` calls per row. docs/design.md,
"Checkpoint cuts".
"""
from __future__ import annotations

import operator
import struct
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .. import hashing
from ..digests import Hasher, scheme
from ..errors import InvalidChunk
from ..packed import Allocator, PackedBatch, PackedField
from ..schema import (
    HASH_BYTES,
    ROUTES_DTYPE,
    ROUTES_NONE,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
    routes_encoding_of,
    routes_field,
)

# ``allocate(field sizes in bytes)`` -> an allocator for those fields' buffers, or None
# for fresh arrays (e.g. ``SlabPool.allocator`` of the store: pooled slabs).
BufferSource = Callable[[Sequence[int]], Allocator | None]

_IDS = TOKEN_FIELDS["token_ids"]
_MASK = TOKEN_FIELDS["token_mask"]
_LOGPROBS = TOKEN_FIELDS["logprobs"]
# Digest v1 (tasks/hashing.py) after its identity part: <q prev_len> <q delta_len>
# <q cum_len> <q weight_version> <b routes_encoding>, then the ids' <Q nbytes>.
_DIGEST_LENGTHS = struct.Struct("<qqqqb")
_DIGEST_LENGTHS_IDS = struct.Struct("<qqqqbQ")
_NBYTES = struct.Struct("<Q")
_ROUTES_HEAD = struct.Struct("<IIQ")
# What pack_chunks reads of every chunk, in one C-level call per chunk.
_CHUNK_FIELDS = operator.attrgetter(
    "key", "delta_len", "identity", "prev_len", "weight_version", "chain_hash", "cumulative_hash", "context_ids",
    "field_digests",
)
_HASH_LEN = {HASH_BYTES}


# (ids <i8[n], logprobs <f4[n], routes [n, L, K] (int16 or uint8) or None): one piece of generated tokens.
Part = tuple[np.ndarray, np.ndarray, np.ndarray | None]


@dataclass(frozen=True, eq=False)
class CallIdentity:
    """What every chunk of one call shares, encoded once per call (not per row).

    ``rollout_id``/``model_call_id``/``parent_call_id`` are the ids' UTF-8 bytes
    (``parent_call_id`` ``None`` for a root); ``digest_head`` is the digest header up to
    its lengths (tag, versions, ids, parent marker); ``id_nbytes`` the ids' bytes a
    packed row carries; ``digest_version`` the version every hash of the call's chunks
    uses (:mod:`tasks.digests`) and ``new`` its hash constructor; ``field_new`` its
    field-digest constructor (None: the version hashes fields inline).
    """

    rollout_id: bytes
    model_call_id: bytes
    parent_call_id: bytes | None
    digest_head: bytes
    id_nbytes: int
    digest_version: int
    new: Callable[..., Hasher]
    field_new: Callable[..., Hasher] | None = None

    @classmethod
    def of(
        cls, rollout_id: str, model_call_id: str, parent_call_id: str | None, digest_version: int = hashing.DIGEST_VERSION
    ) -> "CallIdentity":
        """The identity of a call with these (already checked) ids, hashed with
        ``digest_version`` (an unknown one raises :class:`~tasks.digests.UnsupportedDigest`)."""
        rid, mid = rollout_id.encode("utf-8"), model_call_id.encode("utf-8")
        pid = None if parent_call_id is None else parent_call_id.encode("utf-8")
        head = hashing.digest_header(SCHEMA_VERSION, digest_version, rid, mid, pid, 0, 0, 0, 0, 0)
        ids_nbytes = len(rid) + len(mid) + len(pid or b"")
        s = scheme(digest_version)
        return cls(rid, mid, pid, head[: -_DIGEST_LENGTHS.size], ids_nbytes, digest_version, s.new, s.field_new)


class PackableChunk(Protocol):
    """What :func:`pack_chunks` reads of a chunk (:class:`~tasks.cut.chunk.PrefixChunk`
    is one): arrays little-endian and contiguous, lengths in tokens."""

    key: str
    delta_len: int  # tokens: context + parts
    identity: CallIdentity
    prev_len: int  # tokens sealed before this chunk
    weight_version: int
    chain_hash: bytes  # 32 bytes
    cumulative_hash: bytes  # 32 bytes
    context_ids: np.ndarray | None  # the call's carried tokens (its first chunk only)
    context_routes: np.ndarray | None
    parts: Sequence[Part]  # generated pieces, in order
    routes_shape: tuple[int, int] | None  # (layers, top_k)
    routes_dtype: np.dtype  # of every routes piece: int16 or uint8 (the row's routes encoding)
    # Field digests (ids, mask, logprobs[, routes]) of the field-digest layout, fed as the
    # tokens arrived; None: hashed here from the row's slices.
    field_digests: tuple[bytes, ...] | None


class _Columns(NamedTuple):
    """What pack_chunks reads of each chunk, one list per attribute, in row order."""

    keys: list[str]
    lengths: list[int]  # delta_len (tokens)
    identities: list[CallIdentity]
    prev_lens: list[int]  # tokens
    weight_versions: list[int]
    chain_hashes: list[bytes]  # 32 bytes each
    cumulative_hashes: list[bytes]  # 32 bytes each
    contexts: list[np.ndarray | None]  # context_ids (a call's first chunk only)
    field_digests: list[tuple[bytes, ...] | None]  # streamed field digests (field-digest layout), or None


class _TokenBuffers(NamedTuple):
    """The batch's token fields, every row's tokens back to back (offsets in tokens)."""

    token_ids: np.ndarray  # int64[T]
    token_mask: np.ndarray  # float32[T]
    logprobs: np.ndarray  # float32[T]
    routed_experts: np.ndarray | None  # [T, L, K] (int16 or uint8) or None


def pack_chunks(chunks: Sequence[PackableChunk], allocate: BufferSource | None = None) -> PackedBatch:
    """Pack ``chunks`` as one :class:`PackedBatch` keyed by ``chunk.key`` (rows in order).

    Byte-identical to ``pack_rows([c.to_row() for c in chunks])`` with the keys replaced,
    but each token is copied once (piece -> batch buffer) and each digest is hashed over
    the batch buffer's row slices. Chunks of one batch share a routes shape and dtype (or
    have no routes): the planner groups them by :attr:`~tasks.cut.chunk.PrefixChunk.signature`. ``allocate(sizes)``, given
    the token fields' sizes (bytes), may supply an allocator for their buffers (e.g.
    views of a pooled slab, memory already mapped); by default they are fresh arrays.
    """
    routes_shape, routes_dtype = _shared_routes(chunks)
    columns = _read_columns(chunks)
    context_lens = [0 if ctx is None else len(ctx) for ctx in columns.contexts]
    pieces = _pieces(chunks, columns.contexts, context_lens, routes_shape is not None)
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(columns.lengths, out=offsets[1:])
    tokens = _token_buffers(*pieces, int(offsets[-1]), routes_shape, routes_dtype, allocate)
    _mask_contexts(tokens.token_mask, offsets, context_lens)
    encoding = ROUTES_NONE if tokens.routed_experts is None else routes_encoding_of(routes_dtype)
    digests = _row_digests(columns, offsets, tokens, routes_shape, encoding)
    fields = _fixed_fields(columns, digests, encoding)
    fields["token_ids"] = PackedField(tokens.token_ids, offsets)
    fields["token_mask"] = PackedField(tokens.token_mask, offsets.copy())
    fields["logprobs"] = PackedField(tokens.logprobs, offsets.copy())
    if tokens.routed_experts is not None:
        fields[routes_field(encoding)] = PackedField(tokens.routed_experts, offsets.copy())
    return PackedBatch(columns.keys, fields)


def _shared_routes(chunks: Sequence[PackableChunk]) -> tuple[tuple[int, int] | None, np.dtype]:
    """The batch's one routes shape ``(layers, top_k)`` (or None) and dtype;
    ``InvalidChunk`` if mixed."""
    shapes = {c.routes_shape for c in chunks}
    if len(shapes) > 1:
        raise InvalidChunk(f"chunks of one batch must share a routes shape, got {sorted(map(str, shapes))}")
    shape = shapes.pop() if shapes else None
    dtypes = {np.dtype(c.routes_dtype) for c in chunks} if shape is not None else set()
    if len(dtypes) > 1:
        raise InvalidChunk(f"chunks of one batch must share a routes dtype, got {sorted(d.str for d in dtypes)}")
    return shape, (dtypes.pop() if dtypes else ROUTES_DTYPE)


def _read_columns(chunks: Sequence[PackableChunk]) -> _Columns:
    """Each row's scalars, identity and hashes read in one C-level pass (no per-row
    Python); ``InvalidChunk`` naming a chunk whose hashes are not 32 bytes each."""
    if not chunks:
        return _Columns(*([] for _ in _Columns._fields))
    columns = _Columns(*map(list, zip(*map(_CHUNK_FIELDS, chunks))))
    if set(map(len, columns.chain_hashes)) != _HASH_LEN or set(map(len, columns.cumulative_hashes)) != _HASH_LEN:
        # Checked per chunk (a per-batch length check passes 31 + 33 bytes); named on failure.
        bad = next(c for c in chunks if len(c.chain_hash) != HASH_BYTES or len(c.cumulative_hash) != HASH_BYTES)
        raise InvalidChunk(f"{bad.key}: chain_hash and cumulative_hash must be {HASH_BYTES} bytes each")
    return columns


def _pieces(
    chunks: Sequence[PackableChunk], contexts: list[np.ndarray | None], context_lens: list[int], with_routes: bool
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """(ids, logprobs, routes) pieces in row order: each row's context (logprob 0) then
    its generated parts; a few list appends per row, nothing per token."""
    zeros = np.zeros(max(context_lens, default=0), dtype=_LOGPROBS)
    id_pieces: list[np.ndarray] = []
    lp_pieces: list[np.ndarray] = []
    route_pieces: list[np.ndarray] = []
    add_id, add_lp, add_route = id_pieces.append, lp_pieces.append, route_pieces.append
    for c, ctx, k in zip(chunks, contexts, context_lens):
        if k:
            add_id(ctx)
            add_lp(zeros[:k])
            if with_routes:
                add_route(c.context_routes)
        for p in c.parts:
            add_id(p[0])
            add_lp(p[1])
            if with_routes:
                add_route(p[2])
    return id_pieces, lp_pieces, route_pieces


def _token_buffers(
    id_pieces: list[np.ndarray],
    lp_pieces: list[np.ndarray],
    route_pieces: list[np.ndarray],
    total: int,
    routes_shape: tuple[int, int] | None,
    routes_dtype: np.dtype,
    allocate: BufferSource | None,
) -> _TokenBuffers:
    """The token fields' buffers (``total`` tokens, from ``allocate`` or fresh), each
    filled by ONE concatenate of its pieces (no per-row numpy call); the mask is left
    unfilled (:func:`_mask_contexts`)."""
    out = None
    if allocate is not None:
        sizes = [total * _IDS.itemsize, total * _MASK.itemsize, total * _LOGPROBS.itemsize]
        out = allocate(sizes if routes_shape is None else sizes + [total * routes_dtype.itemsize * routes_shape[0] * routes_shape[1]])
    out = out or _fresh
    ids = _concat(id_pieces, out(_IDS, (total,)))
    mask = out(_MASK, (total,))
    lps = _concat(lp_pieces, out(_LOGPROBS, (total,)))
    routes = None if routes_shape is None else _concat(route_pieces, out(routes_dtype, (total,) + tuple(routes_shape)))
    return _TokenBuffers(ids, mask, lps, routes)


def _mask_contexts(mask: np.ndarray, offsets: np.ndarray, context_lens: list[int]) -> None:
    """Fill ``mask``: 1 for generated tokens, 0 for each row's context (its first
    ``context_lens[row]`` tokens; rows start at ``offsets``), in two vectorized writes."""
    mask.fill(1.0)
    ctx = np.array(context_lens, dtype=np.int64)
    n_ctx = int(ctx.sum())
    if n_ctx:
        ctx_start = np.cumsum(ctx) - ctx  # where each row's context starts among all context tokens
        mask[np.repeat(offsets[:-1] - ctx_start, ctx) + np.arange(n_ctx, dtype=np.int64)] = 0.0


def _row_digests(
    columns: _Columns, offsets: np.ndarray, tokens: _TokenBuffers, routes_shape: tuple[int, int] | None, encoding: int
) -> list[bytes]:
    """One digest per row over its slices of the batch buffers (tasks/hashing.py, with
    the hash constructor of the row's call): the call's encoded identity head, then
    lengths and buffers (or, field-digest layout, the fields' digests); a few calls per row."""
    ids_b = memoryview(tokens.token_ids).cast("B")
    mask_b = memoryview(tokens.token_mask).cast("B")
    lps_b = memoryview(tokens.logprobs).cast("B")
    routes_b = None if tokens.routed_experts is None else memoryview(tokens.routed_experts.reshape(-1)).cast("B")
    per_route = 0 if routes_b is None else tokens.routed_experts.itemsize * routes_shape[0] * routes_shape[1]  # bytes per token
    digests: list[bytes] = []
    add_digest = digests.append
    lengths_ids, nbytes = _DIGEST_LENGTHS_IDS.pack, _NBYTES.pack
    routes_head = None if routes_b is None else _ROUTES_HEAD.pack(routes_shape[0], routes_shape[1], 0)[:8]  # <I L> <I K>
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    for ident, p, version, chain, cum, fds, a, b in zip(
        columns.identities, columns.prev_lens, columns.weight_versions, columns.chain_hashes, columns.cumulative_hashes,
        columns.field_digests, starts, ends,
    ):
        k = b - a
        head = ident.digest_head + lengths_ids(p, k, p + k, version, encoding, 8 * k)
        if ident.field_new is not None:  # field-digest layout: one small hash
            if fds is None:
                fds = _field_digests(ident.field_new, ids_b[8 * a : 8 * b], mask_b[4 * a : 4 * b], lps_b[4 * a : 4 * b],
                                     None if routes_b is None else routes_b[per_route * a : per_route * b])
            q = nbytes(4 * k)
            tail = (routes_head + nbytes(per_route * k) + fds[3]) if routes_b is not None else b""
            add_digest(ident.new(b"".join((head, fds[0], q, fds[1], q, fds[2], tail, chain, cum))).digest())
            continue
        h = ident.new(head)
        h.update(ids_b[8 * a : 8 * b])
        q = nbytes(4 * k)
        h.update(q)
        h.update(mask_b[4 * a : 4 * b])
        h.update(q)
        h.update(lps_b[4 * a : 4 * b])
        if routes_b is not None:
            h.update(_ROUTES_HEAD.pack(routes_shape[0], routes_shape[1], per_route * k))
            h.update(routes_b[per_route * a : per_route * b])
        h.update(chain + cum)
        add_digest(h.digest())
    return digests


def _field_digests(new: Callable[..., Hasher], *fields: memoryview | None) -> tuple[bytes, ...]:
    """The field digests of a row's slices (those not None), in field order."""
    return tuple(new(f).digest() for f in fields if f is not None)


def _fixed_fields(columns: _Columns, digests: list[bytes], encoding: int) -> dict[str, PackedField]:
    """The rows' id, scalar and hash fields (one row each), in the packed field order."""
    n = len(columns.keys)
    arange = np.arange(n + 1, dtype=np.int64)
    prev = np.array(columns.prev_lens, dtype=np.int64)
    delta = np.array(columns.lengths, dtype=np.int64)
    scalars = {
        "prev_len": prev,
        "delta_len": delta,
        "cum_len": prev + delta,
        "weight_version": np.array(columns.weight_versions, dtype=np.int64),
        "routes_encoding": np.full(n, encoding),
        "schema_version": np.full(n, SCHEMA_VERSION),
        "digest_version": np.fromiter((d.digest_version for d in columns.identities), np.int64, n),
    }
    idents = columns.identities
    fields: dict[str, PackedField] = {
        "rollout_id": _utf8_field([d.rollout_id for d in idents]),
        "model_call_id": _utf8_field([d.model_call_id for d in idents]),
        "parent_call_id": _utf8_field([d.parent_call_id or b"" for d in idents]),
    }
    for name, dt in SCALAR_FIELDS.items():
        fields[name] = PackedField(scalars[name].astype(dt, copy=False), arange.copy())
    hashes = (("digest", digests), ("chain_hash", columns.chain_hashes), ("cumulative_hash", columns.cumulative_hashes))
    for name, values in hashes:
        fields[name] = PackedField(np.frombuffer(bytearray(b"".join(values)), dtype=np.uint8), arange * HASH_BYTES)
    return fields


def _utf8_field(encoded: Sequence[bytes]) -> PackedField:
    """One row per encoded string (UTF-8 bytes), offsets in bytes."""
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return PackedField(np.frombuffer(bytearray(b"".join(encoded)), dtype=np.uint8), offsets)


def _fresh(dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A fresh, uninitialized buffer: the allocator when ``allocate`` supplies none."""
    return np.empty(shape, dtype=dtype)


def _concat(pieces: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``pieces`` copied back to back into ``out`` (one numpy call); returns ``out``."""
    if len(pieces) > 1:
        np.concatenate(pieces, out=out)
    elif pieces:
        out[...] = pieces[0]
    return out
