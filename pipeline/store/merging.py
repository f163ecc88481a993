"""Per-unit answers into one answer (pure: no Dask, no I/O).

The gets of several units merge into ONE batch in request order (:func:`merge_gets`);
the two copies' put and delete answers into one per key (:func:`merge_puts`, see
:mod:`~pipeline.store.replication`); a retry after a unit was replaced answers exactly
the keys the first try failed ``unit_unavailable`` (:func:`splice`, :func:`failed_rows`);
a read's fail-over replaces the primaries' failures with the replicas' answers
(:func:`after_failover`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tasks.packed import PackedBatch, PackedField, take_rows

from .protocol import DTYPE_MISMATCH, MISSING_KEY, MOVED, UNIT_UNAVAILABLE, GetResult, StoreResult
from .replication import merge_copies

Failures = dict[str, tuple[str, str]]


def merge_puts(batch: PackedBatch, results: list[StoreResult], failed: Failures, replicated: bool) -> StoreResult:
    """Every call's put answer -> one per key (with replicas: ``ok`` only when both copies are)."""
    if not replicated:
        result = StoreResult.merge(results)
    else:
        result = merge_copies(results, [k for k in batch.keys if isinstance(k, str) and k not in failed])
    result.failed.update(failed)
    return result


# A key failed for one of these may succeed on a newer table: the unit was lost (and may
# have been replaced) or a move fenced it (the call's table is stale).
RETRY_REASONS = frozenset({UNIT_UNAVAILABLE, MOVED})


def any_unavailable(failed: dict) -> bool:
    return any(r in RETRY_REASONS for r, _ in failed.values())


def any_moved(failed: dict) -> bool:
    """Some key was refused ``moved``: a unit holds a newer table than the call's."""
    return any(r == MOVED for r, _ in failed.values())


def unavailable_keys(results: list[GetResult]) -> list[str]:
    return [k for r in results for k, (reason, _) in r.failed.items() if reason in RETRY_REASONS]


def drop_failed(results: list[GetResult], keys: Sequence[str]) -> list[GetResult]:
    drop = set(keys)
    return [GetResult(r.batch, {k: f for k, f in r.failed.items() if k not in drop}) for r in results]


def after_failover(first: list[GetResult], second: list[GetResult]) -> list[GetResult]:
    """Primary answers with the re-read keys' failures replaced by their replicas' answers;
    a key failing on both keeps both details."""
    primary = {k: f for r in first for k, f in r.failed.items() if f[0] == UNIT_UNAVAILABLE}
    for r in second:
        for k, (reason, detail) in list(r.failed.items()):
            if reason == UNIT_UNAVAILABLE and k in primary:
                r.failed[k] = (reason, f"primary: {primary[k][1]}; replica: {detail}")
    return drop_failed(first, list(primary)) + second


def failed_rows(result: StoreResult, batch: PackedBatch) -> PackedBatch:
    """The rows of ``batch`` whose keys failed ``unit_unavailable`` or ``moved`` (to retry them)."""
    idx = [i for i, k in enumerate(batch.keys) if isinstance(k, str) and result.failed.get(k, ("",))[0] in RETRY_REASONS]
    return batch.take(np.asarray(idx, dtype=np.int64))


def removed_before(again: StoreResult, removed: set[str]) -> StoreResult:
    """A retried delete's answer where a key an earlier round removed from some copy and
    every copy asked now misses counts as deleted (a move's switch between the rounds
    refused the first round on one copy after another had removed the row)."""
    gone = [k for k, (r, _) in again.failed.items() if r == MISSING_KEY and k in removed]
    if not gone:
        return again
    out = StoreResult()
    out.ok = again.ok + gone
    out.failed = {k: f for k, f in again.failed.items() if k not in set(gone)}
    out.deferred = list(again.deferred)
    return out


def splice(result: StoreResult, again: StoreResult) -> StoreResult:
    """``result`` with the keys it failed ``unit_unavailable`` or ``moved`` answered by ``again``."""
    redone = {k for k, (r, _) in result.failed.items() if r in RETRY_REASONS}
    out = StoreResult()
    out.ok = result.ok + [k for k in again.ok if k in redone]
    out.failed = {k: f for k, f in result.failed.items() if k not in redone}
    out.failed.update({k: f for k, f in again.failed.items() if k in redone})
    out.deferred = result.deferred + [k for k in again.deferred if k in redone]
    return out


def empty_get() -> GetResult:
    return GetResult(PackedBatch([], {}), {})


def merge_gets(keys: Sequence[str], results: list[GetResult], failed: Failures, allocator: Callable[[Iterable[int]], Any]) -> GetResult:
    """Per-unit answers -> ONE batch in request order (duplicate requests repeat rows).

    Units pin dtypes independently, so a field may come back with different specs from
    different units: the first spec (in unit order) that has rows wins and rows of a
    disagreeing unit are refused ``dtype_mismatch`` rather than silently cast.
    """
    for r in results:
        failed.update(r.failed)
    batches = [r.batch for r in results if len(r.batch)]
    if not batches:
        return GetResult(PackedBatch([], {}), failed)
    names = list(dict.fromkeys(n for b in batches for n in b.fields))
    chosen: dict[str, tuple[np.dtype, tuple]] = {}
    for name in names:
        with_rows = [b.fields[name] for b in batches if name in b.fields and b.fields[name].any_present()]
        proto = with_rows[0] if with_rows else next(b.fields[name] for b in batches if name in b.fields)
        chosen[name] = (proto.values.dtype, proto.values.shape[1:])
    aligned = []
    for b in batches:
        fields = {}
        bad = None
        for name in names:
            f = b.fields.get(name)
            if f is None or not f.any_present():
                fields[name] = PackedField.absent(len(b), *chosen[name])
            elif (f.values.dtype, f.values.shape[1:]) != chosen[name]:
                bad = (
                    f"field {name!r}: {f.values.dtype.str}{list(f.values.shape[1:])} on one unit, "
                    f"{np.dtype(chosen[name][0]).str}{list(chosen[name][1])} on another"
                )
                break
            else:
                fields[name] = f
        if bad is not None:
            failed.update({k: (DTYPE_MISMATCH, bad) for k in b.keys})
            continue
        aligned.append(PackedBatch(b.keys, fields))
    if not aligned:
        return GetResult(PackedBatch([], {}), failed)
    # Where each served key sits: (source batch, row); duplicates in the request repeat.
    where = {k: (b, j) for b, batch in enumerate(aligned) for j, k in enumerate(batch.keys)}
    picks = [where[k] for k in keys if k in where]
    src = np.fromiter((p[0] for p in picks), dtype=np.int64, count=len(picks))
    rows = np.fromiter((p[1] for p in picks), dtype=np.int64, count=len(picks))
    if len(aligned) == 1 and np.array_equal(rows, np.arange(len(aligned[0]))):
        return GetResult(aligned[0], failed)  # already one batch in request order
    # The merged values go into ``allocator``'s memory (a pooled slab: memory this process
    # has already touched, not a fresh mapping that page-faults on every get).
    sizes = (sum(b.fields[n].values.nbytes for b in aligned) for n in names)
    return GetResult(take_rows(aligned, src, rows, out=allocator(sizes)), failed)
