"""Replica placement and the merge of two copies' answers (pure: no Dask).

With ``token-capture.store.replicas: 2`` every key has a primary unit
(``unit_for_key``) and a replica unit on a different worker: the first unit after the
primary, cyclically in unit order, hosted on another worker (:func:`replica_map`; units
are placed round-robin over workers, so that is the next unit except at the wrap). The map
is fixed when the store starts and kept when a lost unit is replaced, so a key's two units
never change. Reasoning and costs: docs/reliability.md, "Replication".
"""
from __future__ import annotations

from typing import Iterable, Sequence

from tasks.errors import InvalidStoreRequest

from .protocol import MISSING_KEY, UNIT_UNAVAILABLE, StoreResult


def replica_map(unit_workers: Sequence[str]) -> list[int]:
    """``replica[u]``: the first unit after ``u`` (cyclically) on a worker other than ``u``'s.

    Raises :class:`InvalidStoreRequest` when every unit is on one worker (a second copy on
    the same worker dies with the first)."""
    n = len(unit_workers)
    if len(set(unit_workers)) < 2:
        raise InvalidStoreRequest(
            f"store.replicas=2 needs storage units on at least 2 workers, got {n} unit(s) on "
            f"{len(set(unit_workers))} worker(s); start more workers or set token-capture.store.replicas: 1"
        )
    out = []
    for u in range(n):
        for step in range(1, n):
            v = (u + step) % n
            if unit_workers[v] != unit_workers[u]:
                out.append(v)
                break
    return out


def witness_map(unit_workers: Sequence[str], replica: Sequence[int]) -> list[int | None]:
    """``witness[p]``: the unit recording the NAMES of the keys whose primary is ``p``, so a
    key whose two copies (units ``p`` and ``replica[p]``) are both lost reads as lost, not
    as never staged. The first unit after ``replica[p]`` (cyclically) on a worker hosting
    neither copy; ``None`` when every unit is on one of those two workers (a store on two
    workers cannot tell a lost key from an unknown one)."""
    n = len(unit_workers)
    out: list[int | None] = []
    for p in range(n):
        r = replica[p]
        taken = {unit_workers[p], unit_workers[r]}
        out.append(next((w for step in range(1, n) if unit_workers[w := (r + step) % n] not in taken), None))
    return out


def witnessed_by(u: int, witness: Sequence[int | None]) -> list[int]:
    """The primaries whose keys unit ``u`` witnesses."""
    return [p for p, w in enumerate(witness) if w == u]


def partners(u: int, replica: Sequence[int]) -> list[int]:
    """Units holding the other copy of some key of unit ``u``: its replica, and every unit
    whose replica ``u`` is (sorted, without ``u``)."""
    return sorted({replica[u], *(p for p, r in enumerate(replica) if r == u)} - {u})


# A unit's own refusal (key_conflict, store_full, ...) outranks not reaching a unit: a
# retry cannot fix it, so it is the answer the caller needs to see.
def _rank(reason: str) -> int:
    return 0 if reason == UNIT_UNAVAILABLE else 1


def merge_copies(results: Iterable[StoreResult], primary_order: Sequence[str]) -> StoreResult:
    """Both copies' put answers -> one per key: ``ok`` only when every copy is ok, else the
    worst failure (a unit's refusal before ``unit_unavailable``). ``ok`` keeps
    ``primary_order`` (the batch's key order)."""
    failed: dict[str, tuple[str, str]] = {}
    acked: set[str] = set()
    for r in results:
        acked.update(r.ok)
        for k, f in r.failed.items():
            old = failed.get(k)
            if old is None or _rank(f[0]) > _rank(old[0]):
                failed[k] = f
    out = StoreResult()
    out.ok = [k for k in primary_order if k in acked and k not in failed]
    out.failed = failed
    return out


def merge_deletes(results: Iterable[StoreResult], keys: Sequence[str]) -> StoreResult:
    """Both copies' delete answers -> one per key: ``ok`` when no copy failed other than
    ``missing_key`` and at least one copy was removed (a half-written key is deletable);
    ``missing_key`` when both were missing; else the worst failure. ``deferred`` if any
    copy's delete waits for a checkpoint."""
    ok: set[str] = set()
    deferred: set[str] = set()
    failed: dict[str, tuple[str, str]] = {}
    for r in results:
        ok.update(r.ok)
        deferred.update(r.deferred)
        for k, f in r.failed.items():
            old = failed.get(k)
            if old is None or (old[0] == MISSING_KEY and f[0] != MISSING_KEY) or _rank(f[0]) > _rank(old[0]):
                failed[k] = f
    out = StoreResult()
    for k in keys:
        f = failed.get(k)
        if k in ok and (f is None or f[0] == MISSING_KEY):
            out.ok.append(k)
            if k in deferred:
                out.deferred.append(k)
        elif f is not None:
            out.failed[k] = f
    return out
