"""Receipts: the token-free record of a rollout's staged calls, held by the controller.

A receipt is what a finalizer trusts the *writer* to have said; rows are what the store
holds. Verification compares the two field by field. Receipts round-trip through plain
dicts (and so msgpack) with :meth:`Receipt.to_dict` / :meth:`Receipt.from_dict`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

RECEIPT_VERSION = 1


@dataclass(frozen=True)
class CallRecord:
    """One staged call as the receipt lists it."""

    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: bytes
    chain_hash: bytes
    cumulative_hash: bytes
    routes_encoding: int
    staging_key: str
    # The algorithm of digest, chain_hash and cumulative_hash (tasks.digests: 1 SHA-256,
    # 2 BLAKE3, 3 BLAKE3 over field digests). A record without it was written before
    # BLAKE3 existed: SHA-256.
    digest_version: int = 1


@dataclass
class Receipt:
    """A rollout's calls, its reward and terminal call, or a poisoned capture."""

    rollout_id: str
    reward: float
    terminal_model_call_id: str | None
    calls: list[CallRecord] = field(default_factory=list)
    poisoned: bool = False
    failure_reason: str | None = None
    group_id: str | None = None
    version: int = RECEIPT_VERSION

    @property
    def staging_keys(self) -> list[str]:
        return [c.staging_key for c in self.calls]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Receipt":
        """Build from a dict; raises ``TypeError``/``KeyError``/``ValueError`` if malformed."""
        calls = [CallRecord(**c) for c in d["calls"]]
        kw = {k: v for k, v in d.items() if k != "calls"}
        return cls(calls=calls, **kw)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "Receipt":
        return cls.from_dict(msgpack.unpackb(data, raw=False))
