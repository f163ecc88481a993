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
        await asyncio.sleep(0)  # a real get always waits for its answer at least one loop turn
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


def coalescer(store: FakeStore, *, batch_size: int = 256, max_tokens: int = 1 << 22, window_ms: float = 2.0,
              max_concurrent: int = 4, timeout_s: float = 30.0, timer: ManualTimer | None = None, **kw) -> PrefixReadCoalescer:
    """A coalescer over ``store`` with the tests' usual knobs (any overridden by name) and
    a hand-driven window timer."""
    return PrefixReadCoalescer(store.get_many, batch_size, max_tokens, window_ms, max_concurrent, timeout_s,
                               timer=timer or ManualTimer(), **kw)


def gated_store(keys) -> FakeStore:
    """A fake store over ``keys`` whose gets wait until ``store.gate`` is set."""
    store = FakeStore(rows_for(keys))
    store.gate = asyncio.Event()
    return store


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
        c = coalescer(store, window_ms=3_600_000.0, timer=timer)
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
        c = coalescer(store, eager_inflight=4)
        requests = [keys[0:3][::-1], keys[2:6], keys[5:10], [keys[9], keys[0], keys[9]]]
        outs = await asyncio.gather(*(c.read(r) for r in requests))
        # The first request found the coalescer idle: its own get, at once (its keys are
        # its own). The rest of the same loop turn shared the next one, deduplicated.
        assert store.calls == [requests[0], [keys[i] for i in (2, 3, 4, 5, 6, 7, 8, 9, 0)]]
        for req, out in zip(requests, outs):
            assert out.keys == req
            for i, k in enumerate(req):
                np.testing.assert_array_equal(out.fields["token_ids"].row(i), store.rows[k]["token_ids"])
        assert c.stats.keys_deduplicated == 2 and c.stats.immediate_gets == 2

    run(main())


def test_window_coalesces_while_a_get_is_in_flight_and_dedups_against_it():
    async def main():
        keys = [f"k{i}" for i in range(6)] + ["k9"]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        timer = ManualTimer()
        # eager_inflight=1: one get in flight already counts as load.
        c = coalescer(store, eager_inflight=1, timer=timer)
        # k9 finds the coalescer idle: its own get, at once. k0/k1, same turn, wait a window.
        lone = asyncio.create_task(c.read(["k9"]))
        first = asyncio.create_task(c.read(["k0", "k1"]))
        await settle()
        assert store.calls == [["k9"]] and c.stats.window_waits == 1
        assert timer.fire() == 1
        await settle()
        assert store.calls == [["k9"], ["k0", "k1"]]
        # Gets in flight: these wait for the window and share one get; k1 is already
        # being read by a shared get, so it is not read again.
        later = [asyncio.create_task(c.read(r)) for r in (["k2", "k1"], ["k3", "k4"], ["k5", "k2"])]
        await settle()
        assert len(store.calls) == 2 and c.stats.window_waits == 2
        assert timer.fire() == 1
        await settle()
        assert store.calls[2] == ["k2", "k3", "k4", "k5"]
        store.gate.set()
        outs = await asyncio.gather(lone, first, *later)
        assert [o.keys for o in outs] == [["k9"], ["k0", "k1"], ["k2", "k1"], ["k3", "k4"], ["k5", "k2"]]
        assert len(store.calls) == 3 and c.stats.keys_deduplicated == 2

    run(main())


def test_light_load_issues_at_once_while_slots_are_free_and_saturation_merges():
    async def main():
        keys = [f"k{i}" for i in range(8)]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        timer = ManualTimer()
        # eager_inflight == max_concurrent (the defaults' shape): no request ever waits
        # for a window while a slot is free.
        c = coalescer(store, window_ms=3_600_000.0, eager_inflight=4, timer=timer)
        tasks = []
        for i, k in enumerate(keys[:4]):  # each in its own loop turn, while the others are in flight
            tasks.append(asyncio.create_task(c.read([k])))
            await asyncio.sleep(0)  # the request's first step: its get is issued right there
            assert store.calls == [[k] for k in keys[: i + 1]]
        assert c.stats.immediate_gets == 4 and c.stats.window_waits == 0 and timer.pending == []
        # Every slot busy: later requests queue, still no window.
        for k in keys[4:]:
            tasks.append(asyncio.create_task(c.read([k])))
            await settle()
        assert len(store.calls) == 4 and c.queued == 4 and c.dispatch_state().decide().value == "wait_slot"
        assert c.stats.slot_waits == 1 and timer.pending == []
        store.gate.set()
        outs = await asyncio.gather(*tasks)
        assert [o.keys for o in outs] == [[k] for k in keys]
        # The queue went as ONE get at the first free slot.
        assert store.calls[4:] == [keys[4:]] and c.stats.gets == 5

    run(main())


