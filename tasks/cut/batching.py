"""Batch planning and packing for checkpoint-cut prefix puts. Pure.

A cut writes one prefix row per in-flight call, in batches of one ``put_many`` each,
bounded by rows, tokens and payload bytes (routes included) per put. :class:`BatchPlanner`
plans incrementally (a batch is put as soon as it is full); :func:`pack_chunks` writes a
batch of :class:`PrefixChunk` straight into one buffer per field and digests each row over
its slices. Per-row Python only, never per token. docs/design.md, "Checkpoint cuts".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Iterable, Sequence

import numpy as np

from .. import hashing
from ..errors import BatchLimitError, InvalidChunk
from ..packed import PackedBatch, PackedField
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
_LOGPROBS = TOKEN_FIELDS["logprobs"]
_TOKEN_SIGNATURE = tuple((name, dt.str, ()) for name, dt in TOKEN_FIELDS.items())


@dataclass(eq=False)
class PrefixChunk:
    """One cut row described by its pieces (nothing concatenated yet).

    ``context_ids`` (and ``context_routes``) are set on a call's first chunk only: its
    carried tokens, written with mask 0 and logprob 0. ``parts`` are the generated pieces
    (mask 1) in order. ``prev_len`` (tokens) is the prefix already sealed before this
    chunk; ``chain_hash``/``cumulative_hash`` are the running states read at freeze time.
    Arrays are little-endian and contiguous (``CallBuffer`` guarantees it).
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
        if self.routes_shape is None:
            return _TOKEN_SIGNATURE
        return _TOKEN_SIGNATURE + ((ROUTES_FIELD, ROUTES_DTYPE.str, tuple(self.routes_shape)),)

    @property
    def nbytes(self) -> int:
        """Same value as :func:`put_nbytes` of the row this chunk packs to (bytes)."""
        per_token = 16 + (0 if self.routes_shape is None else 2 * self.routes_shape[0] * self.routes_shape[1])
        ids = len(self.rollout_id.encode("utf-8")) + len(self.model_call_id.encode("utf-8"))
        ids += len((self.parent_call_id or "").encode("utf-8"))
        return self.delta_len * per_token + ids + ROW_FIXED_BYTES

    def to_row(self) -> StagedRow:
        """The chunk as a :class:`StagedRow` (concatenated, digest set): what a put stores."""
        from ..packed import unpack_rows

        return unpack_rows(pack_chunks([self]))[0]


def _utf8_field(encoded: Sequence[bytes]) -> PackedField:
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return PackedField(np.frombuffer(bytearray(b"".join(encoded)), dtype=np.uint8), offsets)


def _concat(pieces: list[np.ndarray], total: int, trailing: tuple, dtype: np.dtype) -> np.ndarray:
    out = np.empty((total,) + trailing, dtype=dtype)
    if len(pieces) > 1:
        np.concatenate(pieces, out=out)
    elif pieces:
        out[...] = pieces[0]
    return out


