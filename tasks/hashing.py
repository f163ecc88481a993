"""The three hashes of token capture, with their byte layout, for every digest version.

Digest version 1 hashes with SHA-256, versions 2 and 3 with BLAKE3 (:mod:`tasks.digests`);
all use the layouts below (version 3 the digest's field-digest layout), each version with its own domain tags (``TAG_*`` below is
``token-capture/<kind>/v<version>\x00``, e.g. ``token-capture/chain/v2\x00`` for a
BLAKE3 chain hash). Every hash starts with its tag, so a value of one kind (or of one
version) can never be passed off as another; the digest also carries its version in
its header. Integers are little-endian; arrays are hashed as their raw little-endian
buffers (no copies: both hash functions read the numpy buffer directly). One rollout's
chain (and one cut call's chunks) is hashed with one version throughout: its running
cumulative state cannot change algorithm midway, so verifiers reject a mix.

chain_hash (v1: SHA-256, v2: BLAKE3)
    TAG_CHAIN
    parent marker: b"\\x00" for a root, or b"\\x01" + parent's chain_hash (32 bytes)
    token_ids as <i8 bytes
    (:func:`chain_state` is the running form: writers feed ids as they are generated.)

cumulative_hash (v1: SHA-256, v2: BLAKE3)
    TAG_PREFIX
    token_ids (<i8 bytes) of every call from the root through this one, in order.
    Writers keep a running state per chain; verifiers hash the linearized ids.

digest (v1: SHA-256, v2: BLAKE3)
    TAG_CALL
    <H schema_version> <H digest_version>
    <I len> rollout_id utf-8, <I len> model_call_id utf-8
    parent marker: b"\\x00", or b"\\x01" <I len> parent_call_id utf-8
    <q prev_len> <q delta_len> <q cum_len> <q weight_version> <b routes_encoding>
    for token_ids (<i8), token_mask (<f4), logprobs (<f4): <Q nbytes> raw bytes
    if routes_encoding == 1: <I L> <I K> <Q nbytes> routed_experts raw bytes (<i2, 2 per id)
    if routes_encoding == 2: <I L> <I K> <Q nbytes> routed_experts raw bytes (u1, 1 per id)
    chain_hash (32 bytes) cumulative_hash (32 bytes)

digest, field-digest layout (v3: BLAKE3)
    the v1/v2 header above, from TAG_CALL through <b routes_encoding>, then
    <Q nbytes> F(token_ids) <Q nbytes> F(token_mask) <Q nbytes> F(logprobs)
    if routes_encoding != 0: <I L> <I K> <Q nbytes> F(routed_experts)
    chain_hash (32 bytes) cumulative_hash (32 bytes)
  where F(x) is the field digest of x's raw bytes (the same bytes v1/v2 hash): keyed
  BLAKE3 (key ``tasks.digests.FIELD_KEY``, nothing before the bytes), 32 bytes. A field
  digest depends on the field's bytes alone, so a writer feeds it as tokens arrive and a
  cut hashes only the ~200-byte outer layout (:func:`field_state`,
  :func:`digest_of_fields`); a verifier hashes each field from a block boundary.

Routes encodings (``tasks.schema``): 0 no routes (nothing hashed after logprobs but the
hashes); 1 int16 ids (field ``routed_experts``); 2 uint8 ids (field
``routed_experts_u8``, chosen when the model has at most 256 experts). The encoding byte
sits in the header and each encoding hashes its own raw buffer, so the same ids under
the other encoding hash differently: a row relabelled from one encoding to the other
fails its digest. Rows of encoding 1 hash exactly as they did before encoding 2 existed.
"""
from __future__ import annotations

import functools
import struct

import numpy as np

from .digests import DEFAULT_VERSION, DIGEST_SHA256, SCHEMES, Hasher, scheme
from .schema import ROUTES_ENCODINGS

# The version writers use unless told otherwise (the ``capture.digest`` default, BLAKE3).
DIGEST_VERSION = DEFAULT_VERSION
# Version 1's (SHA-256) tags; :func:`tasks.digests.scheme` gives every version's.
TAG_CHAIN = SCHEMES[DIGEST_SHA256].tag_chain
TAG_PREFIX = SCHEMES[DIGEST_SHA256].tag_prefix
TAG_CALL = SCHEMES[DIGEST_SHA256].tag_call
ROOT_MARKER = b"\x00"

_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")


def _buf(a: np.ndarray, dtype: np.dtype) -> memoryview:
    """A zero-copy byte view of ``a`` as ``dtype`` (copies only if not already so)."""
    # reshape(-1): memoryview refuses to cast a view with a zero in its shape, and a flat
    # view of a contiguous array is free.
    a = np.ascontiguousarray(a, dtype=dtype).reshape(-1)
    return memoryview(a).cast("B")


