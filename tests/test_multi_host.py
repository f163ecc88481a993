"""The pipeline on a cluster of hosts started from Dask's CLI (``dask scheduler`` +
``dask worker`` per host, tests/multi_host.py): 4 hosts x 2 workers, each host on its own
loopback address and directory; generation on host1-2, storage on host3-4.

Rollouts are staged through the capture client from tasks on the generation hosts into a
store hosted by the scheduler (replicas 2, units on the storage hosts), finalized and
compared with the uninterrupted oracle; every key's two copies sit on two hosts. Then a
whole storage host is SIGKILLed: every acknowledged row still reads back bit for bit, the
next step finalizes, and a new storage host joins. A worker started without the worker
preload is named when a controller attaches. The demo runs against the cluster as is.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from contextlib import redirect_stderr

import dask
import psutil
import pytest
from multi_host import (S3_CREDENTIALS, STORAGE, host_address, host_of, moto_s3, multi_host_cluster, small_specs,
                        stage_on_generation_hosts)
from support import assert_rows_read_back, wait_for_names, wait_until

from pipeline.actors import workers_now
from pipeline.capture import policy_from_config
from pipeline.client.discovery import lookup_store
from pipeline.cluster import connect
from pipeline.deploy import check_cluster, workers_with_role
from pipeline.finalize import Finalizer
from pipeline.store.hosted import close_hosted, hosted_stores, start_hosted
from pipeline.testing.oracle import reference_mismatches
from tasks.errors import ClusterMisconfigured
from tasks.keys import primary_units
from tasks.toy.rollouts import generate_rollouts

pytestmark = pytest.mark.timeout(300)

NAME = "multi-host-store"
BUCKET = "multi-host-checkpoints"
SETTINGS = {"token-capture.store.replicas": 2, "token-capture.finalize.clear-staged": False}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3 checkpoint location on 127.0.0.1; its credentials in this process's
    environment (restored after) and, through the fixture below, in every host's."""
    saved = {k: os.environ.get(k) for k in S3_CREDENTIALS}
    os.environ.update(S3_CREDENTIALS)
    try:
        with moto_s3(str(tmp_path_factory.mktemp("moto") / "moto.log"), BUCKET) as endpoint:
            yield endpoint
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def cluster(s3):
    # The endpoint is a storage option (config, sent to the units with each save and
    # restore); the credentials come from each process's environment.
    settings = {**SETTINGS, "token-capture.store.checkpoint-storage-options": {"endpoint_url": s3}}
    with multi_host_cluster(settings=settings, env=S3_CREDENTIALS) as (hosts, client):
        yield hosts, client


def listening_ips(pids: list[int]) -> set[str]:
    return {c.laddr.ip for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in set(pids)}


def stage_from_generation_hosts(hosts, client, groups) -> dict:
    return stage_on_generation_hosts(hosts, client, groups, NAME)


def test_each_host_binds_its_own_address_and_directory(cluster):
    hosts, client = cluster
    check = check_cluster(client)
    assert check.ok, check.problems()
    assert len(check.workers) == 8 and all(w.preloaded for w in check.workers)
    dirs = client.run(lambda dask_worker: dask_worker.local_directory)
    for k, (name, host) in enumerate(hosts.hosts.items()):
        assert host.address == host_address(k + 1)
        workers = hosts.workers(name)
        assert len(workers) == 2 and {host_of(w) for w in workers} == {host.address}
        assert all(dirs[w].startswith(host.spec.local_directory + os.sep) for w in workers), (dirs, host.spec.local_directory)
        # Every socket a host's processes listen on is on its own address.
        assert listening_ips(host.pids()) == {host.address}
    assert workers_with_role(client, "generation") == hosts.role_workers("generation") and len(hosts.role_workers("generation")) == 4
    assert {host_of(w) for w in workers_with_role(client, "storage")} == {host_address(3), host_address(4)}


