"""Deadlines on store calls: a hung but alive unit never holds a call.

In-process cluster (``processes=False``) so a unit can be made to hang by patching
``StorageUnit`` in this process: the patched method blocks the unit's actor thread on a
``threading.Event`` that only the test's teardown sets (long after any bound), exactly as a
live unit that stopped answering. Without the bounds every call below would wait for it.
"""
from __future__ import annotations

import os
import threading

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.finalize import Finalizer
from pipeline.generation import GenerationWorker
from pipeline.store import StagingStore
from pipeline.store.protocol import STORE_ERROR, UNIT_UNAVAILABLE, GetResult
from pipeline.store.settings import StoreSettings
from pipeline.store.unit import StorageUnit
from rollout_factory import make_group
from tasks import reasons
from tasks.cut.receipt import DURABLE_FAILURE, DURABLE_PREFIX
from tasks.errors import CheckpointError, InvalidInput, RestoreIncomplete, StoreUnavailable
from tasks.keys import STAGING_PARTITION, unit_for_key, unit_for_rollout
from tasks.packed import PackedBatch, pack_rows
from tasks.schema import STAGING_FIELDS
from tasks.toy.policy import PolicyConfig

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8
HUNG = 1  # the unit made to hang


@pytest.fixture(scope="module")
def client():
    with LocalCluster(
        n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None,
        worker_dashboard_address="127.0.0.1:0", resources={"finalize": 2},
    ) as cluster, Client(cluster) as c:
        yield c


@pytest.fixture
def store(client, tmp_path):
    s = StagingStore.start(client, n_units=2, spill_directory=str(tmp_path / "spill"))
    yield s
    s.close()


@pytest.fixture
def hang(monkeypatch):
    """``hang("put_many", ...)``: those methods of unit HUNG block until teardown."""
    release = threading.Event()
    entered = threading.Event()

    def install(*methods: str) -> threading.Event:
        for name in methods:
            orig = getattr(StorageUnit, name)

            def hung(self, *a, _orig=orig, **kw):
                if self.unit_index == HUNG and not release.is_set():
                    entered.set()
                    release.wait(110)
                return _orig(self, *a, **kw)

            monkeypatch.setattr(StorageUnit, name, hung)
        return entered

    yield install
    release.set()


def groups(tag: str, n_groups: int = 2, per_group: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        f"g{g}": make_group(rng, f"g{g}", per_group, rollout_prefix=f"{tag}g{g}", n_calls=2, routes=(L, K, E), vocab_size=VOCAB)
        for g in range(n_groups)
    }


def test_hung_unit_fails_only_its_keys_by_the_timeout(store, hang):
    builts = [b for bs in groups("dl").values() for b in bs]
    assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
    keys = [r.staging_key for b in builts for r in b.rows]
    on_hung = {k for k in keys if unit_for_key(k, 2) == HUNG}
    assert 0 < len(on_hung) < len(keys)
    before = store.units[0].stats().result()["gets"]
    hang("get_many", "put_many", "delete")

    got = store.get_many(keys, list(STAGING_FIELDS), timeout=0.5)
    assert set(got.batch.keys) == set(keys) - on_hung  # the healthy unit's keys are served
    assert set(got.failed) == on_hung
    assert all(r == UNIT_UNAVAILABLE and "timeout" in d for r, d in got.failed.values())
    assert store.units[0].stats().result()["gets"] == before + 1  # one get reached the healthy unit

    fresh = [b for bs in groups("dl2", seed=1).values() for b in bs]
    res = store.put_many(pack_rows([r for b in fresh for r in b.rows]), timeout=0.5)
    fresh_hung = {r.staging_key for b in fresh for r in b.rows if unit_for_key(r.staging_key, 2) == HUNG}
    assert set(res.failed) == fresh_hung and {r for r, _ in res.failed.values()} == {UNIT_UNAVAILABLE}
    assert len(res.ok) == sum(len(b.rows) for b in fresh) - len(fresh_hung) > 0

    res = store.delete(keys, timeout=0.5)
    assert set(res.failed) == on_hung and set(res.ok) == set(keys) - on_hung


def _policy():
    return dict(PolicyConfig().__dict__)


