"""Verify a restored cut prefix against its continuation, and build what to resume from. Pure.

Every digest is recomputed, none trusted; the first failing check names the reason
(continuation, rows, per-chunk lengths and hashes, vectorized content, token count and
prefix digest). Per-chunk Python only (a prefix has a handful of chunks); content scans
run over the whole prefix at once. Cut row format and check order: docs/design.md,
"Checkpoint cuts".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

import numpy as np

from .. import digests, hashing, reasons, validation
from .receipt import CallAck
from .receipt import prefix_digest as _prefix_digest
from ..errors import InvalidKey
from ..keys import CUT_PREFIX
from ..packed import PackedBatch, row_from_fields
from ..schema import HASH_BYTES, ROUTES_ENCODINGS, ROUTES_NONE, STAGING_FIELDS, StagedRow, routes_field

if TYPE_CHECKING:
    from ..digests import Hasher

# Reasons of this module beyond the finalizer's vocabulary (tasks.reasons).
EMPTY_PREFIX = "empty_prefix"
INVALID_CONTINUATION = "invalid_continuation"
PREFIX_OUT_OF_ORDER = "prefix_out_of_order"
PREFIX_LENGTH_MISMATCH = "prefix_length_mismatch"
PREFIX_DIGEST_MISMATCH = "prefix_digest_mismatch"
PREFIX_REASONS = frozenset(
    {EMPTY_PREFIX, INVALID_CONTINUATION, PREFIX_OUT_OF_ORDER, PREFIX_LENGTH_MISMATCH, PREFIX_DIGEST_MISMATCH}
)


@dataclass(frozen=True)
class Continuation:
    """What a resumed call carries: cut keys in chain order, token count, prefix digest
    and the digest version of that digest and of the rows (None: the rows' own decides)."""

    keys: tuple[str, ...]
    prefix_tokens: int  # tokens
    prefix_digest: bytes  # 32 bytes
    digest_version: int | None = None

    @classmethod
    def of(cls, obj: ContinuationLike) -> "Continuation":
        """From a :class:`Continuation`, a ``CallAck`` (``staging_keys``) or a dict (or
        any object with those attributes).

        Raises ``ValueError`` naming what is malformed.
        """
        if isinstance(obj, Continuation):
            return obj
        get = obj.get if isinstance(obj, Mapping) else (lambda name, default=None: getattr(obj, name, default))
        keys = get("staging_keys")
        if keys is None:
            keys = get("keys")
        if keys is None or isinstance(keys, (str, bytes)):
            raise ValueError(f"continuation needs a list of cut keys, got {keys!r}")
        try:
            keys = tuple(keys)
        except TypeError:
            raise ValueError(f"continuation needs a list of cut keys, got {type(keys).__name__}") from None
        tokens, digest = get("prefix_tokens"), get("prefix_digest")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
            raise ValueError(f"continuation prefix_tokens must be an int, got {tokens!r}")
        if not isinstance(digest, (bytes, bytearray)) or len(digest) != HASH_BYTES:
            raise ValueError(f"continuation prefix_digest must be {HASH_BYTES} bytes, got {digest!r}")
        version = get("digest_version")
        if version is not None and (isinstance(version, bool) or version not in digests.SUPPORTED_VERSIONS):
            raise ValueError(f"continuation digest_version {version!r} unsupported ({digests.described()})")
        return cls(tuple(keys), int(tokens), bytes(digest), None if version is None else int(version))


# What verify_prefix and Continuation.of take: a continuation, a cut receipt's CallAck,
# or a mapping with ``staging_keys`` (or ``keys``), ``prefix_tokens`` and ``prefix_digest``.
ContinuationLike = Continuation | CallAck | Mapping[str, Any]


@dataclass
class ResumePrefix:
    """A verified prefix, ready to resume from (arrays are the whole prefix, in order)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    weight_version: int
    keys: tuple[str, ...]
    chunk_lengths: tuple[int, ...]  # tokens per chunk, chain order
    token_ids: np.ndarray  # int64[T]
    token_mask: np.ndarray  # float32[T]
    logprobs: np.ndarray  # float32[T]
    routed_experts: np.ndarray | None  # [T, L, K] as stored (int16 or uint8), or None
    context_tokens: int  # leading mask-0 tokens (the call's carried context)
    prefix_digest: bytes
    digest_version: int = digests.DEFAULT_VERSION  # of every hash of the prefix: the resumed call continues with it

    @property
    def tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """``token_ids``, ``token_mask``, ``logprobs`` (and ``routed_experts``): the
        ``prefix`` mapping ``GenerationWorker.resume_call`` takes."""
        out = {"token_ids": self.token_ids, "token_mask": self.token_mask, "logprobs": self.logprobs}
        if self.routed_experts is not None:
            out["routed_experts"] = self.routed_experts
        return out

    def resume_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``GenerationWorker.resume_call`` (besides history and budget)."""
        return {
            "prefix": self.arrays(),
            "prefix_keys": list(self.keys),
            "chunk_lengths": list(self.chunk_lengths),
            "parent_call_id": self.parent_call_id,
            "weight_version": self.weight_version,
            "expected_digest": self.prefix_digest,
            "digest_version": self.digest_version,
        }


@dataclass
class PrefixVerdict:
    """``usable`` with the prefix to resume from, or not, with a reason and detail."""

    usable: bool
    reason: str | None = None
    detail: str = ""
    prefix: ResumePrefix | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.usable

    @classmethod
    def unusable(cls, reason: str, detail: str) -> "PrefixVerdict":
        return cls(False, reason, detail, None)


def parse_cut_key(key: str) -> tuple[str, str, str, int]:
    """``(checkpoint_id, rollout_id, model_call_id, seq)`` of a cut key; ``InvalidKey`` if not one."""
    if not isinstance(key, str):
        raise InvalidKey(f"cut key must be str, got {type(key).__name__}")
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != CUT_PREFIX or not all(parts[1:4]):
        raise InvalidKey(f"{key!r} is not a cut key {CUT_PREFIX}/checkpoint/rollout/call/seq")
    try:
        seq = int(parts[4])
    except ValueError:
        raise InvalidKey(f"{key!r}: seq {parts[4]!r} is not an int") from None
    if seq < 0 or str(seq) != parts[4]:
        raise InvalidKey(f"{key!r}: seq {parts[4]!r} is not a canonical non-negative int")
    return parts[1], parts[2], parts[3], seq


def verify_prefix(
    rows: PackedBatch,
    continuation: ContinuationLike,
    *,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    routes_shape: tuple[int, int] | None = None,
) -> PrefixVerdict:
    """Verify ``rows`` (the chunks read for ``continuation``'s keys, in chain order).

    ``vocab_size`` / ``num_experts`` / ``routes_shape`` (``(L, K)``) enable the range and
    shape checks when given. Never raises on bad data: every problem is a verdict. The
    checks run in the order of the module docstring; the first that fails names it.
    """
    try:
        cont = _checked_continuation(continuation)
        _, rollout_id, call_id, _ = parse_cut_key(cont.keys[0])
        _check_rows(rows, cont)
        chain = _walk_chunks(rows, cont, rollout_id, call_id)
        content = _check_content(rows, cont, chain.routed, vocab_size, num_experts, routes_shape)
        digest = _check_claims(cont, chain.tokens, content.token_ids, chain.digest_version)
    except _Unusable as e:
        return PrefixVerdict.unusable(e.reason, e.detail)
    return PrefixVerdict(
        True,
        None,
        "",
        ResumePrefix(
            rollout_id=rollout_id,
            model_call_id=call_id,
            parent_call_id=chain.parent_call_id,
            weight_version=int(chain.weight_version),
            keys=cont.keys,
            chunk_lengths=tuple(chain.chunk_lengths),
            token_ids=content.token_ids,
            token_mask=content.token_mask,
            logprobs=content.logprobs,
            routed_experts=content.routed_experts,
            context_tokens=int(len(content.token_mask) - np.count_nonzero(content.token_mask)),
            prefix_digest=digest,
            digest_version=chain.digest_version,
        ),
    )


# ---- the checks, in order: each raises _Unusable with the verdict's reason and detail ----


class _Unusable(Exception):
    """Internal: the first failed check's ``(reason, detail)``, turned into a verdict."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    @classmethod
    def of(cls, problem: tuple[str, str]) -> "_Unusable":
        return cls(*problem)


@dataclass
class _ChainWalk:
    """What the per-chunk checks established, chunk by chunk in chain order."""

    tokens: int = 0  # tokens of the chunks checked so far (the last one's cum_len)
    parent_call_id: str | None = None  # chunk 0's (every chunk must agree)
    weight_version: int = 0  # chunk 0's
    chunk_lengths: list[int] = field(default_factory=list)  # tokens per chunk
    routed: list[int] = field(default_factory=list)  # per chunk: its routes encoding (0: none)
    digest_version: int = digests.DEFAULT_VERSION  # chunk 0's (every chunk must share it)


class _Content(NamedTuple):
    """The whole prefix's token fields: views of the packed buffers, no copy."""

    token_ids: np.ndarray  # int64[T]
    token_mask: np.ndarray  # float32[T]
    logprobs: np.ndarray  # float32[T]
    routed_experts: np.ndarray | None  # [T, L, K] (int16 or uint8) or None


def _checked_continuation(continuation: ContinuationLike) -> Continuation:
    """The continuation, with at least one key, its keys one call's chunks 0, 1, ..."""
    try:
        cont = Continuation.of(continuation)
    except ValueError as e:
        raise _Unusable(INVALID_CONTINUATION, str(e)) from None
    if not cont.keys:
        raise _Unusable(EMPTY_PREFIX, "the continuation lists no cut keys")
    problem = _check_keys(cont.keys)
    if problem:
        raise _Unusable.of(problem)
    return cont


def _check_rows(rows: PackedBatch, cont: Continuation) -> None:
    """One row per key, in chain order, each with every staging field."""
    if not isinstance(rows, PackedBatch):
        raise _Unusable(reasons.INVALID_STAGING_ROW, f"rows must be a PackedBatch, got {type(rows).__name__}")
    if list(rows.keys) != list(cont.keys):
        missing = [k for k in cont.keys if k not in set(rows.keys)]
        if missing:
            raise _Unusable(reasons.MISSING_STAGING_ROW, f"no row for {missing[0]!r} ({len(missing)} missing)")
        raise _Unusable(PREFIX_OUT_OF_ORDER, f"rows come as {list(rows.keys)[:4]}..., not in chain order")
    absent = [f for f in STAGING_FIELDS if f not in rows.fields]
    if absent:
        raise _Unusable(reasons.INVALID_STAGING_ROW, f"the rows lack field(s) {absent}")
    for name in STAGING_FIELDS:
        f = rows.fields[name]
        if f.present is not None and not f.present.all():
            i = int(np.flatnonzero(~f.present)[0])
            raise _Unusable(reasons.INVALID_STAGING_ROW, f"{rows.keys[i]!r} has no {name!r}")


def _walk_chunks(rows: PackedBatch, cont: Continuation, rollout_id: str, call_id: str) -> _ChainWalk:
    """Every chunk in chain order: identity, lengths, routes, its digest and both running
    hashes recomputed (per-chunk Python: a prefix has a handful of chunks)."""
    walk = _ChainWalk()
    chain: bytes | None = None
    cumulative: Hasher | None = None
    for i, key in enumerate(cont.keys):
        try:
            row = row_from_fields(rows.row(i))
        except (KeyError, ValueError, IndexError, UnicodeDecodeError) as e:
            raise _Unusable(reasons.INVALID_STAGING_ROW, f"{key!r} does not decode: {type(e).__name__}: {e}") from None
        _check_chunk_identity(row, key, i, rollout_id, call_id, walk)
        if i == 0:
            walk.digest_version = _chunk_version(row, key, cont)
            cumulative = hashing.prefix_state(None, walk.digest_version)
        elif row.digest_version != walk.digest_version:
            raise _Unusable(
                reasons.INVALID_STAGING_ROW,
                f"{key!r}: digest_version {row.digest_version}, chunk 0's {walk.digest_version}: one call, one algorithm",
            )
        _check_chunk_layout(row, key, walk.tokens)
        chain = _check_chunk_hashes(row, key, i, chain, cumulative)
        walk.tokens = row.cum_len
        walk.chunk_lengths.append(row.delta_len)
        walk.routed.append(row.routes_encoding)
    return walk


def _chunk_version(row: StagedRow, key: str, cont: Continuation) -> int:
    """Chunk 0's digest version: one this build computes, and the continuation's when it
    states one; else invalid_staging_row."""
    v = row.digest_version
    if v not in digests.SUPPORTED_VERSIONS:
        raise _Unusable(reasons.INVALID_STAGING_ROW, f"{key!r}: digest_version {v} unsupported ({digests.described()})")
    if cont.digest_version is not None and v != cont.digest_version:
        raise _Unusable(reasons.INVALID_STAGING_ROW, f"{key!r}: digest_version {v}, the continuation's {cont.digest_version}")
    return v


def _check_chunk_identity(row: StagedRow, key: str, i: int, rollout_id: str, call_id: str, walk: _ChainWalk) -> None:
    """The chunk belongs to the continuation's call, with chunk 0's parent (chunk 0 sets
    ``walk``'s parent and weight version)."""
    if row.rollout_id != rollout_id or row.model_call_id != call_id:
        raise _Unusable(
            reasons.IDENTITY_MISMATCH,
            f"{key!r} holds ({row.rollout_id!r}, {row.model_call_id!r}), not ({rollout_id!r}, {call_id!r})",
        )
    if i == 0:
        walk.parent_call_id, walk.weight_version = row.parent_call_id, row.weight_version
    elif row.parent_call_id != walk.parent_call_id:
        raise _Unusable(reasons.IDENTITY_MISMATCH, f"{key!r}: parent {row.parent_call_id!r}, chunk 0 says {walk.parent_call_id!r}")


def _check_chunk_layout(row: StagedRow, key: str, preceding: int) -> None:
    """Lengths and token arrays consistent, ``prev_len`` == the ``preceding`` chunks'
    tokens, a known routes encoding with its routes. A stray ``routed_experts`` on a
    chunk without routes is dropped: not hashed, not resumed from."""
    problem = validation.check_lengths(row.prev_len, row.delta_len, row.cum_len) or validation.check_token_arrays(
        row.token_ids, row.token_mask, row.logprobs, row.delta_len
    )
    if problem:
        raise _Unusable(problem[0], f"{key!r}: {problem[1]}")
    if row.prev_len != preceding:
        raise _Unusable(reasons.PARENT_LENGTH_MISMATCH, f"{key!r}: prev_len {row.prev_len}, but {preceding} tokens precede it")
    if row.routes_encoding != ROUTES_NONE and row.routes_encoding not in ROUTES_ENCODINGS:
        raise _Unusable(reasons.INVALID_ROUTES, f"{key!r}: unknown routes_encoding {row.routes_encoding}")
    if row.routes_encoding != ROUTES_NONE and row.routed_experts is None:
        raise _Unusable(reasons.MISSING_ROUTES, f"{key!r}: routes_encoding {row.routes_encoding} but no routed experts")
    if row.routes_encoding == ROUTES_NONE:
        row.routed_experts = None


def _check_chunk_hashes(row: StagedRow, key: str, i: int, chain: bytes | None, cumulative: Hasher) -> bytes:
    """The row's digest recomputed; its chain hash extends ``chain`` (the previous
    chunk's, None for chunk 0) and its cumulative hash extends the running
    ``cumulative`` state (fed this chunk's ids). Returns this chunk's chain hash."""
    try:
        recomputed = hashing.row_digest(row)
    except ValueError as e:  # unsupported digest_version, malformed routes
        raise _Unusable(reasons.INVALID_STAGING_ROW, f"{key!r}: {e}") from None
    if recomputed != row.digest:
        raise _Unusable(reasons.CORRUPT_DIGEST, f"{key!r}: recomputed digest differs from the row's")
    chain = hashing.chain_hash(chain, row.token_ids, row.digest_version)
    if chain != row.chain_hash:
        raise _Unusable(reasons.CHAIN_HASH_MISMATCH, f"{key!r}: chain hash does not extend chunk {i - 1}")
    if hashing.extend_prefix(cumulative, row.token_ids) != row.cumulative_hash:
        raise _Unusable(reasons.CUMULATIVE_HASH_MISMATCH, f"{key!r}: cumulative hash differs")
    return chain


def _check_content(
    rows: PackedBatch,
    cont: Continuation,
    routed: list[int],
    vocab_size: int | None,
    num_experts: int | None,
    routes_shape: tuple[int, int] | None,
) -> _Content:
    """The whole prefix at once (vectorized): mask zeros-then-ones, token range,
    logprobs, and routes on every chunk or none, all of one encoding (``routed``: each
    chunk's routes encoding)."""
    # Rows are in chain order, so each field's packed buffer IS the prefix (no copy).
    ids, mask, lps = (_span(rows, name) for name in ("token_ids", "token_mask", "logprobs"))
    problem = _check_prefix_mask(mask) or (validation.check_tokens(ids, vocab_size) if vocab_size is not None else None)
    problem = problem or validation.check_logprobs(lps, mask)
    if problem:
        raise _Unusable.of(problem)
    routes = None
    if any(routed):
        if not all(routed):
            i = routed.index(ROUTES_NONE)
            raise _Unusable(reasons.MISSING_ROUTES, f"{cont.keys[i]!r} has no routes; chunk(s) before it do")
        enc = routed[0]
        if any(e != enc for e in routed):
            i = next(i for i, e in enumerate(routed) if e != enc)
            raise _Unusable(reasons.INVALID_ROUTES, f"{cont.keys[i]!r}: routes_encoding {routed[i]}, chunk 0's is {enc}")
        routes = _span(rows, routes_field(enc))
        problem = validation.check_routes(enc, routes, len(ids), num_experts, routes_shape)
        if problem:
            raise _Unusable.of(problem)
    elif routes_shape is not None:
        raise _Unusable(reasons.MISSING_ROUTES, f"the prefix has no routes; routes {tuple(routes_shape)} expected")
    return _Content(ids, mask, lps, routes)


def _check_claims(cont: Continuation, tokens: int, token_ids: np.ndarray, digest_version: int) -> bytes:
    """The continuation's own claims: its token count is the chunks' ``tokens``, its
    digest the one recomputed over ``token_ids`` (with the chunks' ``digest_version``).
    Returns that digest (32 bytes)."""
    if tokens != cont.prefix_tokens:
        raise _Unusable(PREFIX_LENGTH_MISMATCH, f"the chunks hold {tokens} tokens, the continuation says {cont.prefix_tokens}")
    digest = _prefix_digest(token_ids, digest_version)
    if digest != cont.prefix_digest:
        raise _Unusable(PREFIX_DIGEST_MISMATCH, "recomputed prefix digest differs from the continuation's")
    return digest


def _span(rows: PackedBatch, name: str) -> np.ndarray:
    """All rows' values of one field, in row order (a view: rows are contiguous)."""
    f = rows.fields[name]
    return f.values[int(f.offsets[0]) : int(f.offsets[-1])]


def _check_keys(keys: tuple[str, ...]) -> validation.Problem:
    """Every key a cut key of one call, with seq 0, 1, ... in order."""
    call = None
    for i, key in enumerate(keys):
        try:
            _, rollout_id, call_id, seq = parse_cut_key(key)
        except InvalidKey as e:
            return INVALID_CONTINUATION, str(e)
        if call is None:
            call = (rollout_id, call_id)
        elif (rollout_id, call_id) != call:
            return reasons.IDENTITY_MISMATCH, f"{key!r} names ({rollout_id!r}, {call_id!r}), key 0 names {call}"
        if seq != i:
            return PREFIX_OUT_OF_ORDER, f"key {i} {key!r} has seq {seq}; chain order needs seq {i}"
    return None


def _check_prefix_mask(mask: np.ndarray) -> validation.Problem:
    """Zeros (context) then ones (generated); unlike a staged delta, no 1 is required."""
    is_one = mask == 1.0
    if not np.all(is_one | (mask == 0.0)):
        return reasons.INVALID_MASK_ORDER, "token_mask holds values other than 0.0 and 1.0"
    n_ones = int(np.count_nonzero(is_one))
    if not is_one[len(is_one) - n_ones :].all():
        return reasons.INVALID_MASK_ORDER, "token_mask is not zeros-then-ones over the prefix"
    return None