def test_bytes_crossing_hosts_are_counted_per_step(cluster):
    """Assembled by the controller, no verified row crosses between workers, wherever the
    group's rows sit. Asked for on the cluster, a group whose rows sit on two storage hosts
    is assembled on the host holding most of them; the other host's verified rows cross
    hosts, and the step's FINALIZE figures say so, planned (the layout) and measured (the
    scheduler's transfers). A group whose rows all sit on one host moves nothing between
    hosts. (The spread step runs first: by the second, Dask knows verify tasks are too
    short to be worth stealing to another host.)"""
    hosts, client = cluster
    store = start_hosted(client, NAME, n_units=4, workers=hosts.role_workers("storage"))
    try:
        unit_hosts = [host_of(w) for w in store.unit_workers]
        assert len(set(unit_hosts)) == 2

        def rows_hosts(prefix: str):
            [group] = small_specs(prefix, groups=1)
            ros = generate_rollouts(policy_from_config(), group)
            return group, {unit_hosts[u] for u in primary_units([ro.staging_keys[0] for ro in ros], len(unit_hosts)).tolist()}

        candidates = [rows_hosts(f"xh-{i}-") for i in range(40)]
        spread, spread_too = [g for g, h in candidates if len(h) == 2][:2]
        local = next(g for g, h in candidates if len(h) == 1)
        fin = Finalizer(client, store)
        for group, crosses in ((spread, True), (local, False)):
            receipts = stage_from_generation_hosts(hosts, client, [group])
            handle = fin.submit_step(receipts)
            handle.group_futures  # assembled on the cluster
            step = handle.result(timeout=120)
            layout = handle.graph.layout
            assert step.metrics["accepted"] == 3
            assert len({site.host for site in layout.sites}) == (2 if crosses else 1)
            if crosses:
                assert layout.crossing_tasks()
                assert step.metrics["cross_host_bytes_planned"] > 0 and step.metrics["cross_host_bytes"] > 0, step.metrics
            else:
                assert step.metrics["cross_host_bytes_planned"] == 0 and step.metrics["cross_host_bytes"] == 0, step.metrics
        # The default: rows on two hosts, assembled by the controller, nothing crosses.
        step = fin.submit_step(stage_from_generation_hosts(hosts, client, [spread_too])).result(timeout=120)
        assert step.metrics["assembled_on"] == "controller" and step.metrics["accepted"] == 3
        assert step.metrics["cross_host_bytes_planned"] == 0 and step.metrics["cross_host_bytes"] == 0, step.metrics
    finally:
        close_hosted(client, NAME)


def test_stage_finalize_then_lose_a_whole_storage_host(cluster):
    hosts, client = cluster
    store = start_hosted(client, NAME, n_units=4, workers=hosts.role_workers("storage"))
    try:
        groups = small_specs("mh-a-")
        receipts = stage_from_generation_hosts(hosts, client, groups)
        reference = generate_rollouts(policy_from_config(), [s for g in groups for s in g])
        assert {r.rollout_id: r for rs in receipts.values() for r in rs} == {ro.spec.rollout_id: ro.receipt for ro in reference}
        step = Finalizer(client, store).submit_step(receipts).result(timeout=120)
        assert step.metrics["accepted"] == 6 and reference_mismatches(step.groups, reference) == {}

        # Each key's primary and replica are on two hosts, and both really hold it.
        keys = [k for ro in reference for k in ro.staging_keys]
        located = store.placement.locate(keys)
        held = {u: set(unit.keys("staging").result()) for u, unit in enumerate(store.units)}
        for key, p, r in zip(keys, located.primary, located.replica):
            assert host_of(store.unit_workers[p]) != host_of(store.unit_workers[r]), key
            assert key in held[p] and key in held[r], key

        # A whole storage host lost: every process SIGKILLed.
        pids = hosts.kill_host("host3")
        assert pids and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert not [w for w in workers_now(client) if host_of(w) == host_address(3)]
        rows = [row for ro in reference for row in ro.rows]
        assert_rows_read_back(lookup_store(client, NAME), rows)

        # The next step stages and finalizes once the store host has re-replicated the lost
        # units (until then a put of a key with a copy there is refused, its receipt poisoned).
        def repaired():
            info = next(i for i in hosted_stores(client) if i["name"] == NAME)
            return not [w for w in info["workers"] if host_of(w) == host_address(3)] and len(info["repaired"]) >= 2

        wait_until(repaired, 120, "the lost units re-replicated")
        groups2 = small_specs("mh-b-", groups=1)
        receipts2 = stage_from_generation_hosts(hosts, client, groups2)
        reference2 = generate_rollouts(policy_from_config(), [s for g in groups2 for s in g])
        step2 = Finalizer(client, lookup_store(client, NAME)).submit_step(receipts2).result(timeout=120)
        assert step2.metrics["accepted"] == 3 and reference_mismatches(step2.groups, reference2) == {}, ({g: (v.status, v.details) for g, v in step2.groups.items()}, step2.rejected, [r.to_dict() for rs in receipts2.values() for r in rs][:1])

        # A new storage host joins: the store host gives it units; every row still reads back.
        new = hosts.add_host(STORAGE)
        new_workers = set(hosts.workers(new.name))
        wait_until(lambda: new_workers <= set(next(i for i in hosted_stores(client) if i["name"] == NAME)["workers"]),
                   120, "units on the new storage host")
        assert_rows_read_back(lookup_store(client, NAME), rows + [row for ro in reference2 for row in ro.rows])
    finally:
        close_hosted(client, NAME)


