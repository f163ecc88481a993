"""The checkpoint-cut receipt: one acknowledgement per call of the inventory. Pure.

Each call listed is ``durable_prefix`` (sealed in the store: keys, token count, prefix
digest), ``durable_failure`` with a reason (it regenerates after a restore) or
``completed``. Receipts are cached by (checkpoint_id, inventory digest) so a retried cut
answers the same receipt. Digest byte layouts: docs/design.md, "Checkpoint cuts". The
prefix digest is hashed with the call's digest version (:mod:`tasks.digests`: 1 SHA-256,
2 and 3 BLAKE3, each with its own tag), which the ack names; the inventory digest (a cache key
over a few ids) stays SHA-256.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Iterable

import numpy as np

from ..digests import DEFAULT_VERSION, DIGEST_SHA256, SCHEMES, Hasher, scheme
from ..errors import InvalidInventory
from ..keys import check_id

CUT_RECEIPT_VERSION = 1
TAG_CUT_PREFIX = SCHEMES[DIGEST_SHA256].tag_cut_prefix  # version 1's; scheme(v).tag_cut_prefix for any
TAG_INVENTORY = b"token-capture/cut-inventory/v1\x00"
_U32 = struct.Struct("<I")

DURABLE_PREFIX = "durable_prefix"
DURABLE_FAILURE = "durable_failure"
COMPLETED = "completed"
STATUSES = (DURABLE_PREFIX, DURABLE_FAILURE, COMPLETED)

CUT_ERROR = "cut_error"
CONTROL_DEADLINE = "control_deadline"
GENERATION_LOST = "generation_lost"
UNKNOWN_CALL = "unknown_call"
EMPTY_PREFIX = "empty_prefix"
FAILURE_REASONS = (CUT_ERROR, CONTROL_DEADLINE, GENERATION_LOST, UNKNOWN_CALL, EMPTY_PREFIX)

CallId = tuple[str, str]
InventoryEntry = CallId | list | str


# ---- digests ---------------------------------------------------------------------------


def prefix_state(digest_version: int = DEFAULT_VERSION) -> Hasher:
    """A fresh running prefix-digest state of ``digest_version``; feed chunks with
    :func:`extend_prefix_digest`."""
    s = scheme(digest_version)
    return s.new(s.tag_cut_prefix)


def extend_prefix_digest(state: Hasher, token_ids: np.ndarray) -> bytes:
    """Feed one chunk's ids (as <i8) into ``state``; return the digest so far."""
    a = np.ascontiguousarray(token_ids, dtype="<i8")
    state.update(memoryview(a).cast("B"))
    return state.digest()


def prefix_digest(token_ids: np.ndarray | Iterable[np.ndarray], digest_version: int = DEFAULT_VERSION) -> bytes:
    """Prefix digest of a whole prefix: one array, or its chunks in chain order."""
    h = prefix_state(digest_version)
    chunks = [token_ids] if isinstance(token_ids, np.ndarray) else token_ids
    out = h.digest()
    for c in chunks:
        out = extend_prefix_digest(h, c)
    return out


def normalize_inventory(inventory: Iterable[InventoryEntry] | None) -> list[CallId] | None:
    """``(rollout_id, model_call_id)`` pairs in first-seen order, duplicates dropped.

    Entries may be pairs or staging keys ``"rollout/call"``. ``None`` stays ``None``
    (every call the worker holds). Raises :class:`InvalidInventory` naming the entry.
    """
    if inventory is None:
        return None
    if isinstance(inventory, (str, bytes)):
        raise InvalidInventory("inventory must be a list of (rollout_id, model_call_id), got a string")
    out: dict[CallId, None] = {}
    for i, e in enumerate(inventory):
        if isinstance(e, str):
            parts = e.split("/")
            if len(parts) != 2:
                raise InvalidInventory(f"inventory[{i}] {e!r} is not a staging key 'rollout/call'")
            e = parts
        if not isinstance(e, (tuple, list)) or len(e) != 2:
            raise InvalidInventory(f"inventory[{i}] {e!r} is not (rollout_id, model_call_id)")
        try:
            pair = (check_id(e[0], "rollout_id"), check_id(e[1], "model_call_id"))
        except ValueError as err:
            raise InvalidInventory(f"inventory[{i}]: {err}") from None
        out[pair] = None
    return list(out)


def inventory_digest(inventory: Iterable[InventoryEntry] | None) -> bytes:
    """Order-free digest of an inventory (see module docstring); part of the cache key."""
    return pairs_digest(normalize_inventory(inventory))


def pairs_digest(pairs: list[CallId] | None) -> bytes:
    """:func:`inventory_digest` of an inventory :func:`normalize_inventory` already gave."""
    h = hashlib.sha256(TAG_INVENTORY)
    if pairs is None:
        h.update(b"*")
        return h.digest()
    pieces: list[bytes] = []
    u32 = _U32.pack
    for r, c in sorted(pairs):
        rb, cb = r.encode("utf-8"), c.encode("utf-8")
        pieces += (u32(len(rb)), rb, u32(len(cb)), cb)
    h.update(b"".join(pieces))  # the same bytes as one update per pair, in one call
    return h.digest()


