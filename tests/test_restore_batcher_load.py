"""PrefixReadBatcher under light load and under load, on a real 2-worker LocalCluster: a
lone request is issued at once (never after the window), requests arriving while every
slot is busy merge into few store gets (counted by the storage units themselves), a bad
request fails alone, and a caller on the batcher's own worker reaches it in-process.

Requests are made concurrent by ordering (issued in successive loop turns while gets are
in flight), never by sleeping; no test asserts on elapsed time.
"""
from __future__ import annotations

import asyncio
import sys

import cloudpickle
import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.actors import start_pinned_actors, workers_now
from pipeline.generation.call_buffer import CallBuffer
from pipeline.restore.batcher import PrefixReadBatcher, local_batcher
from pipeline.store.client import StagingStore
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)

# The Caller actor below runs on the workers: ship this module by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

HOUR_MS = 3_600_000.0  # a window nobody waits out: a read that waited for it would hang the test


class Caller:
    """Test actor: a generation worker's stand-in, reading through its worker's batcher."""

    async def is_local(self, batcher) -> bool:
        return isinstance(local_batcher(batcher), PrefixReadBatcher)

    async def reads(self, batcher, requests: list[list[str]]) -> list:
        """Each request started in its own loop turn (the earlier ones' gets still in
        flight); per request its keys read back, or ``{key: (reason, detail)}``."""
        from pipeline.restore import PrefixReadError

        b = local_batcher(batcher)

        async def one(ks):
            try:
                return list((await b.read(ks)).keys)
            except PrefixReadError as e:
                return dict(e.failed)

        tasks = []
        for ks in requests:
            tasks.append(asyncio.ensure_future(one(ks)))
            await asyncio.sleep(0)  # one loop turn: the previous request has been dispatched
        return list(await asyncio.gather(*tasks))


@pytest.fixture(scope="module")
def rig():
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
    ) as lc, Client(lc) as client:
        store = StagingStore.start(client, n_units=2)
        workers = sorted(workers_now(client))
        callers, _futures = start_pinned_actors(client, Caller, workers)
        yield client, store, workers, callers
        store.close()


def stage(store, tag: str, n: int) -> list[str]:
    """``n`` one-chunk cut rows (real CallBuffer freezes); their keys."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        buf = CallBuffer(f"{tag}-r{i}", "c0", rng.integers(0, 64, 8))
        buf.append(rng.integers(0, 64, 16), -rng.random(16).astype(np.float32))
        frozen = buf.freeze(tag)
        rows.append((frozen.key, frozen.row))
    batch = pack_rows([r for _, r in rows])
    batch.keys = [k for k, _ in rows]
    assert not store.put_many(batch, partition="cut").failed
    return batch.keys


def unit_gets(store) -> int:
    """Gets the storage units themselves have served so far."""
    return sum(s["gets"] for s in store.stats())


def batcher_on(client, store, worker: str, **knobs):
    (b,), futures = start_pinned_actors(client, PrefixReadBatcher, [worker], args=[(store,)], **knobs)
    return b, futures


def test_a_lone_request_is_issued_at_once_not_after_the_window(rig):
    client, store, workers, callers = rig
    keys = stage(store, "lone", 3)
    b, _keep = batcher_on(client, store, workers[0], window_ms=HOUR_MS)
    before = unit_gets(store)
    for k in keys:  # one after the other: no load at all
        assert b.read([k]).result(timeout=60).keys == [k]
    # Through the worker-side path as well (the in-process call).
    assert callers[0].reads(b, [[keys[0]]]).result(timeout=60) == [[keys[0]]]
    s = b.stats().result()
    assert s["immediate_gets"] == 4 and s["window_waits"] == 0 and s["gets"] == 4
    assert unit_gets(store) - before == 4  # one store get per request, as per-request reads


def test_requests_arriving_while_every_slot_is_busy_share_gets(rig):
    client, store, workers, callers = rig
    keys = stage(store, "busy", 24)
    # One slot: while the first get is in flight, every later request queues and they go
    # together when it frees (eager-inflight 1 = max-concurrent-gets: no window involved).
    b, _keep = batcher_on(client, store, workers[1], window_ms=HOUR_MS, max_concurrent=1, eager_inflight=1)
    before = unit_gets(store)
    requests = [[k] for k in keys]
    assert callers[1].reads(b, requests).result(timeout=60) == requests
    served = unit_gets(store) - before
    s = b.stats().result()
    assert s["requests"] == 24 and s["gets"] == served
    assert served < 24 // 2, f"{served} store gets for 24 requests"
    assert s["slot_waits"] >= 1 and s["window_waits"] == 0
    assert s["keys_per_get"] > 2


def test_a_burst_is_one_get_per_storage_unit(rig):
    client, store, workers, _ = rig
    keys = stage(store, "burst", 32)
    b, _keep = batcher_on(client, store, workers[0])
    before = unit_gets(store)
    rows = b.read(keys).result(timeout=60)
    assert rows.keys == keys
    assert unit_gets(store) - before <= len(store.units)  # 32 keys, each unit asked once


def test_a_bad_request_fails_alone(rig):
    client, store, workers, callers = rig
    keys = stage(store, "bad", 6)
    b, _keep = batcher_on(client, store, workers[0], max_concurrent=1, eager_inflight=1)
    gone = "__cut__/bad/never-written/c0/0"
    requests = [[keys[0]], [keys[1], gone], [keys[2], keys[3]], [keys[4]], [gone], [keys[5]]]
    out = callers[0].reads(b, requests).result(timeout=60)
    assert out[0] == [keys[0]] and out[2] == [keys[2], keys[3]] and out[3] == [keys[4]] and out[5] == [keys[5]]
    for bad in (out[1], out[4]):
        assert list(bad) == [gone] and bad[gone][0] == "missing_key"


def test_local_batcher_is_in_process_only_on_its_own_worker(rig):
    client, store, workers, callers = rig
    b, _keep = batcher_on(client, store, workers[0])
    assert local_batcher(b) is b  # on the client: the handle
    assert callers[0].is_local(b).result(timeout=60) is True  # the batcher's own worker
    assert callers[1].is_local(b).result(timeout=60) is False  # another worker: the handle
