"""A cut's puts in flight while its next batch packs (``cut.puts-in-flight``).

:class:`PutWindow` on its own (answers in sending order, never more than its size on the
wire, size 1 on the caller's thread), and a cut run inside a Dask worker process whose
store handle was never used before the cut: the puts a helper thread sends must reach
the units as the cut's own thread would (counted by the units' own ``puts`` counters,
and no row retried alone). Nothing here asserts on time.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from pipeline.generation import CallBuffer, run_cut
from pipeline.generation.cut import CutSettings, puts_in_flight_from_config
from pipeline.generation.put_window import PutWindow
from tasks.cut.batching import BatchLimits
from tasks.cut.receipt import DURABLE_PREFIX

pytestmark = pytest.mark.timeout(180)


def test_answers_come_back_in_sending_order_with_at_most_size_outstanding():
    window: PutWindow[int, int] = PutWindow(2)
    gates = [threading.Event() for _ in range(4)]
    running, most = [0], [0]
    lock = threading.Lock()

    def put(i: int):
        def run() -> int:
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            gates[i].wait(30)
            with lock:
                running[0] -= 1
            return i * 10
        return run

    gates[1].set()  # the second put ends first: its answer still waits for the first's
    assert window.send(put(0), 0) == [] and len(window) == 1
    threading.Timer(0.2, gates[0].set).start()
    assert window.send(put(1), 1) == [(0, 0)], "the oldest is answered once two are out"
    gates[2].set()
    gates[3].set()
    got = window.send(put(2), 2) + window.send(put(3), 3) + window.drain()
    assert got == [(1, 10), (2, 20), (3, 30)] and len(window) == 0
    assert most[0] <= 2


def test_size_one_puts_on_the_callers_thread_and_a_size_below_one_is_refused():
    window: PutWindow[str, str] = PutWindow(1)
    assert window.send(lambda: threading.current_thread().name, "a") == [("a", threading.current_thread().name)]
    with pytest.raises(ValueError, match="at least 1"):
        PutWindow(0)


def test_the_setting_is_read_once_into_the_generation_workers_cut_settings():
    import dask

    with dask.config.set({"token-capture.cut.puts-in-flight": 3}):
        assert CutSettings.from_config().puts_in_flight == 3
    with dask.config.set({"token-capture.cut.puts-in-flight": 0}), pytest.raises(ValueError, match="cut.puts-in-flight"):
        puts_in_flight_from_config()


def _cut_in_worker(store, n_calls: int, rows_per_put: int) -> dict:
    """Runs in a worker's task thread: ``store`` arrives unpickled (its actor handles not
    bound yet), so the cut's first put, sent by a helper thread, binds them."""
    bufs = []
    for i in range(n_calls):
        b = CallBuffer(f"w{i}", "call-0", np.arange(4, dtype=np.int64))
        b.append(np.arange(6, dtype=np.int64), -np.ones(6, dtype=np.float32))
        bufs.append(b)
    receipt, stats = run_cut([(b.call, b) for b in bufs], store, checkpoint_id="win", inventory_digest=b"",
                             limits=BatchLimits(rows_per_put, 1 << 22, 1 << 28), puts_in_flight=2)
    return {"counts": receipt.counts(), "put_calls": stats.put_calls, "delete_calls": stats.delete_calls,
            "helpers": sorted({t.name.split("_")[0] for t in threading.enumerate() if t.name.startswith("cut-put")})}


def test_a_cut_in_a_worker_sends_its_pipelined_puts_from_helpers_that_reach_the_units(store_factory, cluster_client):
    store = store_factory(n_units=2, memory_limit="64MiB")
    before = sum(s["puts"] for s in store.stats())
    out = cluster_client.submit(_cut_in_worker, store, 6, 2, pure=False).result(timeout=120)
    assert out["counts"] == {DURABLE_PREFIX: 6}
    assert out["put_calls"] == 3 and out["delete_calls"] == 0, "no batch failed and was retried row by row"
    assert out["helpers"] == ["cut-put"], "the puts after the first went through the helpers"
    # The units' own counters: 3 batches over 2 units, each batch one call per unit it touches.
    puts = sum(s["puts"] for s in store.stats()) - before
    assert 3 <= puts <= 6
    keys = set(store.keys("cut"))
    assert keys == {f"__cut__/win/w{i}/call-0/0" for i in range(6)}


def test_waiting_for_a_put_leaves_the_cpu_slot():
    left = []
    window: PutWindow[int, int] = PutWindow(2, wait=lambda: left.append(True))
    release = threading.Event()
    window.send(lambda: (release.wait(30), 1)[1], 1)
    threading.Timer(0.1, release.set).start()
    assert window.drain() == [(1, 1)] and left == [True]


def test_only_puts_with_work_left_to_overlap_go_to_a_helper(monkeypatch):
    """A cut's last batch (nothing left to freeze or flush) is put from the cut's own
    thread, after the older answers: a one-batch cut hands no put to a helper, a
    three-batch cut hands two."""
    from pipeline.store.protocol import StoreResult

    class Store:
        def put_many(self, batch, partition="", adopt=False, timeout=None):
            threads.append(threading.current_thread().name)
            return StoreResult(ok=list(batch.keys))

        def delete(self, keys, partition="", timeout=None):
            return StoreResult(ok=list(keys))

    threads: list[str] = []
    for n_calls, helped in ((2, 0), (6, 2)):
        threads.clear()
        bufs = []
        for i in range(n_calls):
            b = CallBuffer(f"h{n_calls}-{i}", "call-0", np.arange(4, dtype=np.int64))
            b.append(np.arange(6, dtype=np.int64), -np.ones(6, dtype=np.float32))
            bufs.append(b)
        receipt, stats = run_cut([(b.call, b) for b in bufs], Store(), checkpoint_id="own", inventory_digest=b"",
                                 limits=BatchLimits(2, 1 << 22, 1 << 28), puts_in_flight=2)
        assert receipt.counts() == {DURABLE_PREFIX: n_calls} and stats.put_calls == len(threads) == n_calls // 2
        assert sum(t.startswith("cut-put") for t in threads) == helped, threads
        assert not threads[-1].startswith("cut-put"), "the last put ran on the cut's thread"
