"""Where a step's work happens: sites, verify tasks, fetch pieces and assembling sites.

:func:`step_layout` turns a :class:`~tasks.finalize.plan.StepPlan` and the store's unit
placement (plain values: which worker hosts each storage unit) into a frozen
:class:`StepLayout`. Receipts are indexed four ways: rollout (``plan.rollouts``), verify
task, site and group; the layout keeps all four in one value, so the Dask graph only
emits tasks from it and every placement rule is testable without Dask.

A step's groups are assembled by the controller, from every site's verified rows at once
(nothing crosses between workers). Each group still has an assembling site, the one
holding most of its rows: where it is assembled when a caller asks for the groups on the
cluster instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..keys import primary_units
from .plan import RolloutPlan, StepPlan, pack_verify_tasks


@dataclass(frozen=True)
class Slot:
    """One row of a group: a planned rollout (``index`` into the step plan) or an early
    receipt rejection (``reason``/``detail``). ``calls`` counts its chain's staged calls."""

    rollout_id: str
    reward: float
    index: int | None = None
    reason: str | None = None
    detail: str = ""
    calls: int = 0


@dataclass(frozen=True)
class FetchPiece:
    """The rows of a site's fetch that one verify task reads.

    Keys ``start:stop`` of :attr:`SiteFetch.keys` (positions, half-open) are verify task
    ``task``'s, rollout after rollout: ``rollout_keys`` lists ``(rollout index, that
    rollout's keys)`` in fetch order, and their keys, concatenated, are exactly that run.
    """

    task: int
    start: int
    stop: int
    rollout_keys: tuple[tuple[int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class SiteFetch:
    """One site's union read of one kind of row (staging fields, or routes).

    ``keys`` lists the rows to read; ``pieces[j]`` is what the site's ``j``-th verify task
    reads (see :func:`site_fetch` for why each piece is a contiguous run). No keys: the
    site's rollouts need no row of this kind and the read is not issued.
    """

    keys: tuple[str, ...]
    pieces: tuple[FetchPiece, ...]


@dataclass(frozen=True)
class VerifyTask:
    """One verify task: ``rollouts`` (indices into the plan, fetch order) of one ``site``."""

    site: int
    rollouts: tuple[int, ...]


@dataclass(frozen=True)
class Site:
    """A worker hosting storage units (``None``: the store places no units, one site
    anywhere), its verify tasks (consecutive task numbers) and its two fetches.

    ``host``: the worker's host (``None``: hosts unknown); ``verify_worker``: where its
    verify tasks are pinned, the site's own worker when it takes verify tasks, else one on
    its host that does (``None``: unpinned, they run where their pieces are;
    :func:`host_worker`)."""

    worker: str | None
    tasks: tuple[int, ...]
    staging: SiteFetch
    routes: SiteFetch
    host: str | None = None
    verify_worker: str | None = None


@dataclass(frozen=True)
class GroupLayout:
    """One submitted group: its rows (``slots``, submission order), the verify tasks its
    assemble waits for (ascending) and the site assembling it (``None``: anywhere)."""

    slots: tuple[Slot, ...]
    tasks: tuple[int, ...]
    assembler: int | None
    worker: str | None = None  # where its assemble task is pinned (None: anywhere; :func:`host_worker`)


@dataclass(frozen=True)
class StepLayout:
    """A step's sites, verify tasks (numbered globally) and groups (submission order).

    Invariants, each kept where it is stated: every planned rollout is in exactly one
    verify task, of the site holding its rows (:func:`site_tasks`); a site's tasks are
    numbered consecutively; each site fetch is cut into one contiguous run per task of
    the site, the runs covering the fetch exactly, in task order (:func:`site_fetch`);
    each group's assembling site is where :func:`group_assemblers` says.
    """

    sites: tuple[Site, ...]
    tasks: tuple[VerifyTask, ...]
    groups: tuple[GroupLayout, ...]

    def crossing_tasks(self) -> list[int]:
        """When the groups are assembled on the cluster (at their assembling sites): the
        verify tasks whose output crosses hosts, once per other host assembling a group
        that reads it (a task listed twice travels to two hosts). Empty when hosts are
        unknown. Assembled by the controller, no verify output moves between workers."""
        out = []
        for t, task in enumerate(self.tasks):
            here = self.sites[task.site].host
            if here is None:
                continue
            to = {self.sites[g.assembler].host for g in self.groups if g.assembler is not None and t in g.tasks}
            out.extend([t] * len(to - {here}))
        return out


# ---- groups' rows --------------------------------------------------------------------


def slots_for(plan: StepPlan) -> list[Slot]:
    """Each submitted receipt (``plan.order``) as its planned rollout or early rejection."""
    index = {p.rollout_id: j for j, p in enumerate(plan.rollouts)}
    slots = []
    for rid, reward in zip(plan.order, plan.rewards):
        if rid in plan.rejected:
            reason, detail = plan.rejected[rid]
            slots.append(Slot(rid, reward, reason=reason, detail=detail))
        else:
            j = index[rid]
            slots.append(Slot(rid, reward, index=j, calls=len(plan.rollouts[j].keys)))
    return slots


def group_slots(plan: StepPlan, group_sizes: Sequence[int]) -> list[list[Slot]]:
    """:func:`slots_for` cut into the submitted groups (``group_sizes[g]``: group ``g``'s
    receipts, submission order)."""
    flat = slots_for(plan)
    out, pos = [], 0
    for n in group_sizes:
        out.append(flat[pos : pos + n])
        pos += n
    return out


# ---- sites and assembling sites ---------------------------------------------------------


def sites(unit_workers: Sequence[str], rollouts: Sequence[RolloutPlan]) -> list[tuple[str | None, list[int]]]:
    """The step's rollouts (indices, plan order) by the worker hosting their rows' unit.

    ``unit_workers[u]`` is the worker hosting storage unit ``u`` (default unit ids
    ``"0".."n-1"``, ranked as the store's placement ranks them). A rollout's rows all
    live on one unit (placed by rollout id), so each site's fetch reads only units of
    that worker: one get per unit per step, and its verify tasks run where the rows
    landed. Sites are numbered in unit order. Without unit placement every rollout is one
    site (``None``); a step without rollouts has no site.
    """
    workers = list(unit_workers)
    if not workers:
        return [(None, list(range(len(rollouts))))] if rollouts else []
    by_worker: dict[str, list[int]] = {}
    units = primary_units([p.keys[0] for p in rollouts], len(workers)).tolist()
    for r, u in enumerate(units):
        by_worker.setdefault(workers[u], []).append(r)
    order = list(dict.fromkeys(workers))
    return [(w, by_worker[w]) for w in order if w in by_worker]


@dataclass(frozen=True)
class HostMap:
    """Where workers are: ``hosts[worker]`` is its host (the IP part of its address), and
    ``finalize`` the workers that take finalize work (the ``finalize`` resource)."""

    hosts: Mapping[str, str]
    finalize: frozenset[str]


def host_worker(worker: str, hosts: HostMap) -> str | None:
    """The worker to run finalize work for rows held on ``worker``: itself when it takes
    finalize work, else the first (sorted) worker on its host that does, else ``None``
    (no such worker on that host: anywhere)."""
    if worker in hosts.finalize:
        return worker
    host = hosts.hosts.get(worker)
    same = sorted(w for w in hosts.finalize if host is not None and hosts.hosts.get(w) == host)
    return same[0] if same else None


def group_assemblers(held: Sequence[Sequence[int]], site_hosts: Sequence[str | None]) -> list[int | None]:
    """The assembling site of each group: ``held[g][s]`` is group ``g``'s planned tokens
    held by site ``s``, ``site_hosts[s]`` its host (``None``: hosts unknown).

    The rule: the host whose sites hold the most of the group's tokens (ties: the host of
    the lowest site number; unknown hosts: each site its own), then the site on that host
    holding the most of them (ties: lower site number). A group without tokens has none.
    """
    out: list[int | None] = []
    for row in held:
        if not sum(row):
            out.append(None)
            continue
        host_of = [h if h is not None else f"site-{s}" for s, h in enumerate(site_hosts)]
        per_host: dict[str, int] = {}
        for s, n in enumerate(row):
            per_host[host_of[s]] = per_host.get(host_of[s], 0) + n
        host = max(per_host, key=lambda h: (per_host[h], -host_of.index(h)))
        out.append(max((s for s in range(len(row)) if host_of[s] == host), key=lambda s: (row[s], -s)))
    return out


# ---- verify tasks and fetches of one site -------------------------------------------------


def site_tasks(site: int, rollouts: Sequence[int], plans: Sequence[RolloutPlan], token_budget: int) -> list[VerifyTask]:
    """The verify tasks of one site (``rollouts``: its rollout indices, plan order):
    ``rollouts`` cut, in plan order, into consecutive runs whose lengths are the task sizes
    :func:`~tasks.finalize.plan.pack_verify_tasks` gives them. Every site walks the groups
    in the same (submission) order, so the first groups' rows are verified first
    everywhere and can be collected while the later ones are verified.
    """
    tasks: list[VerifyTask] = []
    at = 0
    for packed in pack_verify_tasks([plans[r] for r in rollouts], token_budget):
        tasks.append(VerifyTask(site, tuple(rollouts[at : at + len(packed)])))
        at += len(packed)
    return tasks


def site_fetch(
    tasks: Sequence[tuple[int, VerifyTask]], keys_of: Callable[[RolloutPlan], Sequence[str]], plans: Sequence[RolloutPlan]
) -> SiteFetch:
    """One site's fetch of the rows ``keys_of(rollout)`` of its ``(task number, task)``
    pairs, and its pieces.

    The fetch lists its keys task after task, rollout after rollout: so task ``j``'s rows
    are one contiguous run of the fetch, starting where task ``j - 1``'s ends (the first
    at 0, the last ending at the fetch's length), and the fetch task can hand each verify
    task a view of its rows instead of a copy.
    """
    keys: list[str] = []
    pieces = []
    for t, task in tasks:
        start = len(keys)
        rollout_keys = tuple((r, tuple(keys_of(plans[r]))) for r in task.rollouts)
        for _, ks in rollout_keys:
            keys.extend(ks)
        pieces.append(FetchPiece(t, start, len(keys), rollout_keys))
    return SiteFetch(tuple(keys), tuple(pieces))


# ---- the step --------------------------------------------------------------------------


def _staging_keys(p: RolloutPlan) -> Sequence[str]:
    return p.keys


def _routes_keys(p: RolloutPlan) -> Sequence[str]:
    return p.routes_keys


def _assemble_worker(site_list: Sequence[Site], assembler: int | None, hosts: HostMap | None) -> str | None:
    """The worker an assemble task is pinned to: its site's, or with hosts, the site's
    verify worker (a finalize worker of the site's host)."""
    if assembler is None:
        return None
    site = site_list[assembler]
    return site.verify_worker if hosts is not None else site.worker


def step_layout(
    plan: StepPlan, group_sizes: Sequence[int], unit_workers: Sequence[str], token_budget: int,
    hosts: HostMap | None = None,
) -> StepLayout:
    """The layout of a planned step.

    ``group_sizes[g]``: receipts submitted in group ``g`` (submission order, summing to
    ``len(plan.order)``); ``unit_workers[u]``: the worker hosting storage unit ``u`` (empty:
    the store places no units); ``token_budget``: tokens per verify task, as
    :func:`~tasks.finalize.plan.pack_verify_tasks` packs them; ``hosts``: where the
    workers are (``None``: unknown, every placement by worker only). Each group's
    assembling site holds most of its rows (:func:`group_assemblers`, by host first when
    hosts are known); with hosts, verify and assemble tasks are pinned to a finalize
    worker of their rows' host (:func:`host_worker`). Equal inputs give equal layouts.
    """
    plans = list(plan.rollouts)
    slots = group_slots(plan, group_sizes)
    group_of = [0] * len(plans)
    for g, row in enumerate(slots):
        for s in row:
            if s.index is not None:
                group_of[s.index] = g
    by_site = sites(unit_workers, plans)
    site_hosts = [hosts.hosts.get(w, w) if hosts is not None and w is not None else None for w, _ in by_site]
    tasks: list[VerifyTask] = []
    site_list: list[Site] = []
    for s, (worker, rs) in enumerate(by_site):
        # Numbered on from the tasks of the sites before: a site's tasks are consecutive.
        numbered = list(enumerate(site_tasks(s, rs, plans, token_budget), start=len(tasks)))
        staging, routes = site_fetch(numbered, _staging_keys, plans), site_fetch(numbered, _routes_keys, plans)
        pinned = host_worker(worker, hosts) if hosts is not None and worker is not None else None
        site_list.append(Site(worker, tuple(t for t, _ in numbered), staging, routes, site_hosts[s], pinned))
        tasks.extend(task for _, task in numbered)
    placed = bool(by_site) and by_site[0][0] is not None
    held = [[0] * len(by_site) for _ in slots]
    for s, (_, rs) in enumerate(by_site):
        for r in rs:
            held[group_of[r]][s] += plans[r].n_tokens
    assemblers = group_assemblers(held, site_hosts) if placed else [None] * len(slots)
    task_of = {r: t for t, task in enumerate(tasks) for r in task.rollouts}
    groups = []
    for g, row in enumerate(slots):
        needed = tuple(sorted({task_of[s.index] for s in row if s.index is not None}))
        assembler = assemblers[g] if needed else None
        groups.append(GroupLayout(tuple(row), needed, assembler, _assemble_worker(site_list, assembler, hosts)))
    return StepLayout(tuple(site_list), tuple(tasks), tuple(groups))
