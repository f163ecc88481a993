"""Where a store's keys live: a frozen, versioned placement table and the pure plans
made from it (no Dask, no I/O).

A :class:`Placement` names each unit by a stable id, the worker hosting it, and its
home (the worker it joined on: its failure domain, kept by a replacement, so a repair
moves no key). A key's units rank by rendezvous hashing of (rollout id, unit id)
(:mod:`tasks.placement_hash`): its primary is the top one; with ``store.replicas: 2``
its replica is the top unit in another failure domain (another host when the homes span
several, else another worker) and its witness, recording its NAME so that losing both
copies reads ``lost_key``, the top unit on a worker hosting neither copy. Adding or
removing one of n units moves about 1/n of the keys (:meth:`Placement.with_unit`,
:meth:`Placement.without_unit`, :func:`moved`).

From a table: each key's units (:meth:`Placement.locate`, vectorised over keys x
units), the per-unit calls of a put (:func:`plan_put`, capped in bytes per call), a
read (:func:`plan_read`), a write reaching every copy (:func:`plan_all_copies`,
:func:`plan_delete`) and a read's fail-over (:func:`failover`). Every change of the
table is one version on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from tasks.errors import InvalidStoreRequest
from tasks.keys import rollout_of_key
from tasks.packed import PackedBatch, payload_bytes_per_row
from tasks.placement_hash import check_unit_ids, copies, default_unit_ids, rollout_hashes, unit_hashes

from .protocol import INVALID_BATCH, UNIT_UNAVAILABLE, GetResult, field_problem, split_valid_keys

Failures = dict[str, tuple[str, str]]


def host_of(worker: str) -> str:
    """The host part of a worker address (``tcp://10.0.0.1:4000`` -> ``10.0.0.1``)."""
    return worker.split("://", 1)[-1].rsplit(":", 1)[0]


@dataclass(frozen=True)
class _Derived:
    """What every ranking of a table needs, computed once per table."""

    hashes: np.ndarray  # uint64 per unit id
    domain: np.ndarray  # int64 per unit: its failure domain (home host, or home worker)
    worker: np.ndarray  # int64 per unit: its home worker
    index: dict[str, int]  # unit id -> index
    by_host: bool  # copies are separated by host (the homes span several hosts)


@dataclass(frozen=True)
class Located:
    """A request's keys placed: ``primary`` / ``replica`` / ``witness`` unit index per key
    (int64; -1 for an unusable key, no replica or no witness; ``replica`` and ``witness``
    are ``None`` with one copy) and the unusable keys' failures."""

    primary: np.ndarray
    replica: np.ndarray | None
    witness: np.ndarray | None
    failed: Failures


@dataclass(frozen=True)
class Placement:
    """Units by index: unit ``u`` is named ``unit_ids[u]`` (default ``"0".."n-1"``),
    hosted on ``workers[u]``, in the failure domain of ``homes[u]`` (default: its
    worker). ``replicas``: copies of every key (1 or 2)."""

    version: int
    workers: tuple[str, ...]
    unit_ids: tuple[str, ...] = ()
    replicas: int = 1
    homes: tuple[str, ...] = ()
    _derived: _Derived = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        workers = tuple(self.workers)
        n = len(workers)
        if n == 0:
            raise InvalidStoreRequest("a placement needs at least one storage unit")
        ids = default_unit_ids(n) if not self.unit_ids else check_unit_ids(self.unit_ids)
        homes = workers if not self.homes else tuple(self.homes)
        if len(ids) != n or len(homes) != n:
            raise InvalidStoreRequest(f"a placement of {n} worker(s) got {len(ids)} unit id(s) and {len(homes)} home(s)")
        if self.replicas not in (1, 2):
            raise InvalidStoreRequest(f"token-capture.store.replicas must be 1 or 2, got {self.replicas!r}")
        object.__setattr__(self, "workers", workers)
        object.__setattr__(self, "unit_ids", ids)
        object.__setattr__(self, "homes", homes)
        _, worker = np.unique(np.asarray(homes, dtype=object), return_inverse=True)
        _, host = np.unique(np.asarray([host_of(h) for h in homes], dtype=object), return_inverse=True)
        by_host = int(host.max()) > 0
        domain = (host if by_host else worker).astype(np.int64)
        if self.replicas == 2 and int(domain.max()) == 0:
            raise InvalidStoreRequest(
                f"store.replicas=2 needs storage units on at least 2 workers, got {n} unit(s) on "
                f"1 worker(s); start more workers or set token-capture.store.replicas: 1"
            )
        index = {u: i for i, u in enumerate(ids)}
        object.__setattr__(self, "_derived", _Derived(unit_hashes(ids), domain, worker.astype(np.int64), index, by_host))

    # ---- the table -------------------------------------------------------------------

    @property
    def n_units(self) -> int:
        return len(self.workers)

    @property
    def by_host(self) -> bool:
        """True when copies are kept on different hosts (the homes span several hosts),
        False when on different workers."""
        return self._derived.by_host

    def host(self, u: int) -> str:
        """The host part of unit ``u``'s worker address (``tcp://10.0.0.1:4000`` -> ``10.0.0.1``)."""
        return host_of(self.workers[u])

    def index_of(self, unit_id: str) -> int:
        """The index of the unit named ``unit_id``; :class:`InvalidStoreRequest` if none is."""
        try:
            return self._derived.index[unit_id]
        except (KeyError, TypeError):
            raise InvalidStoreRequest(f"no storage unit {unit_id!r} in this placement (units {list(self.unit_ids)})") from None

    def replaced(self, u: int, worker: str) -> "Placement":
        """This placement with unit ``u`` moved to ``worker`` (its replacement), one version
        on. Its id and home stay, so no key changes units."""
        workers = list(self.workers)
        workers[u] = worker
        return Placement(self.version + 1, tuple(workers), self.unit_ids, self.replicas, self.homes)

    def with_unit(self, unit_id: str, worker: str) -> "Placement":
        """This placement with a new unit ``unit_id`` on ``worker`` (its home), one version
        on. Refuses an id already present and a worker that already hosts a unit."""
        if unit_id in self._derived.index:
            raise InvalidStoreRequest(f"storage unit {unit_id!r} is already in this placement")
        if worker in self.workers or worker in self.homes:
            raise InvalidStoreRequest(f"worker {worker!r} already hosts a storage unit; one new unit per worker")
        return Placement(
            self.version + 1, self.workers + (worker,), self.unit_ids + (unit_id,), self.replicas, self.homes + (worker,)
        )

    def without_unit(self, unit_id: str) -> "Placement":
        """This placement without unit ``unit_id``, one version on (later units' indices
        shift down by one). Refuses an unknown id and the last unit."""
        u = self.index_of(unit_id)
        if self.n_units == 1:
            raise InvalidStoreRequest(f"cannot remove storage unit {unit_id!r}: it is the last one")
        drop = lambda t: t[:u] + t[u + 1 :]  # noqa: E731
        return Placement(self.version + 1, drop(self.workers), drop(self.unit_ids), self.replicas, drop(self.homes))

    def partners(self, u: int) -> list[int]:
        """Units that may hold the other copy of a key with a copy on unit ``u``: every
        unit in another failure domain (empty with one copy)."""
        if self.replicas == 1:
            return []
        dom = self._derived.domain
        return [int(v) for v in np.flatnonzero(dom != dom[u])]

    def may_host(self, u: int, worker: str, by_host: bool | None = None) -> bool:
        """Whether unit ``u``'s replacement may run on ``worker``: no other unit of another
        failure domain runs there (nor on its host, when copies are kept on different
        hosts; ``by_host=False`` checks the worker alone), so no key's two copies end up
        on one worker (host)."""
        dom, host = self._derived.domain, host_of(worker)
        by_host = self.by_host if by_host is None else by_host
        here = [v for v, w in enumerate(self.workers) if v != u and (w == worker or (by_host and host_of(w) == host))]
        return all(dom[v] == dom[u] for v in here)

    # ---- a request's keys ------------------------------------------------------------

    def locate_rollouts(
        self, rollout_ids: Sequence[str], replicas: int | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(primary, replica, witness) unit index per rollout id (see :class:`Located`);
        ``replicas=1`` ranks only the primaries."""
        d, replicas = self._derived, self.replicas if replicas is None else replicas
        if not len(rollout_ids):
            empty = np.zeros(0, dtype=np.int64)
            return (empty, None, None) if replicas == 1 else (empty, empty.copy(), empty.copy())
        return copies(rollout_hashes(rollout_ids), d.hashes, d.domain, d.worker, replicas)

    def locate(self, keys: Sequence[str], replicas: int | None = None) -> Located:
        """Every key's units, vectorised over keys x units (``replicas=1``: primaries
        only). Bad keys (lone surrogates, over the byte limits, malformed) fail here, per
        key, so they never reach the hash or the wire."""
        valid, failed = split_valid_keys(keys)
        if len(valid) == len(keys):
            return Located(*self.locate_rollouts([rollout_of_key(k) for k in keys], replicas), failed)
        n, idx = len(keys), np.asarray(valid, dtype=np.int64)
        located = self.locate_rollouts([rollout_of_key(keys[i]) for i in valid], replicas)

        def spread(a: np.ndarray | None) -> np.ndarray | None:
            if a is None:
                return None
            out = np.full(n, -1, dtype=np.int64)
            out[idx] = a
            return out

        p, r, w = (spread(a) for a in located)
        return Located(p, r, w, failed)  # type: ignore[arg-type]

    def route(self, keys: Sequence[str]) -> tuple[np.ndarray, Failures]:
        """Primary unit per key (-1 for an unusable key) and the unusable keys' failures."""
        loc = self.locate(keys, replicas=1)
        return loc.primary, loc.failed

    def copies_of(self, keys: Sequence[str]) -> np.ndarray | None:
        """Replica unit per key (-1 for an unusable key); None without replicas."""
        return self.locate(keys).replica

    def witnesses_of(self, keys: Sequence[str]) -> dict[int, list[str]]:
        """Witness unit -> the names of ``keys`` it records; empty without witnesses."""
        return by_unit(keys, self.locate(keys).witness)


def by_unit(keys: Sequence[str], where: np.ndarray | None) -> dict[int, list[str]]:
    """Unit -> the ``keys`` whose entry of ``where`` is that unit (-1 entries left out),
    units ascending, keys in request order."""
    if where is None:
        return {}
    return {int(u): [keys[i] for i in np.flatnonzero(where == u)] for u in np.unique(where[where >= 0])}


# ---- plans ----------------------------------------------------------------------------


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
    loc = placement.locate(batch.keys)
    row_bytes = payload_bytes_per_row(batch)
    parts: list[tuple[int, np.ndarray]] = []
    for u, idx in _holders(placement, loc):
        # With replicas=2 one call per unit carries its primary AND its replica rows.
        parts.extend((u, chunk) for chunk in chunks_by_bytes(idx, row_bytes, max_call_bytes))
    return PutPlan(parts, loc.failed, by_unit(batch.keys, loc.witness))


def _holders(placement: Placement, loc: Located) -> list[tuple[int, np.ndarray]]:
    """(unit, ascending indices of the keys it holds a copy of) per unit holding any."""
    out = []
    for u in range(placement.n_units):
        held = loc.primary == u if loc.replica is None else (loc.primary == u) | (loc.replica == u)
        idx = np.flatnonzero(held)
        if len(idx):
            out.append((u, idx))
    return out


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
    uniq, parts, _, failed = plan_delete(placement, keys)
    return uniq, parts, failed


def plan_delete(
    placement: Placement, keys: Sequence[str]
) -> tuple[list[str], list[tuple[int, list[str]]], dict[int, list[str]], Failures]:
    """:func:`plan_all_copies` and the names each witness unit records of the keys
    (empty with one copy): (unique keys, parts, witness names, failures)."""
    uniq = list(dict.fromkeys(keys))
    loc = placement.locate(uniq)
    parts = [(u, [uniq[i] for i in idx]) for u, idx in _holders(placement, loc)]
    return uniq, parts, by_unit(uniq, loc.witness), loc.failed


def failover(placement: Placement, results: Sequence[GetResult]) -> list[tuple[int, list[str]]]:
    """Keys whose primary answered ``unit_unavailable``, grouped by replica unit (sorted);
    empty without replicas."""
    if placement.replicas == 1:
        return []
    keys = [k for r in results for k, (reason, _) in r.failed.items() if reason == UNIT_UNAVAILABLE]
    if not keys:
        return []
    return sorted(by_unit(keys, placement.copies_of(keys)).items())


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


# ---- what a change of the table moves ------------------------------------------------------


@dataclass(frozen=True)
class Moved:
    """Of the items given to :func:`moved` (rollout ids or keys, in their order): those
    whose primary unit changes, whose set of copy-holding units changes, and whose
    witness changes (unit ids compared, not indices)."""

    primary: list[str]
    copies: list[str]
    witness: list[str]


def moved(old: Placement, new: Placement, items: Sequence[str]) -> Moved:
    """Which of ``items`` (rollout ids, or staging/cut keys: an item with ``/`` is a key)
    change units between placements ``old`` and ``new``. Pure; vectorised over items x
    units. Raises :class:`~tasks.errors.InvalidKey` for a malformed key or an id that is
    not valid UTF-8."""
    rollouts = [rollout_of_key(x) if "/" in x else x for x in items]
    p0, r0, w0 = old.locate_rollouts(rollouts)
    p1, r1, w1 = new.locate_rollouts(rollouts)
    # Old indices as new ones (a removed unit -> -2, never a new index); -1 stays -1.
    trans = np.asarray([new._derived.index.get(u, -2) for u in old.unit_ids] + [-1], dtype=np.int64)
    none = np.full(len(rollouts), -1, dtype=np.int64)
    before = np.sort(np.stack([trans[p0], trans[none if r0 is None else r0]], axis=1), axis=1)
    after = np.sort(np.stack([p1, none if r1 is None else r1], axis=1), axis=1)
    wit = trans[none if w0 is None else w0] != (none if w1 is None else w1)
    pick = lambda mask: [items[i] for i in np.flatnonzero(mask)]  # noqa: E731
    return Moved(pick(trans[p0] != p1), pick((before != after).any(axis=1)), pick(wit))
