"""A bounded store: finalized steps' rows are cleared, never while a checkpoint or another
in-flight step still needs them.

Counts are the storage units' own counters (``deletes``: delete CALLS a unit answered),
never the number of tasks that asked. Slow phases are made slow by blocking them on an
event the test releases, never by sleeping.
"""
from __future__ import annotations

import dataclasses
import threading

import dask
import numpy as np
import pytest

from pipeline.finalize import Finalizer, clear_rows
from pipeline.finalize import worker_tasks
from pipeline.store import checkpoint as checkpoint_mod
from pipeline.store.client import StagingStore
from pipeline.store.unit import StorageUnit
from rollout_factory import make_group, make_rollout
from support import store_maker, wait_until
from tasks.errors import CheckpointError
from tasks.keys import unit_for_key
from tasks.packed import pack_rows
from tasks.schema import ROUTES_FIELDS

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8


def stage(store, builts):
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed
    return builts


def keys_of(builts) -> list[str]:
    return [r.staging_key for b in builts for r in b.rows]


def present(store, keys) -> set[str]:
    got = store.get_many(keys, ["token_ids"])
    return set(got.batch.keys)


def unit_deletes(store) -> list[int]:
    """Each unit's own count of delete calls it answered."""
    return [s["deletes"] for s in store.stats()]


def units_of(store, keys) -> set[int]:
    return {unit_for_key(k, len(store.units)) for k in keys}


# ---- the unit alone: deferral while a checkpoint is open --------------------------------


def test_unit_defers_deletes_until_the_last_open_checkpoint_ends(tmp_path):
    rng = np.random.default_rng(1)
    unit = StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging", "cut"])
    built = make_rollout(rng, "u-r0", n_calls=3)
    assert not unit.put_many("staging", pack_rows(built.rows)).failed
    keys = [r.staging_key for r in built.rows]
    unit.begin_checkpoint("a")
    unit.begin_checkpoint("b")
    res = unit.delete("staging", keys[:2] + ["u-r0/absent"])
    assert res.ok == keys[:2] and res.deferred == keys[:2]
    assert set(res.failed) == {"u-r0/absent"}
    assert unit.keys("staging") == keys[2:]  # deleted: no longer listed ...
    assert unit.stats()["rows"] == 3  # ... but still held: an open checkpoint may write them
    assert unit.end_checkpoint("a")["applied"] == 0  # "b" is still open
    assert unit.deferred_keys("staging") == keys[:2] and unit.stats()["rows"] == 3
    assert unit.end_checkpoint("b")["applied"] == 2
    assert unit.keys("staging") == keys[2:]
    assert unit.end_checkpoint("b")["applied"] == 0  # closing twice is harmless
    # A checkpoint covering only `cut` leaves staging deletes immediate.
    unit.begin_checkpoint("c", ["cut"])
    res = unit.delete("staging", keys[2:])
    assert res.ok == keys[2:] and res.deferred == []
    assert unit.keys("staging") == []
    unit.end_checkpoint("c")
    s = unit.stats()
    assert s["deletes"] == 2 and s["deleted_rows"] == 3 and s["deferred_rows"] == 2
    assert s["open_checkpoints"] == 0 and s["pending_deletes"] == 0 and s["used_bytes"] == 0
    unit.close()



