"""The staged row: one model call's delta, as captured.

A row is the unit of staging. Token fields are ragged (``delta_len`` long); the rest
are scalars or 32-byte hashes. :data:`FIELD_SPECS` is the single description of every
field's dtype and per-token trailing shape, used by packing, the store's registry
and validation alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCHEMA_VERSION = 1
HASH_BYTES = 32

ROUTES_NONE = 0
ROUTES_INT16 = 1

# Per-token (ragged) fields and their dtypes. routed_experts trails [L, K].
TOKEN_FIELDS: dict[str, np.dtype] = {
    "token_ids": np.dtype("<i8"),
    "token_mask": np.dtype("<f4"),
    "logprobs": np.dtype("<f4"),
}
ROUTES_FIELD = "routed_experts"
ROUTES_DTYPE = np.dtype("<i2")

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

# Everything a finalizer reads in its first (union) fetch: all but routed_experts.
STAGING_FIELDS: tuple[str, ...] = (
    ID_FIELDS + tuple(SCALAR_FIELDS) + HASH_FIELDS + tuple(TOKEN_FIELDS)
)
ALL_FIELDS: tuple[str, ...] = STAGING_FIELDS + (ROUTES_FIELD,)


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
    routed_experts: np.ndarray | None = None  # int16[delta_len, L, K]
    schema_version: int = SCHEMA_VERSION
    digest_version: int = 1
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
        for name in tuple(TOKEN_FIELDS) + (ROUTES_FIELD,):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return False
            if a is not None and (a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes()):
                return False
        return True
