"""The merge of two copies' answers (pure: no Dask).

With ``token-capture.store.replicas: 2`` every key has a primary unit and a replica
unit in another failure domain, chosen per key by rendezvous ranking
(:class:`~pipeline.store.placement.Placement`); a put and a delete reach both copies,
and their answers merge here into one per key. Reasoning and costs:
docs/reliability.md, "Replication".
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .protocol import MISSING_KEY, MOVED, UNIT_UNAVAILABLE, StoreResult


# A unit's own refusal (key_conflict, store_full, ...) outranks not reaching a unit: a
# retry cannot fix it, so it is the answer the caller needs to see.
def _rank(reason: str) -> int:
    return 0 if reason in (UNIT_UNAVAILABLE, MOVED) else 1


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
            # missing_key is no failure of the delete: any other answer of a copy outranks it
            # (one copy missing and the other unreachable is unreachable: its row may remain).
            if old is None or (old[0] == MISSING_KEY and f[0] != MISSING_KEY) or (
                    f[0] != MISSING_KEY and _rank(f[0]) > _rank(old[0])):
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
