"""Bytes a step's tasks moved between hosts, as the scheduler saw them.

:class:`CrossHostTransfers` is a ``SchedulerPlugin`` (installed by the
:class:`~pipeline.finalize.Finalizer`, ``client.register_plugin``). Its ``transition``
hook sees every task finish (``processing -> memory``, with the worker that ran it and
the result's size in bytes, the fields distributed passes to plugins) and, through the
scheduler's task states, the task's dependencies. A dependency not yet held by that
worker was fetched into it: the fetch crosses hosts when no worker holding the
dependency is on the same host (a worker fetches from a holder on its own host when it
can). Its bytes (the dependency's ``nbytes``, what Dask weighs it at) are charged to the
step whose token is in the finishing task's key. The controller reads (and forgets) a
step's figure through the ``token_capture_cross_host`` handler once the step is collected,
or through ``token_capture_step_collected``, which also logs the step's finalize events
(its groups' and, with the figure filled in, its own) in the same round trip.

What it counts: worker-to-worker transfers of the step's own tasks. Not counted: the
store calls the fetch tasks make (a site's fetch runs on the worker hosting its units) and
the controller's gather of the groups (the controller is not a worker).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Sequence, TypedDict

from distributed.diagnostics.plugin import SchedulerPlugin

from .timing import with_cross_host

if TYPE_CHECKING:
    from distributed import Client
    from distributed.scheduler import Scheduler

PLUGIN_NAME = "token-capture-cross-host"
HANDLER = "token_capture_cross_host"
COLLECTED_HANDLER = "token_capture_step_collected"
# Steps whose figure nobody read are forgotten past this many (bounded memory).
KEEP_STEPS = 256


class CrossHost(TypedDict):
    """One step's worker-to-worker transfers: ``bytes`` across hosts and ``transfers``
    (count) across hosts; ``local_bytes`` between workers of one host."""

    bytes: int
    transfers: int
    local_bytes: int


def host_of(address: str) -> str:
    """A worker address's host part: ``tcp://127.0.0.3:4000`` -> ``127.0.0.3``."""
    rest = address.split("://", 1)[-1]
    return rest[1:].split("]", 1)[0] if rest.startswith("[") else rest.rsplit(":", 1)[0]


def step_token(key: object) -> str | None:
    """The step token of a finalize task key (``("tc-verify-<token>", i)``), else None."""
    name = key[0] if isinstance(key, tuple) and key else key
    if not isinstance(name, str) or not name.startswith("tc-"):
        return None
    return name.rsplit("-", 1)[-1]


class CrossHostTransfers(SchedulerPlugin):
    """Counts, per finalize step, the bytes its tasks' inputs crossed hosts (see module)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Scheduler | None = None
        self.holders: dict[Any, set[str]] = {}  # finalize key -> workers holding it
        self.steps: OrderedDict[str, CrossHost] = OrderedDict()

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers[HANDLER] = self._handle
        scheduler.handlers[COLLECTED_HANDLER] = self._collected

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        token = step_token(key)
        if token is None:
            return
        if finish in ("released", "forgotten", "erred"):
            self.holders.pop(key, None)
            return
        worker = kwargs.get("worker")
        if start != "processing" or finish != "memory" or not isinstance(worker, str) or self.scheduler is None:
            return
        ts = self.scheduler.tasks.get(key)
        self.holders[key] = {worker}
        if ts is None:
            return
        here = host_of(worker)
        for dep in ts.dependencies:
            held = self.holders.get(dep.key)
            if held is None or worker in held:
                continue
            figures = self._step(token)
            if any(host_of(w) == here for w in held):
                figures["local_bytes"] += int(dep.nbytes or 0)
            else:
                figures["bytes"] += int(dep.nbytes or 0)
                figures["transfers"] += 1
            held.add(worker)

    def _step(self, token: str) -> CrossHost:
        figures = self.steps.get(token)
        if figures is None:
            figures = self.steps[token] = {"bytes": 0, "transfers": 0, "local_bytes": 0}
            while len(self.steps) > KEEP_STEPS:
                self.steps.popitem(last=False)
        return figures

    def _handle(self, token: str) -> CrossHost:
        """The step's figures, forgotten once read (zeros: nothing crossed workers)."""
        return self.steps.pop(token, None) or {"bytes": 0, "transfers": 0, "local_bytes": 0}

    def _collected(self, token: str, topic: str, events: Sequence[dict[str, Any]]) -> CrossHost:
        """:meth:`_handle`, and ``events`` logged under ``topic`` in order, the last (the
        step's) with the figure filled in (:func:`~pipeline.finalize.timing.with_cross_host`)."""
        figures = self._handle(token)
        events = list(events)  # a tuple, as msgpack hands it
        if events and self.scheduler is not None:
            events[-1] = with_cross_host(events[-1], figures["bytes"])
            for msg in events:
                self.scheduler.log_event(topic, msg)
        return figures


def install(client: Client) -> bool:
    """Register the plugin on ``client``'s scheduler (idempotent); False when the
    scheduler refused it (then steps report no measured cross-host bytes)."""
    try:
        client.register_plugin(CrossHostTransfers(), name=PLUGIN_NAME)
        return True
    except Exception:  # noqa: BLE001 - a figure never stops the work it describes
        return False


def collected(client: Client, token: str, topic: str, events: list[dict[str, Any]]) -> CrossHost | None:
    """Step ``token``'s figures (forgotten on the scheduler) and its ``events`` logged
    there under ``topic``, in one round trip; None when that failed (nothing logged)."""
    try:
        return client.sync(getattr(client.scheduler, COLLECTED_HANDLER), token=token, topic=topic, events=events)
    except Exception:  # noqa: BLE001 - metrics never fail the work they describe
        return None


def read(client: Client, token: str) -> CrossHost | None:
    """Step ``token``'s figures from the scheduler (one round trip), forgotten there; None
    when they cannot be read."""
    try:
        return client.sync(client.scheduler.token_capture_cross_host, token=token)
    except Exception:  # noqa: BLE001 - metrics never fail the work they describe
        return None
