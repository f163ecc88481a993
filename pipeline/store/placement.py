"""Where a store's keys live: a frozen, versioned placement table and the pure plans
made from it (no Dask, no I/O).

A :class:`Placement` names each unit's worker and, with ``store.replicas: 2``, the unit
holding every key's second copy (``replica``) and the unit recording its name
(``witness``). From it: which unit each key routes to (:meth:`Placement.route`), the
per-unit calls of a put (:func:`plan_put`, capped in bytes per call), of a read
(:func:`plan_read`) and of a write reaching every copy (:func:`plan_all_copies`), and the
fail-over of a read whose primary is unavailable (:func:`failover`). The version grows by
one each time a lost unit is replaced; unit indices never change.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tasks.errors import InvalidStoreRequest
from tasks.keys import unit_for_key
from tasks.packed import PackedBatch, payload_bytes_per_row

from .protocol import INVALID_BATCH, UNIT_UNAVAILABLE, GetResult, field_problem, split_valid_keys

Failures = dict[str, tuple[str, str]]


@dataclass(frozen=True)
class Placement:
    """Units by index: ``workers[u]`` hosts unit ``u``; ``replica[u]`` holds the second
    copy of unit ``u``'s keys and ``witness[u]`` their names (both ``None`` with one copy)."""

    version: int
    workers: tuple[str, ...]
    replica: tuple[int, ...] | None = None
    witness: tuple[int | None, ...] | None = None

    @property
    def n_units(self) -> int:
        return len(self.workers)

    def host(self, u: int) -> str:
        """The host part of unit ``u``'s worker address (``tcp://10.0.0.1:4000`` -> ``10.0.0.1``)."""
        return self.workers[u].split("://", 1)[-1].rsplit(":", 1)[0]

    def replaced(self, u: int, worker: str) -> "Placement":
        """This placement with unit ``u`` moved to ``worker`` (its replacement), one version on."""
        workers = list(self.workers)
        workers[u] = worker
        return Placement(self.version + 1, tuple(workers), self.replica, self.witness)

    def route(self, keys: Sequence[str]) -> tuple[np.ndarray, Failures]:
        """Primary unit per key (-1 for an unusable key) and the unusable keys' failures.
        Bad keys (lone surrogates, over the byte limits, malformed) fail here, per key,
        so they never reach crc32 or the wire."""
        where = np.full(len(keys), -1, dtype=np.int64)
        valid, failed = split_valid_keys(keys)
        for i in valid:
            where[i] = unit_for_key(keys[i], self.n_units)
        return where, failed

    def copies_of(self, where: np.ndarray) -> np.ndarray | None:
        """Replica unit per routed key (-1 where ``where`` is -1); None without replicas."""
        if self.replica is None:
            return None
        rep = np.asarray(self.replica, dtype=np.int64)
        return np.where(where >= 0, rep[np.maximum(where, 0)], -1)

    def witnesses_of(self, keys: Sequence[str], where: np.ndarray) -> dict[int, list[str]]:
        """Witness unit -> the names of ``keys`` it records; empty without witnesses."""
        if self.witness is None:
            return {}
        wit = np.asarray([-1 if w is None else w for w in self.witness], dtype=np.int64)
        per_key = np.where(where >= 0, wit[np.maximum(where, 0)], -1)
        return {int(w): [keys[i] for i in np.flatnonzero(per_key == w)] for w in np.unique(per_key[per_key >= 0])}


@dataclass
class PutPlan:
    """A put as calls: ``parts`` is (unit, ascending batch row indices) per call,
    ``failed`` the keys refused before any call, ``witness`` the names each witness unit
    records (consumed by the first call to that unit)."""

    parts: list[tuple[int, np.ndarray]]
    failed: Failures
    witness: dict[int, list[str]] = field(default_factory=dict)


