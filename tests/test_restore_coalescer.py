"""PrefixReadCoalescer: the pure-asyncio core of restore reads, against a fake store.

The fake store records every get_many call; the window timer is driven by hand, so no
test depends on wall-clock timing. The Dask actor over a real StagingStore is exercised
in tests/test_restore_batcher.py.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest

from pipeline.restore.coalescer import PrefixReadCoalescer, PrefixReadError
from tasks.packed import PackedBatch, concat_aligned

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeResult:
    batch: PackedBatch
    failed: dict = field(default_factory=dict)


def make_row(key: str, n: int, routes: bool = False) -> dict:
    seed = sum(key.encode())
    row = {
        "token_ids": np.arange(seed, seed + n, dtype=np.int64),
        "token_mask": np.ones(n, dtype=np.float32),
        "prev_len": np.array([seed], dtype=np.int64),
    }
    if routes:
        row["routed_experts"] = np.full((n, 2, 2), seed % 7, dtype=np.int16)
    return row


class FakeStore:
    """An async get_many over an in-memory dict, with failure and hang hooks."""

    def __init__(self, rows: dict[str, dict]):
        self.rows = rows
        self.calls: list[list[str]] = []
        self.poison: set[str] = set()  # a multi-key get containing one of these raises
        self.poison_alone: set[str] = set()  # these raise even alone
        self.hang: set[str] = set()  # a get containing one of these never returns
        self.gate: asyncio.Event | None = None  # when set, every get waits for it
        self.started = asyncio.Event()

    async def get_many(self, keys: list[str]) -> FakeResult:
        self.calls.append(list(keys))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if self.hang & set(keys):
            await asyncio.Event().wait()
        if self.poison_alone & set(keys) or (len(keys) > 1 and self.poison & set(keys)):
            raise RuntimeError("unit crashed serving a bad row")
        found = [k for k in keys if k in self.rows]
        failed = {k: ("missing_key", f"{k} not staged") for k in keys if k not in self.rows}
        return FakeResult(PackedBatch.from_rows(found, [self.rows[k] for k in found]) if found else PackedBatch([], {}), failed)


class ManualTimer:
    """Stands in for loop.call_later: windows fire only when the test says so."""

    def __init__(self):
        self.pending: list[list] = []

    def __call__(self, delay, callback):
        entry = [delay, callback, False]
        self.pending.append(entry)

        class Handle:
            def cancel(self_inner):
                entry[2] = True

        return Handle()

    def fire(self) -> int:
        fired = 0
        for entry in list(self.pending):
            self.pending.remove(entry)
            if not entry[2]:
                entry[1]()
                fired += 1
        return fired


def rows_for(keys, n=4):
    return {k: make_row(k, n) for k in keys}


async def settle(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(coro)


def test_single_request_issues_immediately_without_window():
    async def main():
        store = FakeStore(rows_for(["a", "b"]))
        timer = ManualTimer()
        # A window of an hour: if the read waited for it, it would never finish.
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 3_600_000.0, 4, 30.0, timer=timer)
        out = await c.read(["b", "a"])
        assert out.keys == ["b", "a"]
        assert store.calls == [["b", "a"]]
        assert timer.pending == []  # no window was ever opened
        assert c.stats.window_waits == 0 and c.stats.immediate_gets == 1
        # Light load: each request alone, one after the other, each immediate.
        for _ in range(3):
            await c.read(["a"])
        assert c.stats.window_waits == 0 and c.stats.immediate_gets == 4 and c.stats.gets == 4

    run(main())


def test_same_tick_burst_shares_one_get_and_keeps_chain_order():
    async def main():
        keys = [f"r{i}/c" for i in range(10)]
        store = FakeStore(rows_for(keys))
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        requests = [keys[0:3][::-1], keys[2:6], keys[5:10], [keys[9], keys[0], keys[9]]]
        outs = await asyncio.gather(*(c.read(r) for r in requests))
        assert len(store.calls) == 1
        assert sorted(store.calls[0]) == sorted(keys)  # deduplicated: each key read once
        assert len(store.calls[0]) == len(set(store.calls[0]))
        for req, out in zip(requests, outs):
            assert out.keys == req
            for i, k in enumerate(req):
                np.testing.assert_array_equal(out.fields["token_ids"].row(i), store.rows[k]["token_ids"])
        assert c.stats.keys_deduplicated == 4

    run(main())


def test_window_coalesces_while_a_get_is_in_flight_and_dedups_against_it():
    async def main():
        keys = [f"k{i}" for i in range(6)]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        timer = ManualTimer()
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=timer)
        first = asyncio.create_task(c.read(["k0", "k1"]))
        await store.started.wait()
        assert store.calls == [["k0", "k1"]]
        # A get is in flight: these wait for the window and share one get; k1 is already
        # being read, so it is not read again.
        later = [asyncio.create_task(c.read(r)) for r in (["k2", "k1"], ["k3", "k4"], ["k5", "k2"])]
        await settle()
        assert len(store.calls) == 1 and c.stats.window_waits == 1
        assert timer.fire() == 1
        await settle()
        assert store.calls[1] == ["k2", "k3", "k4", "k5"]
        store.gate.set()
        outs = await asyncio.gather(first, *later)
        assert [o.keys for o in outs] == [["k0", "k1"], ["k2", "k1"], ["k3", "k4"], ["k5", "k2"]]
        assert len(store.calls) == 2

    run(main())


def test_batch_size_and_max_tokens_respected():
    async def main():
        keys = [f"k{i}" for i in range(10)]
        store = FakeStore(rows_for(keys))
        c = PrefixReadCoalescer(store.get_many, 4, 1 << 22, 2.0, 8, 30.0, timer=ManualTimer())
        out = await c.read(keys)
        assert out.keys == keys
        assert [len(k) for k in store.calls] == [4, 4, 2]

        store.calls.clear()
        c2 = PrefixReadCoalescer(store.get_many, 256, 250, 2.0, 8, 30.0, timer=ManualTimer())
        # 100 tokens per key: at most two keys per get; a 400-token key goes alone.
        hints = [100] * 5 + [400] + [100] * 4
        out = await c2.read(keys, tokens=hints)
        assert out.keys == keys
        per_get = [sum(hints[keys.index(k)] for k in call) for call in store.calls]
        assert all(t <= 250 or len(call) == 1 for t, call in zip(per_get, store.calls))
        assert ["k5"] in store.calls
        assert max(len(call) for call in store.calls) == 2

    run(main())


def test_bad_row_fails_only_its_requesters_and_batch_rereads_each_key_once():
    async def main():
        keys = ["a", "b", "bad", "c"]
        store = FakeStore(rows_for(keys))
        store.poison = {"bad"}  # the shared get raises; alone, only "bad" is refused
        store.poison_alone = {"bad"}
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        results = await asyncio.gather(
            c.read(["a", "b"]), c.read(["bad", "a"]), c.read(["c"]), return_exceptions=True
        )
        assert results[0].keys == ["a", "b"]
        assert results[2].keys == ["c"]
        assert isinstance(results[1], PrefixReadError)
        assert set(results[1].failed) == {"bad"}
        assert results[1].failed["bad"][0] == "read_failed"
        # One shared get, then each of its keys alone exactly once.
        assert store.calls[0] == ["a", "b", "bad", "c"]
        solo = store.calls[1:]
        assert sorted(solo) == [["a"], ["b"], ["bad"], ["c"]]
        assert c.stats.solo_rereads == 4 and c.stats.failed_requests == 1

    run(main())


def test_store_reported_missing_key_fails_only_requesters_without_reread():
    async def main():
        store = FakeStore(rows_for(["a", "b"]))
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        ok, bad = await asyncio.gather(c.read(["a", "b"]), c.read(["b", "gone"]), return_exceptions=True)
        assert ok.keys == ["a", "b"]
        assert isinstance(bad, PrefixReadError) and bad.failed == {"gone": ("missing_key", "gone not staged")}
        assert len(store.calls) == 1  # the store answered per key: nothing to re-read

    run(main())


def test_cancelling_one_request_does_not_cancel_the_shared_get():
    async def main():
        store = FakeStore(rows_for(["a", "b", "c"]))
        store.gate = asyncio.Event()
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        # Both requests need "b", the first key of the one that gets cancelled.
        t1 = asyncio.create_task(c.read(["b", "a"]))
        t2 = asyncio.create_task(c.read(["c", "b"]))
        await store.started.wait()
        assert store.calls == [["b", "a", "c"]]
        t1.cancel()
        await settle()
        assert t1.cancelled()
        store.gate.set()
        out = await t2
        assert out.keys == ["c", "b"]
        assert len(store.calls) == 1 and c.stats.cancelled_requests == 1

    run(main())


def test_queued_keys_of_cancelled_requests_are_not_read():
    async def main():
        store = FakeStore(rows_for(["a", "b", "c"]))
        store.gate = asyncio.Event()
        timer = ManualTimer()
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=timer)
        first = asyncio.create_task(c.read(["a"]))
        await store.started.wait()
        only_b = asyncio.create_task(c.read(["b"]))
        shared = asyncio.create_task(c.read(["c"]))
        await settle()
        only_b.cancel()
        await settle()
        timer.fire()
        store.gate.set()
        assert (await shared).keys == ["c"]
        await first
        assert store.calls == [["a"], ["c"]]
        assert c.stats.dropped_keys == 1

    run(main())


def test_no_head_of_line_block_behind_a_hung_get():
    async def main():
        keys = ["hung", "x", "y", "z"]
        store = FakeStore(rows_for(keys))
        store.hang = {"hung"}
        timer = ManualTimer()
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 0.5, timer=timer)
        stuck = asyncio.create_task(c.read(["hung"]))
        await store.started.wait()
        # The hung get holds one slot; the others keep flowing through the rest.
        done = []
        for k in ("x", "y", "z"):
            t = asyncio.create_task(c.read([k]))
            await settle()
            timer.fire()
            done.append(await t)
            assert not stuck.done()
        assert [d.keys for d in done] == [["x"], ["y"], ["z"]]
        # The hung get times out and fails only its own request.
        with pytest.raises(PrefixReadError) as err:
            await stuck
        assert err.value.failed["hung"][0] == "read_timeout"
        assert c.stats.timeouts == 1

    run(main())


def test_concurrent_gets_are_bounded():
    async def main():
        keys = [f"k{i}" for i in range(12)]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        c = PrefixReadCoalescer(store.get_many, 2, 1 << 22, 2.0, 3, 30.0, timer=ManualTimer())
        t = asyncio.create_task(c.read(keys))
        await settle()
        assert len(store.calls) == 3 and c.inflight == 3 and c.queued == 6
        store.gate.set()
        out = await t
        assert out.keys == keys and len(store.calls) == 6 and c.stats.max_inflight == 3

    run(main())


def test_close_fails_pending_requests():
    async def main():
        store = FakeStore(rows_for(["a"]))
        store.gate = asyncio.Event()
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        t = asyncio.create_task(c.read(["a"]))
        await store.started.wait()
        await c.close()
        with pytest.raises(PrefixReadError) as err:
            await t
        assert err.value.failed["a"][0] == "closed"
        with pytest.raises(PrefixReadError):
            await c.read(["a"])

    run(main())


def test_bad_arguments_are_typed_errors():
    async def main():
        c = PrefixReadCoalescer(FakeStore({}).get_many, timer=ManualTimer())
        with pytest.raises(TypeError, match="must be str"):
            await c.read([1])
        with pytest.raises(ValueError, match="token counts"):
            await c.read(["a", "b"], tokens=[1])
        assert (await c.read([])).keys == []
        with pytest.raises(ValueError, match="batch-size"):
            PrefixReadCoalescer(FakeStore({}).get_many, batch_size=0)

    run(main())


def test_knobs_default_from_config():
    import dask

    async def main():
        with dask.config.set({"token-capture.restore.batch-size": 3}):
            store = FakeStore(rows_for([f"k{i}" for i in range(7)]))
            c = PrefixReadCoalescer(store.get_many, timer=ManualTimer())
            assert c.batch_size == 3 and c.window_s == pytest.approx(0.002)
            await c.read([f"k{i}" for i in range(7)])
            assert [len(k) for k in store.calls] == [3, 3, 1]

    run(main())


def test_mixed_field_sets_are_aligned_when_requests_span_gets():
    a = PackedBatch.from_rows(["a"], [make_row("a", 3, routes=True)])
    b = PackedBatch.from_rows(["b"], [make_row("b", 2)])
    out = concat_aligned([a, b])
    assert out.keys == ["a", "b"]
    assert out.fields["routed_experts"].has(0) and not out.fields["routed_experts"].has(1)
    np.testing.assert_array_equal(out.fields["token_ids"].row(1), make_row("b", 2)["token_ids"])


def test_prefix_read_error_pickles():
    import pickle

    e = PrefixReadError({"k": ("missing_key", "gone")})
    e2 = pickle.loads(pickle.dumps(e))
    assert e2.failed == e.failed and "missing_key" in str(e2)


def test_answers_are_views_when_rows_sit_together_and_copies_otherwise():
    async def main():
        keys = [f"k{i}" for i in range(6)]
        store = FakeStore(rows_for(keys, n=5))
        c = PrefixReadCoalescer(store.get_many, 256, 1 << 22, 2.0, 4, 30.0, timer=ManualTimer())
        together, apart = await asyncio.gather(c.read(["k0", "k1", "k2"]), c.read(["k5", "k3"]))
        assert len(store.calls) == 1
        assert together.keys == ["k0", "k1", "k2"] and apart.keys == ["k5", "k3"]
        f = together.fields["token_ids"]
        assert f.offsets[0] == 0 and f.offsets[-1] == len(f.values) == 15
        for i, k in enumerate(["k5", "k3"]):
            np.testing.assert_array_equal(apart.fields["token_ids"].row(i), store.rows[k]["token_ids"])
        # k4 was not asked for: k3 and k5 are not adjacent in the get, so they were gathered.
        assert apart.fields["token_ids"].values.base is None or len(apart.fields["token_ids"].values) == 10

    run(main())


def test_gets_stay_within_a_group_and_groups_take_turns():
    async def main():
        keys = [f"g{i % 2}-k{i}" for i in range(10)]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        c = PrefixReadCoalescer(store.get_many, 3, 1 << 22, 2.0, 2, 30.0, timer=ManualTimer(), group=lambda k: k[:2])
        t = asyncio.create_task(c.read(keys))
        await settle()
        # Two slots: the oldest group first, then the other one (round robin).
        assert store.calls == [["g0-k0", "g0-k2", "g0-k4"], ["g1-k1", "g1-k3", "g1-k5"]]
        store.gate.set()
        out = await t
        assert out.keys == keys
        assert all(len({k[:2] for k in call}) == 1 for call in store.calls)
        assert sorted(k for call in store.calls for k in call) == sorted(keys)

    run(main())