# ---- acknowledgements and the receipt --------------------------------------------------


@dataclass(frozen=True)
class CallAck:
    """One call's answer to a cut (see module docstring for the statuses)."""

    rollout_id: str
    model_call_id: str
    status: str
    staging_keys: tuple[str, ...] = ()
    prefix_tokens: int = 0
    prefix_digest: bytes | None = None
    reason: str | None = None
    detail: str = ""
    total_tokens: int = 0  # for ``completed``: tokens the finished call holds (context + generated)
    # The digest version of ``prefix_digest`` and of the prefix's rows (tasks.digests);
    # None: not stated (an ack from before BLAKE3): the rows' own version decides.
    digest_version: int | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown cut status {self.status!r}")
        if self.status == DURABLE_FAILURE and self.reason not in FAILURE_REASONS:
            raise ValueError(f"durable_failure needs a reason from {FAILURE_REASONS}, got {self.reason!r}")
        if self.status == DURABLE_PREFIX and (self.prefix_digest is None or len(self.prefix_digest) != 32):
            raise ValueError("durable_prefix needs a 32-byte prefix_digest")

    @property
    def call(self) -> CallId:
        return (self.rollout_id, self.model_call_id)

    @property
    def durable(self) -> bool:
        return self.status == DURABLE_PREFIX

    @classmethod
    def durable_prefix(cls, rollout_id: str, model_call_id: str, staging_keys: tuple[str, ...], prefix_tokens: int,
                       prefix_digest: bytes, digest_version: int) -> "CallAck":
        """A ``durable_prefix`` ack from a writer that holds its values checked (a call
        buffer: ids checked when made, a 32-byte digest it computed); equal to the one
        the constructor makes, without its checks (a cut makes one per call)."""
        ack = object.__new__(cls)
        ack.__dict__.update(rollout_id=rollout_id, model_call_id=model_call_id, status=DURABLE_PREFIX,
                            staging_keys=staging_keys, prefix_tokens=prefix_tokens, prefix_digest=prefix_digest,
                            reason=None, detail="", total_tokens=0, digest_version=digest_version)
        return ack

    @classmethod
    def failure(cls, call: CallId, reason: str, detail: str = "") -> "CallAck":
        return cls(call[0], call[1], DURABLE_FAILURE, reason=reason, detail=detail)


@dataclass(frozen=True)
class CutReceipt:
    """A worker's answer to ``checkpoint_cut``: one :class:`CallAck` per inventory call.

    ``put_calls``/``delete_calls`` count store round trips; ``rows_written`` rows whose
    put succeeded (including rows later cleared); ``bytes_written`` their packed bytes;
    ``wall_ms`` the cut's duration; ``mean_row_wait_ms`` a written row's mean
    time from its freeze to its put's acknowledgement; ``deadline_passed`` whether the deadline stopped it.
    """

    checkpoint_id: str
    inventory_digest: bytes
    acks: tuple[CallAck, ...]
    worker: str = ""
    put_calls: int = 0
    delete_calls: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    wall_ms: float = 0.0
    mean_row_wait_ms: float = 0.0
    deadline_passed: bool = False
    version: int = CUT_RECEIPT_VERSION
    _index: dict = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {a.call: a for a in self.acks})

    def ack(self, rollout_id: str, model_call_id: str) -> CallAck:
        """The ack of one call; ``KeyError`` if the call was not in the inventory."""
        return self._index[(rollout_id, model_call_id)]

    def by_status(self, status: str) -> list[CallAck]:
        return [a for a in self.acks if a.status == status]

    @property
    def durable(self) -> list[CallAck]:
        return self.by_status(DURABLE_PREFIX)

    @property
    def failures(self) -> list[CallAck]:
        return self.by_status(DURABLE_FAILURE)

    def counts(self) -> dict[str, int]:
        """{status or failure reason: number of calls}."""
        out: dict[str, int] = {}
        for a in self.acks:
            k = a.reason if a.status == DURABLE_FAILURE else a.status
            out[k] = out.get(k, 0) + 1
        return out

    @property
    def advertised_keys(self) -> list[str]:
        """Every staging key this receipt hands out (sealed prefixes only)."""
        return [k for a in self.acks if a.durable for k in a.staging_keys]

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("_index", "acks")}
        d["acks"] = [dict(asdict(a), staging_keys=list(a.staging_keys)) for a in self.acks]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CutReceipt":
        acks = tuple(CallAck(**dict(a, staging_keys=tuple(a["staging_keys"]))) for a in d["acks"])
        return cls(**{k: v for k, v in d.items() if k not in ("acks", "_index")}, acks=acks)
