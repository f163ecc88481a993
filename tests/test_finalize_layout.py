"""The step layout (tasks/finalize/layout.py), without Dask: random plans and unit placements.

Receipts are made as plain dicts (hashes are never checked by planning) and planned by
the real :func:`plan_step`, so rejected receipts, routed and unrouted calls, several
groups and any number of units and workers all occur.
"""
from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.finalize.layout import HostMap, StepLayout, step_layout
from tasks.finalize.plan import StepPlan, pack_verify_tasks, plan_step
from tasks.keys import unit_for_key

HASH = b"\0" * 32


def receipt(rid: str, lengths: list[int], routed: list[bool], poisoned: bool) -> dict:
    """A linear chain of calls ``c0 -> c1 -> ...`` (``lengths[i]`` new tokens each)."""
    calls, cum = [], 0
    for i, (n, r) in enumerate(zip(lengths, routed)):
        calls.append({
            "model_call_id": f"c{i}", "parent_call_id": f"c{i - 1}" if i else None,
            "prev_len": cum, "delta_len": n, "cum_len": cum + n, "weight_version": 0,
            "digest": HASH, "chain_hash": HASH, "cumulative_hash": HASH,
            "routes_encoding": int(r), "staging_key": f"{rid}/c{i}",
        })
        cum += n
    return {"rollout_id": rid, "reward": 1.0, "terminal_model_call_id": f"c{len(lengths) - 1}",
            "calls": calls, "poisoned": poisoned}


@st.composite
def rollout(draw: st.DrawFn, rid: str) -> dict:
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    routed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    return receipt(rid, lengths, routed, poisoned=draw(st.integers(0, 9)) == 0)


