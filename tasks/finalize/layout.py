"""Where a step's work happens: sites, verify tasks, fetch pieces and assembling sites.

:func:`step_layout` turns a :class:`~tasks.finalize.plan.StepPlan` and the store's unit
placement (plain values: which worker hosts each storage unit) into a frozen
:class:`StepLayout`. Receipts are indexed four ways: rollout (``plan.rollouts``), verify
task, site and group; the layout keeps all four in one value, so the Dask graph only
emits tasks from it and every placement rule is testable without Dask.
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
    """One verify task: ``rollouts`` (indices into the plan, fetch order) of one ``site``.

    ``ships``: the task's rollouts are assembled on another site, so their verified rows
    cross workers once; such tasks run before the site's own (a higher priority).
    """

    site: int
    rollouts: tuple[int, ...]
    ships: bool


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
    each group is assembled where :func:`group_assemblers` says.
    """

    sites: tuple[Site, ...]
    tasks: tuple[VerifyTask, ...]
    groups: tuple[GroupLayout, ...]

    def crossing_tasks(self) -> list[int]:
        """Verify tasks whose output crosses hosts: run on one host, read by an assemble
        task pinned to another (each such output travels once: every group reading a task
        is assembled on the same site). Empty when hosts are unknown."""
        to_host = {t: self.sites[g.assembler].host for g in self.groups if g.assembler is not None for t in g.tasks}
        return [t for t, task in enumerate(self.tasks)
                if self.sites[task.site].host is not None and t in to_host and to_host[t] != self.sites[task.site].host]


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


def assembly_clusters(tokens: Sequence[int], k: int) -> list[int]:
    """Split groups (``tokens[g]``: group ``g``'s planned tokens, submission order) into
    ``k`` runs of about equal tokens: group ``g`` is in run ``result[g]``.

    The rule: with ``total`` the step's tokens and ``mid[g]`` the token position of group
    ``g``'s midpoint (tokens of the groups before it plus half its own), group ``g`` is
    in run ``min(k - 1, floor(k * mid[g] / total))`` (run 0 when ``total`` is 0). Runs
    are therefore contiguous in submission order and never decrease.
    """
    total = sum(tokens)
    out, before = [], 0
    for n in tokens:
        mid = before + n / 2
        out.append(min(k - 1, int(k * mid / total)) if total else 0)
        before += n
    return out


