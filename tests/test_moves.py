"""Pure move plans: applying a plan's transfers and drops leaves every key exactly on the
copies the new table gives it, moving only what changed (no Dask)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.store.moves import copies_of, plan_moves
from pipeline.store.placement import Placement


def workers(n: int, hosts: int = 1) -> tuple[str, ...]:
    return tuple(f"tcp://127.0.0.{2 + i % hosts}:{4000 + i}" for i in range(n))


def table(n: int, replicas: int, hosts: int = 1, version: int = 0) -> Placement:
    return Placement(version, workers(n, hosts), tuple(f"u{i}" for i in range(n)), replicas)


def holdings(p: Placement, keys: list[str]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {u: set() for u in p.unit_ids}
    for k, cs in zip(keys, copies_of(p, keys)):
        for u in cs:
            out[u].add(k)
    return out


def apply(plan, held: dict[str, set[str]], new: Placement, gone=()) -> dict[str, set[str]]:
    out = {u: set(ks) for u, ks in held.items() if u not in gone}
    for u in new.unit_ids:
        out.setdefault(u, set())
    for t in plan.transfers:
        assert set(t.keys) <= out[t.source], "a source sends only what it holds"
        assert not (set(t.keys) & out[t.target]), "a target never gets a key it holds"
        out[t.target] |= set(t.keys)
    for u, ks in plan.drops.items():
        out[u] -= set(ks)
    return {u: ks for u, ks in out.items() if u in new.unit_ids}


KEYS = [f"r{i}/c{j}" for i in range(600) for j in range(2)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_adding_a_unit_moves_about_one_in_n_and_ends_exactly_on_the_new_copies(replicas):
    old = table(3, replicas, hosts=3)
    new = old.with_unit("u3", "tcp://127.0.0.5:4003")
    held = holdings(old, KEYS)
    plan = plan_moves(old, new, {u: sorted(ks) for u, ks in held.items()}, chunk_keys=64)
    assert apply(plan, held, new) == holdings(new, KEYS)
    copies = len(KEYS) * replicas
    assert 0 < plan.keys_moved <= 1.5 * copies / 4  # about 1/(n+1) of the copies
    assert all(t.target == "u3" for t in plan.transfers)  # only the new unit receives
    assert all(len(t.keys) <= 64 for t in plan.transfers) and not plan.lost


def test_draining_a_unit_empties_it_and_loses_nothing():
    old = table(4, 2, hosts=2)
    new = old.without_unit("u1")
    held = holdings(old, KEYS)
    plan = plan_moves(old, new, {u: sorted(ks) for u, ks in held.items()}, chunk_keys=100)
    assert set(plan.drops["u1"]) == held["u1"]  # the drained unit gives up every copy
    assert apply(plan, held, new) == holdings(new, KEYS) and not plan.lost


def test_a_lost_unit_is_copied_from_the_survivors_or_its_keys_are_lost():
    for replicas in (1, 2):
        old = table(3, replicas, hosts=3)
        new = old.without_unit("u0")
        held = holdings(old, KEYS)
        plan = plan_moves(old, new, {u: sorted(ks) for u, ks in held.items()}, chunk_keys=100, unreachable=["u0"])
        assert "u0" not in {t.source for t in plan.transfers} and "u0" not in plan.drops
        only_u0 = {k for k in held["u0"] if not any(k in held[u] for u in ("u1", "u2"))}
        assert set(plan.lost) == only_u0 and (replicas == 2) == (not only_u0)
        survived = {u: ks for u, ks in holdings(new, KEYS).items()}
        got = apply(plan, held, new, gone=["u0"])
        assert {u: ks - only_u0 for u, ks in survived.items()} == got


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 7), replicas=st.integers(1, 2), hosts=st.integers(1, 3),
       change=st.sampled_from(["add", "remove"]), chunk=st.integers(1, 50))
def test_any_single_change_ends_exactly_on_the_new_copies(n, replicas, hosts, change, chunk):
    old = table(n, replicas, hosts)
    if change == "add":
        new = old.with_unit(f"u{n}", f"tcp://127.0.0.9:{5000 + n}")
    else:
        if n == 2 and replicas == 2:
            return  # replicas=2 needs two units
        try:
            new = old.without_unit("u0")
        except Exception:
            return  # e.g. a single failure domain left with replicas 2
    keys = KEYS[:300]
    held = holdings(old, keys)
    plan = plan_moves(old, new, {u: sorted(ks) for u, ks in held.items()}, chunk_keys=chunk)
    assert apply(plan, held, new) == holdings(new, keys)
    assert all(len(t.keys) <= chunk for t in plan.transfers)


def test_a_chunk_of_zero_is_refused():
    with pytest.raises(ValueError, match="chunk_keys"):
        plan_moves(table(2, 1), table(2, 1), {}, chunk_keys=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_moving_read_asks_the_old_primary_first_and_no_unit_twice(replicas):
    from pipeline.store.moving import MovingTable, holder_parts, read_order

    old = table(3, replicas, hosts=3)
    new = old.with_unit("3", "tcp://127.0.0.9:1")
    moving = MovingTable(new, old)
    keys = [f"r{i}/c0" for i in range(400)]
    order = read_order(moving, keys)
    holders, _ = moving.holders(keys)
    assert (order[:, 0] == holders[:, 2]).all()  # the old primary: it holds every row during the copy
    for row, held in zip(order, holders):
        asked = [u for u in row if u >= 0]
        assert len(asked) == len(set(asked)) and set(asked) == {u for u in held if u >= 0}
    moved = [k for k, row in zip(keys, holders) if row[0] != row[2]]  # new primary differs from the old one
    assert moved  # about 1/4 of the keys go to the new unit
    parts = holder_parts(order, 1, keys, range(len(keys)))
    asked_second = {k for _, ks in parts for k in ks}
    assert set(moved) <= asked_second  # a key whose old primary lacks it is asked of its new one next