def chain_hash(parent_chain: bytes | None, token_ids: np.ndarray, version: int = DIGEST_VERSION) -> bytes:
    """H(TAG_CHAIN, parent marker, ids): links a call to its parent's chain (digest ``version``)."""
    return chain_hash_raw(parent_chain, _buf(token_ids, _I64), version)


def chain_hash_raw(parent_chain: bytes | None, ids_bytes, version: int = DIGEST_VERSION) -> bytes:
    """:func:`chain_hash` over ids already given as their ``<i8`` bytes (any buffer)."""
    h = chain_state(parent_chain, version)
    h.update(ids_bytes)
    return h.digest()


def chain_state(parent_chain: bytes | None, version: int = DIGEST_VERSION) -> Hasher:
    """A running chain-hash state of digest ``version``: TAG_CHAIN and the parent marker,
    awaiting the ids.

    Feeding it a chunk's ids as ``<i8`` bytes (in any number of updates) and taking
    ``digest()`` gives ``chain_hash(parent_chain, ids, version)``. The only place the
    chain layout is written; writers keep one per open chunk instead of re-hashing at a cut.
    """
    s = scheme(version)
    return s.new(s.chain_root if parent_chain is None else s.chain_link + parent_chain)


def prefix_state(parent_state: Hasher | None = None, version: int = DIGEST_VERSION) -> Hasher:
    """A running cumulative-hash state: a copy of the parent's (of the parent's version),
    or a fresh one of digest ``version`` with its tag."""
    if parent_state is not None:
        return parent_state.copy()
    s = scheme(version)
    return s.new(s.tag_prefix)


def extend_prefix(state: Hasher, token_ids: np.ndarray) -> bytes:
    """Feed one call's ids into a running state and return the cumulative hash so far."""
    state.update(_buf(token_ids, _I64))
    return state.digest()


def cumulative_hash(all_token_ids: np.ndarray, version: int = DIGEST_VERSION) -> bytes:
    """Cumulative hash of a whole linearized chain in one pass (digest ``version``)."""
    h = prefix_state(None, version)
    h.update(_buf(all_token_ids, _I64))
    return h.digest()


_HEAD = struct.Struct("<HH")
_LENGTHS = struct.Struct("<qqqqb")
_NBYTES = struct.Struct("<Q")
_ROUTES_HEAD = struct.Struct("<IIQ")
_U32 = struct.Struct("<I")
# The digest's field encodings, for a verifier that builds the header inline (same bytes).
U32, LENGTHS, NBYTES, ROUTES_HEAD = _U32, _LENGTHS, _NBYTES, _ROUTES_HEAD


@functools.lru_cache(maxsize=4096)
def call_head(schema_version: int, rollout_id: bytes, digest_version: int = DIGEST_VERSION) -> bytes:
    """The digest's first bytes: TAG_CALL, ``<H schema_version> <H digest_version>`` and
    ``<I len> rollout_id`` (shared by every call of a rollout)."""
    if not 0 <= schema_version <= 0xFFFF:
        raise ValueError(f"schema_version {schema_version} outside the 16-bit field of the digest")
    tag = scheme(digest_version).tag_call
    return tag + _HEAD.pack(schema_version, digest_version) + _U32.pack(len(rollout_id)) + rollout_id


def digest_header(
    schema_version: int,
    digest_version: int,
    rollout_id: bytes,
    model_call_id: bytes,
    parent_call_id: bytes | None,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    routes_encoding: int,
) -> bytes:
    """The digest's bytes from TAG_CALL (included) through ``routes_encoding``.

    Ids are given as their UTF-8 bytes; ``parent_call_id`` ``None`` means a root. An
    unknown ``digest_version`` raises :class:`~tasks.digests.UnsupportedDigest` (a
    ``ValueError``).
    """
    tag = scheme(digest_version).tag_call
    if not 0 <= schema_version <= 0xFFFF:
        raise ValueError(f"schema_version {schema_version} outside the 16-bit field of the digest")
    parent = ROOT_MARKER if parent_call_id is None else b"\x01" + struct.pack("<I", len(parent_call_id)) + parent_call_id
    return b"".join(
        (
            tag,
            _HEAD.pack(schema_version, digest_version),
            struct.pack("<I", len(rollout_id)),
            rollout_id,
            struct.pack("<I", len(model_call_id)),
            model_call_id,
            parent,
            _LENGTHS.pack(prev_len, delta_len, cum_len, weight_version, routes_encoding),
        )
    )


