"""Finalization of one training step as ONE Dask task graph, submitted in one message.

The step's layout (:mod:`tasks.finalize.layout`: sites, verify tasks, fetch pieces,
assembling sites) is computed without Dask; this module only emits its tasks. Per
storage site: one union fetch of the staging rows the site holds (and at most one of
routes), pinned loosely to that worker, cut into one piece per verify task as views;
verify tasks (``finalize`` resource slot) run where their pieces are, so fetched rows
never cross workers. The verify outputs are the graph's results: the controller gathers
them from every site at once and assembles the groups itself
(:mod:`pipeline.finalize.collect`). :func:`submit_assembly` adds one assemble task per
group on the cluster instead, for callers that want the groups there (e.g. fidelity
checks run next to them). The task bodies are in :mod:`pipeline.finalize.worker_tasks`.
"""
from __future__ import annotations

import operator
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import dask
from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
from dask.task_spec import Task, TaskRef
from distributed import span

from tasks.errors import FinalizeError
from tasks.finalize.assemble import Staleness
from tasks.finalize.layout import HostMap, SiteFetch, Slot, StepLayout, step_layout
from tasks.finalize.plan import ReceiptLike, StepPlan, plan_step
from tasks.keys import STAGING_PARTITION, primary_units
from tasks.schema import STAGING_FIELDS, routes_field

from ..store.placement import Placement
from ..store.protocol import PlacedStoreLike
from . import serializers  # noqa: F401  registers how Dask weighs and ships the step's objects
from . import timing
from .settings import FinalizeSettings
from .task_outputs import Piece, ShippedPlans, VerifyOut
from .worker_tasks import assemble_piece, fetch_pieces, verify_piece

if TYPE_CHECKING:
    from distributed import Client, Future

__all__ = ["FinalizeError", "Piece", "StepGraph", "VerifyOut", "affinity", "new_token", "submit_assembly", "submit_graph",
           "task_key"]

# ---- task keys ---------------------------------------------------------------------------
#
# Every key is a tuple ``(f"{kind}-{token}", i)``: Dask's task GROUP is the tuple's name
# (``key_split_group``), so each step's tasks form their own groups and Dask's spans
# charge them to their own step, while the task PREFIX (``key_split``: the name's words
# before the token, shown in the task stream) is the task's kind. ``key_split`` drops an
# 8-letter word starting with a-f as if it were a hex token, so no kind may hold one
# ("assemble" would show as ``tc``: the assemble tasks are ``tc-assembler``).
FETCH_STAGING = "tc-fetch-staging"
FETCH_ROUTES = "tc-fetch-routes"
PIECE = "tc-piece"
VERIFY = "tc-verify"
ASSEMBLE = "tc-assembler"
CLEAR = "tc-clear"

TaskKey = tuple[str, int]


def new_token() -> str:
    """A step's key token: 16 hex digits, never all letters (``key_split`` would keep an
    all-letter token as part of the task prefix)."""
    token = uuid.uuid4().hex[:16]
    return token if not token.isalpha() else "0" + token[1:]


def task_key(kind: str, token: str, index: int = 0) -> TaskKey:
    """The key of task ``index`` of ``kind`` (e.g. :data:`VERIFY`) in the step ``token``."""
    return (f"{kind}-{token}", index)


@dataclass
class StepGraph:
    """The submitted graph of one step: plan, layout and Dask futures. ``span`` is the
    step's span annotation (name and ids), for tasks submitted later (the clear, the
    assembly on the cluster); ``submitted_s`` is wall-clock seconds since the epoch.
    ``verify_futures`` (task order) are the graph's results; ``group_futures`` stay
    empty unless :func:`submit_assembly` assembled the groups on the cluster."""

    step_id: str
    token: str
    plan: StepPlan
    group_ids: list[str]
    slots: dict[str, list[Slot]]
    submitted_s: float
    queue_depth: int
    fetch_futures: list[Future]  # these two are empty unless keep_intermediates
    piece_futures: list[Future]
    verify_futures: list[Future]
    group_futures: dict[str, Future]
    fetch_calls: int
    verify_layout: list[list[int]]  # rollout indices of each verify task
    span: dict[str, Any] | None = None
    layout: StepLayout | None = None
    priority: int = 0  # the step's task priority (older steps higher)
    retries: int = 0  # Dask retries of its tasks
    trainer_version: int | None = None  # the trainer's weight version given at submission
    staleness: Staleness | None = None  # which verified rollouts are dropped stale (None: none)

    @property
    def futures(self) -> list[Future]:
        """What the step's result is made of: the verify tasks' futures, and the groups'
        once assembled on the cluster."""
        return list(self.verify_futures) + list(self.group_futures.values())


