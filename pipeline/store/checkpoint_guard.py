"""A unit's open store checkpoints and the deletes they hold back (pure bookkeeping).

While a checkpoint is open on a unit, deletes in the partitions it covers are deferred,
so no row the checkpoint may still write is lost, whichever process deletes. Each open
checkpoint has a lease: one older than ``lease_s`` seconds (its writer died) ends by
itself, and its writer is told once that it expired. Times are the unit's clock (s).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckpointGuard:
    """Open checkpoints (token -> partitions covered, ``None``: all), when each began, the
    tokens a lease ended, and per partition the keys whose delete waits."""

    lease_s: float  # 0: no lease
    open: dict[str, frozenset[str] | None] = field(default_factory=dict)
    began: dict[str, float] = field(default_factory=dict)
    expired: set[str] = field(default_factory=set)
    # Per partition: deleted keys whose removal waits -> the checkpoints open at the delete.
    deferred: dict[str, dict[str, frozenset[str]]] = field(default_factory=dict)
    # Per partition: deferred keys a restore's put revived (provisional under its claim)
    # -> the checkpoints open at their delete (they write the row; later ones do not).
    revived: dict[str, dict[str, frozenset[str]]] = field(default_factory=dict)

    def covers(self, partition: str) -> bool:
        """Whether an open checkpoint covers ``partition`` (deletes there are deferred)."""
        return any(parts is None or partition in parts for parts in self.open.values())

    def begin(self, token: str, parts: frozenset[str] | None, now: float) -> bool:
        """Open ``token`` (again: nothing changes); True if it is new."""
        if token in self.open:
            return False
        self.open[token] = parts
        self.began[token] = now
        return True

    def end(self, token: str) -> tuple[bool, bool]:
        """Close ``token``: (it was open, a lease had ended it, told only once)."""
        expired = token in self.expired
        self.expired.discard(token)
        self.began.pop(token, None)
        return self.open.pop(token, ...) is not ..., expired

    def expire(self, now: float) -> list[str]:
        """End every checkpoint open longer than the lease; returns their tokens."""
        if self.lease_s <= 0 or not self.began:
            return []
        old = [t for t, began in self.began.items() if now - began > self.lease_s]
        for token in old:
            del self.began[token]
            self.open.pop(token, None)
            self.expired.add(token)
        return old

    def defer(self, partition: str, key: str, tokens: frozenset[str] | None = None) -> None:
        """Hold back ``key``'s delete, noting the checkpoints open now (the first delete's),
        or ``tokens`` (those open at the delete a restore's revival had cancelled)."""
        waiting = self.deferred.setdefault(partition, {})
        if key not in waiting:
            now = frozenset(t for t, parts in self.open.items() if parts is None or partition in parts)
            waiting[key] = now if tokens is None else tokens

    def deleted_before(self, partition: str, token: str) -> set[str]:
        """Deferred keys of ``partition`` deleted before checkpoint ``token`` began: held
        for older checkpoints only, so ``token`` must not write them."""
        return {k for k, tokens in self.deferred.get(partition, {}).items() if token not in tokens}

    def undefer(self, partition: str, key: str) -> frozenset[str] | None:
        """Cancel ``key``'s deferred delete (it was staged again, identical): the
        checkpoints open at the delete, or None if none waited."""
        waiting = self.deferred.get(partition)
        if not waiting or key not in waiting:
            return None
        tokens = waiting.pop(key)
        if not waiting:
            del self.deferred[partition]
        return tokens

    def revive(self, partition: str, key: str, tokens: frozenset[str]) -> None:
        """A restore's put revived ``key`` (its deferred delete, made while ``tokens`` were
        open, was cancelled): if that restore fails while a checkpoint still covers
        ``partition``, the delete is deferred again for them (:meth:`revived_of`), not
        applied, since they may still write it."""
        self.revived.setdefault(partition, {})[key] = tokens

    def revived_of(self, partition: str) -> dict[str, frozenset[str]]:
        """The revived keys of ``partition`` while an open checkpoint covers it (else none)."""
        return self.revived.get(partition, {}) if self.covers(partition) else {}

    def due(self) -> dict[str, list[str]]:
        """The deferred deletes no open checkpoint holds back any more (taken out)."""
        self.revived = {p: ks for p, ks in self.revived.items() if self.covers(p)}
        return {p: list(self.deferred.pop(p)) for p in [p for p in self.deferred if not self.covers(p)]}

    def pending(self) -> int:
        return sum(len(d) for d in self.deferred.values())

    def clear(self) -> None:
        self.open.clear()
        self.began.clear()
        self.expired.clear()
        self.deferred.clear()
        self.revived.clear()
