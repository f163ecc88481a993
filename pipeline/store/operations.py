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

from .calls import Call, Driven, Operation, Refresh
from .merging import (
    after_failover,
    any_unavailable,
    drop_failed,
    empty_get,
    failed_rows,
    merge_gets,
    merge_puts,
    splice,
    unavailable_keys,
)
from .placement import Placement, failover, plan_delete, plan_put, plan_read
from .protocol import UNIT_UNAVAILABLE, GetResult, StoreResult, pack_names
from .replication import merge_deletes


def _packed(names: list[str] | None) -> bytes | None:
    return None if not names else pack_names(names)


def cut_rows(batch: PackedBatch, chunk: np.ndarray, allocator: Callable) -> PackedBatch:
    """Rows ``chunk`` (ascending) of ``batch``: a new batch object over the same buffers,
    a view of a run, or a gather into ``allocator``'s (pooled) memory. Never ``batch``
    itself, so a batch the caller received is not forwarded still marked ``received``."""
    if len(chunk) == len(batch):
        return PackedBatch(batch.keys, batch.fields)
    if chunk[-1] - chunk[0] + 1 == len(chunk):
        return slice_rows(batch, int(chunk[0]), int(chunk[-1]) + 1)
    return take_rows([batch], np.zeros(len(chunk), np.int64), chunk, out=allocator(gathered_nbytes(batch, chunk)))


def _witness_calls(partition: str, names: dict[int, list[str]], drop: bool) -> list[Call]:
    """One ``witness`` call per witness unit not otherwise called; its answer fails no
    key (the copies decide), it only cannot tell a later loss of both copies."""
    if drop:
        return [Call(w, "witness", lambda ks=ks: (partition, None, pack_names(ks))) for w, ks in names.items()]
    return [Call(w, "witness", lambda ks=ks: (partition, pack_names(ks))) for w, ks in names.items()]


# ---- put ----------------------------------------------------------------------------------


def put(store: Driven, batch: PackedBatch, partition: str, adopt: bool, claim: str | None) -> Operation[StoreResult]:
    """Stage every row of ``batch`` (see :meth:`StagingStore.put_many`)."""
    seen = store.placement.version
    result = yield from _put_once(store, batch, partition, adopt, claim)
    if any_unavailable(result.failed) and (yield Refresh(seen)):
        again = yield from _put_once(store, failed_rows(result, batch), partition, adopt, claim)
        result = splice(result, again)
    return result


def _put_once(store: Driven, batch: PackedBatch, partition: str, adopt: bool, claim: str | None) -> Operation[StoreResult]:
    placement = store.placement
    plan = plan_put(placement, batch, store.settings.max_call_bytes)
    allocator = store.buffers().allocator
    calls = []
    for u, chunk in plan.parts:
        # The first call to a unit also carries the names it witnesses.
        wit = _packed(plan.witness.pop(u, None))
        args = lambda chunk=chunk, wit=wit: (partition, cut_rows(batch, chunk, allocator), adopt, claim, wit)  # noqa: E731
        calls.append(Call(u, "put_many", args, [batch.keys[i] for i in chunk]))
    answers = yield calls + _witness_calls(partition, plan.witness, drop=False)
    return merge_puts(batch, answers[: len(calls)], plan.failed, placement.replicas == 2)


# ---- get ----------------------------------------------------------------------------------


def get(store: Driven, keys: Sequence[str], fields: list[str] | None, partition: str) -> Operation[GetResult]:
    """Rows of ``keys`` as ONE batch in request order (see :meth:`StagingStore.get_many`).
    Keys and fields travel as one msgpack buffer each (a list argument costs Dask ~11 us
    per element per call)."""
    seen = store.placement.version
    wire_fields = None if fields is None else pack_names(fields)
    parts, failed = plan_read(store.placement, keys)
    results = yield from _read(store.placement, parts, partition, wire_fields)
    lost = unavailable_keys(results)
    if lost and (yield Refresh(seen)):
        parts, _ = plan_read(store.placement, lost)
        results = drop_failed(results, lost) + (yield from _read(store.placement, parts, partition, wire_fields))
    return merge_gets(keys, results, failed, store.buffers().allocator)


def _read(placement: Placement, parts: list, partition: str, wire_fields: bytes | None) -> Operation[list[GetResult]]:
    """Read ``parts`` from their primaries, then (replicas=2) what failed from replicas."""
    def call(u: int, ks: list[str], local: bool) -> Call:
        return Call(u, "get_many", lambda: (partition, pack_names(ks), wire_fields), ks, empty_get, local=local)

    results = yield [call(u, ks, True) for u, ks in parts]
    again = failover(placement, results)
    if not again:
        return results
    second = yield [call(r, ks, False) for r, ks in again]
    return after_failover(results, second)


# ---- delete -------------------------------------------------------------------------------


def delete(store: Driven, keys: Sequence[str], partition: str) -> Operation[StoreResult]:
    """Delete ``keys`` on every copy (see :meth:`StagingStore.delete`)."""
    seen = store.placement.version
    result = yield from _delete_once(store.placement, keys, partition)
    if any_unavailable(result.failed) and (yield Refresh(seen)):
        retry = [k for k, (r, _) in result.failed.items() if r == UNIT_UNAVAILABLE]
        result = splice(result, (yield from _delete_once(store.placement, retry, partition)))
    return result


def _delete_once(placement: Placement, keys: Sequence[str], partition: str) -> Operation[StoreResult]:
    uniq, parts, names, failed = plan_delete(placement, keys)
    calls = [
        Call(u, "delete", lambda ks=ks, wit=_packed(names.pop(u, None)): (partition, pack_names(ks), wit), ks)
        for u, ks in parts
    ]
    answers = yield calls + _witness_calls(partition, names, drop=True)
    results = answers[: len(calls)]
    result = StoreResult.merge(results) if placement.replicas == 1 else merge_deletes(results, uniq)
    result.failed.update(failed)
    return result
