"""A controller process for tests/test_controller_failover.py: one that dies mid-step, and
the one that replaces it.

    python tests/failover_controller.py first SCHEDULER NAME SEED JOURNAL OUT
    python tests/failover_controller.py second SCHEDULER NAME JOURNAL OUT

``first``: starts a store hosted by the scheduler (``start_hosted``, replicas 2, 3 units)
under NAME, stages the rollouts of SEED (:func:`build_steps`), and finalizes through a
Finalizer whose step journal is the directory JOURNAL (each step's receipts recorded
there before it is submitted: they are the controller's only state); delivers the first
step (OUT: its tensors, ``torch.save``), lets the second step's graph complete without collecting it,
then occupies every ``finalize`` slot of the cluster with tasks waiting on the Dask event
:data:`HOLD` (so the next steps surely stay in flight), submits the other steps and
prints ``complete <id> in-flight <ids> pending=<groups>``. It then waits to be killed
(SIGKILL).

``second``: attaches to the store by NAME (``Finalizer.attach``) with the same journal,
``resume()``s (every step the journal holds undelivered is submitted again, all at once),
collects them, writes their tensors to OUT (``torch.save``), drains (their clears, and
the first step's rows the journal still owed) and prints ``delivered <ids>``.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
HOLD = "failover-controller-hold"  # the Dask event the slot holders wait on
VOCAB, ROUTES = 64, (2, 2, 8)  # tokens in [0, 64); routes (layers, top-k, experts)
STEPS, GROUPS, ROLLOUTS = 4, 2, 3  # steps of groups of rollouts


def build_steps(seed: int) -> dict[str, dict[str, list]]:
    """Step id -> group id -> the rollouts (``Built``: rows and receipt) of ``seed``: the
    same in every process."""
    sys.path.insert(0, HERE)
    from rollout_factory import make_group

    rng = np.random.default_rng(seed)
    return {
        f"s{s}": {f"f{seed}s{s}g{g}": make_group(rng, f"f{seed}s{s}g{g}", ROLLOUTS, n_calls=3, routes=ROUTES, n_branches=g % 2)
                  for g in range(GROUPS)}
        for s in range(STEPS)
    }


def save_atomically(path: str, write) -> None:
    """``write(file)`` to a temporary file next to ``path``, then rename it over ``path``."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def hold_slot(name: str) -> None:
    """A task holding one ``finalize`` slot until the event ``name`` is set."""
    from distributed import Event

    Event(name).wait()


def hold_every_slot(client) -> list:
    """One holder per ``finalize`` slot of the cluster; returns once each holds its slot."""
    from pipeline.actors import workers_now

    workers = workers_now(client)
    n = int(sum(w.get("resources", {}).get("finalize", 0) for w in workers.values()))
    holders = [client.submit(hold_slot, HOLD, key=f"failover-hold-{i}", resources={"finalize": 1}, pure=False) for i in range(n)]

    def assigned(dask_scheduler, keys):
        return all(k in dask_scheduler.tasks and dask_scheduler.tasks[k].state == "processing" for k in keys)

    while not client.run_on_scheduler(assigned, keys=[h.key for h in holders]):
        time.sleep(0.05)
    return holders


def first(scheduler: str, name: str, seed: int, journal: str, out: str) -> None:
    import dask
    import torch
    from distributed import Client, wait

    from pipeline.finalize import Finalizer
    from pipeline.store.hosted import start_hosted
    from step_tensors import step_tensors
    from tasks.packed import pack_rows

    client = Client(scheduler, set_as_default=True)
    with dask.config.set({"token-capture.store.replicas": 2}):
        store = start_hosted(client, name, n_units=3)
    steps = build_steps(seed)
    res = store.put_many(pack_rows([r for groups in steps.values() for bs in groups.values() for b in bs for r in b.rows]))
    assert not res.failed, list(res.failed.items())[:3]
    receipts = {sid: {gid: [b.receipt for b in bs] for gid, bs in groups.items()} for sid, groups in steps.items()}
    fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=ROUTES[2], journal=journal)
    fin.with_settings(clear_staged=True)
    (delivered, *rest) = list(receipts)
    handle = fin.submit_step(receipts[delivered], step_id=delivered)
    result = handle.result()  # delivered: its rows are cleared now
    save_atomically(out, lambda f: torch.save({delivered: step_tensors(result)}, f))
    handle.clear_future.result()
    (complete, *rest) = rest
    done = fin.submit_step(receipts[complete], step_id=complete)
    wait(done.futures)  # every group computed, none delivered (no result() call)
    holders = hold_every_slot(client)  # held (referenced) until this process dies
    handles = [fin.submit_step(receipts[sid], step_id=sid) for sid in rest]
    print(f"complete {complete} in-flight {','.join(h.step_id for h in handles)} pending={fin.queue_depth}", flush=True)
    while holders:  # the test kills this process here
        time.sleep(1)


def second(scheduler: str, name: str, journal: str, out: str) -> None:
    import torch
    from distributed import Client

    from pipeline.finalize import Finalizer
    from step_tensors import step_tensors

    client = Client(scheduler, set_as_default=True)
    fin = Finalizer.attach(client, name, vocab_size=VOCAB, num_experts=ROUTES[2], journal=journal)
    fin.with_settings(clear_staged=True)
    handles = fin.resume()
    results = {h.step_id: step_tensors(h.result()) for h in handles}
    save_atomically(out, lambda f: torch.save(results, f))
    fin.drain(timeout=60)  # the clears run on the cluster: wait, or exiting may drop them
    print(f"delivered {','.join(results)}", flush=True)
    client.close()


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "first":
        first(args[0], args[1], int(args[2]), args[3], args[4])
    elif mode == "second":
        second(args[0], args[1], args[2], args[3])
    else:
        raise SystemExit(f"unknown mode {mode!r}: expected first or second")
