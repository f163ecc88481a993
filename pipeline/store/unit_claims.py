"""A storage unit's provisional rows: the rows a restore's put created under its claim
(a token), acknowledged to no writer yet, until the restore settles or releases them.

Provisional rows are the store's only unacknowledged rows, so what copies or saves rows
must keep them apart: a store checkpoint leaves them out (:func:`checkpoint_left_out`:
it holds the rows acknowledged when it is taken; a restore of it never brings back rows a
rollback took back), and a lost unit's re-replication lists them (:meth:`claimed_keys`)
and puts them on the replacement under the same claim, so a later release takes back
that copy too (a move carries each row's claim the same way: :mod:`.unit_moves`). A row
a restore *revived* (deleted while a checkpoint was open, staged again) is still written
by the checkpoints open at its delete: it was live when they began.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from ..answers import WireDict
from .fence import stale_refusal
from .protocol import check_partition, unpack_names

if TYPE_CHECKING:  # pragma: no cover
    from .checkpoint_guard import CheckpointGuard
    from .fence import Fence
    from .held_rows import HeldRows


def keys_by_claim(claims: Mapping[str, str | None], keys: Iterable[str] | None = None) -> dict[str | None, list[str]]:
    """``keys`` (default: every key of ``claims``) grouped by their claim (key -> claim;
    a key without one under None), in first-seen order: one call per claim."""
    out: dict[str | None, list[str]] = {}
    for k in claims if keys is None else keys:
        out.setdefault(claims.get(k), []).append(k)
    return out


def checkpoint_left_out(held: "HeldRows", guard: "CheckpointGuard", token: str | None) -> dict[str, set[str]]:
    """Per partition, the keys checkpoint ``token`` must not write: those deleted before
    it began (held back for older checkpoints only) and those provisional under a claim,
    but revived ones whose delete ``token`` was open at (``None``: every provisional key)."""
    out = {} if token is None else {p: guard.deleted_before(p, token) for p in held.index}
    if not held.claims:
        return out
    claims = held.claims
    for partition, index in held.index.items():
        revived = guard.revived.get(partition, {})
        provisional = {k for k, slot in index.items() if slot in claims and token not in revived.get(k, ())}
        if provisional:
            out[partition] = out.get(partition, set()) | provisional
    return out


class ClaimedRows:
    """The claim calls of :class:`~pipeline.store.unit.StorageUnit` (a mixin: it uses the
    unit's ``held``, ``guard``, ``fence``, ``counters``, ``partitions``, ``unit_index``).

    Claim calls carry the table version they were planned on, as every key-routed call
    does: a unit fenced by a newer table refuses an older one (``{"moved": version}``),
    so a handle still on the table before a move asks again on the new one and reaches
    the rows the move put on other units. The move's own calls carry none."""

    held: "HeldRows"
    fence: "Fence | None"
    guard: "CheckpointGuard"
    counters: dict[str, int]
    partitions: list[str] | None
    unit_index: int
    closed: bool

    def _check_open(self) -> None: ...  # pragma: no cover - StorageUnit's

    def release_claim(self, partition: str, keys: Sequence[str] | bytes, claim: str, version: int | None = None) -> dict:
        """Remove the rows of ``keys`` still provisional under ``claim`` (created by a put
        with that claim, acknowledged to no other writer since); every other row stays.
        Not deferred by open checkpoints: no writer was ever told these rows exist; but a
        key deleted while one is open that the claim's put revived is deleted again as it
        was, deferred (for the checkpoints open at its delete). Returns ``{"unit",
        "removed": rows removed, "kept": keys that stay, "deferred": keys whose delete
        waits for the checkpoint}``; a call planned on a table older than the unit's
        fence changes nothing and answers ``{"unit", "moved": the fence's version}``."""
        self._check_open()
        check_partition(partition, self.partitions)
        names = unpack_names(keys, "keys")
        refused = stale_refusal(self, version, len(names))
        if refused is not None:
            return refused
        spare = self.guard.revived_of(partition)
        removed, kept, deferred = self.held.release(partition, names, claim, spare)
        for key in deferred:
            self.guard.defer(partition, key, spare.get(key))
        self.counters["released_rows"] += removed
        self.held.compact()
        return {"unit": self.unit_index, "removed": removed, "kept": kept, "deferred": deferred}

    def settle_claim(self, claim: str, version: int | None = None) -> int | dict:
        """The rows provisional under ``claim`` become ordinary rows; returns how many
        (a call planned on a table older than the unit's fence: ``{"unit", "moved"}``)."""
        if self.closed:
            return 0
        return stale_refusal(self, version) or self.held.settle(claim)

    def claimed_keys(self, partition: str) -> dict[str, str]:
        """The keys of ``partition`` still provisional, each with its claim."""
        self._check_open()
        check_partition(partition, self.partitions)
        claims = self.held.claims
        if not claims:
            return WireDict()
        return WireDict({k: claims[s] for k, s in self.held.index.get(partition, {}).items() if s in claims})
