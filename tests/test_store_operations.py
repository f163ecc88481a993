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

    def refresh(self, seen: int) -> bool:
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
