"""A store that grows with the cluster: storage workers join (``dask worker --resources
storage=1`` from Dask's own CLI) and are retired (``client.retire_workers``) while a
loop keeps putting, reading back bit for bit, deleting and finalizing.

The store is hosted by the scheduler (replicas 2). Each join adds a unit and moves about
1/n of the copies onto it (the units' own ``moved_in_rows``); each retirement drains the
worker's unit first. Nothing acknowledged is lost or changed, no read that should
succeed fails, a deleted key stays deleted, and after each change every unit holds
within 25% of the mean row count.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import dask
import numpy as np
import pytest

from pipeline.actors import workers_now
from pipeline.client.discovery import lookup_store
from pipeline.dashboard.preload import PRELOAD
from pipeline.finalize import Finalizer
from pipeline.store.hosted import close_hosted, hosted_stores, start_hosted
from rollout_factory import make_group
from support import wait_until
from tasks import reasons
from tasks.packed import pack_rows
from tasks.schema import STAGING_FIELDS

NAME = "elastic-store"
SETTINGS = {
    "distributed.comm.timeouts.connect": "3s",
    "token-capture.store.replicas": 2,
    "token-capture.store.repair-interval-s": 0.2,
    "token-capture.store.report-interval-s": 0,
    "token-capture.store.rebalance-chunk-rows": 64,
    "token-capture.finalize.clear-staged": False,
}
VOCAB, ROUTES = 64, (2, 2, 8)


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, Nanny, Scheduler, SpecCluster

    with dask.config.set(SETTINGS):
        opts = {"nthreads": 1, "host": "127.0.0.1", "resources": {"finalize": 2, "storage": 1}}
        spec = {n: {"cls": Nanny, "options": opts} for n in ("a", "b")}
        scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1", "preload": [PRELOAD]}}
        with SpecCluster(workers=spec, scheduler=scheduler) as cl, Client(cl) as client:
            client.wait_for_workers(2)
            yield client


def cli_worker(client, name: str) -> subprocess.Popen:
    """A storage worker started the way a deployment starts one."""
    env = {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"}
    return subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_worker", client.scheduler.address, "--name", name,
         "--nthreads", "1", "--host", "127.0.0.1", "--resources", "storage=1,finalize=2", "--no-dashboard"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )


class Loop(threading.Thread):
    """Puts new groups, reads back every acknowledged row, deletes some, finalizes."""

    def __init__(self, client, store):
        super().__init__(daemon=True)
        self.client, self.store = client, store
        self.rows: dict[str, object] = {}  # acknowledged key -> its row
        self.deleted: set[str] = set()
        self.errors: list[str] = []
        self.steps = self.rounds = 0
        self.stop = threading.Event()
        self.rng = np.random.default_rng(7)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.round()
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.errors.append(f"{type(e).__name__}: {e}")

    def round(self) -> None:
        n = self.rounds
        self.rounds += 1
        group = make_group(self.rng, f"e{n}", 3, n_calls=2, routes=ROUTES)
        rows = [r for b in group for r in b.rows]
        res = self.store.put_many(pack_rows(rows))
        if res.failed:
            self.errors.append(f"round {n}: put failed {list(res.failed.items())[:2]}")
        self.rows.update({r.staging_key: r for r in rows if r.staging_key in set(res.ok)})
        self.check(list(self.rows))
        if n % 4 == 3:  # delete one rollout's rows: the delete must reach every copy
            gone = [k for k in self.rows if k.startswith(f"e{n - 2}-")][:2] or [next(iter(self.rows))]
            dres = self.store.delete(gone)
            if dres.failed:
                self.errors.append(f"round {n}: delete failed {list(dres.failed.items())[:2]}")
            for k in gone:
                self.rows.pop(k, None)
                self.deleted.add(k)
        if n % 5 == 0:
            step = Finalizer(self.client, self.store, vocab_size=VOCAB, num_experts=ROUTES[2]).submit_step(
                {f"e{n}": [b.receipt for b in group]}).result(timeout=120)
            if step.groups[f"e{n}"].status != [reasons.OK] * 3:
                self.errors.append(f"round {n}: finalize {step.groups[f'e{n}'].status}")
            self.steps += 1

    def check(self, keys: list[str]) -> None:
        got = self.store.get_many(keys, list(STAGING_FIELDS))
        if got.failed:
            self.errors.append(f"read failed: {list(got.failed.items())[:2]}")
            return
        want = pack_rows([self.rows[k] for k in keys])
        for f in STAGING_FIELDS:
            if not np.array_equal(got.batch.fields[f].values, want.fields[f].values):
                self.errors.append(f"field {f} changed")
        if self.deleted:
            back = self.store.get_many(sorted(self.deleted)[:50])
            if len(back.batch):
                self.errors.append(f"deleted keys came back: {back.batch.keys[:3]}")


def units_of(client) -> dict:
    return next(s for s in hosted_stores(client) if s["name"] == NAME)


def current(client):
    """The published handle once it names the host's current table."""
    version = units_of(client)["version"]
    return wait_until(lambda: (h := lookup_store(client, NAME)).version >= version and h, 30, "the current table published")