def affinity(store: PlacedStoreLike, keys: Sequence[str]) -> list[str]:
    """Workers hosting the units that hold ``keys`` (soft affinity for the fetch task):
    their primaries by the store's placement, or by the default unit ids over its
    ``unit_workers`` for a store without one."""
    workers = list(store.unit_workers)
    if not workers or not keys:
        return []
    placement = getattr(store, "placement", None)
    if isinstance(placement, Placement) and placement.n_units == len(workers):
        where, _ = placement.route(list(keys))
        units = where[where >= 0]
    else:
        units = primary_units(keys, len(workers))
    return sorted({workers[u] for u in set(units.tolist())})


# ---- emitting the layout as tasks ----------------------------------------------------------


@dataclass(frozen=True)
class _StepArgs:
    """What every task of the step is told besides its layout."""

    step_id: str
    token: str
    vocab_size: int
    num_experts: int | None
    fetch_timeout_s: float  # each fetch's store call is bounded by this (s)
    submitted_s: float
    queue_depth: int
    priority: int


def routes_fields(plan: StepPlan) -> list[str]:
    """The routes fields the step's receipts name (one per routes encoding in use: old
    int16 rows and new uint8 rows may share a step). A routes fetch asks for these only,
    so a step of one encoding gets no ``absent_field`` for the other."""
    encodings = {c.routes_encoding for p in plan.rollouts for c in p.chain}
    return [name for name in map(routes_field, sorted(encodings)) if name is not None]


