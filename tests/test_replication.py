"""Replication (``token-capture.store.replicas: 2``): nothing lost when a storage unit dies.

Real process clusters. Unit loss is a SIGKILLed worker process (its nanny restarts it
under the same name at a new address), while a unit call is in flight: a unit method is
wrapped on the victim worker (``client.run``) so its first call writes its pid to a
marker file and hangs; the test kills that pid.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import dask
import numpy as np
import pytest
import torch

from pipeline.finalize import Finalizer
from pipeline.store import StagingStore
from pipeline.store.owner import start_units, unit_args_from_config
from rollout_factory import make_group
from tasks.errors import InvalidStoreRequest
from tasks.keys import unit_for_key
from tasks.packed import pack_rows
from tasks.schema import STAGING_FIELDS
from support import named_nanny_cluster, wait_for_names, wait_until

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

VOCAB, L, K, E = 64, 2, 2, 8


@pytest.fixture(autouse=True)
def two_copies():
    with dask.config.set({"token-capture.store.replicas": 2, "token-capture.finalize.clear-staged": False}):
        yield


@pytest.fixture(scope="module")
def cluster():
    workers = {n: {"resources": {"finalize": 2}} for n in ("a", "b", "c")}
    with named_nanny_cluster(workers) as client:
        yield client


def make_groups(tag: str, n_groups: int = 3, per_group: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        f"g{g}": make_group(rng, f"g{g}", per_group, rollout_prefix=f"{tag}g{g}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
        for g in range(n_groups)
    }


def rows_of(groups):
    return [r for bs in groups.values() for b in bs for r in b.rows]


def counters(store):
    return [s for s in store.stats()]


# ---- fault injection (inside the victim worker process) ------------------------------------


def _install_unit_hang(marker: str, method: str) -> int:
    """The first ``StorageUnit.<method>`` call in this process writes its pid and hangs."""
    from pipeline.store.unit import StorageUnit

    orig = getattr(StorageUnit, method)
    orig = getattr(orig, "_tc_orig", orig)

    def hang_first(self, *args, **kwargs):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return orig(self, *args, **kwargs)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(600)  # killed long before
        return orig(self, *args, **kwargs)

    hang_first._tc_orig = orig
    setattr(StorageUnit, method, hang_first)
    return os.getpid()


def kill_when_hung(marker: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not (os.path.exists(marker) and os.path.getsize(marker)):
        assert time.monotonic() < deadline, "no unit call reached the fault injection point"
        time.sleep(0.02)
    pid = int(open(marker).read())
    os.kill(pid, signal.SIGKILL)
    return pid


def hang_unit(client, store, u: int, method: str, marker: str) -> None:
    client.run(_install_unit_hang, marker, method, workers=[store.unit_workers[u]])


def wait_repaired(store, n: int, timeout: float = 90.0) -> None:
    wait_until(lambda: len(store.owner.repairer.repaired) >= n, timeout, f"{n} unit(s) re-replicated")


def finalize(client, store, groups, step_id):
    fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
    return fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id=step_id).result(timeout=120)


def assert_same_step(step, reference, groups):
    for gid, bs in groups.items():
        g, ref = step.groups[gid], reference.groups[gid]
        assert g.status == ["ok"] * len(bs), g.status
        for name in ("input_ids", "input_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts"):
            assert torch.equal(getattr(g, name), getattr(ref, name)), name


# ---- a healthy replicated store ------------------------------------------------------------


def test_two_copies_primary_reads_and_deletes_both(cluster, tmp_path):
    names = wait_for_names(cluster, ["a", "b", "c"])
    store = StagingStore.start(cluster, n_units=3, workers=[names["a"], names["b"], names["c"]], spill_directory=str(tmp_path / "s"))
    try:
        rows = rows_of(make_groups("h"))
        keys = [r.staging_key for r in rows]
        loc = store.placement.locate(keys)
        assert all(store.unit_workers[p] != store.unit_workers[r] for p, r in zip(loc.primary, loc.replica))
        assert len(set(loc.replica.tolist())) == 3, "every unit holds some key's second copy"
        res = store.put_many(pack_rows(rows))
        assert not res.failed and sorted(res.ok) == sorted(keys)
        st = counters(store)
        assert [s["puts"] for s in st] == [1, 1, 1]  # ONE put per unit carries both roles
        assert sum(s["rows"] for s in st) == 2 * len(keys)  # every key on exactly two units
        for u, s in enumerate(st):
            mine = [k for k, p, r in zip(keys, loc.primary, loc.replica) if u in (p, r)]
            assert s["rows"] == len(mine)
        got = store.get_many(keys, list(STAGING_FIELDS))
        assert not got.failed and got.batch.keys == keys
        st2 = counters(store)
        for u in range(3):
            primaries = sum(1 for k in keys if unit_for_key(k, 3) == u)
            assert st2[u]["get_rows"] - st[u]["get_rows"] == primaries  # healthy: only primaries read
        assert sorted(store.keys()) == sorted(keys)  # listed once, not once per copy
        res = store.delete(keys)
        assert not res.failed and sorted(res.ok) == sorted(keys)
        assert sum(s["rows"] for s in counters(store)) == 0  # both copies gone
    finally:
        store.close()


def test_two_copies_need_two_workers(cluster, tmp_path):
    names = wait_for_names(cluster, ["a", "b", "c"])
    with pytest.raises(InvalidStoreRequest, match="at least 2 workers"):
        StagingStore.start(cluster, n_units=2, workers=[names["a"]], spill_directory=str(tmp_path / "s"))


def test_start_units_takes_the_copies_asked_over_the_config(cluster, tmp_path):
    names = wait_for_names(cluster, ["a", "b", "c"])
    args = unit_args_from_config(None, None, str(tmp_path / "s"))
    with pytest.raises(InvalidStoreRequest, match="at least 2 workers"):
        start_units(cluster, 2, args, [names["a"]], replicas=2)
    units, owner, placement, directory = start_units(cluster, 2, args, [names["a"], names["b"]], replicas=1)
    try:  # the config says 2 (this module's fixture); the argument wins
        assert (placement.replicas, directory, placement.unit_ids) == (1, None, ("0", "1"))
        assert len(units) == 2 and placement.workers == (names["a"], names["b"])
    finally:
        cluster.cancel(owner.futures, force=True)
    _, owner, placement, directory = start_units(cluster, 2, args, [names["a"], names["b"]])
    try:
        assert placement.replicas == 2 and directory is not None
    finally:
        cluster.cancel(owner.futures, force=True)


def test_checkpoint_of_a_replicated_store_holds_each_key_once(cluster, tmp_path):
    # Every key lives on two units; a checkpoint writes each once (from its primary), so it
    # restores (a key in two files would be refused) into a store of any replica count.
    names = wait_for_names(cluster, ["a", "b", "c"])
    store = StagingStore.start(cluster, n_units=3, workers=[names["a"], names["b"], names["c"]], spill_directory=str(tmp_path / "s"))
    try:
        rows = rows_of(make_groups("ck", n_groups=2))
        assert not store.put_many(pack_rows(rows)).failed
        manifest = store.checkpoint(str(tmp_path / "ckpt"))
        assert manifest["rows"] == len(rows)
    finally:
        store.close()
    with dask.config.set({"token-capture.store.replicas": 1}):
        fresh = StagingStore.from_checkpoint(cluster, str(tmp_path / "ckpt"), n_units=2, spill_directory=str(tmp_path / "s2"))
    try:
        got = fresh.get_many([r.staging_key for r in rows], list(STAGING_FIELDS))
        assert not got.failed and len(got.batch) == len(rows)
    finally:
        fresh.close()


# ---- units killed (last in the module: the nannies restart what it kills) ----------------


def test_units_killed_mid_put_get_and_finalize_lose_nothing(cluster, tmp_path):
    names = wait_for_names(cluster, ["a", "b", "c"])
    # Reference: the same rollouts finalized by an unreplicated store with no fault.
    groups = make_groups("rep", seed=11)
    with dask.config.set({"token-capture.store.replicas": 1}):
        plain = StagingStore.start(cluster, n_units=2, workers=[names["a"], names["b"]], spill_directory=str(tmp_path / "p"))
        try:
            assert not plain.put_many(pack_rows(rows_of(groups))).failed
            reference = finalize(cluster, plain, groups, "reference")
        finally:
            plain.close()

    store = StagingStore.start(cluster, n_units=2, workers=[names["a"], names["b"]], spill_directory=str(tmp_path / "r"))
    try:
        rows = rows_of(groups)
        keys = [r.staging_key for r in rows]
        # 1. Mid-put: unit 1's worker dies while the put is in flight. The keys with a copy
        # there fail unit_unavailable; after re-replication a retry completes them.
        hang_unit(cluster, store, 1, "put_many", str(tmp_path / "put.pid"))
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("res", store.put_many(pack_rows(rows))))
        t.start()
        kill_when_hung(str(tmp_path / "put.pid"))
        t.join(60)
        res = box["res"]
        assert set(res.failed) and {r for r, _ in res.failed.values()} == {"unit_unavailable"}
        wait_repaired(store, 1)
        res = store.put_many(pack_rows([r for r in rows if r.staging_key in res.failed]))
        assert not res.failed, list(res.failed.items())[:2]
        assert sum(s["rows"] for s in counters(store)) == 2 * len(keys)

        # 2. Mid-get: the (new) unit 1 dies during a get; its keys are re-read from replicas.
        hang_unit(cluster, store, 1, "get_many", str(tmp_path / "get.pid"))
        t = threading.Thread(target=lambda: box.__setitem__("got", store.get_many(keys, list(STAGING_FIELDS))))
        t.start()
        kill_when_hung(str(tmp_path / "get.pid"))
        t.join(60)
        got = box["got"]
        assert not got.failed and got.batch.keys == keys
        wait_repaired(store, 2)

        # 3. Mid-finalization: unit 0's worker dies during the step's union fetch.
        hang_unit(cluster, store, 0, "get_many", str(tmp_path / "fin.pid"))
        fin = Finalizer(cluster, store, vocab_size=VOCAB, num_experts=E)
        handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id="mid-finalize")
        kill_when_hung(str(tmp_path / "fin.pid"))
        assert_same_step(handle.result(timeout=120), reference, groups)
        wait_repaired(store, 3)

        # 4. After re-replication finished, another unit is lost: still nothing lost.
        victim = store.unit_workers[1]
        pid = cluster.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        assert_same_step(finalize(cluster, store, groups, "after-second-loss"), reference, groups)
        wait_repaired(store, 4)
        assert sum(s["rows"] for s in counters(store)) == 2 * len(keys)
        assert_same_step(finalize(cluster, store, groups, "after-repair"), reference, groups)
    finally:
        store.close()