@st.composite
def step(draw: st.DrawFn) -> tuple[StepPlan, list[int], list[str], int]:
    """A planned step, its group sizes, the unit -> worker placement and a token budget."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=6))
    groups, n = {}, 0
    for g, size in enumerate(sizes):
        groups[f"g{g}"] = [draw(rollout(f"r{n + i}")) for i in range(size)]
        n += size
    workers = [f"w{i}" for i in range(draw(st.integers(1, 4)))]
    unit_workers = draw(st.lists(st.sampled_from(workers), min_size=0, max_size=6))
    return plan_step(groups), sizes, unit_workers, draw(st.integers(1, 300))


def planned_rollouts(layout: StepLayout, g: int) -> list[int]:
    return [s.index for s in layout.groups[g].slots if s.index is not None]


@settings(max_examples=300, deadline=None)
@given(step())
def test_every_rollout_is_verified_exactly_once_on_its_site(case):
    plan, sizes, unit_workers, budget = case
    layout = step_layout(plan, sizes, unit_workers, budget)
    verified = sorted(r for task in layout.tasks for r in task.rollouts)
    assert verified == list(range(len(plan.rollouts)))
    for task in layout.tasks:
        worker = layout.sites[task.site].worker
        for r in task.rollouts:
            if unit_workers:
                assert worker == unit_workers[unit_for_key(plan.rollouts[r].keys[0], len(unit_workers))]
            else:
                assert worker is None and len(layout.sites) == 1
    # Per site: its rollouts in plan order (every site walks the groups in submission
    # order), cut into runs of the sizes pack_verify_tasks gives them.
    for site in layout.sites:
        tasks = [layout.tasks[t] for t in site.tasks]
        rollouts = sorted(r for task in tasks for r in task.rollouts)
        assert [r for task in tasks for r in task.rollouts] == rollouts
        sizes = [len(t) for t in pack_verify_tasks([plan.rollouts[r] for r in rollouts], budget)]
        assert [len(task.rollouts) for task in tasks] == sizes
    # A site's tasks are numbered consecutively, site after site.
    assert [t for site in layout.sites for t in site.tasks] == list(range(len(layout.tasks)))
    assert all(layout.tasks[t].site == s for s, site in enumerate(layout.sites) for t in site.tasks)


@settings(max_examples=300, deadline=None)
@given(step())
def test_each_piece_is_a_contiguous_run_and_the_pieces_tile_the_fetch(case):
    plan, sizes, unit_workers, budget = case
    layout = step_layout(plan, sizes, unit_workers, budget)
    for site in layout.sites:
        for fetch, keys_of in ((site.staging, lambda p: p.keys), (site.routes, lambda p: p.routes_keys)):
            assert [p.task for p in fetch.pieces] == list(site.tasks)
            at = 0
            for piece in fetch.pieces:
                assert piece.start == at <= piece.stop  # starts where the previous run ends
                run = [k for _, ks in piece.rollout_keys for k in ks]
                assert list(fetch.keys[piece.start : piece.stop]) == run
                assert [r for r, _ in piece.rollout_keys] == list(layout.tasks[piece.task].rollouts)
                assert all(list(ks) == list(keys_of(plan.rollouts[r])) for r, ks in piece.rollout_keys)
                at = piece.stop
            assert at == len(fetch.keys)  # the pieces cover the fetch exactly
        assert sorted(site.staging.keys) == sorted(k for t in site.tasks for r in layout.tasks[t].rollouts
                                                   for k in plan.rollouts[r].keys)


@settings(max_examples=300, deadline=None)
@given(step())
def test_groups_keep_their_shape_and_wait_for_exactly_their_tasks(case):
    plan, sizes, unit_workers, budget = case
    layout = step_layout(plan, sizes, unit_workers, budget)
    assert [len(g.slots) for g in layout.groups] == sizes
    assert [s.rollout_id for g in layout.groups for s in g.slots] == plan.order
    task_of = {r: t for t, task in enumerate(layout.tasks) for r in task.rollouts}
    for g, group in enumerate(layout.groups):
        assert group.tasks == tuple(sorted({task_of[r] for r in planned_rollouts(layout, g)}))


@settings(max_examples=300, deadline=None)
@given(step())
def test_each_group_is_assembled_on_the_site_holding_most_of_its_rows(case):
    """Without hosts: a group's assembling site (where it is assembled when asked for on
    the cluster) holds the most of its planned tokens (ties: the lower site); a group
    without planned rollouts, or a store placing no units, has none. Assembled by the
    controller, nothing crosses hosts."""
    plan, sizes, unit_workers, budget = case
    layout = step_layout(plan, sizes, unit_workers, budget)
    assert layout.crossing_tasks() == []
    if not unit_workers or not plan.rollouts:
        assert all(g.assembler is None and g.worker is None for g in layout.groups)
        return
    site_of = {r: s for s, site in enumerate(layout.sites) for t in site.tasks for r in layout.tasks[t].rollouts}
    for g, group in enumerate(layout.groups):
        held = [0] * len(layout.sites)
        for r in planned_rollouts(layout, g):
            held[site_of[r]] += plan.rollouts[r].n_tokens
        if not group.tasks or not sum(held):
            assert group.assembler is None
            continue
        assert group.assembler == max(range(len(held)), key=lambda s: (held[s], -s))
        assert group.worker == layout.sites[group.assembler].worker


@settings(max_examples=100, deadline=None)
@given(step())
def test_equal_inputs_give_equal_layouts(case):
    plan, sizes, unit_workers, budget = case
    first = step_layout(plan, sizes, unit_workers, budget)
    again = step_layout(copy.deepcopy(plan), list(sizes), list(unit_workers), budget)
    assert first == again and hash(first.tasks) == hash(again.tasks)


def test_one_site_packs_like_pack_verify_tasks():
    plan = plan_step({"g0": [receipt(f"p{i}", [10 * (i + 1)], [False], False) for i in range(5)]})
    layout = step_layout(plan, [5], [], 35)
    packed = pack_verify_tasks(plan.rollouts, 35)
    assert [len(t.rollouts) for t in layout.tasks] == [len(t) for t in packed]
    assert layout.sites[0].worker is None and layout.groups[0].assembler is None


# ---- host-aware placement: workers on hosts, some without the finalize resource ------------


@st.composite
def hosted_step(draw: st.DrawFn) -> tuple[StepPlan, list[int], list[str], int, HostMap]:
    """:func:`step` plus where its workers are: 1-3 hosts, any workers taking finalize work."""
    plan, sizes, unit_workers, budget = draw(step())
    workers = sorted(set(unit_workers) | {f"w{i}" for i in range(4)})
    n_hosts = draw(st.integers(1, 3))
    hosts = {w: f"h{draw(st.integers(0, n_hosts - 1))}" for w in workers}
    finalize = frozenset(w for w in workers if draw(st.booleans()))
    return plan, sizes, unit_workers, budget, HostMap(hosts, finalize)


@settings(max_examples=300, deadline=None)
@given(hosted_step())
def test_each_group_is_assembled_on_the_host_holding_most_of_its_rows(case):
    """With hosts, a group's assembling site is on the host whose sites hold the most of
    the group's tokens (ties: the host of the lowest site), and its assemble task is
    pinned to a finalize worker of that host (none there: unpinned)."""
    plan, sizes, unit_workers, budget, hosts = case
    layout = step_layout(plan, sizes, unit_workers, budget, hosts)
    site_of = {r: s for s, site in enumerate(layout.sites) for t in site.tasks for r in layout.tasks[t].rollouts}
    for g, group in enumerate(layout.groups):
        if group.assembler is None:
            assert group.worker is None
            continue
        per_host: dict[str, int] = {}
        for r in planned_rollouts(layout, g):
            host = layout.sites[site_of[r]].host
            per_host[host] = per_host.get(host, 0) + plan.rollouts[r].n_tokens
        order = [site.host for site in layout.sites]
        if sum(per_host.values()):
            best = max(per_host, key=lambda h: (per_host[h], -order.index(h)))
            assert layout.sites[group.assembler].host == best, (per_host, group.assembler)
        if group.worker is not None:
            assert hosts.hosts[group.worker] == layout.sites[group.assembler].host and group.worker in hosts.finalize
        else:
            assert not any(hosts.hosts[w] == layout.sites[group.assembler].host for w in hosts.finalize)


@settings(max_examples=300, deadline=None)
@given(hosted_step())
def test_verify_tasks_run_on_their_rows_host_and_crossing_outputs_are_named(case):
    """Every rollout is verified once, by a task of the site holding its rows, pinned to
    the site's own worker when it takes finalize work, else to a finalize worker of the
    same host (unpinned only when its host has none). A task's output crosses hosts
    once per other host assembling a group that reads it."""
    plan, sizes, unit_workers, budget, hosts = case
    layout = step_layout(plan, sizes, unit_workers, budget, hosts)
    seen = sorted(r for task in layout.tasks for r in task.rollouts)
    assert seen == list(range(len(plan.rollouts)))
    for site in layout.sites:
        if site.worker is None:
            assert site.verify_worker is None
            continue
        assert site.host == hosts.hosts[site.worker]
        if site.worker in hosts.finalize:
            assert site.verify_worker == site.worker
        elif site.verify_worker is not None:
            assert site.verify_worker in hosts.finalize and hosts.hosts[site.verify_worker] == site.host
        else:
            assert not any(hosts.hosts[w] == site.host for w in hosts.finalize)
    expected = []
    for t, task in enumerate(layout.tasks):
        to = {layout.sites[g.assembler].host for g in layout.groups if g.assembler is not None and t in g.tasks}
        expected += [t] * len(to - {layout.sites[task.site].host})
    assert layout.crossing_tasks() == expected


def test_a_storage_only_worker_hands_its_rows_to_a_finalize_worker_of_its_host():
    """Units on a worker without the finalize resource: the site's verify tasks and the
    groups it assembles go to the finalize worker on the same host, not another host's."""
    plan = plan_step({"g0": [receipt(f"s{i}", [10, 5], [True, False], False) for i in range(4)]})
    hosts = HostMap({"store-a": "10.0.0.1", "fin-a": "10.0.0.1", "fin-b": "10.0.0.2"}, frozenset({"fin-a", "fin-b"}))
    layout = step_layout(plan, [4], ["store-a"], 1000, hosts)
    assert [(s.worker, s.host, s.verify_worker) for s in layout.sites] == [("store-a", "10.0.0.1", "fin-a")]
    assert layout.groups[0].worker == "fin-a" and layout.crossing_tasks() == []
    # Without host knowledge the same step is placed by worker only, as before.
    plain = step_layout(plan, [4], ["store-a"], 1000)
    assert plain.sites[0].verify_worker is None and plain.groups[0].worker == "store-a"


def test_a_group_whose_rows_sit_on_another_host_is_assembled_there():
    """Two sites on two hosts: each group is assembled on the host (and site) holding
    most of its rows."""
    receipts = {f"g{g}": [receipt(f"x{g}-{i}", [8 * (g + 1)], [False], False) for i in range(3)] for g in range(4)}
    plan = plan_step(receipts)
    hosts = HostMap({"a": "10.0.0.1", "b": "10.0.0.2"}, frozenset({"a", "b"}))
    layout = step_layout(plan, [3] * 4, ["a", "b"], 10_000, hosts)
    site_of = {r: s for s, site in enumerate(layout.sites) for t in site.tasks for r in layout.tasks[t].rollouts}
    for g, group in enumerate(layout.groups):
        held = [sum(plan.rollouts[r].n_tokens for r in planned_rollouts(layout, g) if site_of[r] == s) for s in range(2)]
        assert held[group.assembler] == max(held), (g, held)
        assert group.worker == layout.sites[group.assembler].worker
