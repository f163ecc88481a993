"""The staged row: one model call's delta, as captured.

A row is the unit of staging. Token fields are ragged (``delta_len`` long); the rest
are scalars or 32-byte hashes. :data:`FIELD_SPECS` is the single description of every
field's dtype and per-token trailing shape, used by packing, the store's registry
and validation alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .digests import DEFAULT_VERSION

SCHEMA_VERSION = 1
HASH_BYTES = 32

# Routes encodings (a row's and a receipt's ``routes_encoding``): how the row stores its
# routed expert ids, each encoding in its own field (a field has one dtype in a batch and
# in the store's registry, so rows of both encodings coexist in a store, a cut and a
# checkpoint). ``ROUTES_UINT8`` is chosen whenever the model has at most 256 experts
# (:func:`routes_encoding_for`): one byte per id instead of two.
ROUTES_NONE = 0
ROUTES_INT16 = 1  # "routed_experts", int16 ids (every row staged before uint8 existed)
ROUTES_UINT8 = 2  # "routed_experts_u8", uint8 ids (experts <= 256)

# Per-token (ragged) fields and their dtypes. The routes fields trail [L, K].
TOKEN_FIELDS: dict[str, np.dtype] = {
    "token_ids": np.dtype("<i8"),
    "token_mask": np.dtype("<f4"),
    "logprobs": np.dtype("<f4"),
}
ROUTES_FIELD = "routed_experts"
ROUTES_DTYPE = np.dtype("<i2")
ROUTES_U8_FIELD = "routed_experts_u8"
ROUTES_U8_DTYPE = np.dtype("u1")
UINT8_MAX_EXPERTS = 256
# encoding -> (field, dtype) of every encoding that carries routes.
ROUTES_ENCODINGS: dict[int, tuple[str, np.dtype]] = {
    ROUTES_INT16: (ROUTES_FIELD, ROUTES_DTYPE),
    ROUTES_UINT8: (ROUTES_U8_FIELD, ROUTES_U8_DTYPE),
}
ROUTES_FIELDS: tuple[str, ...] = tuple(f for f, _ in ROUTES_ENCODINGS.values())


def routes_encoding_for(num_experts: int | None) -> int:
    """The routes encoding a writer picks for a model of ``num_experts`` experts:
    :data:`ROUTES_UINT8` when every id fits a byte (``num_experts <= 256``), else
    :data:`ROUTES_INT16` (also when the expert count is unknown)."""
    if num_experts is not None and 0 < int(num_experts) <= UINT8_MAX_EXPERTS:
        return ROUTES_UINT8
    return ROUTES_INT16


def routes_dtype_for(num_experts: int | None) -> np.dtype:
    """The dtype of routed expert ids under :func:`routes_encoding_for` ``(num_experts)``."""
    return ROUTES_ENCODINGS[routes_encoding_for(num_experts)][1]


def routes_field(encoding: int) -> str | None:
    """The field holding routes of ``encoding`` (None: no routes, or an unknown encoding)."""
    spec = ROUTES_ENCODINGS.get(encoding)
    return None if spec is None else spec[0]


def routes_encoding_of(dtype: np.dtype) -> int | None:
    """The encoding whose ids have ``dtype`` (None: no encoding stores that dtype)."""
    return next((enc for enc, (_, dt) in ROUTES_ENCODINGS.items() if dt == dtype), None)

# One value per row.
SCALAR_FIELDS: dict[str, np.dtype] = {
    "prev_len": np.dtype("<i8"),
    "delta_len": np.dtype("<i8"),
    "cum_len": np.dtype("<i8"),
    "weight_version": np.dtype("<i8"),
    "routes_encoding": np.dtype("i1"),
    "schema_version": np.dtype("<i8"),
    "digest_version": np.dtype("<i8"),
}
HASH_FIELDS = ("digest", "chain_hash", "cumulative_hash")
# Identity strings, stored as UTF-8 bytes. parent_call_id "" means root.
ID_FIELDS = ("rollout_id", "model_call_id", "parent_call_id")

# Everything a finalizer reads in its first (union) fetch: all but the routes fields.
STAGING_FIELDS: tuple[str, ...] = (
    ID_FIELDS + tuple(SCALAR_FIELDS) + HASH_FIELDS + tuple(TOKEN_FIELDS)
)
ALL_FIELDS: tuple[str, ...] = STAGING_FIELDS + ROUTES_FIELDS


def row_fields(encoding: int) -> tuple[str, ...]:
    """The fields a row of routes ``encoding`` carries: :data:`STAGING_FIELDS` and its
    routes field (a get asking for exactly these reports no ``absent_field``)."""
    name = routes_field(encoding)
    return STAGING_FIELDS if name is None else STAGING_FIELDS + (name,)


@dataclass
class StagedRow:
    """One model call's delta with its hashes. Arrays are little-endian and contiguous."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    token_ids: np.ndarray  # int64[delta_len]
    token_mask: np.ndarray  # float32[delta_len]
    logprobs: np.ndarray  # float32[delta_len]
    digest: bytes
    chain_hash: bytes
    cumulative_hash: bytes
    routes_encoding: int = ROUTES_NONE
    routed_experts: np.ndarray | None = None  # [delta_len, L, K]: int16 (encoding 1) or uint8 (2)
    schema_version: int = SCHEMA_VERSION
    digest_version: int = DEFAULT_VERSION  # tasks.digests: 1 SHA-256, 2 BLAKE3, 3 BLAKE3 over field digests
    extra: dict = field(default_factory=dict, repr=False)

    @property
    def staging_key(self) -> str:
        from .keys import staging_key

        return staging_key(self.rollout_id, self.model_call_id)

    @property
    def nbytes(self) -> int:
        """Payload bytes of the token fields (what a put moves, roughly)."""
        n = self.token_ids.nbytes + self.token_mask.nbytes + self.logprobs.nbytes
        if self.routed_experts is not None:
            n += self.routed_experts.nbytes
        return n

    def same_content(self, other: "StagedRow") -> bool:
        """Field-by-field equality, arrays compared bitwise."""
        if not isinstance(other, StagedRow):
            return False
        for name in ID_FIELDS + tuple(SCALAR_FIELDS) + HASH_FIELDS:
            if getattr(self, name) != getattr(other, name):
                return False
        for name in tuple(TOKEN_FIELDS) + ("routed_experts",):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes()):
                return False
        return True