def test_eager_inflight_zero_always_coalesces_and_is_read_when_built():
    import dask

    async def main():
        store = FakeStore(rows_for(["a", "b", "c"]))
        timer = ManualTimer()
        with dask.config.set({"token-capture.restore.eager-inflight": 0}):
            c = coalescer(store, timer=timer)
            t = asyncio.create_task(c.read(["a"]))
            await settle()
            assert store.calls == [] and c.stats.window_waits == 1  # a lone request waits too
            assert timer.fire() == 1
            assert (await t).keys == ["a"]
        # The knob was read when the coalescer was built: it keeps coalescing...
        t = asyncio.create_task(c.read(["b"]))
        await settle()
        assert store.calls == [["a"]] and c.stats.window_waits == 2 and c.eager_inflight == 0
        assert timer.fire() == 1
        assert (await t).keys == ["b"]
        # ... and one built now reads the default: a lone request goes at once.
        c2 = coalescer(store, timer=timer)
        assert (await c2.read(["c"])).keys == ["c"]
        assert c2.stats.window_waits == 0 and c2.stats.immediate_gets == 1

    run(main())


def test_load_dropping_below_eager_ends_the_window_wait():
    async def main():
        store = gated_store(["a", "b", "c"])
        timer = ManualTimer()
        c = coalescer(store, window_ms=3_600_000.0, eager_inflight=1, timer=timer)
        first = asyncio.create_task(c.read(["a"]))
        await store.started.wait()
        second = asyncio.create_task(c.read(["b"]))
        await settle()
        third = asyncio.create_task(c.read(["c", "b"]))
        await settle()
        assert c.stats.window_waits == 1 and c.dispatch_state().decide().value == "wait_window"
        # The get in flight finishes: nothing is in flight any more, so what waited goes
        # now, as one get, without waiting out its (hour-long) window.
        store.gate.set()
        assert (await first).keys == ["a"] and (await second).keys == ["b"] and (await third).keys == ["c", "b"]
        assert store.calls == [["a"], ["b", "c"]]

    run(main())


def test_a_request_cancelled_before_taking_the_queue_leaves_it_to_the_others():
    async def main():
        store = gated_store(["a", "x", "b", "c"])
        c = coalescer(store, eager_inflight=4)
        first = asyncio.create_task(c.read(["a"]))
        await store.started.wait()
        # One loop turn: "x" (first of the turn) issues its own get at once; "b" will take
        # the queue one loop turn later; "c" leaves that to it. "b" is cancelled first.
        x = asyncio.create_task(c.read(["x"]))
        b = asyncio.create_task(c.read(["b"]))
        cc = asyncio.create_task(c.read(["c"]))
        await asyncio.sleep(0)  # all registered; b waits out its loop turn
        assert store.calls == [["a"], ["x"]]
        b.cancel()
        store.gate.set()
        assert (await cc).keys == ["c"] and (await first).keys == ["a"] and (await x).keys == ["x"]
        with pytest.raises(asyncio.CancelledError):
            await b
        assert store.calls == [["a"], ["x"], ["c"]] and c.inflight == 0 and c.stats.dropped_keys == 1

    run(main())


def test_batch_size_and_max_tokens_respected():
    async def main():
        keys = [f"k{i}" for i in range(10)]
        store = FakeStore(rows_for(keys))
        c = coalescer(store, batch_size=4, max_concurrent=8)
        out = await c.read(keys)
        assert out.keys == keys
        assert [len(k) for k in store.calls] == [4, 4, 2]

        store.calls.clear()
        c2 = coalescer(store, max_tokens=250, max_concurrent=8)
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
        keys = ["a", "b", "bad", "c", "d"]
        store = FakeStore(rows_for(keys))
        store.poison = {"bad"}  # the shared get raises; alone, only "bad" is refused
        store.poison_alone = {"bad"}
        c = coalescer(store)
        results = await asyncio.gather(
            c.read(["a", "b"]), c.read(["bad", "a"]), c.read(["c"]), c.read(["d"]), return_exceptions=True
        )
        assert results[0].keys == ["a", "b"]
        assert results[2].keys == ["c"] and results[3].keys == ["d"]
        assert isinstance(results[1], PrefixReadError)
        assert set(results[1].failed) == {"bad"}
        assert results[1].failed["bad"][0] == "read_failed"
        # The first request alone (idle coalescer), the rest in one shared get, which
        # fails; then each of its keys alone, exactly once.
        assert store.calls[:2] == [["a", "b"], ["bad", "a", "c", "d"]]
        assert sorted(store.calls[2:]) == [["a"], ["bad"], ["c"], ["d"]]
        assert c.stats.solo_rereads == 4 and c.stats.failed_requests == 1

    run(main())


def test_store_reported_missing_key_fails_only_requesters_without_reread():
    async def main():
        store = FakeStore(rows_for(["a", "b"]))
        c = coalescer(store)
        ok, bad = await asyncio.gather(c.read(["a", "b"]), c.read(["b", "gone"]), return_exceptions=True)
        assert ok.keys == ["a", "b"]
        assert isinstance(bad, PrefixReadError) and bad.failed == {"gone": ("missing_key", "gone not staged")}
        assert store.calls == [["a", "b"], ["b", "gone"]]  # the store answered per key: nothing re-read
        assert c.stats.solo_rereads == 0

    run(main())


