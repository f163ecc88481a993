"""A put never aliases its caller's memory: a unit keeps a put's buffers as its rows only
when the bytes really were received (the batch was rebuilt from frames off the wire) or
the caller handed them over (``adopt=True``), never because of the unit's address.

Every way a caller can reach a unit in the unit's own process is tried: an actor on the
unit's worker (Dask calls it in-process with the caller's objects), a task on an
in-process cluster, a batch the caller itself received and forwards, local reads, and a
unit called directly. Each caller then reuses its buffers; every stored row must read
back as it was put, from every client. The unit's own ``adopted_rows`` counter says
whether it kept views."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from distributed import get_worker

from pipeline.store import StagingStore
from pipeline.store.unit import StorageUnit
from tasks.packed import PackedBatch, pack_rows

from test_store import TOKENS, assert_rows_exact, make_rows

pytestmark = pytest.mark.timeout(120)


class Reuser:
    """An actor that stages two batches from ONE set of buffers it overwrites in between,
    as an engine reusing its output arrays would (``adopt`` left at its default)."""

    def __init__(self, store: StagingStore):
        self.store = store

    def worker(self) -> str:
        return get_worker().address

    def stage_reusing(self, first: PackedBatch, second: PackedBatch) -> tuple[list, list]:
        mine = PackedBatch(list(first.keys), {n: type(f)(f.values.copy(), f.offsets.copy(), f.present) for n, f in first.fields.items()})
        a = self.store.put_many(mine)
        for name, f in mine.fields.items():  # reuse the same arrays for the next batch
            f.values[...] = second.fields[name].values
        mine.keys[:] = second.keys
        b = self.store.put_many(mine)
        return sorted(a.failed), sorted(b.failed)


def _same_shape_batches(seed: int) -> tuple[list, list]:
    one = make_rows(4, calls=1, tokens=TOKENS, seed=seed, prefix="one-")
    two = make_rows(4, calls=1, tokens=TOKENS, seed=seed + 1, prefix="two-")
    return one, two


def test_an_actor_on_the_units_worker_reusing_its_buffers_changes_no_stored_row(store_factory, cluster_client):
    store = store_factory(n_units=1)
    actor = cluster_client.submit(Reuser, store, actor=True, workers=[store.unit_workers[0]], pure=False).result()
    assert actor.worker().result() == store.unit_workers[0], "the actor must share the unit's worker"
    one, two = _same_shape_batches(seed=40)
    assert actor.stage_reusing(pack_rows(one), pack_rows(two)).result() == ([], [])
    assert_rows_exact(store, one)  # not overwritten by the second batch's content
    assert_rows_exact(store, two)
    assert store.stats()[0]["adopted_rows"] == 0, "an in-process put is copied, never kept as views"


def test_a_put_that_crossed_the_wire_is_still_adopted(store_factory):
    """The counterpart: a batch sent from this process over TCP is the unit's own copy."""
    store = store_factory(n_units=1)
    rows = make_rows(4, calls=1, tokens=TOKENS, seed=41)
    batch = pack_rows(rows)
    assert not store.put_many(batch).failed
    assert store.stats()[0]["adopted_rows"] == len(rows)
    batch.fields["token_ids"].values[:] = -1  # the sender's buffers are not the unit's
    assert_rows_exact(store, rows)


def test_a_task_on_an_in_process_cluster_reusing_its_buffers_changes_no_stored_row(inprocess_client, tmp_path):
    store = StagingStore.start(inprocess_client, n_units=1, spill_directory=str(tmp_path))
    try:
        one, two = _same_shape_batches(seed=42)

        def stage(first: PackedBatch, second: PackedBatch) -> None:
            assert not store.put_many(first).failed
            for name, f in first.fields.items():
                f.values[...] = second.fields[name].values
            first.keys[:] = second.keys
            assert not store.put_many(first).failed

        inprocess_client.submit(stage, pack_rows(one), pack_rows(two), workers=[store.unit_workers[0]], pure=False).result()
        assert_rows_exact(store, one)
        assert_rows_exact(store, two)
        assert store.stats()[0]["adopted_rows"] == 0
    finally:
        store.close()