def test_cut_checkpoint_to_s3_lose_a_host_restore_onto_a_new_one_and_resume_bit_for_bit(cluster):
    """Generation actors on the generation hosts, a store on the storage hosts; cut every
    in-flight call, checkpoint the store to s3://, then lose a whole storage host and the
    generation actors; restore into a store on the remaining storage host plus a new one,
    resume every call from its prefix, finish, finalize: bit for bit the uninterrupted run."""
    from pipeline.driver import RolloutDriver
    from pipeline.store.client import StagingStore

    hosts, client = cluster
    storage = [h for h in hosts.hosts.values() if not h.killed and "storage" in h.spec.roles]
    groups = small_specs("mh-r-")
    store = StagingStore.start(client, n_units=2, workers=[w for h in storage for w in hosts.workers(h.name)][::2])
    restored = None
    try:
        driver = RolloutDriver(client, store, workers=hosts.role_workers("generation"), step_tokens=4)
        driver.submit(groups)
        driver.run_rounds(3)  # turn 0 staged, turn 1 in flight
        cut = driver.cut("mh-ck")
        assert cut.durable == cut.calls == 6 and not cut.failed
        url = f"s3://{BUCKET}/run-1"
        driver.checkpoint_store(url)
        snapshot = driver.snapshot
        driver.run_rounds(2)  # lost with the crash, redone identically
        driver.kill()
        hosts.kill_host(storage[0].name)  # a whole storage host, with its unit
        new = hosts.add_host(STORAGE)
        targets = hosts.workers(storage[1].name)[:1] + hosts.workers(new.name)[:1]
        restored = StagingStore.from_checkpoint(client, url, n_units=2, workers=targets)
        assert {host_of(w) for w in restored.unit_workers} == {storage[1].address, new.address}
        resumed, rec = RolloutDriver.recover(client, restored, snapshot, workers=hosts.role_workers("generation"))
        assert rec.resumed == 6 and rec.regenerated == {} and rec.poisoned == {}
        receipts = resumed.finish()
        resumed.kill()
        step = Finalizer(client, restored).submit_step(receipts).result(timeout=120)
        reference = generate_rollouts(policy_from_config(), [s for g in groups for s in g])
        assert step.metrics["accepted"] == 6 and reference_mismatches(step.groups, reference) == {}
        got = {r.rollout_id: r for rs in receipts.values() for r in rs}
        assert all(got[ro.spec.rollout_id] == ro.receipt for ro in reference)
    finally:
        store.close()
        if restored is not None:
            restored.close()


def bare_worker(address: str) -> subprocess.Popen:
    """A worker started from Dask's CLI without the worker preload and without resources."""
    return subprocess.Popen(
        [sys.executable, "-m", "dask", "worker", address, "--name", "bare-worker", "--host", "127.0.0.20",
         "--no-nanny", "--nthreads", "1", "--no-dashboard"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"},
    )


def test_a_worker_without_the_preload_or_a_role_is_named_when_a_controller_attaches(cluster, caplog):
    from pipeline.cli import main

    hosts, client = cluster
    proc = bare_worker(hosts.address)
    try:
        address = wait_for_names(client, ["bare-worker"])["bare-worker"]
        check = check_cluster(client)
        assert [w.name for w in check.without_preload] == ["bare-worker"]
        assert [w.name for w in check.without_role] == ["bare-worker"]
        with dask.config.set({"token-capture.hosts.attach-check": "error"}):
            with pytest.raises(ClusterMisconfigured, match=rf"bare-worker \({address}\) started without the worker preload "
                               r"pipeline\.deploy\.worker_preload; restart it with `dask worker .* --preload pipeline\.deploy\.worker_preload"):
                with connect(hosts.address):
                    pass
            err = io.StringIO()
            with redirect_stderr(err):
                code = main(["demo", "--scheduler", hosts.address, "--steps", "1", "--quiet"])
            lines = err.getvalue().strip().splitlines()
            assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "bare-worker" in lines[0], lines
            assert "no role resource" in lines[0] and "Traceback" not in err.getvalue()
        caplog.clear()
        with caplog.at_level("WARNING", logger="pipeline.deploy.check"), connect(hosts.address):
            pass
        named = [r.getMessage() for r in caplog.records if "bare-worker" in r.getMessage()]
        assert len(named) == 1 and "worker preload" in named[0] and "no role" in named[0], named  # one line
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        wait_until(lambda: "bare-worker" not in hosts.registered(client), 30, "the bare worker gone")


def test_the_demo_runs_against_the_cluster_unchanged(cluster, caplog):
    from pipeline import demo
    from pipeline.cli import build_parser

    hosts, _ = cluster
    args = build_parser().parse_args(["demo", "--scheduler", hosts.address, "--steps", "1", "--groups", "2", "--rollouts", "2",
                                      "--turns", "2", "--tokens-per-turn", "8", "--no-tamper", "--quiet"])
    out = io.StringIO()
    with caplog.at_level("WARNING", logger="pipeline.deploy.check"):
        summary = demo.run(args, out=out)
    text = out.getvalue()
    assert summary["accepted"] == summary["rollouts"] == 8, text
    assert "4/4 rollouts accepted" in text and "4/4 rollouts matched the uninterrupted run" in text, text
    assert not caplog.records, [r.getMessage() for r in caplog.records]  # the attach check found nothing to say
