"""A unit's fence (pure): which keys it must refuse, tombstones, a draining unit."""
from __future__ import annotations

from pipeline.store.fence import Fence
from pipeline.store.moves import copies_of
from pipeline.store.placement import Placement

KEYS = [f"r{i}/c0" for i in range(400)]


def table(n: int, replicas: int = 2) -> Placement:
    return Placement(3, tuple(f"tcp://127.0.0.{2 + i}:4000" for i in range(n)), tuple(f"u{i}" for i in range(n)), replicas)


def test_a_fenced_unit_refuses_exactly_the_keys_the_table_does_not_give_it():
    p = table(4)
    owners = copies_of(p, KEYS)
    for uid in p.unit_ids:
        fence = Fence.from_message(Fence.message(p, uid))
        refused = set(fence.not_given(KEYS))
        assert refused == {k for k, cs in zip(KEYS, owners) if uid not in cs}
        assert 0 < len(refused) < len(KEYS)
        assert "version 3" in fence.detail(KEYS[0])


def test_a_draining_unit_is_given_nothing():
    p = table(4).without_unit("u2")
    fence = Fence.from_message(Fence.message(p, "u2"))
    assert fence.leaving and fence.not_given(KEYS) == KEYS


def test_tombstones_live_only_while_moving_and_a_reput_revives():
    fence = Fence.from_message(Fence.message(table(3), "u0"))
    fence.deleted("staging", ["r1/c0", "r2/c0"])
    assert fence.buried("staging", ["r1/c0", "r3/c0"]) == {"r1/c0"}
    fence.revived("staging", ["r1/c0"])
    assert fence.buried("staging", ["r1/c0", "r2/c0"]) == {"r2/c0"}
    fence.settled()
    assert not fence.moving and fence.buried("staging", ["r2/c0"]) == set()
    fence.deleted("staging", ["r4/c0"])  # no move: nothing to remember
    assert fence.buried("staging", ["r4/c0"]) == set()