def test_cut_with_a_hung_unit_returns_by_its_deadline_and_a_retry_is_not_blocked(client, store, hang):
    gen = client.submit(GenerationWorker, store, name="gen-dl", policy=_policy(), actor=True).result()
    specs = [{"rollout_id": f"c{i}", "model_call_id": "call-0", "context": np.arange(5) + i, "max_new_tokens": 64} for i in range(8)]
    gen.start_calls(specs).result()
    gen.step(8).result()
    on_hung = {s["rollout_id"] for s in specs if unit_for_rollout(s["rollout_id"], 2) == HUNG}
    assert 0 < len(on_hung) < len(specs)
    entered = hang("put_many", "delete")
    import time

    with dask.config.set({"token-capture.cut.generation-prefix-batch-size": 1}):
        # One put per call: the hung unit's calls fail; the cut returns by its deadline
        # (calls it had no time left for fail control_deadline, the rest are durable).
        r1 = gen.checkpoint_cut("dl-a", deadline=time.time() + 1.5).result(timeout=60)
        assert entered.is_set()
        assert r1.deadline_passed
        assert all(a.status == DURABLE_FAILURE for a in r1.acks if a.rollout_id in on_hung)
        assert {a.status for a in r1.acks} <= {DURABLE_FAILURE, DURABLE_PREFIX}
        # The worker's cut lock was released: a retried cut runs (it is not queued behind
        # a store call) and is bounded the same way.
        r2 = gen.checkpoint_cut("dl-b", deadline=time.time() + 1.0).result(timeout=60)
    assert {a.rollout_id for a in r2.acks if a.status == DURABLE_FAILURE} >= on_hung
    assert r2.checkpoint_id == "dl-b"


def staged(store, tag: str, seed: int):
    """Groups ``tag`` staged in ``store``: (groups, their built rollouts, the ids of those
    on unit ``HUNG``: some but not all)."""
    gs = groups(tag, seed=seed)
    builts = [b for bs in gs.values() for b in bs]
    assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
    on_hung = {b.rollout_id for b in builts if unit_for_rollout(b.rollout_id, 2) == HUNG}
    assert 0 < len(on_hung) < len(builts)
    return gs, builts, on_hung


def assert_only_unread_kept(store, builts, unread_rollouts) -> None:
    """After a step's clear: the rows of ``unread_rollouts`` are all still staged, every
    other rollout's are gone."""
    unread = [r.staging_key for b in builts if b.rollout_id in unread_rollouts for r in b.rows]
    served = [r.staging_key for b in builts if b.rollout_id not in unread_rollouts for r in b.rows]
    got = store.get_many(unread + served, list(STAGING_FIELDS))
    assert set(got.batch.keys) == set(unread), f"deleted rows never read: {sorted(set(unread) - set(got.batch.keys))}"


def test_finalize_step_with_a_hung_unit_rejects_only_its_rollouts(client, store, hang):
    gs, builts, on_hung = staged(store, "fin", seed=3)
    hang("get_many")
    with dask.config.set({"token-capture.finalize.fetch-timeout-s": 1.0, "token-capture.finalize.clear-staged": False,
                          "token-capture.finalize.retries": 0}):
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
        step = fin.submit_step({g: [b.receipt for b in bs] for g, bs in gs.items()}, step_id="hung-unit").result(timeout=60)
    for gid, bs in gs.items():
        g = step.groups[gid]
        assert g.input_ids.shape[0] == len(bs)
        for i, b in enumerate(bs):
            assert g.status[i] == (reasons.MISSING_STAGING_ROW if b.rollout_id in on_hung else reasons.OK), (b.rollout_id, g.status[i])
    assert step.rejected == {reasons.MISSING_STAGING_ROW: len(on_hung)}