def pack_chunks(chunks: Sequence[PrefixChunk]) -> PackedBatch:
    """Pack ``chunks`` as one :class:`PackedBatch` keyed by ``chunk.key`` (rows in order).

    Byte-identical to ``pack_rows([c.to_row() for c in chunks])`` with the keys replaced,
    but each token is copied once (piece -> batch buffer) and each digest is hashed over
    the batch buffer's row slices. Chunks of one batch share a routes shape (or none):
    the planner groups them by :attr:`PrefixChunk.signature`.
    """
    n = len(chunks)
    shapes = {c.routes_shape for c in chunks}
    if len(shapes) > 1:
        raise InvalidChunk(f"chunks of one batch must share a routes shape, got {sorted(map(str, shapes))}")
    routes_shape = shapes.pop() if shapes else None
    lengths = [c.delta_len for c in chunks]
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    # Pieces in row order, copied by ONE concatenate per field (no per-row numpy call):
    # context (mask 0, logprob 0) then the generated parts (mask 1).
    ctx_lens = [0 if c.context_ids is None else len(c.context_ids) for c in chunks]
    zeros = np.zeros(max(ctx_lens, default=0), dtype=TOKEN_FIELDS["logprobs"])
    id_pieces: list[np.ndarray] = []
    lp_pieces: list[np.ndarray] = []
    route_pieces: list[np.ndarray] = []
    for c, k in zip(chunks, ctx_lens):
        if k:
            id_pieces.append(c.context_ids)
            lp_pieces.append(zeros[:k])
            if routes_shape is not None:
                route_pieces.append(c.context_routes)
        for p in c.parts:
            id_pieces.append(p[0])
            lp_pieces.append(p[1])
            if routes_shape is not None:
                route_pieces.append(p[2])
    ids = _concat(id_pieces, total, (), TOKEN_FIELDS["token_ids"])
    lps = _concat(lp_pieces, total, (), TOKEN_FIELDS["logprobs"])
    routes = None if routes_shape is None else _concat(route_pieces, total, tuple(routes_shape), ROUTES_DTYPE)
    seg = np.empty(2 * n, dtype=np.int64)  # per row: context length, generated length
    seg[0::2] = ctx_lens
    seg[1::2] = np.asarray(lengths, dtype=np.int64) - seg[0::2]
    mask = np.repeat(np.tile(np.array([0.0, 1.0], dtype=TOKEN_FIELDS["token_mask"]), n), seg)
    ids_b, mask_b, lps_b = memoryview(ids).cast("B"), memoryview(mask).cast("B"), memoryview(lps).cast("B")
    routes_b = None if routes is None else memoryview(routes.reshape(-1)).cast("B")
    per_route = 0 if routes_shape is None else 2 * routes_shape[0] * routes_shape[1]  # bytes per token
    enc = ROUTES_NONE if routes is None else ROUTES_INT16
    rid = [c.rollout_id.encode("utf-8") for c in chunks]
    mid = [c.model_call_id.encode("utf-8") for c in chunks]
    pid = [None if c.parent_call_id is None else c.parent_call_id.encode("utf-8") for c in chunks]
    digests: list[bytes] = []
    bounds = offsets.tolist()
    for i, c in enumerate(chunks):
        if len(c.chain_hash) != HASH_BYTES or len(c.cumulative_hash) != HASH_BYTES:
            # Checked per chunk: a per-batch length check passes 31 + 33 bytes.
            raise InvalidChunk(f"{c.key}: chain_hash and cumulative_hash must be {HASH_BYTES} bytes each")
        a, b = bounds[i], bounds[i + 1]
        header = hashing.digest_header(SCHEMA_VERSION, hashing.DIGEST_VERSION, rid[i], mid[i], pid[i],
                                       c.prev_len, b - a, c.prev_len + b - a, c.weight_version, enc)
        r = None if routes is None else (routes_shape[0], routes_shape[1], routes_b[a * per_route : b * per_route])
        digests.append(hashing.digest_raw(header, ids_b[a * 8 : b * 8], mask_b[a * 4 : b * 4],
                                          lps_b[a * 4 : b * 4], r, c.chain_hash, c.cumulative_hash))
    arange = np.arange(n + 1, dtype=np.int64)
    prev = np.fromiter((c.prev_len for c in chunks), dtype=np.int64, count=n)
    delta = np.asarray(lengths, dtype=np.int64)
    scalars = {
        "prev_len": prev,
        "delta_len": delta,
        "cum_len": prev + delta,
        "weight_version": np.fromiter((c.weight_version for c in chunks), dtype=np.int64, count=n),
        "routes_encoding": np.full(n, enc),
        "schema_version": np.full(n, SCHEMA_VERSION),
        "digest_version": np.full(n, hashing.DIGEST_VERSION),
    }
    fields: dict[str, PackedField] = {
        "rollout_id": _utf8_field(rid),
        "model_call_id": _utf8_field(mid),
        "parent_call_id": _utf8_field([b"" if p is None else p for p in pid]),
    }
    for name, dt in SCALAR_FIELDS.items():
        fields[name] = PackedField(scalars[name].astype(dt, copy=False), arange.copy())
    hashes = {"digest": digests, "chain_hash": [c.chain_hash for c in chunks],
              "cumulative_hash": [c.cumulative_hash for c in chunks]}
    for name in HASH_FIELDS:
        buf = b"".join(hashes[name])
        if len(buf) != n * HASH_BYTES:
            raise ValueError(f"{name}: every chunk needs {HASH_BYTES} bytes")
        fields[name] = PackedField(np.frombuffer(bytearray(buf), dtype=np.uint8), arange * HASH_BYTES)
    fields["token_ids"] = PackedField(ids, offsets)
    fields["token_mask"] = PackedField(mask, offsets.copy())
    fields["logprobs"] = PackedField(lps, offsets.copy())
    if routes is not None:
        fields[ROUTES_FIELD] = PackedField(routes, offsets.copy())
    return PackedBatch([c.key for c in chunks], fields)