def balanced(client) -> list[int]:
    rows = [s["rows"] for s in current(client).stats()]
    mean = sum(rows) / len(rows)
    assert all(abs(r - mean) <= 0.25 * mean for r in rows), rows
    return rows


def test_storage_grows_2_4_3_2_while_the_loop_runs(cluster):
    store = start_hosted(cluster, NAME, n_units=2)
    procs: dict[str, subprocess.Popen] = {}
    loop = Loop(cluster, store)
    try:
        for _ in range(12):  # rows to move before anything changes
            loop.round()
        loop.start()
        moved: list[tuple[int, int, int]] = []
        for name in ("c", "d"):  # 2 -> 3 -> 4: a unit per joining storage worker
            before = len(units_of(cluster)["changes"])
            stats_before = current(cluster).stats()
            sent_before = sum(s["sent_rows"] for s in stats_before)
            moved_in_before = sum(s["moved_in_rows"] for s in stats_before)
            procs[name] = cli_worker(cluster, name)
            rec = wait_until(lambda: (c := units_of(cluster)["changes"])[before:] and c[before], 120, f"a unit on {name}")
            stats = current(cluster).stats()
            copies = sum(s["rows"] for s in stats)  # rows held, both copies
            newcomer = next(s for s in stats if s["unit_id"] == rec["unit"])
            # The units' own counts: the newcomer takes the moved copies, except that a key a
            # concurrent put had given one copy when the move listed it gets its second copy
            # on an old unit, so the rows every unit took in add up to the record's.
            assert 0 < newcomer["moved_in_rows"] <= rec["rows_moved"]
            assert sum(s["moved_in_rows"] for s in stats) - moved_in_before == rec["rows_moved"]
            # ... sent unit to unit: the sources' own counters, not the store host, carried them
            assert sum(s["sent_rows"] for s in stats) - sent_before == rec["rows_moved"] > 0
            moved.append((rec["rows_moved"], copies, units_of(cluster)["units"]))
            balanced(cluster)
        for name in ("d", "c"):  # 4 -> 3 -> 2: each retirement drains first
            addr = next(a for a, w in workers_now(cluster).items() if w["name"] == name)
            cluster.retire_workers([addr], close_workers=True)
            wait_until(lambda: addr not in workers_now(cluster), 60, f"{name} retired")
            assert addr not in units_of(cluster)["workers"]
            balanced(cluster)
        time.sleep(0.5)
    finally:
        loop.stop.set()
        loop.join(120)
        for p in procs.values():
            p.terminate()
    assert not loop.errors, loop.errors[:5]
    assert loop.steps >= 1 and loop.rounds > 12
    loop.check(list(loop.rows))  # every acknowledged row, bit for bit, after all of it
    assert not loop.errors, loop.errors[:5]
    info = units_of(cluster)
    assert info["units"] == 2 and [c["kind"] for c in info["changes"]] == ["add", "add", "drain", "drain"]
    for rows_moved, copies, n in moved:  # about 1/n of the copies move onto the new unit
        assert 0 < rows_moved <= 1.5 * copies / n, (rows_moved, copies, n)
    stats = current(cluster).stats()
    assert sum(s["moved_in_rows"] for s in stats) > 0  # the units' own counters
    close_hosted(cluster, NAME)