def test_rows_a_slow_unit_did_not_serve_survive_the_step_clear(client, store, monkeypatch):
    # A unit slow past finalize.fetch-timeout-s fails its keys unit_unavailable: its rollouts
    # are rejected missing_staging_row and the step is delivered, but their rows were never
    # read. The step's clear, which reaches the unit once it answers again, keeps them (a
    # later step may finalize them); the delivered rollouts' rows go.
    gs, builts, on_hung = staged(store, "hc", seed=5)
    release = threading.Event()
    orig = StorageUnit.get_many

    def slow(self, *a, **kw):
        if self.unit_index == HUNG and not release.is_set():
            release.wait(60)
        return orig(self, *a, **kw)

    monkeypatch.setattr(StorageUnit, "get_many", slow)
    try:
        with dask.config.set({"token-capture.finalize.fetch-timeout-s": 2.0, "token-capture.finalize.clear-staged": True,
                              "token-capture.finalize.retries": 0}):
            fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
            handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in gs.items()}, step_id="slow-clear")
            step = handle.result(timeout=60)
    finally:
        release.set()  # the unit answers again (slow, not lost)
    assert step.rejected == {reasons.MISSING_STAGING_ROW: len(on_hung)}
    handle.clear_future.result(timeout=60)
    assert_only_unread_kept(store, builts, on_hung)


def test_rows_whose_routes_a_unit_could_not_read_survive_the_step_clear(client, store, monkeypatch):
    # The same for the routes fetch alone: one unit fails to read the routes of its rows
    # (store_error, as a spill read gone bad answers), so its rollouts are rejected
    # missing_routes, their routes never read; their rows are kept too.
    gs, builts, on_bad = staged(store, "hr", seed=6)
    orig = StorageUnit.get_many

    def unreadable_routes(self, partition, keys, fields=None, *a, **kw):
        got = orig(self, partition, keys, fields, *a, **kw)
        names = bytes(fields) if isinstance(fields, (bytes, bytearray)) else "".join(fields or ()).encode()
        if self.unit_index == HUNG and b"routed_experts" in names and len(got.batch):
            failed = {k: (STORE_ERROR, "reading the row failed (test)") for k in got.batch.keys}
            return GetResult(PackedBatch([], {}), {**got.failed, **failed})
        return got

    monkeypatch.setattr(StorageUnit, "get_many", unreadable_routes)
    with dask.config.set({"token-capture.finalize.clear-staged": True, "token-capture.finalize.retries": 0}):
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
        handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in gs.items()}, step_id="bad-routes")
        step = handle.result(timeout=60)
    assert step.rejected == {reasons.MISSING_ROUTES: len(on_bad)}
    handle.clear_future.result(timeout=60)
    assert_only_unread_kept(store, builts, on_bad)  # no routes asked: read as usual


def test_stats_keys_and_close_return_with_a_hung_unit(store, hang):
    """``stats()``, ``keys()`` and ``close()`` wait ``store.admin-call-timeout-s`` for a
    unit, then name the silent one (without the bound each waits for the hung unit)."""
    hang("stats", "keys", "close")
    quick = store.with_settings(admin_timeout_s=1.0)
    with pytest.raises(StoreUnavailable, match=r"storage unit 1 cannot give its figures: no answer in time"):
        quick.stats()
    with pytest.raises(StoreUnavailable, match=r"storage unit 1 cannot give its keys: no answer in time"):
        quick.keys(STAGING_PARTITION)
    closed = quick.close_units()
    assert closed[0]["unit"] == 0 and "error" not in closed[0]  # its final figures
    assert closed[1]["closed"] is False and "TimeoutError" in closed[1]["error"]
    assert quick.closed


def test_the_whole_store_bound_is_a_positive_number_of_seconds():
    with dask.config.set({"token-capture.store.admin-call-timeout-s": 0}):
        with pytest.raises(InvalidInput, match=r"admin-call-timeout-s is 0; set a number of seconds > 0"):
            StoreSettings.from_config()
    with dask.config.set({"token-capture.store.admin-call-timeout-s": 2.5}):
        assert StoreSettings.from_config().admin_timeout_s == 2.5


