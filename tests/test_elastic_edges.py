"""The elastic store's edges: each is refused clearly (a typed error naming the problem
and the fix) or serialized, never a lost or changed key.

One module-scoped cluster: four nanny workers on 127.0.0.1 (no storage role, so the store
host never grows onto them by itself) and a scheduler with the store host. Owned stores
(``StagingStore.start`` from this process) are driven through ``Rebalancer`` directly;
hosted ones through the scheduler's host, with storage workers started from Dask's CLI
(``--no-nanny``, so a SIGKILL ends one for good). Counts come from the units' own
counters (``moved_in_rows``, ``moved_refusals``, ``placement_version``).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading

import dask
import numpy as np
import pytest
from rollout_factory import make_group
from support import assert_rows_read_back, wait_until

from pipeline.actors import current_workers, workers_now
from pipeline.client.discovery import lookup_store
from pipeline.dashboard.preload import PRELOAD
from pipeline.store.client import StagingStore
from pipeline.store.fence import Fence
from pipeline.store.host import PLUGIN_NAME
from pipeline.store.hosted import close_hosted, hosted_stores, start_hosted
from pipeline.store.moves import copies_of
from pipeline.store.placement import Placement
from pipeline.store.rebalance import RebalanceSettings, Rebalancer
from pipeline.store.unit import StorageUnit
from tasks.errors import CheckpointError, InvalidStoreRequest, StoreBusy
from tasks.packed import pack_rows

SETTINGS = {
    "distributed.comm.timeouts.connect": "3s",
    "token-capture.store.repair-interval-s": 0.2,
    "token-capture.store.report-interval-s": 0,
    "token-capture.store.rebalance-chunk-rows": 8,
}
FAST = RebalanceSettings(chunk_keys=8, call_timeout_s=20.0, retry_s=60.0)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, Nanny, Scheduler, SpecCluster

    with dask.config.set(SETTINGS):
        spec = {n: {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1"}} for n in "abcd"}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1", "preload": [PRELOAD]}}
        with SpecCluster(workers=spec, scheduler=scheduler) as cl, Client(cl) as client:
            client.wait_for_workers(4)
            yield client


@pytest.fixture()
def spawned():
    """CLI worker processes a test starts; ended (SIGKILL) if still running at its end."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)


def by_name(client) -> dict[str, str]:
    return {w["name"]: a for a, w in workers_now(client).items()}


