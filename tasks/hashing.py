"""The three SHA-256 hashes of token capture, with their byte layout (version 1).

Every hash starts with its own domain tag, so a value of one kind can never be passed
off as another. Integers are little-endian; arrays are hashed as their raw
little-endian buffers (no copies: hashlib reads the numpy buffer directly).

chain_hash v1
    TAG_CHAIN
    parent marker: b"\\x00" for a root, or b"\\x01" + parent's chain_hash (32 bytes)
    token_ids as <i8 bytes

cumulative_hash v1
    TAG_PREFIX
    token_ids (<i8 bytes) of every call from the root through this one, in order.
    Writers keep a running ``hashlib`` state per chain; verifiers hash the linearized ids.

digest v1
    TAG_CALL
    <H schema_version> <H digest_version>
    <I len> rollout_id utf-8, <I len> model_call_id utf-8
    parent marker: b"\\x00", or b"\\x01" <I len> parent_call_id utf-8
    <q prev_len> <q delta_len> <q cum_len> <q weight_version> <b routes_encoding>
    for token_ids (<i8), token_mask (<f4), logprobs (<f4): <Q nbytes> raw bytes
    if routes_encoding == 1: <I L> <I K> <Q nbytes> routed_experts raw bytes (<i2)
    chain_hash (32 bytes) cumulative_hash (32 bytes)
"""
from __future__ import annotations

import hashlib
import struct
from typing import Optional

import numpy as np

DIGEST_VERSION = 1
TAG_CHAIN = b"token-capture/chain/v1\x00"
TAG_PREFIX = b"token-capture/prefix/v1\x00"
TAG_CALL = b"token-capture/call/v1\x00"
ROOT_MARKER = b"\x00"

_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")
_I16 = np.dtype("<i2")


def _buf(a: np.ndarray, dtype: np.dtype) -> memoryview:
    """A zero-copy byte view of ``a`` as ``dtype`` (copies only if not already so)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    return memoryview(a).cast("B")


def chain_hash(parent_chain: Optional[bytes], token_ids: np.ndarray) -> bytes:
    """H(TAG_CHAIN, parent marker, ids): links a call to its parent's chain."""
    h = hashlib.sha256(TAG_CHAIN)
    h.update(ROOT_MARKER if parent_chain is None else b"\x01" + parent_chain)
    h.update(_buf(token_ids, _I64))
    return h.digest()


def prefix_state(parent_state: Optional["hashlib._Hash"] = None) -> "hashlib._Hash":
    """A running cumulative-hash state: a copy of the parent's, or a fresh tagged one."""
    return hashlib.sha256(TAG_PREFIX) if parent_state is None else parent_state.copy()


def extend_prefix(state: "hashlib._Hash", token_ids: np.ndarray) -> bytes:
    """Feed one call's ids into a running state and return the cumulative hash so far."""
    state.update(_buf(token_ids, _I64))
    return state.digest()


def cumulative_hash(all_token_ids: np.ndarray) -> bytes:
    """Cumulative hash of a whole linearized chain in one pass."""
    h = hashlib.sha256(TAG_PREFIX)
    h.update(_buf(all_token_ids, _I64))
    return h.digest()


def _framed_id(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def digest(
    *,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: Optional[str],
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids: np.ndarray,
    token_mask: np.ndarray,
    logprobs: np.ndarray,
    routes_encoding: int,
    routed_experts: Optional[np.ndarray],
    chain_hash: bytes,
    cumulative_hash: bytes,
    schema_version: int = 1,
    digest_version: int = DIGEST_VERSION,
) -> bytes:
    """The per-call digest over identity, lengths, token buffers and both chain hashes."""
    if digest_version != DIGEST_VERSION:
        raise ValueError(f"unsupported digest_version {digest_version} (this build: {DIGEST_VERSION})")
    if not 0 <= schema_version <= 0xFFFF:
        raise ValueError(f"schema_version {schema_version} outside the 16-bit field of digest v1")
    h = hashlib.sha256(TAG_CALL)
    header = [struct.pack("<HH", schema_version, digest_version), _framed_id(rollout_id), _framed_id(model_call_id)]
    header.append(ROOT_MARKER if parent_call_id is None else b"\x01" + _framed_id(parent_call_id))
    header.append(struct.pack("<qqqqb", prev_len, delta_len, cum_len, weight_version, routes_encoding))
    h.update(b"".join(header))
    for arr, dt in ((token_ids, _I64), (token_mask, _F32), (logprobs, _F32)):
        b = _buf(arr, dt)
        h.update(struct.pack("<Q", b.nbytes))
        h.update(b)
    if routes_encoding == 1:
        if routed_experts is None or routed_experts.ndim != 3:
            raise ValueError("routes_encoding 1 needs routed_experts of shape [delta_len, L, K]")
        b = _buf(routed_experts, _I16)
        h.update(struct.pack("<IIQ", routed_experts.shape[1], routed_experts.shape[2], b.nbytes))
        h.update(b)
    h.update(chain_hash)
    h.update(cumulative_hash)
    return h.digest()


def row_digest(row) -> bytes:
    """:func:`digest` of a :class:`~tasks.schema.StagedRow` (recomputed, never read)."""
    return digest(
        rollout_id=row.rollout_id,
        model_call_id=row.model_call_id,
        parent_call_id=row.parent_call_id,
        prev_len=row.prev_len,
        delta_len=row.delta_len,
        cum_len=row.cum_len,
        weight_version=row.weight_version,
        token_ids=row.token_ids,
        token_mask=row.token_mask,
        logprobs=row.logprobs,
        routes_encoding=row.routes_encoding,
        routed_experts=row.routed_experts,
        chain_hash=row.chain_hash,
        cumulative_hash=row.cumulative_hash,
        schema_version=row.schema_version,
        digest_version=row.digest_version,
    )
