"""A controller that dies mid-step is replaced by another process, which resubmits the
same receipts and gets the same tensors bit for bit.

Real processes on 127.0.0.1: a scheduler (with the ``pipeline.dashboard.preload`` preload,
so a store host) and 3 nanny workers (``finalize=2`` each) in this process's cluster, and
two controller processes (tests/failover_controller.py). The first starts a store hosted
by the scheduler (replicas 2), stages 4 steps of rollouts, finalizes with a step journal
(a directory: each step's receipts recorded before it is submitted), delivers step s0, lets s1 complete without collecting it, and is SIGKILLed while s2 and s3
are in flight (every ``finalize`` slot is held, so they surely are). One storage unit's worker is SIGKILLed too; the store host
re-replicates it. Until a controller has delivered a step, every row of it stays readable;
the second controller attaches by name, resumes from the journal (s1..s3 submitted again)
and writes their tensors, which equal those of a reference run of the same seeds without
kills in every field; the journal is empty once it drained.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading

import dask
import pytest
import torch

from failover_controller import HOLD, ROUTES, STEPS, VOCAB, build_steps
from step_tensors import assert_identical, n_fields, step_tensors
from support import assert_rows_read_back, preloaded_nanny_cluster, wait_until

from pipeline.client.discovery import lookup_store
from pipeline.finalize import Finalizer
from pipeline.store.client import StagingStore
from pipeline.store.hosted import close_hosted, hosted_stores
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(180)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "failover_controller.py")
NAME, SEED = "failover-store", 5
SETTINGS = {
    "distributed.comm.timeouts.connect": "3s",
    "token-capture.store.repair-interval-s": 0.2,
    "token-capture.store.report-interval-s": 0,
}


@pytest.fixture(scope="module")
def client():
    with preloaded_nanny_cluster("abc", SETTINGS) as c:
        yield c


def controller_env() -> dict[str, str]:
    return {**os.environ, "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")])}


def reference_run(client, steps) -> dict[str, dict]:
    """The same steps finalized without any kill: one controller (this process), a store it
    owns (replicas 1, 2 units: another placement), every step at once."""
    with dask.config.set({"token-capture.store.replicas": 1}):
        store = StagingStore.start(client, n_units=2)
    try:
        res = store.put_many(pack_rows([r for groups in steps.values() for bs in groups.values() for b in bs for r in b.rows]))
        assert not res.failed
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=ROUTES[2])
        fin.with_settings(clear_staged=False)
        handles = {sid: fin.submit_step({gid: [b.receipt for b in bs] for gid, bs in groups.items()}, step_id=f"ref-{sid}")
                   for sid, groups in steps.items()}
        return {sid: step_tensors(h.result()) for sid, h in handles.items()}
    finally:
        store.close()


def rows_of(groups) -> list:
    return [r for bs in groups.values() for b in bs for r in b.rows]


assert_readable = assert_rows_read_back


def readable(store, rows) -> set[str]:
    return set(store.get_many([r.staging_key for r in rows], ["token_ids"]).batch.keys)


def start_first(client, state: str, out: str, log) -> tuple[subprocess.Popen, str]:
    """The first controller, and its ``complete ... in-flight ...`` line once it printed it."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "first", client.scheduler.address, NAME, str(SEED), state, out],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=controller_env())
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=90)
        except queue.Empty:
            raise AssertionError("the first controller printed no in-flight marker") from None
        if line.startswith("complete"):
            return proc, line.strip()


def test_a_killed_controller_is_replaced_and_its_steps_come_back_bit_for_bit(client, tmp_path):
    from distributed import Event

    steps = build_steps(SEED)
    reference = reference_run(client, steps)
    state, out_first, out_second = (str(tmp_path / n) for n in ("journal", "first.pt", "second.pt"))
    delivered, complete, running = "s0", "s1", [f"s{s}" for s in range(2, STEPS)]
    in_flight = [complete, *running]  # undelivered: the second controller resubmits them
    with open(tmp_path / "first.log", "w") as log:
        proc, marker = start_first(client, state, out_first, log)
        try:
            assert marker == f"complete {complete} in-flight {','.join(running)} pending={sum(len(steps[s]) for s in running)}"
        finally:
            os.kill(proc.pid, signal.SIGKILL)  # s1 complete but not delivered, s2 and s3 mid-step
            proc.wait(30)
    try:
        Event(HOLD, client=client).set()  # the dead controller's slot holders end
        store = lookup_store(client, NAME)
        assert store.owner is None  # the scheduler owns it, not the dead controller
        # s0 was delivered, so it was cleared; nothing of the undelivered steps was (s1's
        # graph completed: completion alone clears nothing).
        assert readable(store, rows_of(steps[delivered])) == set()
        in_flight_rows = [r for s in in_flight for r in rows_of(steps[s])]
        assert_readable(store, in_flight_rows)

        # A storage unit's worker dies too: the store host re-replicates it.
        victim = store.unit_workers[0]
        pid = client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: any(s["name"] == NAME and s["repaired"] for s in hosted_stores(client)), 90, "the unit re-replicated")
        fresh = wait_until(lambda: (h := lookup_store(client, NAME)).version > store.version and h, 30, "the repaired table")
        assert victim not in fresh.unit_workers or len(set(fresh.unit_workers)) == 3
        assert_readable(fresh, in_flight_rows)  # nothing deleted before a controller delivered
        assert sum(s["rows"] for s in fresh.stats()) == 2 * len(in_flight_rows)  # both copies again

        second = subprocess.run([sys.executable, SCRIPT, "second", client.scheduler.address, NAME, state, out_second],
                                capture_output=True, text=True, timeout=120, env=controller_env(), check=False)
        assert second.returncode == 0 and f"delivered {','.join(in_flight)}" in second.stdout, (second.stdout, second.stderr[-3000:])

        with open(out_first, "rb") as f1, open(out_second, "rb") as f2:
            got = {**torch.load(f1, weights_only=True), **torch.load(f2, weights_only=True)}
        assert sorted(got) == sorted(reference) == [f"s{s}" for s in range(STEPS)]
        for sid in reference:
            assert_identical(reference[sid], got[sid], sid)
            for gid, group in got[sid]["groups"].items():
                assert group["status"] == ["ok"] * len(steps[sid][gid]), (sid, gid, group["details"])
        assert n_fields(got) == STEPS * n_fields(reference["s0"]) > 0
        # Delivered, so cleared: every row of the resubmitted steps is gone now.
        assert readable(fresh, in_flight_rows) == set()
        assert sum(s["rows"] for s in fresh.stats()) == 0
        assert not [n for n in os.listdir(state) if n.startswith("step-")]  # nothing left to resume
    finally:
        if NAME in [s["name"] for s in hosted_stores(client)]:
            close_hosted(client, NAME)