def test_a_restore_with_a_hung_unit_rolls_back_by_its_bound(client, store, hang, tmp_path):
    """A restore's puts and its rollback wait ``store.admin-call-timeout-s`` for a unit:
    the hung unit's keys fail ``unit_unavailable``, the rows put on the healthy unit are
    taken back, and the restore raises instead of waiting for the hung unit."""
    source = StagingStore.start(client, n_units=2, spill_directory=str(tmp_path / "source"))
    try:
        rows = [r for bs in groups("rh").values() for b in bs for r in b.rows]
        assert not source.put_many(pack_rows(rows)).failed
        source.checkpoint(str(tmp_path / "ck"))
    finally:
        source.close()
    keys = [r.staging_key for r in rows]
    on_hung = {k for k in keys if unit_for_key(k, 2) == HUNG}
    assert 0 < len(on_hung) < len(keys)
    hang("put_many", "release_claim")
    quick = store.with_settings(admin_timeout_s=1.0)
    with pytest.raises(RestoreIncomplete) as info:
        quick.restore(str(tmp_path / "ck"))
    assert set(info.value.failed) == on_hung
    assert all(reason == UNIT_UNAVAILABLE for reason, _ in info.value.failed.values())
    assert info.value.removed == len(keys) - len(on_hung)  # the healthy unit's rows taken back
    assert store.units[0].keys(STAGING_PARTITION).result() == []


@pytest.mark.parametrize("stuck", ["begin_checkpoint", "checkpoint_write"])
def test_a_save_with_a_hung_unit_fails_by_its_bound_and_keeps_the_previous_checkpoint(store, hang, tmp_path, stuck):
    """Opening and closing a save wait ``store.admin-call-timeout-s`` for a unit, its
    writes ``store.checkpoint-lease-s`` (past it the checkpoint could not count anyway)."""
    rows = [r for bs in groups("sv").values() for b in bs for r in b.rows]
    assert not store.put_many(pack_rows(rows)).failed
    path = str(tmp_path / "ck")
    first = store.checkpoint(path)
    hang(stuck)
    quick = store.with_settings(admin_timeout_s=1.0)
    what = "open the checkpoint" if stuck == "begin_checkpoint" else "write its files"
    with dask.config.set({"token-capture.store.checkpoint-lease-s": 1.0}):
        with pytest.raises(CheckpointError, match=rf"storage unit 1 did not {what} in time"):
            quick.checkpoint(path)
    assert [n for n in os.listdir(path) if n.startswith("gen-")] == [first["generation"]]  # the previous one kept


class AsyncReader:
    """An actor reading through a store handle's async driver (its worker's event loop)."""

    def __init__(self, store):
        self.store = store

    async def get(self, keys: list[str], timeout: float) -> tuple[int, dict]:
        got = await self.store.get_many_async(keys, list(STAGING_FIELDS), timeout=timeout)
        return len(got.batch), dict(got.failed)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_read_a_stalled_primary_holds_past_the_failover_bound_is_served_by_the_other_copy(client, tmp_path, hang, driver):
    # Replicas 2: a primary that has not answered a get within store.read-failover-s is
    # given up (a SlowRead, counted, not remembered as down) and its keys are read from
    # their other copy, long before the get's own deadline. Without the bound the get
    # waits out that deadline before it reads the replicas.
    from pipeline.store.unit_health import unit_health

    settings = {"token-capture.store.replicas": 2, "token-capture.store.read-failover-s": 0.5,
                "token-capture.store.admin-call-timeout-s": 1.0}  # close() does not wait long for the hung unit
    with dask.config.set(settings):
        store = StagingStore.start(client, n_units=2, spill_directory=str(tmp_path / "spill"))
    try:
        builts = [b for bs in groups("fo").values() for b in bs]
        assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
        keys = [r.staging_key for b in builts for r in b.rows]
        before = unit_health().figures()
        hang("get_many")
        if driver == "sync":
            got = store.get_many(keys, list(STAGING_FIELDS), timeout=90)
            rows, failed = len(got.batch), dict(got.failed)
        else:
            reader = client.submit(AsyncReader, store, actor=True, workers=[store.unit_workers[0]]).result()
            rows, failed = reader.get(keys, 90).result(timeout=60)
        assert failed == {} and rows == len(keys)  # every key served, the hung unit's from the other copy
        after = unit_health().figures()
        assert after["slow_reads"] > before["slow_reads"]  # given up after the bound, not the 90 s deadline
        assert after["unreachable"] == before["unreachable"]  # a slow unit, not remembered as a lost one
    finally:
        store.close()
