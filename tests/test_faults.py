"""Worker and storage-unit loss while finalizing.

One process cluster (``SpecCluster`` of nannies, the machinery under ``LocalCluster``)
with named workers, so a test can find a worker again after its nanny restarted it:

    store     hosts the storage units; no ``finalize`` slot, so no verify task runs there
    v0, v1    ``finalize`` slots: verify (and, in one test, fetch) tasks run here

A fault is injected by wrapping a graph task body on the verify workers (``client.run``)
so that the FIRST call anywhere claims a marker file (O_EXCL), writes its pid and hangs;
the test then SIGKILLs that pid, i.e. the worker dies while the task is in flight. The
nanny restarts a fresh worker (without the wrapper) and Dask reschedules the task.
"""
from __future__ import annotations

import os
import signal
import time

import dask
import numpy as np
import pytest
from rollout_factory import make_group
from support import named_nanny_cluster, wait_for_names, wait_replaced

from pipeline.finalize import Finalizer
from pipeline.store import StagingStore
from pipeline.store.protocol import UNIT_UNAVAILABLE
from tasks import reasons
from tasks.keys import unit_for_key
from tasks.packed import pack_rows
from tasks.schema import STAGING_FIELDS

pytestmark = [pytest.mark.usefixtures("keep_staged_rows"), pytest.mark.timeout(180), pytest.mark.slow]



VOCAB, L, K, E = 64, 2, 2, 8


@pytest.fixture(scope="module")
def fault_cluster():
    workers = {"store": {}, "v0": {"resources": {"finalize": 2}}, "v1": {"resources": {"finalize": 2}}}
    with named_nanny_cluster(workers) as client:
        yield client








# ---- fault injection (runs inside worker processes via client.run) ----------------------


def _install_hang(marker: str, target: str) -> int:
    """Wrap ``pipeline.finalize.worker_tasks.<target>``: the first call (cluster-wide, by
    an O_EXCL marker file) writes its pid to ``marker`` and hangs until killed."""
    import pipeline.finalize.worker_tasks as worker_tasks

    orig = getattr(worker_tasks, target)
    orig = getattr(orig, "_tc_orig", orig)

    def hang_first(*args, **kwargs):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return orig(*args, **kwargs)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep(600)  # the test kills this process long before
        return orig(*args, **kwargs)

    hang_first._tc_orig = orig
    setattr(worker_tasks, target, hang_first)
    return os.getpid()


def kill_when_hung(marker: str, timeout: float = 60.0) -> int:
    """Wait for the hung task's marker, SIGKILL its worker process; returns the pid."""
    deadline = time.monotonic() + timeout
    while not (os.path.exists(marker) and os.path.getsize(marker)):
        assert time.monotonic() < deadline, "no task reached the fault injection point"
        time.sleep(0.02)
    pid = int(open(marker).read())
    os.kill(pid, signal.SIGKILL)
    return pid


# ---- helpers ------------------------------------------------------------------------------


def stage(store, builts):
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed


def expected_row(built):
    rows = [built.row(c) for c in built.chain_ids]
    return np.concatenate([r.token_ids for r in rows]), np.concatenate([r.logprobs for r in rows])


def assert_exactly_once(step, groups):
    """Every rollout finalized, once, in its slot, with its own tokens."""
    assert list(step.groups) == list(groups)
    seen = []
    for gid, builts in groups.items():
        g = step.groups[gid]
        assert g.status == ["ok"] * len(builts), g.status
        assert g.input_ids.shape[0] == len(builts)  # no duplicate and no missing row
        for i, b in enumerate(builts):
            ids, lps = expected_row(b)
            n = int(g.input_lengths[i])
            assert n == len(ids)
            np.testing.assert_array_equal(g.input_ids[i, :n].numpy(), ids)
            np.testing.assert_array_equal(g.logprobs[i, :n].numpy(), lps)
            seen.append(b.rollout_id)
    assert len(seen) == len(set(seen))
    assert step.metrics["accepted"] == len(seen)


def make_groups(tag: str, n_groups: int = 4, per_group: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        f"g{g}": make_group(rng, f"g{g}", per_group, rollout_prefix=f"{tag}g{g}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
        for g in range(n_groups)
    }


# ---- item 1: worker loss mid-finalize ------------------------------------------------------


@pytest.mark.parametrize("target", ["verify_piece", "fetch_pieces"])
def test_worker_killed_mid_task_step_completes_exactly_once(fault_cluster, tmp_path, target):
    client = fault_cluster
    names = wait_for_names(client, ["store", "v0", "v1"])
    store = StagingStore.start(client, n_units=2, workers=[names["store"]], spill_directory=str(tmp_path / "spill"))
    try:
        groups = make_groups(target)
        for bs in groups.values():
            stage(store, bs)
        graph_store = store
        if target == "fetch_pieces":
            # The fetch prefers the unit-hosting workers (soft affinity). Point that hint at
            # the verify workers so the fetch runs on a worker we may kill without losing
            # the units themselves (as with a stale hint after units moved).
            graph_store = StagingStore(store.units, [names["v0"], names["v1"]], store.partitions)
        marker = str(tmp_path / f"{target}.pid")
        pids = client.run(_install_hang, marker, target, workers=[names["v0"], names["v1"]])
        # Small verify budget: several verify tasks, so the step is really spread out.
        with dask.config.set({"token-capture.finalize.verify-token-budget": 64}):
            fin = Finalizer(client, graph_store, vocab_size=VOCAB, num_experts=E)
            handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id=f"kill-{target}")
        killed = kill_when_hung(marker)
        assert killed in pids.values()  # a verify worker, never the store's
        step = handle.result(timeout=120)
        assert_exactly_once(step, groups)
        # The killed worker really died and was replaced; the units never moved.
        after = wait_for_names(client, ["store", "v0", "v1"])
        assert killed not in client.run(os.getpid).values()
        assert after["store"] == names["store"]
        assert sum(s["rows"] for s in store.stats()) == sum(len(b.rows) for bs in groups.values() for b in bs)
    finally:
        store.close()