def plan_put(placement: Placement, batch: PackedBatch, max_call_bytes: int) -> PutPlan:
    """One or more calls per unit holding a copy of some row of ``batch``, each carrying
    at most ``max_call_bytes`` of payload (a bigger row goes alone): several calls in
    flight pipeline one transfer with the unit's copy of another.

    A field that cannot be cut into rows fails the whole batch per key here: its offsets
    are what the cut needs (the unit checks every field again, as the edge that stores)."""
    if not isinstance(batch, PackedBatch):
        raise InvalidStoreRequest(f"put_many needs a PackedBatch, got {type(batch).__name__}")
    for name, f in batch.fields.items():
        problem = field_problem(name, f, len(batch))
        if problem:
            return PutPlan([], {k if isinstance(k, str) else repr(k): (INVALID_BATCH, problem) for k in batch.keys})
    where, failed = placement.route(batch.keys)
    row_bytes = payload_bytes_per_row(batch)
    copy = placement.copies_of(where)
    parts: list[tuple[int, np.ndarray]] = []
    for u in range(placement.n_units):
        # With replicas=2 one call per unit carries its primary AND its replica rows.
        idx = np.flatnonzero(where == u) if copy is None else np.flatnonzero((where == u) | (copy == u))
        parts.extend((u, chunk) for chunk in chunks_by_bytes(idx, row_bytes, max_call_bytes))
    return PutPlan(parts, failed, placement.witnesses_of(batch.keys, where))


def plan_read(placement: Placement, keys: Sequence[str]) -> tuple[list[tuple[int, list[str]]], Failures]:
    """(unit, its keys) per call reading ``keys`` from their primaries (duplicates once),
    and the unusable keys' failures."""
    uniq = list(dict.fromkeys(keys))
    where, failed = placement.route(uniq)
    parts = []
    for u in range(placement.n_units):
        idx = np.flatnonzero(where == u)
        if len(idx):
            parts.append((u, [uniq[i] for i in idx]))
    return parts, failed


def plan_all_copies(placement: Placement, keys: Sequence[str]) -> tuple[list[str], list[tuple[int, list[str]]], Failures]:
    """Like :func:`plan_read`, but each unit gets every key it holds a copy of; also the
    unique keys in request order."""
    uniq = list(dict.fromkeys(keys))
    if placement.replica is None:
        parts, failed = plan_read(placement, uniq)
        return uniq, parts, failed
    where, failed = placement.route(uniq)
    copy = placement.copies_of(where)
    parts = []
    for u in range(placement.n_units):
        idx = np.flatnonzero((where == u) | (copy == u))
        if len(idx):
            parts.append((u, [uniq[i] for i in idx]))
    return uniq, parts, failed


def failover(placement: Placement, results: Sequence[GetResult]) -> list[tuple[int, list[str]]]:
    """Keys whose primary answered ``unit_unavailable``, grouped by replica unit (sorted);
    empty without replicas."""
    if placement.replica is None:
        return []
    by_replica: dict[int, list[str]] = {}
    for r in results:
        for k, (reason, _) in r.failed.items():
            if reason == UNIT_UNAVAILABLE:
                by_replica.setdefault(placement.replica[unit_for_key(k, placement.n_units)], []).append(k)
    return sorted(by_replica.items())


def chunks_by_bytes(idx: np.ndarray, row_bytes: np.ndarray, max_bytes: int) -> list[np.ndarray]:
    """Split row indices ``idx`` into runs of at most ``max_bytes`` (a bigger row goes alone)."""
    if not len(idx):
        return []
    sizes = row_bytes[idx]
    if int(sizes.sum()) <= max_bytes:
        return [idx]
    chunks, start, acc = [], 0, 0
    for i, b in enumerate(sizes.tolist()):  # per row, not per token
        if acc and acc + b > max_bytes:
            chunks.append(idx[start:i])
            start, acc = i, 0
        acc += b
    chunks.append(idx[start:])
    return chunks
