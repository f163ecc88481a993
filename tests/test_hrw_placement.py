"""Rendezvous (HRW) placement over stable unit ids, pure: no Dask, no cluster.

Adding one of n+1 units moves about 1/(n+1) of the rollouts (all to the new unit),
removing one of n moves about 1/n (only its own); units are balanced; a key's replica
is on another host when the units span several (else another worker), its witness on a
worker hosting neither copy; the table's pure changes refuse what would make it
ambiguous; the ranking is numpy over keys x units."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tasks.placement_hash as ph
from pipeline.store.checkpoint_files import primary_items
from pipeline.store.losses import LossBook
from pipeline.store.placement import Placement, moved, plan_put
from tasks.errors import InvalidKey, InvalidStoreRequest
from tasks.keys import primary_unit, primary_units, unit_for_key, unit_for_rollout
from tasks.packed import PackedBatch, PackedField

ROLLOUTS = [f"rollout-{i:05d}" for i in range(20_000)]
UNIT_IDS = st.lists(st.text("abcdefghij0123456789-", min_size=1, max_size=8), min_size=2, max_size=12, unique=True)


def one_host(n: int, replicas: int = 1, ids: tuple[str, ...] = ()) -> Placement:
    """n units, one per worker, all on 127.0.0.1."""
    return Placement(0, tuple(f"tcp://127.0.0.1:{4001 + u}" for u in range(n)), ids, replicas)


def primary_ids(p: Placement, rollouts: list[str]) -> np.ndarray:
    return np.asarray(p.unit_ids, dtype=object)[p.locate_rollouts(rollouts, replicas=1)[0]]


# ---- moving ~1/n of the keys ---------------------------------------------------------------


@pytest.mark.parametrize("n", range(2, 17))
def test_adding_a_unit_moves_about_one_in_n_plus_one_all_to_it(n):
    old = one_host(n)
    new = old.with_unit("new", "tcp://127.0.0.1:5000")
    before, after = primary_ids(old, ROLLOUTS), primary_ids(new, ROLLOUTS)
    changed = before != after
    fraction = changed.mean()
    assert 0.5 / (n + 1) < fraction <= 1.5 / (n + 1), fraction
    assert set(after[changed]) == {"new"}, "every moved rollout went to the new unit"
    assert moved(old, new, ROLLOUTS).primary == [r for r, c in zip(ROLLOUTS, changed) if c]
    assert new.version == old.version + 1


@pytest.mark.parametrize("n", range(2, 17))
def test_removing_a_unit_moves_about_one_in_n_only_its_own(n):
    old = one_host(n)
    gone = str(n // 2)
    new = old.without_unit(gone)
    before, after = primary_ids(old, ROLLOUTS), primary_ids(new, ROLLOUTS)
    changed = before != after
    assert 0.5 / n < changed.mean() <= 1.5 / n, changed.mean()
    assert np.array_equal(changed, before == gone), "exactly the removed unit's rollouts moved"
    assert gone not in set(after) and new.n_units == n - 1 and new.version == old.version + 1


def test_eight_units_hold_within_a_quarter_of_the_mean():
    counts = np.bincount(one_host(8).locate_rollouts(ROLLOUTS)[0], minlength=8)
    mean = len(ROLLOUTS) / 8
    assert counts.sum() == len(ROLLOUTS)
    assert np.all(np.abs(counts - mean) <= 0.25 * mean), counts


@settings(max_examples=40, deadline=None)
@given(ids=UNIT_IDS, seed=st.integers(0, 2**32 - 1))
def test_a_key_keeps_its_unit_id_whatever_the_table_order(ids, seed):
    # Ranks come from (rollout id, unit id) alone: a permuted table places every key on
    # the same named unit, and removing a unit moves only the rollouts it held.
    rollouts = ROLLOUTS[:500]
    p = one_host(len(ids), ids=tuple(ids))
    order = np.random.default_rng(seed).permutation(len(ids))
    q = Placement(0, tuple(p.workers[i] for i in order), tuple(ids[i] for i in order))
    assert np.array_equal(primary_ids(p, rollouts), primary_ids(q, rollouts))
    gone = ids[seed % len(ids)]
    before, after = primary_ids(p, rollouts), primary_ids(p.without_unit(gone), rollouts)
    assert np.array_equal(before != after, before == gone)


def test_default_ids_and_unit_for_key_rank_as_the_table_does():
    p = one_host(5)
    assert p.unit_ids == ("0", "1", "2", "3", "4")
    keys = [f"{r}/c0" for r in ROLLOUTS[:300]] + [f"__cut__/ck/{r}/c1/3" for r in ROLLOUTS[:50]]
    where, failed = p.route(keys)
    assert not failed
    assert where.tolist() == [unit_for_key(k, 5) for k in keys] == primary_units(keys, 5).tolist()
    assert [unit_for_rollout(r, 5) for r in ROLLOUTS[:50]] == [primary_unit(r, p.unit_ids) for r in ROLLOUTS[:50]]
    named = one_host(3, ids=("x", "y", "z"))
    assert named.route(keys)[0].tolist() == primary_units(keys, ("x", "y", "z")).tolist()
    assert unit_for_rollout("only", 1) == 0


def test_bad_keys_fail_alone_and_bad_ids_raise():
    p = one_host(3, replicas=2)
    loc = p.locate(["r0/c0", "r\ud800/c0", "no-slash", "r1/c1"])
    assert set(loc.failed) == {"r\ud800/c0", "no-slash"}
    assert all(why == "invalid_key" for why, _ in loc.failed.values())
    assert loc.primary[1] == loc.primary[2] == loc.replica[1] == loc.witness[2] == -1
    assert loc.primary[0] >= 0 and loc.primary[3] >= 0
    with pytest.raises(InvalidKey, match="UTF-8"):
        unit_for_rollout("r\ud800", 4)
    with pytest.raises(InvalidKey, match="UTF-8"):
        moved(p, p, ["r\ud800"])


# ---- copies: replica across hosts (or workers), witness on a third worker ------------------


def two_hosts(per_host: int = 3) -> Placement:
    workers = tuple(f"tcp://127.0.0.{h}:{4001 + w}" for h in (1, 2) for w in range(per_host))
    return Placement(0, workers, replicas=2)


def test_with_several_hosts_a_replica_is_on_another_host():
    p = two_hosts()
    assert p.by_host
    prim, rep, wit = p.locate_rollouts(ROLLOUTS[:5000])
    hosts = np.asarray([p.host(u) for u in range(p.n_units)])
    assert np.all(hosts[prim] != hosts[rep])
    assert np.all(wit >= 0) and np.all((wit != prim) & (wit != rep))
    # Any of the other host's units may be the replica: the load of copies spreads.
    assert set(rep[prim == 0].tolist()) == {3, 4, 5}


def test_on_one_host_a_replica_is_on_another_worker_and_the_witness_on_a_third():
    workers = ("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002", "tcp://127.0.0.1:4001", "tcp://127.0.0.1:4003")
    p = Placement(0, workers, replicas=2)
    assert not p.by_host
    prim, rep, wit = p.locate_rollouts(ROLLOUTS[:5000])
    w = np.asarray(workers)
    assert np.all(w[prim] != w[rep])
    assert np.all(wit >= 0) and np.all((w[wit] != w[prim]) & (w[wit] != w[rep]))
    # Two workers only: the copies take both, no witness is left.
    _, _, none = Placement(0, workers[:3], replicas=2).locate_rollouts(ROLLOUTS[:500])
    assert np.all(none == -1)


@settings(max_examples=60, deadline=None)
@given(hosts=st.lists(st.integers(1, 3), min_size=2, max_size=10), ids=UNIT_IDS)
def test_copy_rules_hold_for_any_table(hosts, ids):
    n = min(len(hosts), len(ids))
    workers = tuple(f"tcp://127.0.0.{h}:{4001 + u}" for u, h in enumerate(hosts[:n]))
    p = Placement(0, workers, tuple(ids[:n]), 2)
    prim, rep, wit = p.locate_rollouts(ROLLOUTS[:300])
    host = np.asarray([p.host(u) for u in range(n)])
    w = np.asarray(workers)
    several = len(set(host)) > 1
    assert np.all((host[prim] != host[rep]) if several else (w[prim] != w[rep]))
    has = wit >= 0
    assert np.all((w[wit[has]] != w[prim[has]]) & (w[wit[has]] != w[rep[has]]))
    # A witness is missing only when no unit sits on a worker hosting neither copy.
    third = np.asarray([len(set(workers) - {w[a], w[b]}) > 0 for a, b in zip(prim, rep)])
    assert np.array_equal(has, third)
    # The replica is the best-ranked unit allowed: no allowed unit outranks it.
    order = ph.ranking(ROLLOUTS[:300], p.unit_ids)
    for i in range(0, 300, 37):
        allowed = [u for u in order[i] if (host[u] != host[prim[i]] if several else w[u] != w[prim[i]])]
        assert order[i][0] == prim[i] and allowed[0] == rep[i]


@pytest.mark.parametrize("make", [lambda: one_host(6, replicas=2), lambda: two_hosts()])
def test_a_unit_joining_or_leaving_changes_only_copies_it_takes_or_held(make):
    old = make()
    worker = "tcp://127.0.0.1:5000"
    new = old.with_unit("new", worker)
    change = moved(old, new, ROLLOUTS[:4000])
    _, r1, _ = new.locate_rollouts(change.copies)
    p1 = new.locate_rollouts(change.copies)[0]
    idx = new.index_of("new")
    assert change.copies and np.all((p1 == idx) | (r1 == idx)), "every changed copy set now includes the new unit"
    assert len(change.copies) <= 1.5 * 2 / new.n_units * 4000, "about the keys it takes a copy of"
    back = moved(new, old, ROLLOUTS[:4000])
    assert back.copies == change.copies and back.primary == change.primary


def test_replicas_need_two_workers():
    with pytest.raises(InvalidStoreRequest, match="at least 2 workers"):
        Placement(0, ("tcp://127.0.0.1:4001",) * 3, replicas=2)
    with pytest.raises(InvalidStoreRequest, match="1 or 2"):
        Placement(0, ("tcp://127.0.0.1:4001",), replicas=3)


# ---- the table's pure changes ---------------------------------------------------------------


def test_table_changes_refuse_what_is_ambiguous():
    p = one_host(3)
    with pytest.raises(InvalidStoreRequest, match="already in this placement"):
        p.with_unit("1", "tcp://127.0.0.1:5000")
    with pytest.raises(InvalidStoreRequest, match="already hosts"):
        p.with_unit("x", p.workers[0])
    with pytest.raises(InvalidStoreRequest, match="no storage unit 'x'"):
        p.without_unit("x")
    with pytest.raises(InvalidStoreRequest, match="last one"):
        one_host(1).without_unit("0")
    with pytest.raises(InvalidStoreRequest, match="appears twice"):
        Placement(0, p.workers, ("a", "b", "a"))
    with pytest.raises(InvalidStoreRequest, match="2 unit id"):
        Placement(0, p.workers, ("a", "b"))
    with pytest.raises(InvalidStoreRequest, match="at least 2 workers"):
        Placement(0, ("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002"), replicas=2).without_unit("0")
    q = p.with_unit("x", "tcp://127.0.0.1:5000").without_unit("0")
    assert (q.version, q.unit_ids, q.workers[-1], q.homes[-1]) == (2, ("1", "2", "x"), "tcp://127.0.0.1:5000", "tcp://127.0.0.1:5000")


def test_moved_takes_keys_or_rollout_ids_and_names_witness_changes():
    old = one_host(4, replicas=2)
    new = old.without_unit("2")
    keys = [f"{r}/c0" for r in ROLLOUTS[:2000]]
    by_key, by_rollout = moved(old, new, keys), moved(old, new, ROLLOUTS[:2000])
    assert [k.split("/")[0] for k in by_key.primary] == by_rollout.primary
    p0, r0, w0 = old.locate_rollouts(ROLLOUTS[:2000])
    assert by_rollout.copies == [r for r, a, b in zip(ROLLOUTS, p0, r0) if 2 in (a, b)]
    assert set(by_rollout.witness) >= {r for r, w in zip(ROLLOUTS, w0) if w == 2}
    assert moved(old, old, keys) == type(by_key)([], [], [])


def test_a_replacement_may_not_share_a_worker_with_another_domain():
    p = Placement(0, ("tcp://127.0.0.1:4001", "tcp://127.0.0.1:4002", "tcp://127.0.0.1:4001", "tcp://127.0.0.1:4003"), replicas=2)
    assert p.partners(0) == [1, 3] and p.partners(1) == [0, 2, 3]
    assert p.may_host(0, "tcp://127.0.0.1:4009")  # a fresh worker
    assert p.may_host(0, "tcp://127.0.0.1:4001")  # with unit 2, its own domain
    assert not p.may_host(0, "tcp://127.0.0.1:4002")  # unit 1 may hold its keys' other copies
    h = two_hosts()
    assert not h.may_host(0, "tcp://127.0.0.2:4999")  # the other host
    assert h.may_host(0, "tcp://127.0.0.1:4999") and h.may_host(0, "tcp://127.0.0.2:4999", by_host=False)
    assert one_host(3).partners(0) == []


# ---- the units' own routing lines rank as the table does -----------------------------------


def test_checkpoint_primaries_and_witnessed_names_follow_the_table_ids():
    p = one_host(4, replicas=2, ids=("a", "b", "c", "d"))
    keys = [f"{r}/c0" for r in ROLLOUTS[:400]]
    where = p.route(keys)[0]
    items = [(k, i) for i, k in enumerate(keys)]
    for u in range(4):
        assert [k for k, _ in primary_items(items, p.unit_ids, u)] == [k for k, w in zip(keys, where) if w == u]
    book = LossBook()
    book.witness("staging", keys)
    assert book.witnessed_of("staging", 1, p.unit_ids) == [k for k, w in zip(keys, where) if w == 1]
    assert book.witnessed_of("staging") == keys
    with pytest.raises(InvalidStoreRequest, match="units"):
        book.witnessed_of("staging", 1)


# ---- vectorised ---------------------------------------------------------------------------


def test_route_ranks_keys_by_units_in_one_numpy_pass(monkeypatch):
    calls = []
    real = ph.splitmix64

    def counting(x):
        calls.append(x.shape)
        return real(x)

    monkeypatch.setattr(ph, "splitmix64", counting)
    keys = [f"{r}/c{i % 3}" for i, r in enumerate(ROLLOUTS[:256])]
    p = one_host(8, replicas=2)
    p.route(keys)
    assert calls == [(256, 8)], "one mix over the whole keys x units matrix, no per-key loop"
    calls.clear()
    batch = PackedBatch(keys, {"token_ids": PackedField(np.zeros(256 * 4, np.int64), np.arange(257, dtype=np.int64) * 4, None)})
    plan = plan_put(p, batch, 1 << 20)
    assert calls == [(256, 8)] and sum(len(c) for _, c in plan.parts) == 512


# ---- a handle taking a changed table ---------------------------------------------------------


def test_a_handle_installs_a_newer_table_and_refuses_an_older_or_unnamed_one():
    from pipeline.store.client import StagingStore
    from pipeline.store.directory import UnitTable
    from tasks.errors import StoreUnavailable

    old = one_host(2)
    store = StagingStore(["h0", "h1"], old.workers, placement=old)  # handles are opaque here
    grown = old.with_unit("2", "tcp://127.0.0.1:5000")
    store.install_placement(grown, ["h0", "h1", "h2"])
    assert (store.placement, store.units, store.unit_ids) == (grown, ["h0", "h1", "h2"], ["0", "1", "2"])
    store.install_placement(grown, ["h0", "h1", "h2"])  # the current table again: no change
    with pytest.raises(InvalidStoreRequest, match="not newer"):
        store.install_placement(old, ["h0", "h1"])
    with pytest.raises(InvalidStoreRequest, match="one handle per unit"):
        store.install_placement(grown.without_unit("0"), ["h1"] * 3)
    with pytest.raises(InvalidStoreRequest, match="do not match"):
        StagingStore(["h0"], old.workers, placement=old)
    # A shared table naming workers only keeps the handle's ids; a different unit count
    # without the ids cannot be taken.
    moved_worker = UnitTable(grown.version + 1, ["h0", "x", "h2"], [grown.workers[0], "tcp://127.0.0.1:6000", grown.workers[2]])
    assert store._take_table(moved_worker) and store.placement.unit_ids == grown.unit_ids
    assert store.placement.homes == grown.homes and store.placement.workers[1] == "tcp://127.0.0.1:6000"
    with pytest.raises(StoreUnavailable, match="does not say their ids"):
        store._take_table(UnitTable(store.version + 1, ["h0"], [grown.workers[0]]))