# ---- item 2: storage unit loss --------------------------------------------------------------


def test_storage_unit_lost_rejects_its_rollouts_and_checkpoint_restores(fault_cluster, tmp_path):
    client = fault_cluster
    names = wait_for_names(client, ["store", "v0", "v1"])
    # unit 0 on the store worker, unit 1 on v1 (which we kill).
    store = StagingStore.start(client, n_units=2, workers=[names["store"], names["v1"]], spill_directory=str(tmp_path / "spill"))
    replacement = None
    try:
        groups = make_groups("unitloss", seed=7)
        builts = [b for bs in groups.values() for b in bs]
        for bs in groups.values():
            stage(store, bs)
        lost_unit = 1
        on_lost = {b.rollout_id for b in builts if unit_for_key(b.receipt.calls[0].staging_key, 2) == lost_unit}
        assert 0 < len(on_lost) < len(builts)  # both kinds present, or the test proves nothing
        manifest = store.checkpoint(str(tmp_path / "ckpt"))
        assert manifest["rows"] == sum(len(b.rows) for b in builts)

        victim = client.run(os.getpid, workers=[names["v1"]])[names["v1"]]
        os.kill(victim, signal.SIGKILL)
        wait_replaced(client, "v1", names["v1"])

        # The step completes: rollouts on the lost unit are rejected with a reason naming
        # the loss, every other rollout finalizes; groups keep their shape.
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E, keep_intermediates=True)
        handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id="unit-lost")
        verify_outs = client.gather(handle.graph.verify_futures)
        step = handle.result(timeout=120)
        # The rejection names the loss, not only the missing row.
        lost_details = [r.detail for vo in verify_outs for r in vo.results.values() if r.rollout_id in on_lost]
        assert len(lost_details) == len(on_lost)
        assert all(UNIT_UNAVAILABLE in d and "storage unit 1" in d for d in lost_details), lost_details[:2]
        for gid, bs in groups.items():
            g = step.groups[gid]
            assert g.input_ids.shape[0] == len(bs)
            for i, b in enumerate(bs):
                if b.rollout_id in on_lost:
                    assert g.status[i] == reasons.MISSING_STAGING_ROW
                    assert float(g.sample_mask[i]) == 0.0
                else:
                    assert g.status[i] == reasons.OK
                    ids, _ = expected_row(b)
                    np.testing.assert_array_equal(g.input_ids[i, : len(ids)].numpy(), ids)
        assert step.rejected == {reasons.MISSING_STAGING_ROW: len(on_lost)}

        # The store keeps serving from the remaining unit: reads and writes there work,
        # keys of the lost unit fail per key with unit_unavailable (never the whole call).
        keys = [r.staging_key for b in builts for r in b.rows]
        got = store.get_many(keys, list(STAGING_FIELDS))
        lost_keys = {k for k in keys if k.split("/")[0] in on_lost}
        assert set(got.batch.keys) == set(keys) - lost_keys
        assert set(got.failed) == lost_keys
        assert {r for r, _ in got.failed.values()} == {UNIT_UNAVAILABLE}
        assert all("unit 1" in d for _, d in got.failed.values())
        fresh = make_groups("after-loss", n_groups=1, per_group=8, seed=8)["g0"]
        res = store.put_many(pack_rows([r for b in fresh for r in b.rows]))
        fresh_lost = {r.staging_key for b in fresh for r in b.rows if unit_for_key(r.staging_key, 2) == lost_unit}
        assert set(res.failed) == fresh_lost and {r for r, _ in res.failed.values()} <= {UNIT_UNAVAILABLE}
        assert len(res.ok) == sum(len(b.rows) for b in fresh) - len(fresh_lost) > 0

        # The checkpoint brings the lost unit's rows back (onto live workers), and the
        # rejected rollouts now finalize with the same tokens.
        live = wait_for_names(client, ["store", "v0", "v1"])
        replacement = StagingStore.from_checkpoint(
            client, str(tmp_path / "ckpt"), n_units=2, workers=[live["store"], live["v0"]], spill_directory=str(tmp_path / "spill2")
        )
        back = replacement.get_many(sorted(lost_keys), list(STAGING_FIELDS))
        assert not back.failed and set(back.batch.keys) == lost_keys
        fin2 = Finalizer(client, replacement, vocab_size=VOCAB, num_experts=E)
        redo = {gid: [b for b in bs if b.rollout_id in on_lost] for gid, bs in groups.items()}
        redo = {gid: bs for gid, bs in redo.items() if bs}
        step2 = fin2.submit_step({g: [b.receipt for b in bs] for g, bs in redo.items()}, step_id="unit-restored").result(timeout=120)
        assert_exactly_once(step2, redo)
    finally:
        out = store.close()
        assert any(o.get("closed") is False for o in out)  # the lost unit reports, never raises
        if replacement is not None:
            replacement.close()
