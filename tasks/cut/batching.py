"""Batch planning and packing for checkpoint-cut prefix puts. Pure.

A cut writes one prefix row per in-flight call, in batches of one ``put_many`` each,
bounded by rows, tokens and payload bytes (routes included) per put. :class:`BatchPlanner`
plans incrementally (a batch is put as soon as it is full); :func:`pack_chunks` writes a
batch of :class:`PrefixChunk` straight into one buffer per field (optionally views of a
pooled slab) and digests each row over its slices, from its call's identity encoded once
(:class:`CallIdentity`). Per-row Python only, never per token. docs/design.md, "Checkpoint cuts".
"""
from __future__ import annotations

import hashlib
import operator
import struct
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from .. import hashing
from ..errors import BatchLimitError, InvalidChunk
from ..packed import Allocator, PackedBatch, PackedField
from ..schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_DTYPE,
    ROUTES_FIELD,
    ROUTES_INT16,
    ROUTES_NONE,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
    StagedRow,
)

# Bytes a packed row costs besides its token payload: scalars, hashes and one offset per
# field (ids are counted from their actual length).
ROW_FIXED_BYTES = len(SCALAR_FIELDS) * 8 + len(HASH_FIELDS) * HASH_BYTES + (len(ID_FIELDS) + len(SCALAR_FIELDS) + len(HASH_FIELDS) + len(TOKEN_FIELDS) + 1) * 8

Signature = Hashable


@dataclass(frozen=True)
class BatchLimits:
    """Per-put bounds: rows, tokens and bytes (all positive)."""

    max_rows: int
    max_tokens: int
    max_bytes: int

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_tokens", "max_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise BatchLimitError(f"{name} must be a positive int, got {v!r}")


@dataclass
class PlannedBatch:
    """One put: row indices (caller's numbering, in the order added), totals, signature."""

    signature: Signature
    rows: list[int] = field(default_factory=list)
    tokens: int = 0
    nbytes: int = 0
    oversized: bool = False

    def __len__(self) -> int:
        return len(self.rows)


def row_signature(row: StagedRow) -> Signature:
    """(field, dtype, trailing shape) of every token field the row carries."""
    sig = tuple((name, np.asarray(getattr(row, name)).dtype.str, ()) for name in TOKEN_FIELDS)
    if row.routes_encoding and row.routed_experts is not None:
        r = row.routed_experts
        sig += ((ROUTES_FIELD, r.dtype.str, tuple(r.shape[1:])),)
    return sig


def put_nbytes(row: StagedRow) -> int:
    """Bytes the row adds to a packed put: token payload + routed experts + fixed fields."""
    ids = sum(len((getattr(row, n) or "").encode("utf-8")) for n in ID_FIELDS)
    routes = row.routed_experts.nbytes if (row.routes_encoding and row.routed_experts is not None) else 0
    return int(row.token_ids.nbytes + row.token_mask.nbytes + row.logprobs.nbytes + routes + ids + ROW_FIXED_BYTES)