def assembly_runs(site_tokens: Sequence[int], token_budget: int) -> int:
    """How many runs of groups the step's assembly is split into (``site_tokens[s]``: the
    planned tokens site ``s`` holds; ``token_budget``: tokens per verify task).

    ``min(sites, max(1, ceil(max(site_tokens) / token_budget)))``: one run unless a site
    holds more than one verify budget, since a run is one more verify task per site, which
    costs more than it saves on a small step.
    """
    return min(len(site_tokens), max(1, -(-max(site_tokens, default=0) // token_budget)))


def group_assemblers(site_tokens: Sequence[int], group_tokens: Sequence[int], runs: int) -> list[int]:
    """The site assembling each group (``group_tokens[g]``: group ``g``'s planned tokens,
    submission order), for a store placing units.

    The rule: the groups are split into ``runs`` runs (:func:`assembly_clusters`) and run
    ``c`` is assembled on the site holding the ``c``-th most tokens (ties: lower site
    number first). With one run, the site holding the most tokens of the step assembles
    every group. The rule balances assembly over sites; it does not look at where a
    group's own rows are.
    """
    heaviest_first = sorted(range(len(site_tokens)), key=lambda s: -site_tokens[s])
    return [heaviest_first[c] for c in assembly_clusters(group_tokens, runs)]


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


def host_assemblers(
    site_hosts: Sequence[str], tokens: Sequence[Sequence[int]], chosen: Sequence[int]
) -> list[int]:
    """Each group's assembling site moved to the host holding most of its rows.

    ``site_hosts[s]``: site ``s``'s host; ``tokens[g][s]``: group ``g``'s planned tokens
    held by site ``s``; ``chosen[g]``: the site :func:`group_assemblers` gave it. The rule:
    group ``g``'s host is the one whose sites hold the most of its tokens (ties: the host
    of the lowest site number). ``chosen[g]`` stays if it is on that host, else the site
    on that host holding most of the group's tokens (ties: lower site number). A group
    without tokens keeps its site.
    """
    out = []
    for g, row in enumerate(tokens):
        per_host: dict[str, int] = {}
        for s, n in enumerate(row):
            per_host[site_hosts[s]] = per_host.get(site_hosts[s], 0) + n
        if not sum(row):
            out.append(chosen[g])
            continue
        host = max(per_host, key=lambda h: (per_host[h], -site_hosts.index(h)))
        if site_hosts[chosen[g]] == host:
            out.append(chosen[g])
        else:
            out.append(max((s for s in range(len(row)) if site_hosts[s] == host), key=lambda s: (row[s], -s)))
    return out


# ---- verify tasks and fetches of one site -------------------------------------------------


def site_tasks(
    site: int,
    rollouts: Sequence[int],
    plans: Sequence[RolloutPlan],
    group_of: Sequence[int],
    assemblers: Sequence[int] | None,
    token_budget: int,
) -> list[VerifyTask]:
    """The verify tasks of one site (``rollouts``: its rollout indices, plan order;
    ``group_of[r]``: rollout ``r``'s group; ``assemblers[g]``: the site assembling group
    ``g``, ``None``: every group is assembled anywhere, counted as this site).

    The site's rollouts are split by the site assembling their group, those assembled
    elsewhere first (ascending site), then its own. Each split, in plan order, is cut into
    consecutive runs whose lengths are the task sizes
    :func:`~tasks.finalize.plan.pack_verify_tasks` gives it (group-aligned). Every
    rollout of the site lands in exactly one task: the splits partition ``rollouts`` and
    the sizes of a split sum to its length.
    """
    def assembler(r: int) -> int:
        return site if assemblers is None else assemblers[group_of[r]]

    tasks: list[VerifyTask] = []
    for c in sorted({assembler(r) for r in rollouts}, key=lambda c: (c == site, c)):
        mine = [r for r in rollouts if assembler(r) == c]
        at = 0
        for packed in pack_verify_tasks([plans[r] for r in mine], token_budget, [group_of[r] for r in mine]):
            tasks.append(VerifyTask(site, tuple(mine[at : at + len(packed)]), ships=c != site))
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
    workers are (``None``: unknown, every placement by worker only). With hosts, each
    group is assembled on the host holding most of its rows (:func:`host_assemblers`) and
    verify and assemble tasks are pinned to a finalize worker of their rows' host
    (:func:`host_worker`). Equal inputs give equal layouts.
    """
    plans = list(plan.rollouts)
    slots = group_slots(plan, group_sizes)
    group_of = [0] * len(plans)
    for g, row in enumerate(slots):
        for s in row:
            if s.index is not None:
                group_of[s.index] = g
    by_site = sites(unit_workers, plans)
    site_tokens = [sum(plans[r].n_tokens for r in rs) for _, rs in by_site]
    runs = assembly_runs(site_tokens, token_budget)
    group_tokens = [sum(plans[s.index].n_tokens for s in row if s.index is not None) for row in slots]
    placed = bool(by_site) and by_site[0][0] is not None
    assemblers = group_assemblers(site_tokens, group_tokens, runs) if placed else None
    site_hosts = [hosts.hosts.get(w, w) if hosts is not None and w is not None else None for w, _ in by_site]
    if assemblers is not None and hosts is not None:
        site_of = {r: s for s, (_, rs) in enumerate(by_site) for r in rs}
        held = [[0] * len(by_site) for _ in slots]
        for r, p in enumerate(plans):
            held[group_of[r]][site_of[r]] += p.n_tokens
        assemblers = host_assemblers([h or "" for h in site_hosts], held, assemblers)
    tasks: list[VerifyTask] = []
    site_list: list[Site] = []
    for s, (worker, rs) in enumerate(by_site):
        # Numbered on from the tasks of the sites before: a site's tasks are consecutive.
        numbered = list(enumerate(site_tasks(s, rs, plans, group_of, assemblers, token_budget), start=len(tasks)))
        staging, routes = site_fetch(numbered, _staging_keys, plans), site_fetch(numbered, _routes_keys, plans)
        pinned = host_worker(worker, hosts) if hosts is not None and worker is not None else None
        site_list.append(Site(worker, tuple(t for t, _ in numbered), staging, routes, site_hosts[s], pinned))
        tasks.extend(task for _, task in numbered)
    task_of = {r: t for t, task in enumerate(tasks) for r in task.rollouts}
    groups = []
    for g, row in enumerate(slots):
        needed = tuple(sorted({task_of[s.index] for s in row if s.index is not None}))
        assembler = assemblers[g] if assemblers is not None and needed else None
        groups.append(GroupLayout(tuple(row), needed, assembler, _assemble_worker(site_list, assembler, hosts)))
    return StepLayout(tuple(site_list), tuple(tasks), tuple(groups))