class _Emitter:
    """The step's tasks by layer (in creation order, each layer depending on the ones
    before it), their annotations, and the keys of each kind of task."""

    def __init__(self, store: PlacedStoreLike, plan: StepPlan, layout: StepLayout, args: _StepArgs) -> None:
        self.store, self.plan, self.layout, self.args = store, plan, layout, args
        self.layers: dict[str, dict[TaskKey, Task]] = {}
        self.annotations: dict[str, dict[str, Any]] = {}
        self.fetch_keys: list[TaskKey] = []
        self.piece_keys: list[TaskKey] = []
        self.verify_keys: list[TaskKey] = []
        self.routes_fields = routes_fields(plan)

    def add(self, layer: str, key: TaskKey, func: Callable[..., object], *args: object) -> TaskRef:
        self.layers.setdefault(layer, {})[key] = Task(key, func, *args)
        return TaskRef(key)

    def pin(self, layer: str, worker: str | None) -> None:
        """Run ``layer``'s tasks on ``worker`` if it is up (a soft hint; ``None``: anywhere)."""
        self.annotations[layer] = {"workers": [worker], "allow_other_workers": True} if worker else {}

    def fetch(self, layer: str, kind: str, fields: list[str], fetch: SiteFetch, site: int) -> TaskRef | None:
        """The site's fetch of ``kind`` (cut into its pieces), or None when it reads no row."""
        if not fetch.keys:
            return None
        key = task_key(FETCH_STAGING if kind == "staging" else FETCH_ROUTES, self.args.token, site)
        self.fetch_keys.append(key)
        pieces = [[(r, list(ks)) for r, ks in piece.rollout_keys] for piece in fetch.pieces]
        return self.add(layer, key, fetch_pieces, self.store, list(fetch.keys), fields, pieces, kind,
                        STAGING_PARTITION, site, self.args.fetch_timeout_s)

    def piece(self, layer: str, fetched: TaskRef | None, t: int, j: int, n: int, kind: str) -> TaskRef | None:
        """Verify task ``t``'s piece (``j``-th of the site's ``n``): the fetch itself when
        its site has one task. In the site's layer: unpinned, Dask would take these getitem
        tasks for root tasks and run them on any worker, moving the whole fetch there."""
        if fetched is None or n == 1:
            return fetched
        key = task_key(f"{PIECE}-{kind}", self.args.token, t)
        self.piece_keys.append(key)
        return self.add(layer, key, operator.getitem, fetched, j)

    def site(self, s: int) -> None:
        """Site ``s``'s fetches and pieces (one layer, loosely pinned to its worker) and the
        verify tasks reading them (unpinned: the scheduler runs each where its pieces are)."""
        site, a = self.layout.sites[s], self.args
        layer = f"{FETCH_STAGING}-{a.token}-site{s}"
        self.pin(layer, site.worker)
        staging = self.fetch(layer, "staging", list(STAGING_FIELDS), site.staging, s)
        routes = self.fetch(layer, "routes", self.routes_fields, site.routes, s)
        # A site whose worker takes no finalize work: its verify tasks pinned (loosely) to
        # a finalize worker of its host, so its rows do not leave the host.
        moved = site.verify_worker is not None and site.verify_worker != site.worker
        for j, t in enumerate(site.tasks):
            task = self.layout.tasks[t]
            has_routes = routes is not None and site.routes.pieces[j].stop > site.routes.pieces[j].start
            verify_layer = VERIFY
            if moved:
                verify_layer = f"{VERIFY}-{a.token}-site{s}"
                self.annotations[verify_layer] = {
                    "resources": {"finalize": 1}, "priority": a.priority,
                    "workers": [site.verify_worker], "allow_other_workers": True}
            self.add(
                verify_layer, self.verify_keys[t],
                verify_piece, t, ShippedPlans.pack([(r, self.plan.rollouts[r]) for r in task.rollouts]),
                self.piece(layer, staging, t, j, len(site.tasks), "staging"),
                self.piece(layer, routes, t, j, len(site.tasks), "routes") if has_routes else None,
                a.vocab_size, a.num_experts,
            )

    def emit(self) -> None:
        """Every task of the step: each site's fetches, pieces and verify tasks."""
        a = self.args
        self.verify_keys = [task_key(VERIFY, a.token, t) for t in range(len(self.layout.tasks))]
        for s in range(len(self.layout.sites)):
            self.site(s)
        self.annotations[VERIFY] = {"resources": {"finalize": 1}, "priority": a.priority}

    def graph(self) -> HighLevelGraph:
        names = list(self.layers)
        for name in names:
            self.annotations.setdefault(name, {})
        return HighLevelGraph(
            {name: MaterializedLayer(self.layers[name], annotations=self.annotations[name] or None) for name in names},
            {name: set(names[:i]) for i, name in enumerate(names)},
        )


# ---- planning and submitting a step --------------------------------------------------------


def _check_groups(groups: Mapping[str, Sequence[ReceiptLike]]) -> list[str]:
    """The groups' ids as ``str``; raises :class:`FinalizeError` on an empty step, an empty
    group, or ids that collide once converted."""
    if not groups:
        raise FinalizeError("a step needs at least one group")
    for gid, receipts in groups.items():
        if not isinstance(receipts, Sequence) or isinstance(receipts, (str, bytes)) or not len(receipts):
            raise FinalizeError(f"group {gid!r} has no receipts (expected a non-empty list)")
    group_ids = [str(g) for g in groups]
    if len(set(group_ids)) != len(group_ids):
        raise FinalizeError("group ids collide once converted to str")
    return group_ids