def digest_raw(
    header: bytes,
    token_ids,
    token_mask,
    logprobs,
    routes: tuple[int, int, object] | None,
    chain_hash: bytes,
    cumulative_hash: bytes,
    digest_version: int = DIGEST_VERSION,
) -> bytes:
    """The digest from :func:`digest_header`'s bytes and the raw little-endian buffers,
    hashed with ``digest_version``'s algorithm (the version the header was built with).

    ``token_ids`` (``<i8``), ``token_mask`` and ``logprobs`` (``<f4``) are flat byte
    buffers (``bytes`` or format-``B`` memoryviews, whose ``len`` is their size in bytes;
    memoryviews hash without copies); ``routes`` is ``(L, K, raw bytes)`` when the
    header's ``routes_encoding`` carries routes (``<i2`` bytes for 1, ``u1`` for 2), else
    ``None``. Byte-identical to :func:`digest`.
    """
    s = scheme(digest_version)
    if s.field_new is not None:
        new = s.field_new
        routes_fd = None if routes is None else (routes[0], routes[1], len(routes[2]), new(routes[2]).digest())
        return digest_of_fields(header, (len(token_ids), new(token_ids).digest()), (len(token_mask), new(token_mask).digest()),
                                (len(logprobs), new(logprobs).digest()), routes_fd, chain_hash, cumulative_hash, digest_version)
    h = s.new(header + _NBYTES.pack(len(token_ids)))
    h.update(token_ids)
    h.update(_NBYTES.pack(len(token_mask)))
    h.update(token_mask)
    h.update(_NBYTES.pack(len(logprobs)))
    h.update(logprobs)
    if routes is not None:
        n_layers, top_k, buf = routes
        h.update(_ROUTES_HEAD.pack(n_layers, top_k, len(buf)))
        h.update(buf)
    h.update(chain_hash + cumulative_hash)
    return h.digest()


FieldDigest = tuple[int, bytes]  # (the field's size in bytes, its 32-byte field digest)


def field_state(version: int = DIGEST_VERSION) -> Hasher:
    """A running field digest of ``version`` (one of the field-digest layout): fed a
    field's raw bytes in any number of updates, ``digest()`` gives F(field)."""
    new = scheme(version).field_new
    if new is None:
        raise ValueError(f"digest_version {version} hashes fields inline: it has no field digests")
    return new()


def digest_of_fields(
    header: bytes,
    token_ids: FieldDigest,
    token_mask: FieldDigest,
    logprobs: FieldDigest,
    routes: tuple[int, int, int, bytes] | None,
    chain_hash: bytes,
    cumulative_hash: bytes,
    digest_version: int = DIGEST_VERSION,
) -> bytes:
    """The field-digest layout's digest from :func:`digest_header`'s bytes, each token
    field's ``(nbytes, field digest)`` and ``routes`` ``(L, K, nbytes, field digest)``
    (None: no routes). One small hash: no token byte is read here."""
    parts = [header, _NBYTES.pack(token_ids[0]), token_ids[1], _NBYTES.pack(token_mask[0]), token_mask[1],
             _NBYTES.pack(logprobs[0]), logprobs[1]]
    if routes is not None:
        parts += [_ROUTES_HEAD.pack(routes[0], routes[1], routes[2]), routes[3]]
    parts += [chain_hash, cumulative_hash]
    return scheme(digest_version).new(b"".join(parts)).digest()


def digest(
    *,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids: np.ndarray,
    token_mask: np.ndarray,
    logprobs: np.ndarray,
    routes_encoding: int,
    routed_experts: np.ndarray | None,
    chain_hash: bytes,
    cumulative_hash: bytes,
    schema_version: int = 1,
    digest_version: int = DIGEST_VERSION,
) -> bytes:
    """The per-call digest over identity, lengths, token buffers and both chain hashes."""
    header = digest_header(
        schema_version,
        digest_version,
        rollout_id.encode("utf-8"),
        model_call_id.encode("utf-8"),
        None if parent_call_id is None else parent_call_id.encode("utf-8"),
        prev_len,
        delta_len,
        cum_len,
        weight_version,
        routes_encoding,
    )
    routes = None
    spec = ROUTES_ENCODINGS.get(routes_encoding)  # (field, the dtype its ids are hashed as)
    if spec is not None:
        dtype = spec[1]
        if routed_experts is None or routed_experts.ndim != 3:
            raise ValueError(f"routes_encoding {routes_encoding} needs routed_experts of shape [delta_len, L, K]")
        if routed_experts.dtype.newbyteorder("<") != dtype:  # no value casts: only byte order is canonicalized
            raise ValueError(f"routes_encoding {routes_encoding} needs {dtype} routed_experts, got {routed_experts.dtype}")
        routes = (routed_experts.shape[1], routed_experts.shape[2], _buf(routed_experts, dtype))
    return digest_raw(
        header,
        _buf(token_ids, _I64),
        _buf(token_mask, _F32),
        _buf(logprobs, _F32),
        routes,
        chain_hash,
        cumulative_hash,
        digest_version,
    )


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
