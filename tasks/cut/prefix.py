"""Verify a restored cut prefix against its continuation, and build what to resume from. Pure.

Every digest is recomputed, none trusted; the first failing check names the reason
(continuation, rows, per-chunk lengths and hashes, vectorized content, token count and
prefix digest). Per-chunk Python only (a prefix has a handful of chunks); content scans
run over the whole prefix at once. Cut row format and check order: docs/design.md,
"Checkpoint cuts".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .. import hashing, reasons, validation
from .receipt import prefix_digest as _prefix_digest
from ..errors import InvalidKey
from ..keys import CUT_PREFIX
from ..packed import PackedBatch, row_from_fields
from ..schema import HASH_BYTES, ROUTES_FIELD, ROUTES_INT16, ROUTES_NONE, STAGING_FIELDS

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
    """What a resumed call carries: cut keys in chain order, token count, prefix digest."""

    keys: tuple[str, ...]
    prefix_tokens: int  # tokens
    prefix_digest: bytes  # 32 bytes

    @classmethod
    def of(cls, obj: Any) -> "Continuation":
        """From a :class:`Continuation`, a ``CallAck`` (``staging_keys``) or a dict.

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
        tokens, digest = get("prefix_tokens"), get("prefix_digest")
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
            raise ValueError(f"continuation prefix_tokens must be an int, got {tokens!r}")
        if not isinstance(digest, (bytes, bytearray)) or len(digest) != HASH_BYTES:
            raise ValueError(f"continuation prefix_digest must be {HASH_BYTES} bytes, got {digest!r}")
        return cls(tuple(keys), int(tokens), bytes(digest))


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
    routed_experts: np.ndarray | None  # int16[T, L, K] or None
    context_tokens: int  # leading mask-0 tokens (the call's carried context)
    prefix_digest: bytes

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
    continuation: Any,
    *,
    vocab_size: int | None = None,
    num_experts: int | None = None,
    routes_shape: tuple[int, int] | None = None,
) -> PrefixVerdict:
    """Verify ``rows`` (the chunks read for ``continuation``'s keys, in chain order).

    ``vocab_size`` / ``num_experts`` / ``routes_shape`` (``(L, K)``) enable the range and
    shape checks when given. Never raises on bad data: every problem is a verdict.
    """
    try:
        cont = Continuation.of(continuation)
    except ValueError as e:
        return PrefixVerdict.unusable(INVALID_CONTINUATION, str(e))
    if not cont.keys:
        return PrefixVerdict.unusable(EMPTY_PREFIX, "the continuation lists no cut keys")
    problem = _check_keys(cont.keys)
    if problem:
        return PrefixVerdict.unusable(*problem)
    _, rollout_id, call_id, _ = parse_cut_key(cont.keys[0])

    if not isinstance(rows, PackedBatch):
        return PrefixVerdict.unusable(reasons.INVALID_STAGING_ROW, f"rows must be a PackedBatch, got {type(rows).__name__}")
    if list(rows.keys) != list(cont.keys):
        missing = [k for k in cont.keys if k not in set(rows.keys)]
        if missing:
            return PrefixVerdict.unusable(reasons.MISSING_STAGING_ROW, f"no row for {missing[0]!r} ({len(missing)} missing)")
        return PrefixVerdict.unusable(PREFIX_OUT_OF_ORDER, f"rows come as {list(rows.keys)[:4]}..., not in chain order")
    absent = [f for f in STAGING_FIELDS if f not in rows.fields]
    if absent:
        return PrefixVerdict.unusable(reasons.INVALID_STAGING_ROW, f"the rows lack field(s) {absent}")
    for name in STAGING_FIELDS:
        f = rows.fields[name]
        if f.present is not None and not f.present.all():
            i = int(np.flatnonzero(~f.present)[0])
            return PrefixVerdict.unusable(reasons.INVALID_STAGING_ROW, f"{rows.keys[i]!r} has no {name!r}")

    # ---- per chunk, chain order ----
    chain: bytes | None = None
    cumulative = hashing.prefix_state()
    total = 0
    parent = weight_version = None
    lengths: list[int] = []
    routed: list[bool] = []
    for i, key in enumerate(cont.keys):
        try:
            row = row_from_fields(rows.row(i))
        except (KeyError, ValueError, IndexError, UnicodeDecodeError) as e:
            return PrefixVerdict.unusable(reasons.INVALID_STAGING_ROW, f"{key!r} does not decode: {type(e).__name__}: {e}")
        if row.rollout_id != rollout_id or row.model_call_id != call_id:
            return PrefixVerdict.unusable(
                reasons.IDENTITY_MISMATCH,
                f"{key!r} holds ({row.rollout_id!r}, {row.model_call_id!r}), not ({rollout_id!r}, {call_id!r})",
            )
        if i == 0:
            parent, weight_version = row.parent_call_id, row.weight_version
        elif row.parent_call_id != parent:
            return PrefixVerdict.unusable(
                reasons.IDENTITY_MISMATCH, f"{key!r}: parent {row.parent_call_id!r}, chunk 0 says {parent!r}"
            )
        problem = validation.check_lengths(row.prev_len, row.delta_len, row.cum_len) or validation.check_token_arrays(
            row.token_ids, row.token_mask, row.logprobs, row.delta_len
        )
        if problem:
            return PrefixVerdict.unusable(problem[0], f"{key!r}: {problem[1]}")
        if row.prev_len != total:
            return PrefixVerdict.unusable(
                reasons.PARENT_LENGTH_MISMATCH, f"{key!r}: prev_len {row.prev_len}, but {total} tokens precede it"
            )
        if row.routes_encoding not in (ROUTES_NONE, ROUTES_INT16):
            return PrefixVerdict.unusable(reasons.INVALID_ROUTES, f"{key!r}: unknown routes_encoding {row.routes_encoding}")
        if row.routes_encoding == ROUTES_INT16 and row.routed_experts is None:
            return PrefixVerdict.unusable(reasons.MISSING_ROUTES, f"{key!r}: routes_encoding 1 but no routed_experts")
        if row.routes_encoding == ROUTES_NONE:
            row.routed_experts = None  # a stray field is not hashed and not resumed from
        try:
            recomputed = hashing.row_digest(row)
        except ValueError as e:  # unsupported digest_version, malformed routes
            return PrefixVerdict.unusable(reasons.INVALID_STAGING_ROW, f"{key!r}: {e}")
        if recomputed != row.digest:
            return PrefixVerdict.unusable(reasons.CORRUPT_DIGEST, f"{key!r}: recomputed digest differs from the row's")
        chain = hashing.chain_hash(chain, row.token_ids)
        if chain != row.chain_hash:
            return PrefixVerdict.unusable(reasons.CHAIN_HASH_MISMATCH, f"{key!r}: chain hash does not extend chunk {i - 1}")
        if hashing.extend_prefix(cumulative, row.token_ids) != row.cumulative_hash:
            return PrefixVerdict.unusable(reasons.CUMULATIVE_HASH_MISMATCH, f"{key!r}: cumulative hash differs")
        total = row.cum_len
        lengths.append(row.delta_len)
        routed.append(row.routes_encoding == ROUTES_INT16)

    # ---- content, whole prefix at once ----
    # Rows are in chain order, so each field's packed buffer IS the prefix (no copy).
    ids, mask, lps = (_span(rows, name) for name in ("token_ids", "token_mask", "logprobs"))
    problem = _check_prefix_mask(mask) or (validation.check_tokens(ids, vocab_size) if vocab_size is not None else None)
    problem = problem or validation.check_logprobs(lps, mask)
    if problem:
        return PrefixVerdict.unusable(*problem)
    routes = None
    if any(routed):
        if not all(routed):
            i = routed.index(False)
            return PrefixVerdict.unusable(reasons.MISSING_ROUTES, f"{cont.keys[i]!r} has no routes; chunk(s) before it do")
        routes = _span(rows, ROUTES_FIELD)
        problem = validation.check_routes(ROUTES_INT16, routes, len(ids), num_experts, routes_shape)
        if problem:
            return PrefixVerdict.unusable(*problem)
    elif routes_shape is not None:
        return PrefixVerdict.unusable(reasons.MISSING_ROUTES, f"the prefix has no routes; routes {tuple(routes_shape)} expected")

    # ---- the continuation's own claims ----
    if total != cont.prefix_tokens:
        return PrefixVerdict.unusable(
            PREFIX_LENGTH_MISMATCH, f"the chunks hold {total} tokens, the continuation says {cont.prefix_tokens}"
        )
    pdigest = _prefix_digest(ids)
    if pdigest != cont.prefix_digest:
        return PrefixVerdict.unusable(PREFIX_DIGEST_MISMATCH, "recomputed prefix digest differs from the continuation's")
    context = int(len(mask) - np.count_nonzero(mask))
    return PrefixVerdict(
        True,
        None,
        "",
        ResumePrefix(
            rollout_id=rollout_id,
            model_call_id=call_id,
            parent_call_id=parent,
            weight_version=int(weight_version),
            keys=cont.keys,
            chunk_lengths=tuple(lengths),
            token_ids=ids,
            token_mask=mask,
            logprobs=lps,
            routed_experts=routes,
            context_tokens=context,
            prefix_digest=pdigest,
        ),
    )


def _span(rows: PackedBatch, name: str) -> np.ndarray:
    """All rows' values of one field, in row order (a view: rows are contiguous)."""
    f = rows.fields[name]
    return f.values[int(f.offsets[0]) : int(f.offsets[-1])]


def _check_keys(keys: tuple[str, ...]) -> tuple[str, str] | None:
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


def _check_prefix_mask(mask: np.ndarray) -> tuple[str, str] | None:
    """Zeros (context) then ones (generated); unlike a staged delta, no 1 is required."""
    is_one = mask == 1.0
    if not np.all(is_one | (mask == 0.0)):
        return reasons.INVALID_MASK_ORDER, "token_mask holds values other than 0.0 and 1.0"
    n_ones = int(np.count_nonzero(is_one))
    if not is_one[len(is_one) - n_ones :].all():
        return reasons.INVALID_MASK_ORDER, "token_mask is not zeros-then-ones over the prefix"
    return None
