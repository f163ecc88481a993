"""The step layout (tasks/finalize/layout.py), without Dask: random plans and unit placements.

Receipts are made as plain dicts (hashes are never checked by planning) and planned by
the real :func:`plan_step`, so rejected receipts, routed and unrouted calls, several
groups and any number of units and workers all occur.
"""
from __future__ import annotations

import copy
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.finalize.layout import StepLayout, assembly_clusters, step_layout
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
    # Per site: its rollouts split by assembling site (others first, ascending), each
    # split cut in plan order into runs of the sizes pack_verify_tasks gives it.
    group_of = {s.index: g for g, group in enumerate(layout.groups) for s in group.slots if s.index is not None}
    assembler_of = lambda r: layout.groups[group_of[r]].assembler  # noqa: E731
    for s, site in enumerate(layout.sites):
        tasks = [layout.tasks[t] for t in site.tasks]
        rollouts = sorted(r for task in tasks for r in task.rollouts)
        others = sorted({assembler_of(r) for r in rollouts} - {s, None})
        at = 0
        for c in others + [c for c in (s, None) if c in {assembler_of(r) for r in rollouts}]:
            split = [r for r in rollouts if assembler_of(r) == c]
            sizes = [len(t) for t in pack_verify_tasks([plan.rollouts[r] for r in split], budget, [group_of[r] for r in split])]
            runs = tasks[at : at + len(sizes)]
            assert [r for task in runs for r in task.rollouts] == split
            assert [len(task.rollouts) for task in runs] == sizes
            assert all(task.ships == (c != s and c is not None) for task in runs)
            at += len(sizes)
        assert at == len(tasks)
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
def test_assembling_sites_follow_the_token_runs_rule(case):
    """One run of groups per site holding more than a verify budget (at least one, at most
    one per site), each group in the run its token midpoint falls in, run ``c`` on the
    site holding the ``c``-th most tokens. With one run that is the site holding the most
    tokens of the step. A group without planned rollouts is assembled anywhere."""
    plan, sizes, unit_workers, budget = case
    layout = step_layout(plan, sizes, unit_workers, budget)
    tok = lambda rs: sum(plan.rollouts[r].n_tokens for r in rs)  # noqa: E731
    site_tokens = [tok(r for t in site.tasks for r in layout.tasks[t].rollouts) for site in layout.sites]
    group_tokens = [tok(planned_rollouts(layout, g)) for g in range(len(layout.groups))]
    if not unit_workers or not plan.rollouts:
        assert all(g.assembler is None for g in layout.groups)
        assert not any(task.ships for task in layout.tasks)
        return
    runs = min(len(site_tokens), max(1, math.ceil(max(site_tokens) / budget)))
    heaviest_first = sorted(range(len(site_tokens)), key=lambda s: (-site_tokens[s], s))
    total, before = sum(group_tokens), 0
    for g, group in enumerate(layout.groups):
        mid = before + group_tokens[g] / 2
        run = min(runs - 1, math.floor(runs * mid / total))
        assert run * total <= runs * mid and (run == runs - 1 or runs * mid < (run + 1) * total)
        assert group.assembler == (heaviest_first[run] if group.tasks else None)
        if runs == 1 and group.tasks:
            assert site_tokens[group.assembler] == max(site_tokens)
        before += group_tokens[g]
    # A task ships iff its rollouts are assembled on another site, and ships first.
    assembler_of = {r: group.assembler for g, group in enumerate(layout.groups) for r in planned_rollouts(layout, g)}
    for s, site in enumerate(layout.sites):
        ships = [layout.tasks[t].ships for t in site.tasks]
        assert ships == sorted(ships, reverse=True)
        for t in site.tasks:
            assert {assembler_of[r] != s for r in layout.tasks[t].rollouts} == {layout.tasks[t].ships}


@settings(max_examples=100, deadline=None)
@given(step())
def test_equal_inputs_give_equal_layouts(case):
    plan, sizes, unit_workers, budget = case
    first = step_layout(plan, sizes, unit_workers, budget)
    again = step_layout(copy.deepcopy(plan), list(sizes), list(unit_workers), budget)
    assert first == again and hash(first.tasks) == hash(again.tasks)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=20), st.integers(1, 6))
def test_assembly_runs_are_contiguous_and_in_range(tokens, k):
    runs = assembly_clusters(tokens, k)
    assert runs == sorted(runs) and all(0 <= c < k for c in runs)


def test_one_site_packs_like_pack_verify_tasks():
    plan = plan_step({"g0": [receipt(f"p{i}", [10 * (i + 1)], [False], False) for i in range(5)]})
    layout = step_layout(plan, [5], [], 35)
    packed = pack_verify_tasks(plan.rollouts, 35, [0] * 5)
    assert [len(t.rollouts) for t in layout.tasks] == [len(t) for t in packed]
    assert layout.sites[0].worker is None and layout.groups[0].assembler is None
