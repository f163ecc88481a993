"""The store's key-routed operations as sans-I/O generators: plan, calls, settle, merge.

Each operation reads the handle's current :class:`~pipeline.store.placement.Placement`,
yields the actor calls it needs (:class:`~pipeline.store.calls.Call`) and gets their
settled answers back, then merges them. After a unit was unavailable it yields a
:class:`~pipeline.store.calls.Refresh`: when the units were replaced meanwhile it
retries exactly the failed keys on the new placement. The drivers in
:mod:`~pipeline.store.calls` run the same generator synchronously or asynchronously.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tasks.packed import PackedBatch, gathered_nbytes, slice_rows, take_rows

from .calls import Call, Driven, Operation, Refresh, Window
from .merging import (
    RETRY_REASONS,
    after_failover,
    any_moved,
    any_unavailable,
    drop_failed,
    empty_get,
    failed_rows,
    merge_gets,
    merge_puts,
    removed_before,
    splice,
    unavailable_keys,
)
from .moving import ASK_NEXT, MovingTable, holder_parts, plan_all_moving, plan_put_moving, read_order
from .placement import failover, plan_delete, plan_put, plan_read
from .protocol import MISSING_KEY, GetResult, StoreResult, pack_names
from .replication import merge_deletes


REFRESHES = 3  # table refreshes one operation follows (a unit replaced, a move fenced it)


def _packed(names: list[str] | None) -> bytes | None:
    return None if not names else pack_names(names)


def cut_rows(batch: PackedBatch, chunk: np.ndarray, allocator: Callable) -> PackedBatch:
    """Rows ``chunk`` (ascending) of ``batch``: a new batch object over the same buffers,
    a view of a run, or a gather into ``allocator``'s (pooled) memory. Never ``batch``
    itself nor its fields' dict, so a batch the caller received is not forwarded still
    marked ``received``, and the cut may be emptied once sent (:func:`_put_once`)."""
    if len(chunk) == len(batch):
        return PackedBatch(batch.keys, dict(batch.fields))
    if chunk[-1] - chunk[0] + 1 == len(chunk):
        return slice_rows(batch, int(chunk[0]), int(chunk[-1]) + 1)
    return take_rows([batch], np.zeros(len(chunk), np.int64), chunk, out=allocator(gathered_nbytes(batch, chunk)))


def _witness_calls(partition: str, names: dict[int, list[str]], drop: bool) -> list[Call]:
    """One ``witness`` call per witness unit (a put's: per unit not otherwise called; a
    delete's: after the copies answered); its answer fails no key (the copies decide), it
    only cannot tell a later loss of both copies."""
    if drop:
        return [Call(w, "witness", lambda ks=ks: (partition, None, pack_names(ks))) for w, ks in names.items()]
    return [Call(w, "witness", lambda ks=ks: (partition, pack_names(ks))) for w, ks in names.items()]


# ---- put ----------------------------------------------------------------------------------


def put(store: Driven, batch: PackedBatch, partition: str, adopt: bool, claim: str | None) -> Operation[StoreResult]:
    """Stage every row of ``batch`` (see :meth:`StagingStore.put_many`)."""
    seen = store.placement.version
    result = yield from _put_once(store, batch, partition, adopt, claim)
    for _ in range(REFRESHES):
        if not any_unavailable(result.failed) or not (yield Refresh(seen, moved=any_moved(result.failed))):
            break
        seen = store.placement.version
        again = yield from _put_once(store, failed_rows(result, batch), partition, adopt, claim)
        result = splice(result, again)
    return result


def _put_once(store: Driven, batch: PackedBatch, partition: str, adopt: bool, claim: str | None) -> Operation[StoreResult]:
    placement, moving, version = store.placement, store.moving, stamp(store)
    cap = store.settings.max_call_bytes
    plan = plan_put(placement, batch, cap) if moving is None else plan_put_moving(moving, batch, cap)
    allocator = store.buffers().allocator
    calls = []
    sent: list[PackedBatch] = []

    def cut(chunk: np.ndarray) -> PackedBatch:
        part = cut_rows(batch, chunk, allocator)
        sent.append(part)
        return part

    for u, chunk in plan.parts:
        # The first call to a unit also carries the names it witnesses.
        wit = _packed(plan.witness.pop(u, None))
        args = lambda chunk=chunk, wit=wit: (partition, cut(chunk), adopt, claim, wit, False, version)  # noqa: E731
        calls.append(Call(u, "put_many", args, [batch.keys[i] for i in chunk]))
    # At most calls-in-flight per unit, each cut as it leaves: the gathered rows in memory
    # at once stay a few calls' worth, whatever the size of the put.
    answers = yield Window(calls + _witness_calls(partition, plan.witness, drop=False), store.settings.calls_in_flight)
    for part in sent:
        # Answered: the call's arguments may outlive it in a reference cycle of Dask's
        # (until a garbage collection); the gathered buffers must not, the client's pool
        # hands them out again as soon as nothing refers to them.
        part.fields.clear()
    return merge_puts(batch, answers[: len(calls)], plan.failed, placement.replicas == 2 or moving is not None)


# ---- get ----------------------------------------------------------------------------------


def get(store: Driven, keys: Sequence[str], fields: list[str] | None, partition: str) -> Operation[GetResult]:
    """Rows of ``keys`` as ONE batch in request order (see :meth:`StagingStore.get_many`).
    Keys and fields travel as one msgpack buffer each (a list argument costs Dask ~11 us
    per element per call)."""
    seen = store.placement.version
    wire_fields = None if fields is None else pack_names(fields)
    parts, failed = plan_read(store.placement, keys)
    results, failed_over = yield from _read(store, parts, partition, wire_fields)
    for _ in range(REFRESHES):
        lost = unavailable_keys(results)
        if not lost:
            if failed_over:  # every key read from its replica: learn whether the unit was
                yield Refresh(seen, learn_only=True)  # replaced, for later calls (once per window)
            break
        if not (yield Refresh(seen, moved=any(any_moved(r.failed) for r in results))):
            break
        seen = store.placement.version
        parts, _ = plan_read(store.placement, lost)
        again, failed_over = yield from _read(store, parts, partition, wire_fields)
        results = drop_failed(results, lost) + again
    return merge_gets(keys, results, failed, store.buffers().allocator)


def _read(store: Driven, parts: list, partition: str, wire_fields: bytes | None) -> Operation[tuple[list[GetResult], bool]]:
    """Read ``parts`` from their primaries, then (replicas=2) what failed from replicas;
    while keys move, from each key's holders in :func:`~.moving.read_order` instead.
    Also says whether some primary was unavailable (its keys were read elsewhere)."""
    placement, moving, version = store.placement, store.moving, stamp(store)
    budget = store.settings.max_answer_bytes or None
    # A primary read whose keys have another copy is given up after store.read-failover-s
    # (a stalled unit holds it no longer): the replicas' read below takes its keys.
    failover_s = store.settings.read_failover_s
    bound = failover_s if placement.replicas == 2 and failover_s > 0 and moving is None else None

    def call(u: int, ks: list[str], primary: bool) -> Call:
        # Over the wire a unit may answer views of its memory (sent, not copied); in-process, copies.
        return Call(u, "get_many", lambda: (partition, pack_names(ks), wire_fields, version, budget, True), ks, empty_get,
                    local=primary, local_args=lambda: (partition, pack_names(ks), wire_fields, version, budget, False),
                    bound_s=bound if primary else None)

    def fetch(parts: list, local: bool) -> Operation[list[GetResult]]:
        return _fetch(store, (partition, wire_fields), parts, call, local)

    if moving is not None:
        return (yield from _read_moving(moving, [k for _, ks in parts for k in ks], fetch)), False
    results = yield from fetch(parts, True)
    again = failover(placement, results)
    if again:
        results = after_failover(results, (yield from fetch(again, False)))
    return results, bool(again)


ESTIMATE_MARGIN = 1.1  # a call planned from the last answers' bytes per row asks for this much less than its budget


def _fetch(store: Driven, what: tuple, parts: list, call: Callable[[int, list[str], bool], Call], local: bool
           ) -> Operation[list[GetResult]]:
    """Every answer to ``parts`` (unit, keys), in calls of at most one answer budget
    (``store.max-answer-bytes``) each, ``calls_in_flight`` per unit at a time, so no
    answer (nor buffer holding one) grows with the size of the get. Calls are planned from
    the bytes per row the last answers for ``what`` (partition, fields) had; a unit whose
    answer reached the budget all the same leaves the rest in ``more``, asked for next."""
    settings, sizes = store.settings, store.answer_row_bytes
    per_call = None
    if settings.max_answer_bytes and sizes.get(what):
        per_call = max(1, int(settings.max_answer_bytes / (sizes[what] * ESTIMATE_MARGIN)))
    queued = [(u, ks[i : i + per_call]) for u, ks in parts for i in range(0, len(ks), per_call)] if per_call else list(parts)
    results: list[GetResult] = []
    while queued:
        wave = queued
        answers = yield Window([call(u, ks, local) for u, ks in wave], settings.calls_in_flight)
        queued = []
        for (u, asked), r in zip(wave, answers):
            if r.more:
                answered = len(asked) - len(r.more)
                queued += [(u, r.more[i : i + answered]) for i in range(0, len(r.more), max(1, answered))]
            results.append(GetResult(r.batch, r.failed) if r.more or r.parts else r)
            results += [GetResult(part, {}) for part in r.parts]
    rows = sum(len(r.batch) for r in results)
    if rows:
        sizes[what] = sum(r.batch.nbytes for r in results) / rows
    return results


def _read_moving(moving: MovingTable, keys: list[str], fetch: Callable[[list, bool], Operation[list[GetResult]]]) -> Operation[list[GetResult]]:
    """``keys`` while a move runs: the old primaries first (one round trip: they hold every
    row until the final table is fenced), then each next holder only for the keys the
    previous could not give (missing, moved or unreachable); a key's answer is its last
    holder's."""
    order = read_order(moving, keys)
    results: list[GetResult] = []
    pending = list(range(len(keys)))
    for column in range(order.shape[1]):
        parts = holder_parts(order, column, keys, pending)
        if not parts:
            continue
        asked = {k for _, ks in parts for k in ks}
        got = yield from fetch(parts, column == 0)
        results = drop_failed(results, list(asked)) + got
        again = {k for r in got for k, (reason, _) in r.failed.items() if reason in ASK_NEXT}
        pending = [i for i in pending if keys[i] in again or keys[i] not in asked]
        if not pending:
            break
    return results


# ---- delete -------------------------------------------------------------------------------


def delete(store: Driven, keys: Sequence[str], partition: str) -> Operation[StoreResult]:
    """Delete ``keys`` on every copy (see :meth:`StagingStore.delete`)."""
    seen = store.placement.version
    result, removed = yield from _delete_once(store, keys, partition)
    for _ in range(REFRESHES):
        if not any_unavailable(result.failed) or not (yield Refresh(seen, moved=any_moved(result.failed))):
            break
        seen = store.placement.version
        retry = [k for k, (r, _) in result.failed.items() if r in RETRY_REASONS]
        again, more = yield from _delete_once(store, retry, partition)
        removed |= more
        result = splice(result, removed_before(again, removed))
    return result


def _delete_once(store: Driven, keys: Sequence[str], partition: str) -> Operation[tuple[StoreResult, set[str]]]:
    """One round of deletes: the answer per key, and the keys some copy removed. The
    witnesses forget a name only after the copies answered (:func:`_applied_names`)."""
    placement, moving, version = store.placement, store.moving, stamp(store)
    uniq, parts, names, failed = plan_delete(placement, keys)
    if moving is not None:  # every copy of either table
        uniq, parts, failed = plan_all_moving(moving, keys)
    calls = [Call(u, "delete", lambda ks=ks: (partition, pack_names(ks), None, version), ks) for u, ks in parts]
    results = yield calls
    replicated = placement.replicas == 2 or moving is not None
    result = merge_deletes(results, uniq) if replicated else StoreResult.merge(results)
    result.failed.update(failed)
    drop = _applied_names(names, result)
    if drop:
        yield _witness_calls(partition, drop, drop=True)
    return result, {k for r in results for k in r.ok}


def _applied_names(names: dict[int, list[str]], result: StoreResult) -> dict[int, list[str]]:
    """Witness unit -> the names of ``names`` whose delete was applied (``result``: ``ok``,
    or ``missing_key`` from every copy). A key whose delete failed on a copy (unreachable,
    refused, moved) keeps its name: if its remaining copies die together later it must
    read ``lost_key``, not ``missing_key``, and refuse new content."""
    done = set(result.ok) | {k for k, (reason, _) in result.failed.items() if reason == MISSING_KEY}
    out = {w: [k for k in ks if k in done] for w, ks in names.items()}
    return {w: ks for w, ks in out.items() if ks}


def stamp(store: Driven) -> int:
    """The table version a call is planned on: a unit fenced by a newer one refuses it
    ``moved`` (a unit never fenced ignores it)."""
    return store.placement.version
