"""The store's sans-I/O operations driven by hand (no Dask): each ``yield`` of calls is
answered the way units would answer at that moment of a move."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.store import operations
from pipeline.store.calls import Call, Refresh
from pipeline.store.moving import MovingTable
from pipeline.store.placement import Placement
from pipeline.store.protocol import MISSING_KEY, MOVED, StoreResult

WORKERS = ("tcp://127.0.0.2:1", "tcp://127.0.0.3:1", "tcp://127.0.0.4:1")


@dataclass
class Handle:
    """What an operation reads of a store handle: its table(s); refresh takes ``final``."""

    placement: Placement
    moving: MovingTable | None
    final: Placement
    units: list = field(default_factory=list)
    refreshed: int = 0

    def refresh(self, seen: int, moved: bool = False) -> bool:
        self.placement, self.moving, self.refreshed = self.final, None, self.refreshed + 1
        return True


def test_a_delete_split_by_a_moves_switch_is_not_reported_missing():
    # Round 1 (moving table): the old holder already took the final table's fence and
    # refuses the call as stale (moved); the new holder removes the row. Round 2 (the
    # final table): the new holder misses it, since round 1 removed it. The key is gone
    # everywhere: the delete succeeded and must say so.
    old = Placement(1, WORKERS[:2], ("0", "1"), 1)
    new = old.with_unit("2", WORKERS[2])
    final = Placement(new.version + 1, new.workers, new.unit_ids, 1)
    keys = [f"r{i}/c0" for i in range(200)]
    moving = MovingTable(new, old)
    holders, _ = moving.holders(keys)
    moved = [k for k, row in zip(keys, holders) if row[0] != row[2]]  # keys the new unit takes
    assert moved
    handle = Handle(new, moving, final)
    rounds: list[list[Call]] = []

    def answer(calls: list[Call]) -> list[StoreResult]:
        rounds.append(calls)
        out = []
        for c in calls:
            ks = [k for k in c.keys if k in moved]
            if len(rounds) == 1:  # the union unit 2 (new) removes, the old ones are stale
                out.append(StoreResult(ok=ks) if c.unit == 2 else StoreResult(failed={k: (MOVED, "stale") for k in ks}))
            else:
                out.append(StoreResult(failed={k: (MISSING_KEY, "not held") for k in ks}))
        return out

    op = operations.delete(handle, moved, "staging")
    reply, result = None, None
    try:
        while True:
            step = op.send(reply)
            reply = handle.refresh(step.seen) if isinstance(step, Refresh) else answer(step)
    except StopIteration as done:
        result = done.value
    assert handle.refreshed == 1 and len(rounds) == 2
    assert sorted(result.ok) == sorted(moved) and not result.failed, list(result.failed.items())[:2]


def test_a_key_missing_everywhere_stays_missing():
    old = Placement(1, WORKERS[:2], ("0", "1"), 1)
    handle = Handle(old, None, old)
    op = operations.delete(handle, ["r1/c0"], "staging")
    try:
        op.send(None)
        result = op.send([StoreResult(failed={"r1/c0": (MISSING_KEY, "not held")})])
    except StopIteration as done:
        result = done.value
    assert result.failed["r1/c0"][0] == MISSING_KEY and result.ok == []


def test_a_get_over_the_answer_budget_is_split_into_calls_in_flight_and_merged_in_order():
    """Each unit answers at most the call's byte budget and leaves the rest in ``more``;
    the get asks for the rest in budget-sized calls, at most ``calls_in_flight`` per unit
    at a time, and merges every part into one batch in request order."""
    import numpy as np

    from pipeline.store.protocol import GetResult, unpack_names
    from pipeline.store.settings import StoreSettings
    from pipeline.store.slab_pool import SlabPool
    from tasks.packed import PackedBatch, PackedField

    placement = Placement(0, WORKERS[:2], ("0", "1"), 1)
    row_bytes, budget = 1000, 3500  # a unit answers 3 rows per call
    keys = [f"r{i}/c0" for i in range(40)]
    handle = Handle(placement, None, placement)
    handle.settings = StoreSettings(16 << 20, False, budget, 2)
    handle.buffers = lambda: SlabPool(0)
    handle.answer_row_bytes = {}
    value = {k: i for i, k in enumerate(keys)}

    def answer(call: Call) -> GetResult:
        partition, packed, _fields, _version, max_bytes, views = call.args()
        assert views, "over the wire a unit may answer views"
        asked = unpack_names(packed, "keys")
        n = max(1, max_bytes // row_bytes)
        served, more = asked[:n], asked[n:]

        def batch(ks: list[str]) -> PackedBatch:
            values = np.repeat(np.array([value[k] for k in ks], np.int64), row_bytes // 8)
            return PackedBatch(ks, {"token_ids": PackedField(values, np.arange(len(ks) + 1, dtype=np.int64) * (row_bytes // 8))})

        if call.unit == 1:  # runs of rows as separate parts (views, sent as they are)
            return GetResult(PackedBatch([], {}), {}, more, [batch(served[:1]), batch(served[1:])])
        return GetResult(batch(served), {}, more)

    def drive(wanted: list[str]) -> tuple[list[list[Call]], GetResult]:
        op = operations.get(handle, wanted, None, "staging")
        waves: list[list[Call]] = []
        try:
            step = op.send(None)
            while True:
                waves.append(step)
                step = op.send([answer(c) for c in step])
        except StopIteration as done:
            return waves, done.value

    wanted = keys[::-1] + keys[:3]  # any order, duplicates repeat
    per_unit = [len(ks) for _, ks in operations.plan_read(placement, wanted)[0]]
    waves, result = drive(wanted)
    assert [len(w) for w in waves] == [2, sum(-(-(n - 3) // 3) for n in per_unit)], "one call per unit, then the rest"
    assert all(w.per_unit == 2 for w in waves), "answers in flight per unit"
    assert [waves[1][i].unit for i in waves[1].order()[:2]] == [0, 1], "sent round-robin over the units"
    assert result.batch.keys == wanted and not result.failed
    got = result.batch.fields["token_ids"]
    assert [int(got.values[got.offsets[i]]) for i in range(len(wanted))] == [value[k] for k in wanted]
    # The next get is planned from these answers' bytes per row: budget-sized calls at once.
    waves, again = drive(wanted)
    assert len(waves) == 1 and again.batch.keys == wanted
    assert len(waves[0]) == sum(-(-n // 3) for n in per_unit) and max(len(c.keys) for c in waves[0]) == 3


def test_a_window_keeps_at_most_per_unit_calls_in_flight():
    """The sync driver sends a :class:`Window`'s calls ``per_unit`` at a time per unit,
    the next one as one of its unit's is answered; answers come back in call order."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from pipeline.store.calls import Window, _send_sync

    in_flight = {0: 0, 1: 0}
    peak = {0: 0, 1: 0}

    class Unit:
        def __init__(self, u: int) -> None:
            self.u = u

        def get_many(self, n: int) -> Future:
            in_flight[self.u] += 1
            peak[self.u] = max(peak[self.u], in_flight[self.u])
            f: Future = Future()
            f.set_result(n)
            real = f.result

            def result(timeout=None):
                in_flight[self.u] -= 1
                return real(timeout)

            f.result = result  # type: ignore[method-assign]
            return f

    store = SimpleNamespace(units=[Unit(0), Unit(1)], settings=SimpleNamespace(local_reads=False, skip_unreachable_s=0.0),
                            placement=SimpleNamespace(workers=WORKERS[:2]))
    calls = [Call(0 if i < 6 else 1, "get_many", lambda i=i: (i,)) for i in range(10)]  # one unit's, then the other's
    window = Window(calls, 2)
    assert [calls[i].unit for i in window.order()] == [0, 1, 0, 1, 0, 1, 0, 1, 0, 0]
    assert _send_sync(window, store, None) == list(range(10))
    assert peak == {0: 2, 1: 2}
