"""ActorPool: the generation actors a driver runs on, one per slot (a Dask worker each).

It starts them (pinned, one per worker), fans a call out to several at once and waits for
every answer (bounded: a hung worker's actor raises :class:`ActorUnresponsive`), tells an
actor that is gone (connection failure, worker left) from one that raised, and drops them
all (:meth:`ActorPool.kill`). A lost actor is replaced by starting a new pool
(:meth:`ActorPool.start`), which is what recovery does.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, TypeVar

from tasks.errors import ActorUnresponsive, DriverError

from ..actors import current_workers, start_pinned_actors, workers_now
from .handles import CutStore, GenerationActor, Pending
from .settings import PoolSettings

if TYPE_CHECKING:
    from distributed import Client, Future

T = TypeVar("T")
# One actor call: (slot, its actor) -> the call in flight.
ActorCall = Callable[[int, GenerationActor], Pending[T]]
MIN_WAIT_S = 0.001  # an answer already due is still taken if it has arrived (s)


class ActorPool:
    """Generation actors by slot; ``workers[slot]`` hosts ``actors[slot]``.

    Holds the actors' futures: the actors live as long as the pool does (or until
    :meth:`kill`). Build with :meth:`start`.
    """

    def __init__(self, client: Client, actors: Sequence[GenerationActor], futures: Sequence[Future],
                 workers: Sequence[str], settings: PoolSettings | None = None):
        self.client = client
        self.actors: list[GenerationActor] = list(actors)
        self.workers: list[str] = list(workers)
        self.settings = settings
        self._futures: list[Future] = list(futures)

    @staticmethod
    def placement(client: Client, n_workers: int | None = None, workers: Sequence[str] | None = None) -> list[str]:
        """The workers to host actors: ``workers`` (default every worker now), the first
        ``n_workers`` of them; :class:`DriverError` if none."""
        chosen = current_workers(client) if workers is None else list(workers)
        if n_workers is not None:
            chosen = chosen[: int(n_workers)]
        if not chosen:
            raise DriverError("no workers to host generation actors")
        return chosen

    @classmethod
    def start(cls, client: Client, workers: Sequence[str], cut_store: CutStore, settings: PoolSettings) -> ActorPool:
        """One GenerationWorker on each of ``workers`` (an address may repeat), writing cut
        prefixes to ``cut_store``."""
        from ..generation.worker import GenerationWorker

        workers = list(workers)
        # Completed calls carry their tokens: the handles talk to their worker directly.
        actors, futures = start_pinned_actors(
            client, GenerationWorker, workers, args=[(cut_store,)] * len(workers),
            policy=dict(settings.policy), with_routes=settings.with_routes,
        )
        return cls(client, actors, futures, workers, settings)

    def __len__(self) -> int:
        return len(self.actors)

    def fan_out(self, slots: Iterable[int], call: ActorCall[T], what: str = "call") -> dict[int, T]:
        """``call`` on the actor of every slot, all issued before any is awaited; the
        answers by slot (in ``slots`` order). The first failure propagates; an actor that
        does not answer within ``driver.actor-call-timeout-s`` raises
        :class:`ActorUnresponsive` naming ``what`` and its worker."""
        pending = {s: call(s, self.actors[s]) for s in slots}
        end = self.call_deadline()
        return {s: await_answer(p, end, self._who(s), what, "driver.actor-call-timeout-s") for s, p in pending.items()}

    def fan_out_surviving(self, slots: Iterable[int], call: ActorCall[T], wait_s: float | None = None,
                          what: str = "call") -> tuple[dict[int, T], dict[int, BaseException]]:
        """:meth:`fan_out`, with actors lost meanwhile: ``(answers, errors)`` by slot, an
        error for each slot whose actor :meth:`is_lost`, or that did not answer within
        ``wait_s`` seconds (None: no bound) of the calls' start (an
        :class:`ActorUnresponsive`); any other failure propagates."""
        pending = {s: call(s, self.actors[s]) for s in slots}
        end = None if wait_s is None else time.monotonic() + wait_s
        answers: dict[int, T] = {}
        lost: dict[int, BaseException] = {}
        for s, p in pending.items():
            try:
                answers[s] = await_answer(p, end, self._who(s), what, "driver.cut-answer-margin-s")
            except Exception as e:
                if not self.is_lost(s, e):
                    raise
                lost[s] = e
        return answers, lost

    def _who(self, slot: int) -> str:
        return f"the generation actor on {self.workers[slot]} (slot {slot})"

    def call_deadline(self) -> float | None:
        """When calls issued now stop being awaited (monotonic s; None: never):
        ``driver.actor-call-timeout-s`` from now."""
        timeout = self.settings.call_timeout_s if self.settings is not None else None
        return None if timeout is None else time.monotonic() + timeout

    def is_lost(self, slot: int, error: BaseException) -> bool:
        """Whether ``error`` (raised by an actor call of ``slot``) means the actor is gone:
        a connection failure, or its worker no longer in the cluster. Other errors are
        the actor's own (a bug, a bad argument) and propagate."""
        if isinstance(error, OSError):  # CommClosedError, refused connect, timeouts
            return True
        return self.in_cluster(slot) is False  # the scheduler cannot say: treat the actor as reachable

    def in_cluster(self, slot: int) -> bool | None:
        """Whether the worker of ``slot`` is registered with the scheduler now (None: the
        scheduler cannot say). A worker that left the cluster took its actor with it."""
        return self.slots_in_cluster([slot])[slot]

    def slots_in_cluster(self, slots: Iterable[int]) -> dict[int, bool | None]:
        """:meth:`in_cluster` of each of ``slots``, from one scheduler query."""
        slots = list(slots)
        try:
            registered = workers_now(self.client)
        except Exception:  # noqa: BLE001 - unknown, not gone
            return dict.fromkeys(slots)
        return {s: self.workers[s] in registered for s in slots}

    def kill(self) -> list[str]:
        """Drop every actor (a simulated crash): release their futures and handles, so the
        workers delete them; their in-flight calls are lost. Returns the actors' keys."""
        keys = [f.key for f in self._futures]
        self.client.cancel(self._futures, force=True)
        self._futures, self.actors = [], []
        return keys


def await_answer(pending: Pending[T], end: float | None, who: str, what: str,
                 setting: str = "driver.actor-call-timeout-s") -> T:
    """``pending``'s answer, waiting until ``end`` (monotonic seconds; None: forever);
    past it :class:`ActorUnresponsive` naming ``who`` (the actor), ``what`` (the call)
    and ``setting`` (the bound)."""
    if end is None:
        return pending.result()
    try:
        return pending.result(timeout=max(end - time.monotonic(), MIN_WAIT_S))
    except TimeoutError as e:
        if isinstance(e, ActorUnresponsive):
            raise
        raise ActorUnresponsive(f"{who} did not answer {what} in time: its worker is hung or stalled; restart that "
                                f"worker and recover from the last cut, or raise {setting}") from None