class BatchPlanner:
    """Greedy, order-keeping batcher: one open batch per signature.

    :meth:`add` returns the batches the new row closed (ready to put now); :meth:`flush`
    closes the rest. A row that does not fit its signature's open batch closes it and
    opens the next one; an oversized row is returned as its own batch at once and leaves
    the open batch untouched.
    """

    def __init__(self, limits: BatchLimits):
        self.limits = limits
        self._open: dict[Signature, PlannedBatch] = {}

    @property
    def pending_rows(self) -> list[int]:
        """Rows added but not yet returned in a batch (they roll back if a cut stops)."""
        return [i for b in self._open.values() for i in b.rows]

    def add(self, index: int, tokens: int, nbytes: int, signature: Signature = None) -> list[PlannedBatch]:
        if tokens < 0 or nbytes < 0:
            raise ValueError(f"row {index}: tokens ({tokens}) and nbytes ({nbytes}) must be >= 0")
        lim = self.limits
        if tokens > lim.max_tokens or nbytes > lim.max_bytes:
            return [PlannedBatch(signature, [index], tokens, nbytes, oversized=True)]
        ready: list[PlannedBatch] = []
        b = self._open.get(signature)
        if b is not None and (
            len(b.rows) + 1 > lim.max_rows or b.tokens + tokens > lim.max_tokens or b.nbytes + nbytes > lim.max_bytes
        ):
            ready.append(b)
            b = None
        if b is None:
            b = self._open[signature] = PlannedBatch(signature)
        b.rows.append(index)
        b.tokens += tokens
        b.nbytes += nbytes
        if len(b.rows) == lim.max_rows:
            # Full: put it now rather than waiting for the next row to overflow it.
            ready.append(self._open.pop(signature))
        return ready

    def flush(self) -> list[PlannedBatch]:
        """Close every open batch, in order of each batch's first row."""
        out = sorted(self._open.values(), key=lambda b: b.rows[0])
        self._open.clear()
        return out

    def discard(self) -> list[int]:
        """Drop the open batches (a stopped cut); return their rows to roll back."""
        rows = self.pending_rows
        self._open.clear()
        return rows


def plan_batches(
    tokens: Sequence[int],
    nbytes: Sequence[int],
    signatures: Sequence[Signature] | None = None,
    *,
    limits: BatchLimits,
) -> list[PlannedBatch]:
    """Plan every row at once; batches are ordered by their first row."""
    if len(tokens) != len(nbytes) or (signatures is not None and len(signatures) != len(tokens)):
        raise ValueError(f"{len(tokens)} token counts, {len(nbytes)} byte counts, "
                         f"{'no' if signatures is None else len(signatures)} signatures")
    planner = BatchPlanner(limits)
    out: list[PlannedBatch] = []
    for i in range(len(tokens)):
        out.extend(planner.add(i, int(tokens[i]), int(nbytes[i]), None if signatures is None else signatures[i]))
    out.extend(planner.flush())
    out.sort(key=lambda b: b.rows[0])
    return out


def plan_rows(rows: Iterable[StagedRow], *, limits: BatchLimits) -> list[PlannedBatch]:
    """:func:`plan_batches` over staged (prefix) rows: delta_len tokens, :func:`put_nbytes` bytes."""
    rows = list(rows)
    return plan_batches(
        [r.delta_len for r in rows], [put_nbytes(r) for r in rows], [row_signature(r) for r in rows], limits=limits
    )


# ---- frozen chunks packed straight into batch buffers ----------------------------------

# (ids <i8[n], logprobs <f4[n], routes <i2[n, L, K] or None): one piece of generated tokens.
Part = tuple[np.ndarray, np.ndarray, np.ndarray | None]
_IDS = TOKEN_FIELDS["token_ids"]
_MASK = TOKEN_FIELDS["token_mask"]
_LOGPROBS = TOKEN_FIELDS["logprobs"]
# ``allocate(field sizes in bytes)`` -> an allocator for those fields' buffers, or None
# for fresh arrays (e.g. ``SlabPool.allocator`` of the store: pooled slabs).
BufferSource = Callable[[Sequence[int]], Allocator | None]
_TOKEN_SIGNATURE = tuple((name, dt.str, ()) for name, dt in TOKEN_FIELDS.items())
# Digest v1 (tasks/hashing.py) after its identity part: <q prev_len> <q delta_len>
# <q cum_len> <q weight_version> <b routes_encoding>, then the ids' <Q nbytes>.
_DIGEST_LENGTHS = struct.Struct("<qqqqb")
_DIGEST_LENGTHS_IDS = struct.Struct("<qqqqbQ")
_NBYTES = struct.Struct("<Q")
_ROUTES_HEAD = struct.Struct("<IIQ")
# What pack_chunks reads of every chunk, in one C-level call per chunk.
_CHUNK_FIELDS = operator.attrgetter(
    "key", "delta_len", "identity", "prev_len", "weight_version", "chain_hash", "cumulative_hash", "context_ids"
)
_HASH_LEN = {HASH_BYTES}