class Clock:
    """A clock the test turns (seconds), for checkpoint leases."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_checkpoint_whose_writer_died_ends_with_its_lease(tmp_path, monkeypatch):
    # A controller that crashed between begin and end must not defer deletes forever.
    clock = Clock()
    monkeypatch.setattr(StorageUnit, "clock", clock)
    rng = np.random.default_rng(2)
    with dask.config.set({"token-capture.store.checkpoint-lease-s": 60.0}):  # read once, when the unit is built
        unit = StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging", "cut"])
    built = make_rollout(rng, "lease-r0", n_calls=3)
    assert not unit.put_many("staging", pack_rows(built.rows)).failed
    keys = [r.staging_key for r in built.rows]
    unit.begin_checkpoint("dead-writer")
    assert unit.delete("staging", keys[:1]).deferred == keys[:1]
    clock.now += 59.0
    unit.report_figures()  # a reporter tick inside the lease: nothing ends
    assert unit.deferred_keys("staging") == keys[:1] and unit.stats()["rows"] == 3
    assert unit.counters["checkpoints_expired"] == 0
    clock.now += 2.0
    unit.report_figures()  # past it: the checkpoint ends, its deferred delete applies
    assert unit.deferred_keys("staging") == [] and unit.stats()["rows"] == 2
    assert unit.counters["checkpoints_expired"] == 1 and not unit.guard.open
    res = unit.delete("staging", keys[1:2])  # no checkpoint defers deletes any more
    assert res.deferred == [] and unit.keys("staging") == keys[2:]
    # The writer, had it lived, is told: once.
    assert unit.end_checkpoint("dead-writer").get("expired") is True
    assert "expired" not in unit.end_checkpoint("dead-writer")
    with dask.config.set({"token-capture.store.checkpoint-lease-s": 0}):
        forever = StorageUnit(1, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging"])
    assert not forever.put_many("staging", pack_rows(built.rows[2:])).failed
    forever.begin_checkpoint("forever")
    forever.delete("staging", keys[2:])
    clock.now += 1e9
    forever.report_figures()
    assert forever.deferred_keys("staging") == keys[2:] and forever.stats()["rows"] == 1  # 0: no lease
    assert forever.end_checkpoint("forever")["applied"] == 1
    unit.close()
    forever.close()


def test_a_save_that_outlived_its_lease_fails_and_keeps_the_previous_checkpoint(inprocess_client, tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(StorageUnit, "clock", clock)
    real_write = StorageUnit.checkpoint_write

    def slow_write(self, *args):
        clock.now += 120.0  # the write takes past the lease ...
        self.expire_checkpoints()  # ... and a reporter tick lands meanwhile
        return real_write(self, *args)

    rng = np.random.default_rng(3)
    with store_maker(inprocess_client, tmp_path / "spill") as make, dask.config.set({"token-capture.store.checkpoint-lease-s": 60.0}):
        store = make(n_units=2)
        stage(store, [make_rollout(rng, f"lease-s{i}", n_calls=2) for i in range(4)])
        path = str(tmp_path / "ckpt")
        first = store.checkpoint(path)
        monkeypatch.setattr(StorageUnit, "checkpoint_write", slow_write)
        with pytest.raises(CheckpointError, match="checkpoint-lease-s"):
            store.checkpoint(path)
        monkeypatch.setattr(StorageUnit, "checkpoint_write", real_write)
        assert checkpoint_mod.read_manifest(path)["generation"] == first["generation"]


# ---- a real checkpoint and a delete from another process --------------------------------


@pytest.fixture
def store(store_factory):
    return store_factory(n_units=2, memory_limit="16KiB")


def test_delete_during_a_checkpoint_is_deferred_then_applied(cluster_client, store, tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    builts = stage(store, [make_rollout(rng, f"ck-r{i}", n_calls=2) for i in range(6)])
    keys = keys_of(builts)
    assert len(units_of(store, keys)) == 2
    issued = {}
    settle_all = checkpoint_mod.settle_all

    def settle_then_delete(futures, end=None):
        out = settle_all(futures, end)
        if not issued:  # right after the save opened on every unit, before any unit writes
            issued["res"] = cluster_client.submit(clear_rows, store, keys, pure=False).result()  # on a worker process
            issued["present"] = present(store, keys)
        return out

    monkeypatch.setattr(checkpoint_mod, "settle_all", settle_then_delete)
    manifest = store.checkpoint(str(tmp_path / "ckpt"))
    monkeypatch.setattr(checkpoint_mod, "settle_all", settle_all)
    assert issued["res"]["deleted"] == len(keys) and issued["res"]["deferred"] == len(keys)
    assert issued["present"] == set(keys)  # acknowledged, not removed while the checkpoint was open
    assert manifest["rows"] == len(keys)
    assert present(store, keys) == set()  # applied once the checkpoint ended
    stats = store.stats()
    assert sum(s["deferred_rows"] for s in stats) == len(keys)
    assert sum(s["deleted_rows"] for s in stats) == len(keys)
    assert all(s["open_checkpoints"] == 0 and s["pending_deletes"] == 0 for s in stats)
    # The checkpoint holds every row the delete asked for: restore it and find them.
    fresh = StagingStore.from_checkpoint(cluster_client, str(tmp_path / "ckpt"), n_units=2, spill_directory=str(tmp_path / "spill2"))
    try:
        got = fresh.get_many(keys, ["token_ids"])
        assert not got.failed
        want = {r.staging_key: r.token_ids for b in builts for r in b.rows}
        for i, k in enumerate(got.batch.keys):
            np.testing.assert_array_equal(got.batch.fields["token_ids"].row(i), want[k])
    finally:
        fresh.close()


# ---- finalized steps: one delete per unit, every key, rejected rollouts too --------------


def test_a_step_clears_every_key_in_one_delete_per_unit(cluster_client, store):
    rng = np.random.default_rng(3)
    routes = (L, K, E)
    good = stage(store, make_group(rng, "one", 6, n_calls=2, n_branches=1, routes=routes))
    bad = stage(store, [make_rollout(rng, "one-bad", n_calls=2, group_id="one", routes=routes)])[0]
    poisoned = stage(store, [make_rollout(rng, "one-poison", n_calls=2, group_id="one", routes=routes)])[0]
    store.delete([f"{bad.rollout_id}/c1"])  # its terminal row is missing: rejected at verify
    receipts = [b.receipt for b in good] + [bad.receipt]
    receipts.append(dataclasses.replace(poisoned.receipt, poisoned=True, failure_reason="test"))  # rejected at plan time
    keys = [k for k in keys_of(good + [bad, poisoned]) if k != f"{bad.rollout_id}/c1"]
    assert len(units_of(store, keys)) == 2
    before = unit_deletes(store)
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    fin.with_settings(clear_staged=True)
    handle = fin.submit_step([receipts])
    step = handle.result()
    assert step.groups["g0"].status == ["ok"] * 6 + ["missing_staging_row", "capture_poisoned"]
    cleared = handle.clear_future.result()
    assert cleared["deleted"] == len(keys) and set(cleared["failed"]) == {f"{bad.rollout_id}/c1"}  # deleted above
    after = unit_deletes(store)
    assert [a - b for a, b in zip(after, before)] == [1, 1]  # ONE delete call per unit for the step
    got = store.get_many(keys, ["token_ids", *ROUTES_FIELDS])  # routes live in the same rows
    assert len(got.batch) == 0 and set(got.failed) == set(keys)
    assert all(s["rows"] == 0 for s in store.stats())


def test_clear_staged_false_deletes_nothing(cluster_client, store):
    rng = np.random.default_rng(4)
    bs = stage(store, make_group(rng, "keep", 4, n_calls=2, n_branches=1))
    before = unit_deletes(store)
    with dask.config.set({"token-capture.finalize.clear-staged": False}):
        fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=None)
    with dask.config.set({"token-capture.finalize.clear-staged": True}):
        handle = fin.submit_step([[b.receipt for b in bs]])  # read once: the finalizer's own
    fin.with_settings(clear_staged=True)
    step = handle.result()  # the setting is the one at submission
    assert step.groups["g0"].status == ["ok"] * 4
    assert handle.clear_future is None
    assert unit_deletes(store) == before
    assert present(store, keys_of(bs)) == set(keys_of(bs))


# ---- ordering: never before the assemble tasks, never under another in-flight step -------




@pytest.fixture
def thread_store(inprocess_client, tmp_path):
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        yield make(n_units=2)


class AssembleGate:
    """Holds the assemble of any group containing one of ``rollouts`` until released."""

    def __init__(self, rollouts):
        self.rollouts = set(rollouts)
        self.started = threading.Event()
        self.release = threading.Event()
        self.real = worker_tasks.assemble_group

    def __call__(self, rows, rewards, **kw):
        if any(r.rollout_id in self.rollouts for r in rows):
            self.started.set()
            assert self.release.wait(60), "the test never released the assemble"
        return self.real(rows, rewards, **kw)


def callbacks_ran(futures) -> None:
    """Return once every done-callback registered on ``futures`` before this call ran:
    Dask runs them in order on one callback thread, so one registered last runs after."""
    ran = [threading.Event() for _ in futures]
    for fut, event in zip(futures, ran):
        fut.add_done_callback(lambda _f, e=event: e.set())
    assert all(e.wait(30) for e in ran), "the futures' callbacks never ran"


def test_a_step_is_cleared_only_after_its_groups_were_delivered(inprocess_client, thread_store, monkeypatch):
    store = thread_store
    rng = np.random.default_rng(5)
    g0 = stage(store, make_group(rng, "ord0", 3, n_calls=2))
    g1 = stage(store, make_group(rng, "ord1", 3, n_calls=2))
    keys = keys_of(g0 + g1)
    gate = AssembleGate({g1[0].rollout_id})
    monkeypatch.setattr(worker_tasks, "assemble_group", gate)
    before = unit_deletes(store)
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    handle = fin.submit_step({"ord0": [b.receipt for b in g0], "ord1": [b.receipt for b in g1]})
    handle.group_futures  # the groups assembled on the cluster, where the gate holds one
    try:
        assert gate.started.wait(30)
        wait_until(lambda: handle.group_futures["ord0"].done(), what="group ord0 assembled")
        # One group's tensors exist, the other's do not: nothing may be deleted yet.
        assert handle.clear_future is None
        assert unit_deletes(store) == before
        assert present(store, keys) == set(keys)
    finally:
        gate.release.set()
    # Every group's tensors exist, none was delivered: completion alone clears nothing
    # (a controller dying now must find every row for its resubmission).
    futures = list(handle.group_futures.values())
    callbacks_ran(futures)
    assert all(f.status == "finished" for f in futures)
    assert handle.clear_future is None
    assert unit_deletes(store) == before
    assert present(store, keys) == set(keys)
    # result() delivers the tensors, then clears: one delete per unit holding the rows.
    assert handle.result().groups["ord1"].status == ["ok"] * 3
    assert handle.clear_future is not None
    assert handle.clear_future.result()["deleted"] == len(keys)
    assert present(store, keys) == set()
    assert [a - b for a, b in zip(unit_deletes(store), before)] == [int(u in units_of(store, keys)) for u in range(2)]


class AssembleFault:
    """Makes the assemble of any group containing one of ``rollouts`` raise."""

    def __init__(self, rollouts):
        self.rollouts = set(rollouts)
        self.real = worker_tasks.assemble_group

    def __call__(self, rows, rewards, **kw):
        if any(r.rollout_id in self.rollouts for r in rows):
            raise RuntimeError("injected assemble failure")
        return self.real(rows, rewards, **kw)


def test_a_failed_step_clears_nothing_and_keeps_no_other_step_from_clearing(inprocess_client, thread_store, monkeypatch):
    store = thread_store
    rng = np.random.default_rng(7)
    bs = stage(store, make_group(rng, "fail", 3, n_calls=2))
    keys = keys_of(bs)
    real = worker_tasks.assemble_group
    monkeypatch.setattr(worker_tasks, "assemble_group", AssembleFault({bs[0].rollout_id}))
    before = unit_deletes(store)
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True, retries=0)
    failed = fin.submit_step([[b.receipt for b in bs]], step_id="F")
    with pytest.raises(RuntimeError, match="injected assemble failure"):
        failed.result()
    assert failed.failed() and failed in fin.in_flight
    assert failed.clear_future is None
    assert unit_deletes(store) == before
    assert present(store, keys) == set(keys)  # every row stays for the resubmission
    # The resubmission delivers, then clears them all: the failed step will never read them.
    monkeypatch.setattr(worker_tasks, "assemble_group", real)
    again = fin.submit_step([[b.receipt for b in bs]], step_id="F-again")
    assert again.result().groups["g0"].status == ["ok"] * 3
    assert again.kept_keys == []
    assert again.clear_future.result()["deleted"] == len(keys)
    assert present(store, keys) == set()


def test_a_complete_but_undelivered_step_keeps_the_keys_it_shares(inprocess_client, thread_store):
    store = thread_store
    rng = np.random.default_rng(8)
    only_a = stage(store, make_group(rng, "udA", 2, n_calls=2))
    shared = stage(store, make_group(rng, "udS", 1, n_calls=2))
    only_b = stage(store, make_group(rng, "udB", 2, n_calls=2))
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    step_a = fin.submit_step([[b.receipt for b in only_a + shared]], step_id="A")
    step_b = fin.submit_step([[b.receipt for b in shared + only_b]], step_id="B")
    callbacks_ran(step_a.futures + step_b.futures)  # both complete, neither delivered
    step_a.result()
    # B's graph is complete, but B was not delivered: its rows stay for a resubmission.
    assert sorted(step_a.kept_keys) == sorted(keys_of(shared))
    step_a.clear_future.result()
    assert present(store, keys_of(only_a)) == set()
    assert present(store, keys_of(shared + only_b)) == set(keys_of(shared + only_b))
    step_b.result()
    assert step_b.kept_keys == []
    assert step_b.clear_future.result()["deleted"] == len(keys_of(shared + only_b))
    assert all(s["rows"] == 0 for s in store.stats())


def test_a_key_another_in_flight_step_reads_survives_until_both_are_done(inprocess_client, thread_store, monkeypatch):
    store = thread_store
    rng = np.random.default_rng(6)
    only_a = stage(store, make_group(rng, "shA", 2, n_calls=2))
    shared = stage(store, make_group(rng, "shS", 1, n_calls=2))
    only_b = stage(store, make_group(rng, "shB", 2, n_calls=2))
    gate = AssembleGate({only_b[0].rollout_id})  # step B stays in flight until released
    monkeypatch.setattr(worker_tasks, "assemble_group", gate)
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    step_a = fin.submit_step([[b.receipt for b in only_a + shared]], step_id="A")
    step_b = fin.submit_step([[b.receipt for b in shared + only_b]], step_id="B")  # resubmitted rollout
    step_b.group_futures  # B's group assembled on the cluster, held there by the gate
    try:
        assert gate.started.wait(30)
        result_a = step_a.result()
        assert result_a.groups["g0"].status == ["ok"] * 3
        wait_until(lambda: step_a.clear_future is not None and step_a.clear_future.done(), what="step A's clear")
        assert sorted(step_a.kept_keys) == sorted(keys_of(shared))
        assert present(store, keys_of(only_a)) == set()
        assert present(store, keys_of(shared + only_b)) == set(keys_of(shared + only_b))  # B still reads them
        before_b = unit_deletes(store)
    finally:
        gate.release.set()
    result_b = step_b.result()
    assert result_b.groups["g0"].status == ["ok"] * 3  # B verified the shared rollout's rows
    assert step_b.clear_future.result()["deleted"] == len(keys_of(shared + only_b))
    assert present(store, keys_of(shared + only_b)) == set()
    after = unit_deletes(store)
    assert [a - b for a, b in zip(after, before_b)] == [int(u in units_of(store, keys_of(shared + only_b))) for u in range(2)]
    assert all(s["rows"] == 0 for s in store.stats())


def test_rows_of_wrong_group_and_duplicate_receipts_are_kept():
    # A receipt rejected wrong_group may be resubmitted under its own group, and rows behind
    # a duplicated rollout id cannot be told apart: their rows stay; other plan-time
    # rejections (here capture_poisoned) are cleared with the step.
    from pipeline.finalize.controller import rejected_receipt_keys

    rng = np.random.default_rng(3)
    wrong, dup, poisoned = (make_rollout(rng, rid, group_id="g", n_calls=2) for rid in ("rw", "rd", "rp"))
    groups = {"g": [b.receipt for b in (wrong, dup, poisoned)]}
    rejected = {"rw": ("wrong_group", ""), "rd": ("duplicate_staging_key", ""), "rp": ("capture_poisoned", "")}
    keys = rejected_receipt_keys(groups, rejected)
    assert keys == [r.staging_key for r in poisoned.rows]


def test_rows_of_a_rollout_the_verifier_failed_on_are_kept(inprocess_client, thread_store, monkeypatch):
    # internal_error is a verifier bug, not a verdict on the data: its rows stay staged for
    # a resubmission; the step's other rows are cleared as usual.
    from tasks.finalize import verify

    store = thread_store
    bs = stage(store, make_group(np.random.default_rng(11), "ierr", 3, n_calls=2))
    real = verify.linearize_chain

    def faulty(walk, *args, **kwargs):
        if walk.plan.rollout_id == bs[0].rollout_id:
            raise RuntimeError("injected verifier fault")
        return real(walk, *args, **kwargs)

    monkeypatch.setattr(verify, "linearize_chain", faulty)
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    handle = fin.submit_step({"ierr": [b.receipt for b in bs]})
    assert handle.result().groups["ierr"].status == ["internal_error", "ok", "ok"]
    assert handle.result().retryable == [bs[0].rollout_id]  # kept: the trainer may submit it again
    assert handle.clear_future.result()["deleted"] == len(keys_of(bs[1:]))
    assert present(store, keys_of(bs)) == set(keys_of(bs[:1]))


def test_other_rows_of_a_rollout_with_a_row_never_staged_are_cleared(inprocess_client, thread_store):
    # A row the store answers absent (missing_key) rejects its rollout for good: unlike a
    # row it could not read, its rollout's other rows go with the step.
    store = thread_store
    bs = make_group(np.random.default_rng(12), "absent", 3, n_calls=2)
    stage(store, bs[1:])
    stage(store, [dataclasses.replace(bs[0], rows=bs[0].rows[1:])])
    fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    handle = fin.submit_step({"absent": [b.receipt for b in bs]})
    group = handle.result().groups["absent"]
    assert group.status == ["missing_staging_row", "ok", "ok"]
    assert "store: missing_key" in group.details[0]
    assert handle.result().retryable == []  # absent for good: nothing to submit again
    assert handle.clear_future.result()["deleted"] == len(keys_of(bs)) - 1
    assert present(store, keys_of(bs)) == set()


def test_a_row_the_store_answered_for_decides_over_one_it_could_not_read():
    # One key absent, one unreachable: the rollout can never finalize, so its rows are not kept.
    from pipeline.finalize.kept_rows import rows_unread
    from tasks.finalize.verify import rejected_result

    plan = dataclasses.make_dataclass("Plan", ["keys"])(["r/a", "r/b"])
    unread = {"r/a": ("unit_unavailable", "timeout"), "r/b": ("store_error", "spill read")}
    res = worker_tasks._with_store_reason(rejected_result("r", "missing_staging_row"), plan, unread)
    assert res.store_reason == "unit_unavailable" and rows_unread(res)
    res = worker_tasks._with_store_reason(rejected_result("r", "missing_staging_row"), plan, {**unread, "r/b": ("missing_key", "")})
    assert res.store_reason == "missing_key" and not rows_unread(res)