def spawn(client, procs: list, name: str, storage: bool, report_s: float = 0) -> subprocess.Popen:
    """A worker started the way a deployment starts one (no nanny: a SIGKILL ends it);
    its units report every ``report_s`` seconds (0: never)."""
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s",
           "DASK_TOKEN_CAPTURE__STORE__REPORT_INTERVAL_S": str(report_s)}
    cmd = [sys.executable, "-m", "distributed.cli.dask_worker", client.scheduler.address, "--name", name, "--no-nanny",
           "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"] + (["--resources", "storage=1"] if storage else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(proc)
    return proc


def joined(client, name: str) -> str:
    return wait_until(lambda: by_name(client).get(name), 60, f"worker {name} joined")


def cli_worker(client, procs: list, name: str, storage: bool, report_s: float = 0) -> tuple[subprocess.Popen, str]:
    """:func:`spawn`, once joined: (process, address)."""
    proc = spawn(client, procs, name, storage, report_s)
    return proc, joined(client, name)


def rows_of(seed: int, groups: int = 4) -> list:
    rng = np.random.default_rng(seed)
    return [r for g in range(groups) for b in make_group(rng, f"x{seed}g{g}", 3, n_calls=2, routes=(2, 2, 8)) for r in b.rows]


def owned(client, workers: list[str], replicas: int, n_units: int | None = None) -> tuple[StagingStore, Rebalancer]:
    with dask.config.set({"token-capture.store.replicas": replicas}):
        store = StagingStore.start(client, n_units=n_units or len(workers), memory_limit="64MiB", capacity="256MiB", workers=workers)
    return store, Rebalancer(store, client, store.owner.unit_args, FAST)


def put_all(store, rows) -> None:
    res = store.put_many(pack_rows(rows))
    assert not res.failed and len(res.ok) == len(rows), list(res.failed.items())[:2]


def put_from_a_task(store, rows) -> int:
    """:func:`put_all` in a task; the handle's table version after it."""
    put_all(store, rows)
    return store.version


same_rows = assert_rows_read_back


def counter(store, name: str) -> int:
    return sum(s[name] for s in store.stats())


def state(store) -> tuple:
    """What a refused change must leave as it was: versions (handle, units) and rows."""
    stats = store.stats()
    return store.version, [s["placement_version"] for s in stats], [s["rows"] for s in stats], store.moving


def actors_on(client) -> int:
    return client.run_on_scheduler(lambda dask_scheduler: sum(len(ws.actors) for ws in dask_scheduler.workers.values()))


def host_of(client):
    return client.cluster.scheduler.plugins[PLUGIN_NAME]


def info(client, name: str) -> dict:
    return next(s for s in hosted_stores(client) if s["name"] == name)


def current(client, name: str):
    version = info(client, name)["version"]
    return wait_until(lambda: (h := lookup_store(client, name)).version >= version and h, 30, "the current table published")


class KillMidCopy(Rebalancer):
    """A rebalancer whose first copy SIGKILLs ``victim`` after one transfer (once)."""

    victim: subprocess.Popen | None = None

    def _copy(self, by_id, partition, transfers):
        if self.victim is None or len(transfers) < 2:
            return super()._copy(by_id, partition, transfers)
        moved = super()._copy(by_id, partition, transfers[:1])
        victim, self.victim = self.victim, None
        victim.send_signal(signal.SIGKILL)
        victim.wait(30)
        return moved + super()._copy(by_id, partition, transfers[1:])


class ReadMidMove(Rebalancer):
    """A rebalancer that, fenced and moving but before its first copy, reads ``rows``
    back through the store and records the get calls each unit answered meanwhile."""

    rows: list = []
    gets_during: dict[str, int] = {}

    def _copy(self, by_id, partition, transfers):
        if self.rows and not self.gets_during:
            before = {s["unit_id"]: s["gets"] for s in self.store.stats()}
            same_rows(self.store, self.rows)  # every row, bit for bit, while nothing is copied yet
            self.gets_during = {s["unit_id"]: s["gets"] - before[s["unit_id"]] for s in self.store.stats()}
        return super()._copy(by_id, partition, transfers)


# ---- 1-2: refused before anything changes ----------------------------------------------


def test_a_second_unit_on_a_worker_is_refused_before_any_actor_starts(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        rows = rows_of(1)
        put_all(store, rows)
        before, actors = state(store), actors_on(cluster)
        with pytest.raises(InvalidStoreRequest, match="already hosts storage unit '0' of this store.*another worker"):
            rb.add_unit(w["a"])
        assert actors_on(cluster) == actors and state(store) == before and not rb.changes
        same_rows(store, rows)
    finally:
        store.close()


def test_draining_the_last_unit_or_the_last_failure_domain_is_refused_and_changes_nothing(cluster):
    w = by_name(cluster)
    one, rb1 = owned(cluster, [w["a"]], replicas=1)
    two, rb2 = owned(cluster, [w["a"], w["b"]], replicas=2, n_units=3)  # units 0 and 2 on a, 1 on b
    try:
        rows = rows_of(2)
        put_all(one, rows)
        put_all(two, rows)
        before1, before2 = state(one), state(two)
        with pytest.raises(InvalidStoreRequest, match="'0'.*last unit.*add a unit on another worker first"):
            rb1.drain_unit("0")
        with pytest.raises(InvalidStoreRequest, match="'1'.*two failure domains.*start another storage worker first"):
            rb2.drain_unit("1")
        assert state(one) == before1 and state(two) == before2 and not rb1.changes and not rb2.changes
        same_rows(one, rows)
        same_rows(two, rows)
        rb2.drain_unit("2")  # the refusal is about the domain left, not any drain
        assert two.unit_ids == ["0", "1"] and counter(two, "moved_in_rows") > 0
        same_rows(two, rows)
    finally:
        one.close()
        two.close()


# ---- 3-4: serialized changes, older tables ---------------------------------------------


def test_two_changes_at_once_are_serialized_and_both_land(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"], w["c"]], replicas=2)
    try:
        rows = rows_of(3)
        put_all(store, rows)
        start, errors = threading.Barrier(2), []

        def run(change) -> None:
            start.wait()
            try:
                change()
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(lambda: rb.add_unit(w["d"]),)),
                   threading.Thread(target=run, args=(lambda: rb.drain_unit("0"),))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert sorted(c["kind"] for c in rb.changes) == ["add", "drain"]
        assert [c["version"] for c in rb.changes] == [2, 4]  # one after the other, each its two versions
        assert sorted(store.unit_workers) == sorted([w["b"], w["c"], w["d"]])  # the add's unit, less the drained one
        assert store.moving is None and {s["placement_version"] for s in store.stats()} == {4}
        same_rows(store, rows)
        assert sum(s["rows"] for s in store.stats()) == 2 * len(rows)  # both copies, once each
        assert counter(store, "moved_in_rows") > 0
    finally:
        store.close()


def test_an_older_table_is_refused_and_a_call_planned_on_one_is_refreshed(cluster):
    w = by_name(cluster)
    store, rb = owned(cluster, [w["a"], w["b"]], replicas=1)
    try:
        rows = rows_of(4)
        put_all(store, rows)
        stale_reader, stale_writer = (pickle.loads(pickle.dumps(store)) for _ in range(2))
        old, old_units = store.placement, list(store.units)
        published, install = [], store.install_moving

        def spy(moving, units):  # what every unit was told when the moving table went out
            published.append({u.stats().result()["placement_version"] for u in units})
            return install(moving, units)

        store.install_moving = spy
        rb.add_unit(w["c"])
        assert published == [{old.version + 1}]  # fenced early: before any writer has the table
        assert stale_reader.version == old.version < store.version
        with pytest.raises(InvalidStoreRequest, match="older than its .*never goes back"):
            store.units[0].set_fence(Fence.message(old, "0", False)).result()
        with pytest.raises(InvalidStoreRequest, match=f"version {old.version} is not newer"):
            store.install_placement(old, old_units)
        refusals = counter(store, "moved_refusals")
        same_rows(stale_reader, rows)  # answered moved, refreshed, read again
        assert counter(store, "moved_refusals") > refusals and stale_reader.version == store.version
        more = rows_of(40, groups=2)
        refusals = counter(store, "moved_refusals")
        # From a task: this process's other handles now take the table stale_reader
        # fetched before planning (unit_health.py); a worker process has not seen it.
        assert cluster.submit(put_from_a_task, stale_writer, more, pure=False).result() == store.version
        assert counter(store, "moved_refusals") > refusals
        same_rows(store, rows + more)
        assert sum(s["rows"] for s in store.stats()) == len(rows + more)
    finally:
        store.close()


def test_an_early_fence_keeps_tombstones_and_refuses_older_calls_only_once_published(tmp_path):
    """The unit's side of fencing before publishing: a delete that reaches a new holder
    before its fence proper still leaves a tombstone, and calls on the older table are
    served until the table is published."""
    unit = StorageUnit(2, 1 << 26, 1 << 28, spill_directory=str(tmp_path))
    t0 = Placement(4, ("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002"))
    t1 = t0.with_unit("2", "tcp://127.0.0.1:4003")
    rows = [r for r in rows_of(11) if copies_of(t1, [r.staging_key])[0] == ("2",)]
    keys, part = [r.staging_key for r in rows], "staging"
    try:
        assert rows
        unit.set_fence(Fence.message(t1, "2", True, t0, early=True))
        assert set(unit.delete(part, keys, version=t1.version).failed) == set(keys)  # nothing here yet
        older = unit.get_many(part, keys, None, version=t0.version)
        assert {r for r, _ in older.failed.values()} == {"missing_key"}  # the older table still served
        unit.set_fence(Fence.message(t1, "2", True, t0))  # published: older calls refused from here on
        assert {r for r, _ in unit.get_many(part, keys, None, version=t0.version).failed.values()} == {"moved"}
        assert unit.move_in(part, pack_rows(rows)) == 0  # the copy read before the delete is skipped
        assert unit.stats()["move_tombstone_skips"] == len(keys) and not len(unit.get_many(part, keys).batch)
    finally:
        unit.close()


# ---- 5: checkpoints and moves never overlap ---------------------------------------------


def test_a_join_during_a_checkpoint_waits_and_the_host_retries_until_it_lands(cluster, spawned):
    w, name = by_name(cluster), "ckpt-join"
    with dask.config.set({"token-capture.store.replicas": 2}):
        store = start_hosted(cluster, name, n_units=2, workers=[w["a"], w["b"]])
    try:
        rows = rows_of(5)
        put_all(store, rows)
        for u in store.units:  # a checkpoint open on every unit, as a save holds it
            u.begin_checkpoint("held-open").result()
        _, storage = cli_worker(cluster, spawned, "s5", storage=True)
        waiting = wait_until(lambda: info(cluster, name)["waiting"], 60, "the add waiting for the checkpoint")
        assert f"add on {storage}" in waiting and "checkpoint open" in waiting[f"add on {storage}"]
        assert not info(cluster, name)["changes"]
        for u in store.units:
            u.end_checkpoint("held-open").result()
        changes = wait_until(lambda: info(cluster, name)["changes"], 60, "the add landed once the checkpoint ended")
        assert changes[0]["kind"] == "add" and storage in info(cluster, name)["workers"]
        wait_until(lambda: not info(cluster, name)["waiting"], 30, "nothing left waiting")
        fresh = current(cluster, name)
        same_rows(fresh, rows)
        assert counter(fresh, "moved_in_rows") > 0
        # A drain (the worker's retirement) during a checkpoint waits for it the same way.
        for u in fresh.units:
            u.begin_checkpoint("again").result()
        retiring = threading.Thread(target=cluster.retire_workers, args=([storage],), kwargs={"close_workers": True})
        retiring.start()
        waiting = wait_until(lambda: info(cluster, name)["waiting"], 60, "the drain waiting for the checkpoint")
        assert [k for k in waiting if k.startswith("drain") and storage in k] and storage in info(cluster, name)["workers"]
        for u in fresh.units:
            u.end_checkpoint("again").result()
        retiring.join(120)
        wait_until(lambda: storage not in by_name(cluster).values(), 60, "the storage worker retired")
        assert [c["kind"] for c in info(cluster, name)["changes"]] == ["add", "drain"]
        same_rows(current(cluster, name), rows)
    finally:
        close_hosted(cluster, name)


def test_a_change_while_a_unit_is_lost_waits_for_its_repair(cluster, spawned):
    # A storage worker joining right after another died (a chaos soak's replacement host)
    # used to fail its add for good: the add asked every unit for its checkpoints, the
    # lost one raised "Unable to contact Actor's worker", and the joined worker never got
    # a unit. Now the change is refused StoreBusy (the host retries it) until the repairer
    # has replaced the lost unit, then it lands.
    procs = [cli_worker(cluster, spawned, f"lost{i}", storage=False) for i in range(3)]
    workers = [a for _, a in procs]
    with dask.config.set({"token-capture.store.repair-interval-s": 3600}):  # the repair runs when the test says
        store, rb = owned(cluster, workers, replicas=2)
    try:
        rows = rows_of(9)
        put_all(store, rows)
        target = by_name(cluster)["a"]
        # Alive and registered but silent (stopped): the change waits for it the same way.
        os.kill(procs[2][0].pid, signal.SIGSTOP)
        try:
            patient = Rebalancer(store, cluster, store.owner.unit_args, RebalanceSettings(8, call_timeout_s=1.0, retry_s=60.0))
            with pytest.raises(StoreBusy, match="did not answer before a change"):
                patient.add_unit(target)
        finally:
            os.kill(procs[2][0].pid, signal.SIGCONT)
        assert list(store.placement.workers) == workers
        procs[2][0].kill()
        wait_until(lambda: workers[2] not in workers_now(cluster), 60, "the killed worker removed")
        actors = actors_on(cluster)
        with pytest.raises(StoreBusy, match="lost with their worker and not re-replicated yet"):
            rb.add_unit(target)
        assert list(store.placement.workers) == workers and actors_on(cluster) == actors  # nothing started or changed
        assert store.owner.repairer.check() == [2]
        target = next(by_name(cluster)[n] for n in "abcd" if by_name(cluster)[n] not in store.placement.workers)
        record = rb.add_unit(target)
        assert record["kind"] == "add" and target in store.placement.workers and len(store.units) == 4
        same_rows(store, rows)
    finally:
        store.close()


class Paused(Rebalancer):
    """A rebalancer that holds its copy until told to go on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copying, self.go = threading.Event(), threading.Event()

    def _copy(self, by_id, partition, transfers):
        self.copying.set()
        self.go.wait(60)
        return super()._copy(by_id, partition, transfers)


def test_a_checkpoint_during_a_move_is_refused_and_one_after_it_holds_every_key_once(cluster, tmp_path):
    w = by_name(cluster)
    with dask.config.set({"token-capture.store.replicas": 2}):
        store = StagingStore.start(cluster, n_units=2, memory_limit="64MiB", capacity="256MiB", workers=[w["a"], w["b"]])
    rb = Paused(store, cluster, store.owner.unit_args, FAST)
    restored = None
    try:
        rows = rows_of(6)
        put_all(store, rows)
        adding = threading.Thread(target=rb.add_unit, args=(w["c"],))
        adding.start()
        assert rb.copying.wait(60)
        handle = pickle.loads(pickle.dumps(store))  # any process's handle, the move's table in it
        with pytest.raises(CheckpointError, match="moving keys") as refused:
            handle.checkpoint(str(tmp_path / "during"))
        assert isinstance(refused.value.__cause__, StoreBusy)
        during = rows_of(60, groups=2)
        put_all(handle, during)  # on the copies of both tables, some of them old holders only
        rb.go.set()
        adding.join(120)
        assert [c["kind"] for c in rb.changes] == ["add"] and store.moving is None
        every = rows + during
        assert sum(s["rows"] for s in store.stats()) == 2 * len(every)  # two copies each, no stray third
        manifest = store.checkpoint(str(tmp_path / "after"))
        assert manifest["rows"] == len(every)  # every key once, though each is held twice
        with dask.config.set({"token-capture.store.replicas": 2}):
            restored = StagingStore.from_checkpoint(cluster, str(tmp_path / "after"), n_units=2, memory_limit="64MiB",
                                                    capacity="256MiB", workers=[w["b"], w["d"]])
        same_rows(restored, every)
        assert sum(s["rows"] for s in restored.stats()) == 2 * len(every)
        gone = [r.staging_key for r in during]
        assert not store.delete(gone).failed
        rb.drain_unit("0")  # a later move must not bring back what was deleted
        back = store.get_many(gone)
        assert not len(back.batch) and {r for r, _ in back.failed.values()} == {"missing_key"}
        same_rows(store, rows)
    finally:
        rb.go.set()
        store.close()
        if restored is not None:
            restored.close()


# ---- 6: one copy ---------------------------------------------------------------------------


def test_one_copy_rebalances_and_drains_and_a_lost_worker_is_counted(cluster, spawned, caplog):
    w, name = by_name(cluster), "one-copy"
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = start_hosted(cluster, name, n_units=2, workers=[w["a"], w["b"]])
    try:
        rows = rows_of(7)
        put_all(store, rows)
        p1, s1 = cli_worker(cluster, spawned, "s6a", storage=True)
        wait_until(lambda: info(cluster, name)["changes"], 60, "a unit added on the storage worker")
        fresh = current(cluster, name)
        same_rows(fresh, rows)
        assert counter(fresh, "moved_in_rows") > 0
        cluster.retire_workers([s1], close_workers=True)  # the host drains it first
        p1.wait(60)
        assert [c["kind"] for c in info(cluster, name)["changes"]] == ["add", "drain"]
        fresh = current(cluster, name)
        same_rows(fresh, rows)
        assert sum(s["rows"] for s in fresh.stats()) == len(rows) and not info(cluster, name)["lost_rows"]

        p2, s2 = cli_worker(cluster, spawned, "s6b", storage=True, report_s=0.2)
        wait_until(lambda: len(info(cluster, name)["changes"]) == 3, 60, "a unit added on the second storage worker")
        fresh = current(cluster, name)
        uid = fresh.unit_ids[fresh.unit_workers.index(s2)]
        put_all(fresh, rows_of(70))  # rows the host learns of only from the unit's STORE reports
        held = next(s["rows"] for s in fresh.stats() if s["worker"] == s2)
        assert held > info(cluster, name)["changes"][-1]["rows_moved"] > 0
        wait_until(lambda: info(cluster, name)["unit_rows"][uid] == held, 30, "the unit's report counted")
        with caplog.at_level(logging.WARNING, logger="pipeline.store.host"):
            p2.send_signal(signal.SIGKILL)
            p2.wait(30)
            record = wait_until(lambda: info(cluster, name)["lost_units"], 60, "the loss counted")
        assert list(record) == [dict(record[0], unit=uid, worker=s2, rows=held, known=True)]
        assert info(cluster, name)["lost_rows"] == held
        said = [r.getMessage() for r in caplog.records if "lost storage unit" in r.getMessage()]
        assert said and f"{held} row(s) gone" in said[0] and "token-capture.store.replicas: 2" in said[0]
    finally:
        close_hosted(cluster, name)


# ---- 7: a change that fails part-way ----------------------------------------------------


def test_a_move_whose_target_dies_stays_correct_refuses_the_next_change_and_resumes(cluster, spawned):
    w = by_name(cluster)
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = StagingStore.start(cluster, n_units=2, memory_limit="64MiB", capacity="256MiB", workers=[w["a"], w["b"]])
    rb = KillMidCopy(store, cluster, store.owner.unit_args, FAST)
    try:
        rows = rows_of(8)
        put_all(store, rows)
        rb.victim, target = cli_worker(cluster, spawned, "k7", storage=False)
        with pytest.raises(OSError):
            rb.add_unit(target)
        stuck = store.moving
        assert stuck is not None and rb.interrupted["kind"] == "add"
        same_rows(store, rows)  # the new holder is gone: reads fall back to the old ones
        more = rows_of(41, groups=2)
        acked = set(store.put_many(pack_rows(more)).ok)  # keys the dead unit was to hold are not acknowledged
        assert acked
        with pytest.raises(StoreBusy, match=f"(?s)placement version {stuck.version} \\(add of unit '2' interrupted.*resume"):
            rb.add_unit(w["c"])
        wait_until(lambda: target not in current_workers(cluster), 60, "the scheduler saw the target die")
        record = rb.resume()
        assert record["resumed"] and record["abandoned"] == ["2"] and store.moving is None and rb.interrupted is None
        kept = rows + [r for r in more if r.staging_key in acked]
        same_rows(store, kept)
        assert store.unit_workers == [w["a"], w["b"]] and {s["placement_version"] for s in store.stats()} == {store.version}
        rb.add_unit(w["c"])  # the next change goes ahead
        same_rows(store, kept)
    finally:
        store.close()


def test_the_host_resumes_an_interrupted_move_by_itself(cluster, spawned):
    w, name = by_name(cluster), "resumed"
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = start_hosted(cluster, name, n_units=2, workers=[w["a"], w["b"]])
    try:
        rows = rows_of(9)
        put_all(store, rows)
        host = host_of(cluster)
        hosted = host.stores[name]
        killing = KillMidCopy(hosted, host.client(), hosted.owner.unit_args, FAST)
        host.rebalancers[name] = killing
        killing.victim = spawn(cluster, spawned, "k8", storage=True)  # the victim is known before it joins
        address = joined(cluster, "k8")
        changes = wait_until(lambda: info(cluster, name)["changes"], 90, "the interrupted add resumed by the host")
        assert changes[0].get("resumed") and changes[0]["abandoned"], changes and info(cluster, name)["interrupted"] is None
        assert address not in info(cluster, name)["workers"]
        assert info(cluster, name)["lost_rows"] == 0  # the dead unit held copies only
        same_rows(current(cluster, name), rows)
    finally:
        close_hosted(cluster, name)


def test_a_read_during_a_move_asks_the_old_holders_only(cluster):
    # The old primaries hold every row until the final table is fenced: a read during the
    # copy costs one round trip. Asking the new holders first would send the joining unit
    # a get for every key it is to hold (and a second round trip to the old ones).
    w = by_name(cluster)
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = StagingStore.start(cluster, n_units=2, memory_limit="64MiB", capacity="256MiB", workers=[w["a"], w["b"]])
    rb = ReadMidMove(store, cluster, store.owner.unit_args, FAST)
    try:
        rb.rows = rows_of(5)
        put_all(store, rb.rows)
        record = rb.add_unit(w["c"])
        assert record["rows_moved"] > 0 and rb.gets_during, rb.gets_during
        new_unit = record["unit"]
        assert rb.gets_during[new_unit] == 0, rb.gets_during  # the joining unit answered no read
        assert sum(rb.gets_during.values()) >= 1
        same_rows(store, rb.rows)  # and after the move, from the new table
    finally:
        store.close()