def test_cancelling_one_request_never_fails_another():
    async def main():
        store = gated_store(["a", "b", "x"])
        c = coalescer(store)
        # One loop turn: x (first) issues its own get; t1 runs the next, shared get itself.
        tx = asyncio.create_task(c.read(["x"]))
        t1 = asyncio.create_task(c.read(["b", "a"]))
        await settle()
        assert store.calls == [["x"], ["b", "a"]]
        # t2 and t3 join t1's keys in flight.
        t2 = asyncio.create_task(c.read(["a", "b"]))
        t3 = asyncio.create_task(c.read(["b"]))
        await settle()
        assert len(store.calls) == 2 and c.stats.keys_deduplicated == 3
        # Cancelling a request that only joined leaves the get alone.
        t2.cancel()
        await settle()
        assert t2.cancelled() and len(store.calls) == 2
        # Cancelling t1 stops the get it runs: the key t3 still waits for is read again
        # (not "a": nobody wants it any more); t3 gets its row, no failure.
        t1.cancel()
        await settle()
        assert t1.cancelled()
        store.gate.set()
        assert (await t3).keys == ["b"] and (await tx).keys == ["x"]
        assert store.calls == [["x"], ["b", "a"], ["b"]]
        assert c.stats.cancelled_requests == 2 and c.stats.failed_keys == 0 and c.inflight == 0

    run(main())


def test_queued_keys_of_cancelled_requests_are_not_read():
    async def main():
        store = gated_store(["a", "b", "c"])
        timer = ManualTimer()
        c = coalescer(store, eager_inflight=1, timer=timer)
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
        c = coalescer(store, timeout_s=0.5, timer=timer)
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
        c = coalescer(store, batch_size=2, max_concurrent=3)
        t = asyncio.create_task(c.read(keys))
        await settle()
        assert len(store.calls) == 3 and c.inflight == 3 and c.queued == 6
        store.gate.set()
        out = await t
        assert out.keys == keys and len(store.calls) == 6 and c.stats.max_inflight == 3

    run(main())


def test_close_fails_pending_requests():
    async def main():
        store = gated_store(["a"])
        c = coalescer(store)
        # t's own task runs its get; so does "joined" (a lone request's keys are private).
        t = asyncio.create_task(c.read(["a"]))
        await store.started.wait()
        joined = asyncio.create_task(c.read(["a"]))
        await settle()
        assert store.calls == [["a"], ["a"]]
        await c.close()
        for task in (t, joined):
            with pytest.raises(PrefixReadError) as err:
                await task
            assert err.value.failed["a"][0] == "closed"
        if hasattr(t, "cancelling"):  # Python >= 3.11: the owner's task is not left cancelling
            assert t.cancelling() == 0
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
        with pytest.raises(ValueError, match="eager-inflight must be >= 0"):
            PrefixReadCoalescer(FakeStore({}).get_many, eager_inflight=-1)

    run(main())


def test_knobs_default_from_config():
    import dask

    async def main():
        with dask.config.set({"token-capture.restore.batch-size": 3}):
            store = FakeStore(rows_for([f"k{i}" for i in range(7)]))
            c = PrefixReadCoalescer(store.get_many, timer=ManualTimer())
            assert c.batch_size == 3 and c.window_s == pytest.approx(0.002) and c.eager_inflight == 4
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
        keys = [f"k{i}" for i in range(6)] + ["k9"]
        store = FakeStore(rows_for(keys, n=5))
        c = coalescer(store)
        # k9's get goes alone (idle coalescer); the next three share [k0, k1, k2, k3, k4, k5].
        _, together, _, apart = await asyncio.gather(
            c.read(["k9"]), c.read(["k0", "k1", "k2"]), c.read(["k3", "k4"]), c.read(["k5", "k3"]))
        assert store.calls == [["k9"], ["k0", "k1", "k2", "k3", "k4", "k5"]]
        assert together.keys == ["k0", "k1", "k2"] and apart.keys == ["k5", "k3"]
        f = together.fields["token_ids"]
        assert f.offsets[0] == 0 and f.offsets[-1] == len(f.values) == 15
        for i, k in enumerate(["k5", "k3"]):
            np.testing.assert_array_equal(apart.fields["token_ids"].row(i), store.rows[k]["token_ids"])
        # k3 and k5 are not adjacent (in that order) in the get: gathered, a copy of 10 values.
        a = apart.fields["token_ids"].values
        assert len(a) == 10 and not np.shares_memory(a, f.values)

    run(main())


def test_gets_stay_within_a_group_and_groups_take_turns():
    async def main():
        keys = [f"g{i % 2}-k{i}" for i in range(10)]
        store = FakeStore(rows_for(keys))
        store.gate = asyncio.Event()
        c = coalescer(store, batch_size=3, max_concurrent=2, group=lambda k: k[:2])
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