def test_a_batch_the_caller_received_and_forwards_in_process_is_copied(inprocess_client, tmp_path):
    """A batch rebuilt from wire buffers is marked received; handed on in-process through
    the store client it is the caller's memory again, so the unit copies it."""
    store = StagingStore.start(inprocess_client, n_units=1, spill_directory=str(tmp_path))
    try:
        rows = make_rows(3, calls=1, tokens=TOKENS, seed=43)
        received = pickle.loads(pickle.dumps(pack_rows(rows), protocol=5))
        assert received.received
        assert not store.put_many(received).failed
        assert store.stats()[0]["adopted_rows"] == 0
        received.fields["token_ids"].values[:] = -1
        assert_rows_exact(store, rows)
    finally:
        store.close()


def test_local_reads_answer_copies_a_reader_may_overwrite(store_factory, cluster_client):
    """A task on the unit's worker reads in-process (``store.local-reads``); writing into
    the answer must not reach the stored rows."""
    store = store_factory(n_units=1)
    rows = make_rows(3, calls=1, tokens=TOKENS, seed=44)
    assert not store.put_many(pack_rows(rows)).failed
    keys = [r.staging_key for r in rows]

    def read_and_scribble() -> int:
        got = store.get_many(keys)
        got.batch.fields["token_ids"].values[:] = -1
        got.batch.fields["logprobs"].values[:] = 0
        return len(got.batch)

    assert cluster_client.submit(read_and_scribble, workers=[store.unit_workers[0]], pure=False).result() == 3
    assert_rows_exact(store, rows)


def test_a_unit_adopts_only_received_or_handed_over_batches(tmp_path):
    """The unit's own rule, called directly: a batch built here is copied; one rebuilt from
    pickle buffers (as off a socket) or given with ``adopt=True`` is kept as views; one
    unpickled from its sender's own buffers in the sender's process is copied."""
    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path))
    try:
        rows = make_rows(6, calls=1, tokens=TOKENS, seed=45)
        local = pack_rows(rows[:2])
        assert not unit.put_many("staging", local).failed
        assert unit.counters["adopted_rows"] == 0
        local.fields["token_ids"].values[:] = -1
        got = unit.get_many("staging", [r.staging_key for r in rows[:2]]).batch
        assert np.array_equal(got.fields["token_ids"].values, pack_rows(rows[:2]).fields["token_ids"].values)

        wire = pickle.loads(pickle.dumps(pack_rows(rows[2:4]), protocol=5))
        assert not unit.put_many("staging", wire).failed
        assert unit.counters["adopted_rows"] == 2

        buffers: list = []
        sender = pack_rows(rows[4:])
        shared = pickle.loads(pickle.dumps(sender, protocol=5, buffer_callback=buffers.append), buffers=buffers)
        assert not shared.received, "unpickled from the sender's own buffers: not received"
        assert not unit.put_many("staging", shared).failed
        assert unit.counters["adopted_rows"] == 2
    finally:
        unit.close()


def test_heavy_rows_leave_over_the_wire_as_views_in_process_as_copies(tmp_path):
    """An answer that only crosses the wire (``views=True``) serves a put's heavy rows as
    read-only views of the memory they are stored in, one batch per run of rows stored
    side by side; without ``views`` (an in-process caller) the answer is a copy."""
    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path))
    try:
        rows = make_rows(6, calls=1, tokens=8 * TOKENS, seed=46)  # 16,384 tokens: heavy rows
        for part in (rows[:4], rows[4:]):  # two puts, each received off the wire
            assert not unit.put_many("staging", pickle.loads(pickle.dumps(pack_rows(part), protocol=5))).failed
        order = [r.staging_key for r in rows[1:3] + rows[4:] + rows[:1]]
        got = unit.get_many("staging", order, views=True)
        assert len(got.batch) == 0 and [p.keys for p in got.parts] == [order[:2], order[2:4], order[4:]]
        stored = [unit.held.rows.peek(unit.held.index["staging"][k]) for k in order]
        ids = got.parts[0].fields["token_ids"].values
        assert np.shares_memory(ids, stored[0]["token_ids"]) and np.shares_memory(ids, stored[1]["token_ids"])
        assert not ids.flags.writeable
        merged = PackedBatch.concat(got.parts)
        want = pack_rows(rows[1:3] + rows[4:] + rows[:1])
        for name, f in want.fields.items():
            assert np.array_equal(merged.fields[name].values, f.values) and np.array_equal(merged.fields[name].offsets, f.offsets)
        copy = unit.get_many("staging", order)
        assert not copy.parts and not np.shares_memory(copy.batch.fields["token_ids"].values, stored[0]["token_ids"])
    finally:
        unit.close()
