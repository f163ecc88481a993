"""Losses said plainly (``store.replicas: 2``): when BOTH copies of a key die with their
units, the key reads as lost, never as never staged.

Three named workers, three units: a key's copies are on two of them and its witness
(recording its name) on the third. Workers ``a`` and ``b`` (units 0 and 1) are SIGKILLed
together, so the keys whose copies are units 0 and 1 (witness: unit 2) lose both. After re-replication
they read ``lost_key`` (a distinct reason, counted by the units, on ``/metrics`` and on
the dashboard's store table), are listed by ``keys()``, refuse any put (write-once holds),
and the finalizer rejects their rollouts ``lost_staging_row``. Deleting a lost key
forgets the loss.
"""
from __future__ import annotations

import os
import signal
import urllib.request

import dask
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.actors import workers_now
from pipeline.dashboard.preload import PRELOAD
from pipeline.finalize import Finalizer
from pipeline.store import StagingStore
from pipeline.store.placement import Placement
from pipeline.store.unit import StorageUnit
from rollout_factory import make_group
from tasks import reasons
from tasks.packed import pack_rows
from support import wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

VOCAB, L, K, E = 64, 2, 2, 8


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, Nanny, Scheduler, SpecCluster

    settings = {
        "distributed.comm.timeouts.connect": "3s",
        "token-capture.store.replicas": 2,
        "token-capture.store.report-interval-s": 0.2,
        "token-capture.store.repair-interval-s": 0.2,
        "token-capture.finalize.clear-staged": False,
    }
    with dask.config.set(settings):
        spec = {n: {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", "resources": {"finalize": 2}}} for n in "abc"}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1", "preload": [PRELOAD]}}
        with SpecCluster(workers=spec, scheduler=scheduler) as cl, Client(cl) as client:
            client.wait_for_workers(3)
            yield client


def _names(client) -> dict[str, str]:
    return {w["name"]: a for a, w in workers_now(client).items()}


def _lost_gauge(client) -> float:
    port = client.scheduler_info()["services"]["dashboard"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams["token_capture_store_lost_keys"].samples)


def test_witness_is_a_third_worker_or_none():
    keys = [f"r{i}/c0" for i in range(60)]
    three = Placement(0, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"), replicas=2).locate(keys)
    assert sorted({(int(p), int(r), int(w)) for p, r, w in zip(three.primary, three.replica, three.witness)}) == [
        (p, r, 3 - p - r) for p in range(3) for r in range(3) if p != r
    ]
    two = Placement(0, ("tcp://127.0.0.1:1", "tcp://127.0.0.1:2") * 2, replicas=2).locate(keys)
    assert two.witness.tolist() == [-1] * len(keys)  # two workers: no witness


def test_both_copies_lost_read_as_lost_refuse_puts_and_reject_rollouts(cluster, tmp_path):
    names = _names(cluster)
    store = StagingStore.start(cluster, n_units=3, workers=[names[n] for n in "abc"], spill_directory=str(tmp_path / "s"))
    try:
        rng = np.random.default_rng(7)
        groups = {f"g{g}": make_group(rng, f"g{g}", 4, rollout_prefix=f"lk{g}", n_calls=2, routes=(L, K, E), vocab_size=VOCAB)
                  for g in range(3)}
        rows = [r for bs in groups.values() for b in bs for r in b.rows]
        assert not store.put_many(pack_rows(rows)).failed
        keys = [r.staging_key for r in rows]
        loc = store.placement.locate(keys)
        doomed = {k for k, p, r in zip(keys, loc.primary, loc.replica) if {int(p), int(r)} == {0, 1}}
        assert doomed and store.stats()[2]["witnessed_keys"] == len(doomed)
        assert {k for k, w in zip(keys, loc.witness) if w == 2} == doomed

        pids = cluster.run(os.getpid, workers=[names["a"], names["b"]])
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: {0, 1} <= {r["unit"] for r in store.owner.repairer.repaired}, 120, "units 0 and 1 re-replicated")

        got = store.get_many(keys)
        assert {k for k, (why, _) in got.failed.items() if why == "lost_key"} == doomed
        assert set(got.failed) == doomed, "every other key survived on its second copy"
        assert "both its copies were lost" in got.failed[next(iter(doomed))][1]
        stats = store.stats()
        assert stats[0]["lost_keys"] == stats[1]["lost_keys"] == len(doomed)
        assert stats[0]["lost_reads"] + stats[1]["lost_reads"] >= len(doomed)
        assert doomed <= set(store.keys()), "a lost key is still listed"

        # Write-once holds: neither new nor the original content is accepted.
        victim = next(r for r in rows if r.staging_key in doomed)
        other = make_group(np.random.default_rng(99), "gx", 1, rollout_prefix="zz", n_calls=1, vocab_size=VOCAB)[0].rows[0]
        clash = pack_rows([other])
        clash.keys = [victim.staging_key]
        res = store.put_many(clash)
        assert res.failed[victim.staging_key][0] == "lost_key"
        assert store.put_many(pack_rows([victim])).failed[victim.staging_key][0] == "lost_key"

        # The finalizer says lost, not never staged.
        fin = Finalizer(cluster, store, vocab_size=VOCAB, num_experts=E)
        step = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id="after-loss").result(timeout=120)
        verdicts = {b.receipt.rollout_id: s for g, bs in groups.items() for b, s in zip(bs, step.groups[g].status)}
        hit = {r.rollout_id for r in rows if r.staging_key in doomed}
        assert {rid for rid, s in verdicts.items() if s == reasons.LOST_STAGING_ROW} == hit
        assert all(s == "ok" for rid, s in verdicts.items() if rid not in hit)

        # Counted on /metrics (the units' own reports) and on the dashboard state.
        wait_until(lambda: _lost_gauge(cluster) == 2 * len(doomed), 60, "lost keys on /metrics")
        snap = cluster.sync(cluster.scheduler.token_capture_state)
        assert sum(u["lost_keys"] for u in snap["store_units"].values()) == 2 * len(doomed)

        # Deleting a lost key forgets the loss: it may be staged again.
        assert store.delete([victim.staging_key]).ok == [victim.staging_key]
        assert not store.put_many(pack_rows([victim])).failed
        assert not store.get_many([victim.staging_key]).failed
    finally:
        store.close()


def test_a_unit_records_lost_keys_and_forgets_them_on_delete(tmp_path):
    from test_store import make_rows

    unit = StorageUnit(0, memory_limit=1 << 30, capacity=1 << 30, spill_directory=str(tmp_path))
    try:
        rows = make_rows(2, calls=1, tokens=16, seed=3)
        held, gone = rows[0].staging_key, rows[1].staging_key
        assert unit.put_many("staging", pack_rows(rows[:1])).ok == [held]
        assert unit.mark_lost("staging", [held, gone], "test") == 1, "a held key is never marked lost"
        got = unit.get_many("staging", [held, gone])
        assert got.batch.keys == [held] and got.failed[gone][0] == "lost_key"
        assert unit.put_many("staging", pack_rows(rows[1:])).failed[gone][0] == "lost_key"
        assert unit.keys("staging") == [held, gone]
        assert (unit.stats()["lost_keys"], unit.counters["lost_reads"]) == (1, 1)
        res = unit.delete("staging", [gone])
        assert res.ok == [gone] and unit.counters["deleted_rows"] == 0
        assert unit.put_many("staging", pack_rows(rows[1:])).ok == [gone]
    finally:
        unit.close()