def submit_graph(
    client: Client,
    store: PlacedStoreLike,
    groups: Mapping[str, Sequence[ReceiptLike]],
    *,
    step_id: str,
    settings: FinalizeSettings,
    queue_depth: int = 0,
    priority: int = 0,
    keep_intermediates: bool = False,
    check_groups: bool = True,
    hosts: HostMap | None = None,
    trainer_version: int | None = None,
) -> StepGraph:
    """Plan ``groups`` (group id -> receipts) and submit the step's graph; returns futures.

    With ``check_groups`` (the default) a receipt whose own ``group_id`` names a group
    other than the one it is submitted in is rejected ``wrong_group``; the controller
    turns it off for groups given as a plain list (their ids ``"g0"``, ... are made up).

    Only the verify futures (the graph's results) are held by default, so Dask frees
    fetched rows and pieces as soon as their verify tasks ran (the verified rows are
    views of them: the fetched buffers live until the step is collected);
    ``keep_intermediates=True`` also keeps the fetch and piece futures (debugging, tests).

    ``settings`` are the finalizer's (read once when it was built): the verify token
    budget, retries, the fetch timeout, vocabulary and expert bounds. Tasks of a step share ``priority`` (the controller gives older
    steps a higher one, so several steps in flight drain in order).

    Placement (soft hints, see :mod:`tasks.finalize.layout`): each site's fetches on the
    worker hosting its units; verify tasks where their pieces are. ``hosts`` (where the
    workers are): verify tasks (and the groups' assemble tasks, when
    :func:`submit_assembly` asks for them) on a finalize worker of their rows' host
    (:func:`tasks.finalize.layout.step_layout`).

    ``trainer_version`` (the trainer's weight version) with ``settings.max_staleness``:
    verified rollouts lagging it by more than that are rejected ``stale`` at assembly.
    """
    group_ids = _check_groups(groups)
    token_budget, retries = settings.verify_token_budget, settings.retries
    token = new_token()
    plan = plan_step(dict(zip(group_ids, groups.values())) if check_groups else [r for g in groups.values() for r in g])
    unit_workers = list(getattr(store, "unit_workers", None) or ())
    layout = step_layout(plan, [len(receipts) for receipts in groups.values()], unit_workers, token_budget, hosts)
    slots = {gid: list(group.slots) for gid, group in zip(group_ids, layout.groups)}
    args = _StepArgs(step_id, token, settings.vocab_size, settings.num_experts, settings.fetch_timeout_s,
                     timing.wall_s(), queue_depth, priority)
    # The whole step goes to the scheduler as ONE graph (one message, however many tasks).
    emitter = _Emitter(store, plan, layout, args)
    emitter.emit()
    intermediates = emitter.fetch_keys + emitter.piece_keys
    wanted = emitter.verify_keys + (intermediates if keep_intermediates else [])
    with span("token-capture", "finalize", step_id):
        span_annotation = dask.get_annotations().get("span")
        futures = client.get(emitter.graph(), wanted, sync=False, retries=retries or None, priority=priority, fifo_timeout="100ms")
    by_key = dict(zip(wanted, futures))  # intermediates only with keep_intermediates
    return StepGraph(
        step_id=step_id,
        token=token,
        plan=plan,
        group_ids=group_ids,
        slots=slots,
        submitted_s=args.submitted_s,
        queue_depth=queue_depth,
        fetch_futures=[by_key[k] for k in emitter.fetch_keys if k in by_key],
        piece_futures=[by_key[k] for k in emitter.piece_keys if k in by_key],
        verify_futures=[by_key[k] for k in emitter.verify_keys],
        group_futures={},
        fetch_calls=len(emitter.fetch_keys),
        verify_layout=[list(task.rollouts) for task in layout.tasks],
        span=span_annotation,
        layout=layout,
        priority=priority,
        retries=retries,
        trainer_version=trainer_version,
        staleness=None if trainer_version is None or settings.max_staleness is None
        else Staleness(trainer_version, settings.max_staleness),
    )


def submit_assembly(client: Client, graph: StepGraph) -> dict[str, Future]:
    """One assemble task per group of a submitted step, on the cluster (group id ->
    future of its :class:`~tasks.finalize.assemble.FinalizedGroup`, submission order),
    each pinned (loosely) where the layout assembles it and publishing its group event
    there. The step's verify futures must still be held (the step not collected)."""
    layout = graph.layout
    if layout is None or len(graph.verify_futures) != len(layout.tasks):
        raise FinalizeError(f"step {graph.step_id!r}: its verify results are gone (collected or cancelled)")
    futures: dict[str, Future] = {}
    with dask.annotate(**({"span": graph.span} if graph.span else {})):
        for g, (gid, group) in enumerate(zip(graph.group_ids, layout.groups)):
            deps = [graph.verify_futures[t] for t in group.tasks]
            futures[gid] = client.submit(
                assemble_piece, graph.step_id, gid, graph.slots[gid], graph.submitted_s, graph.queue_depth, *deps,
                key=task_key(ASSEMBLE, graph.token, g), pure=False, priority=graph.priority,
                workers=[group.worker] if group.worker else None, allow_other_workers=True,
                retries=graph.retries or None, staleness=graph.staleness,
            )
    return futures