@dataclass(frozen=True, eq=False)
class CallIdentity:
    """What every chunk of one call shares, encoded once per call (not per row).

    ``rollout_id``/``model_call_id``/``parent_call_id`` are the ids' UTF-8 bytes
    (``parent_call_id`` ``None`` for a root); ``digest_head`` is the digest v1 header
    up to its lengths (tag, versions, ids, parent marker); ``id_nbytes`` the ids' bytes
    a packed row carries.
    """

    rollout_id: bytes
    model_call_id: bytes
    parent_call_id: bytes | None
    digest_head: bytes
    id_nbytes: int

    @classmethod
    def of(cls, rollout_id: str, model_call_id: str, parent_call_id: str | None) -> "CallIdentity":
        """The identity of a call with these (already checked) ids."""
        rid, mid = rollout_id.encode("utf-8"), model_call_id.encode("utf-8")
        pid = None if parent_call_id is None else parent_call_id.encode("utf-8")
        head = hashing.digest_header(SCHEMA_VERSION, hashing.DIGEST_VERSION, rid, mid, pid, 0, 0, 0, 0, 0)
        return cls(rid, mid, pid, head[: -_DIGEST_LENGTHS.size], len(rid) + len(mid) + len(pid or b""))


@dataclass(eq=False)
class PrefixChunk:
    """One cut row described by its pieces (nothing concatenated yet).

    ``context_ids`` (and ``context_routes``) are set on a call's first chunk only: its
    carried tokens, written with mask 0 and logprob 0. ``parts`` are the generated pieces
    (mask 1) in order. ``prev_len`` (tokens) is the prefix already sealed before this
    chunk; ``chain_hash``/``cumulative_hash`` are the running states read at freeze time.
    Arrays are little-endian and contiguous (``CallBuffer`` guarantees it). ``identity``
    encodes the ids as given at construction: a chunk's ids are not reassigned after it.
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
    ) -> "PrefixChunk":
        """A chunk built without :meth:`__post_init__`'s checks, for a writer whose pieces
        are valid by construction (:class:`~pipeline.generation.call_buffer.CallBuffer`
        converts every piece on append): ``delta_len`` (tokens) and ``identity`` given."""
        # Plain attribute stores: the instance keeps its values inline (reading
        # ``__dict__`` would allocate a dict per chunk, one more object for the GC).
        self = object.__new__(cls)
        self.key, self.rollout_id, self.model_call_id, self.parent_call_id = key, rollout_id, model_call_id, parent_call_id
        self.prev_len, self.weight_version, self.context_ids, self.context_routes = prev_len, weight_version, context_ids, context_routes
        self.parts, self.routes_shape, self.chain_hash, self.cumulative_hash = parts, routes_shape, chain_hash, cumulative_hash
        self.delta_len, self.identity = delta_len, identity
        return self

    def __post_init__(self) -> None:
        # Checked per piece (a few per call, never per token): pack_chunks copies with
        # numpy's casting rules, which would silently convert a wrong dtype.
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
                    else ctx_routes.dtype is ROUTES_DTYPE and ctx_routes.shape[1:] == rs and len(ctx_routes) == len(ctx))
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
                    else routes.dtype is ROUTES_DTYPE and routes.shape[1:] == rs and len(routes) == len(ids))
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

    def _check_routes(self, what: str, a: object, n: int, rs: tuple | None) -> None:
        if rs is None:
            if a is not None:
                raise InvalidChunk(f"{self.key}: {what} given but routes_shape is None")
            return
        if not isinstance(a, np.ndarray) or a.dtype != ROUTES_DTYPE or a.shape != (n,) + rs:
            got = f"{a.dtype.str}{list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise InvalidChunk(f"{self.key}: {what} must be {ROUTES_DTYPE.str}{[n, *rs]}, got {got}")

    @property
    def signature(self) -> Signature:
        """Same value as :func:`row_signature` of the row this chunk packs to."""
        return chunk_signature(self.routes_shape)

    @property
    def nbytes(self) -> int:
        """Same value as :func:`put_nbytes` of the row this chunk packs to (bytes)."""
        return self.delta_len * token_nbytes(self.routes_shape) + self.identity.id_nbytes + ROW_FIXED_BYTES

    def to_row(self) -> StagedRow:
        """The chunk as a :class:`StagedRow` (concatenated, digest set): what a put stores."""
        from ..packed import unpack_rows

        return unpack_rows(pack_chunks([self]))[0]


def chunk_signature(routes_shape: tuple[int, int] | None) -> Signature:
    """The planner signature of every chunk with ``routes_shape`` (:func:`row_signature`)."""
    if routes_shape is None:
        return _TOKEN_SIGNATURE
    return _TOKEN_SIGNATURE + ((ROUTES_FIELD, ROUTES_DTYPE.str, tuple(routes_shape)),)


def token_nbytes(routes_shape: tuple[int, int] | None) -> int:
    """Bytes one token adds to a packed row: ids, mask, logprobs (and routed experts)."""
    return 16 + (0 if routes_shape is None else 2 * routes_shape[0] * routes_shape[1])


def _utf8_field(encoded: Sequence[bytes]) -> PackedField:
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return PackedField(np.frombuffer(bytearray(b"".join(encoded)), dtype=np.uint8), offsets)


def _fresh(dtype: np.dtype, shape: tuple) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _concat(pieces: list[np.ndarray], out: np.ndarray) -> np.ndarray:
    """``pieces`` copied back to back into ``out`` (one numpy call); returns ``out``."""
    if len(pieces) > 1:
        np.concatenate(pieces, out=out)
    elif pieces:
        out[...] = pieces[0]
    return out


def pack_chunks(chunks: Sequence[PrefixChunk], allocate: BufferSource | None = None) -> PackedBatch:
    """Pack ``chunks`` as one :class:`PackedBatch` keyed by ``chunk.key`` (rows in order).

    Byte-identical to ``pack_rows([c.to_row() for c in chunks])`` with the keys replaced,
    but each token is copied once (piece -> batch buffer) and each digest is hashed over
    the batch buffer's row slices. Chunks of one batch share a routes shape (or none):
    the planner groups them by :attr:`PrefixChunk.signature`. ``allocate(sizes)``, given
    the token fields' sizes (bytes), may supply an allocator for their buffers (e.g.
    views of a pooled slab, memory already mapped); by default they are fresh arrays.
    """
    n = len(chunks)
    shapes = {c.routes_shape for c in chunks}
    if len(shapes) > 1:
        raise InvalidChunk(f"chunks of one batch must share a routes shape, got {sorted(map(str, shapes))}")
    routes_shape = shapes.pop() if shapes else None
    with_routes = routes_shape is not None
    # Each row's scalars, identity and hashes read in one C-level pass (no per-row
    # Python), then the pieces in row order: context (mask 0, logprob 0) then generated
    # parts (mask 1), a few list appends per row, nothing per token.
    rows = list(map(_CHUNK_FIELDS, chunks))
    keys, lengths, idents, prevs, versions, chains, cums, ctxs = map(list, zip(*rows)) if n else ([] for _ in range(8))
    if n and (set(map(len, chains)) != _HASH_LEN or set(map(len, cums)) != _HASH_LEN):
        # Checked per chunk (a per-batch length check passes 31 + 33 bytes); named on failure.
        bad = next(c for c in chunks if len(c.chain_hash) != HASH_BYTES or len(c.cumulative_hash) != HASH_BYTES)
        raise InvalidChunk(f"{bad.key}: chain_hash and cumulative_hash must be {HASH_BYTES} bytes each")
    ctx_lens = [0 if ctx is None else len(ctx) for ctx in ctxs]
    zeros = np.zeros(max(ctx_lens, default=0), dtype=_LOGPROBS)
    id_pieces: list[np.ndarray] = []
    lp_pieces: list[np.ndarray] = []
    route_pieces: list[np.ndarray] = []
    add_id, add_lp, add_route = id_pieces.append, lp_pieces.append, route_pieces.append
    for c, ctx, k in zip(chunks, ctxs, ctx_lens):
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
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    route_shape = () if routes_shape is None else tuple(routes_shape)
    out = None
    if allocate is not None:
        sizes = [total * _IDS.itemsize, total * _MASK.itemsize, total * _LOGPROBS.itemsize]
        out = allocate(sizes if routes_shape is None else sizes + [total * ROUTES_DTYPE.itemsize * routes_shape[0] * routes_shape[1]])
    out = out or _fresh
    # Copied by ONE concatenate per field (no per-row numpy call).
    ids = _concat(id_pieces, out(_IDS, (total,)))
    mask = out(_MASK, (total,))
    lps = _concat(lp_pieces, out(_LOGPROBS, (total,)))
    routes = None if routes_shape is None else _concat(route_pieces, out(ROUTES_DTYPE, (total,) + route_shape))
    # Mask: 1 for generated tokens, 0 for each row's context (its first tokens).
    mask.fill(1.0)
    delta = np.array(lengths, dtype=np.int64)
    ctx = np.array(ctx_lens, dtype=np.int64)
    n_ctx = int(ctx.sum())
    if n_ctx:
        ctx_start = np.cumsum(ctx) - ctx  # where each row's context starts among all context tokens
        mask[np.repeat(offsets[:-1] - ctx_start, ctx) + np.arange(n_ctx, dtype=np.int64)] = 0.0
    ids_b, mask_b, lps_b = memoryview(ids).cast("B"), memoryview(mask).cast("B"), memoryview(lps).cast("B")
    routes_b = None if routes is None else memoryview(routes.reshape(-1)).cast("B")
    per_route = 0 if routes_shape is None else 2 * routes_shape[0] * routes_shape[1]  # bytes per token
    enc = ROUTES_NONE if routes is None else ROUTES_INT16
    # One digest per row over its slices of the batch buffers (digest v1, tasks/hashing.py):
    # the call's encoded identity head, then lengths and buffers; a few calls per row.
    digests: list[bytes] = []
    add_digest = digests.append
    sha256, lengths_ids, nbytes = hashlib.sha256, _DIGEST_LENGTHS_IDS.pack, _NBYTES.pack
    starts, ends = offsets[:-1].tolist(), offsets[1:].tolist()
    for ident, p, version, chain, cum, a, b in zip(idents, prevs, versions, chains, cums, starts, ends):
        k = b - a
        h = sha256(ident.digest_head + lengths_ids(p, k, p + k, version, enc, 8 * k))
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
    arange = np.arange(n + 1, dtype=np.int64)
    prev = np.array(prevs, dtype=np.int64)
    scalars = {
        "prev_len": prev,
        "delta_len": delta,
        "cum_len": prev + delta,
        "weight_version": np.array(versions, dtype=np.int64),
        "routes_encoding": np.full(n, enc),
        "schema_version": np.full(n, SCHEMA_VERSION),
        "digest_version": np.full(n, hashing.DIGEST_VERSION),
    }
    fields: dict[str, PackedField] = {
        "rollout_id": _utf8_field([d.rollout_id for d in idents]),
        "model_call_id": _utf8_field([d.model_call_id for d in idents]),
        "parent_call_id": _utf8_field([d.parent_call_id or b"" for d in idents]),
    }
    for name, dt in SCALAR_FIELDS.items():
        fields[name] = PackedField(scalars[name].astype(dt, copy=False), arange.copy())
    for name, values in (("digest", digests), ("chain_hash", chains), ("cumulative_hash", cums)):
        fields[name] = PackedField(np.frombuffer(bytearray(b"".join(values)), dtype=np.uint8), arange * HASH_BYTES)
    fields["token_ids"] = PackedField(ids, offsets)
    fields["token_mask"] = PackedField(mask, offsets.copy())
    fields["logprobs"] = PackedField(lps, offsets.copy())
    if routes is not None:
        fields[ROUTES_FIELD] = PackedField(routes, offsets.copy())
    return PackedBatch(keys, fields)
