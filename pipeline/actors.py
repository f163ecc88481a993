"""Actors pinned to one worker each: start them, and handles that fail fast.

Storage units, generation workers and prefix-read batchers hold state that lives on their
worker and nowhere else: a recreated actor would be empty, so they never move. This module
starts such actors (:func:`start_pinned_actors`) and provides the handles to call them:
:class:`PinnedActor` (fails fast when the worker is gone) and :class:`DirectActor` (a
client's calls go straight to the worker, not through the scheduler).
"""
from __future__ import annotations

import concurrent.futures
import uuid
from typing import Any, Callable, Sequence

from distributed import Actor, Client, Future

from . import config, dask_compat


class PinnedActor(dask_compat.FailFastActor):
    """An actor handle that fails fast when its worker is gone.

    A plain ``Actor`` handle that holds its task's future awaits that future on a connection
    error, i.e. forever for a pinned task whose worker died. This handle keeps that future
    only to keep the actor alive (as a plain handle does), out of the retry path, so the
    call fails with ``OSError`` after the connect timeout and the caller reports the
    actor's work as unavailable (the store: its keys ``unit_unavailable``). The mechanics
    live in :class:`pipeline.dask_compat.FailFastActor`.
    """


class DirectActor(PinnedActor):
    """A pinned actor handle whose calls from a client go straight to the hosting worker.

    Dask's default (``distributed.client.direct-to-workers: null``) routes a client's actor
    calls through the scheduler, which copies every argument and answer twice more; staged
    batches are megabytes, so handles talk to their worker directly (config
    ``token-capture.store.direct-to-workers``; calls from workers are direct anyway).
    """

    direct_to_worker = True


def current_workers(client: Client) -> list[str]:
    """Addresses of every worker connected now, sorted (a stable placement order)."""
    return sorted(workers_now(client))


def workers_now(client: Client) -> dict[str, dict[str, Any]]:
    """Every worker connected now (address -> its identity: name, resources, ...), asked
    of the scheduler in one call (a sync client).

    Not ``Client.scheduler_info(n_workers=-1)["workers"]``: that answers the client's cached
    identity after refreshing it, and the client's periodic refresh (which asks for no
    workers) can replace the cache in between, so under load it answered no worker at all.
    ``client.scheduler.identity`` is the call distributed's own docstring points to."""
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def pinned_handle(actor: Actor) -> PinnedActor:
    """The handle to use for ``actor``: direct to its worker or through the scheduler,
    as ``token-capture.store.direct-to-workers`` says; fails fast either way."""
    handle = DirectActor if config.get("store.direct-to-workers") else PinnedActor
    return handle.from_actor(actor)


def start_pinned_actors(
    client: Client,
    cls: type,
    workers: Sequence[str],
    args: Sequence[tuple] = (),
    keys: Sequence[str] | None = None,
    **kwargs: object,
) -> tuple[list[PinnedActor], list[Future]]:
    """Start one ``cls`` actor on each of ``workers`` (an address may repeat), pinned there.

    ``args[i]`` are actor ``i``'s positional arguments (none when ``args`` is empty);
    ``kwargs`` go to every constructor. Keys default to ``"{cls name}-{random tag}-{i}"``.
    Returns the handles (see :func:`pinned_handle`) and the actor futures; keep the futures
    for as long as the actors must live.
    """
    workers = list(workers)
    if args and len(args) != len(workers):
        raise ValueError(f"{len(args)} argument tuples for {len(workers)} actors")
    if keys is None:
        tag = uuid.uuid4().hex[:8]
        keys = [f"{cls.__name__}-{tag}-{i}" for i in range(len(workers))]
    futures = [
        client.submit(
            cls, *(args[i] if args else ()), actor=True, workers=[addr], allow_other_workers=False,
            key=keys[i], **kwargs,
        )
        for i, addr in enumerate(workers)
    ]
    actors = client.gather(futures)
    return [pinned_handle(a) for a in actors], futures


def local_call(handle: Actor, method: str) -> Callable[..., concurrent.futures.Future] | None:
    """``call(*args) -> Future`` running ``handle``'s ``method`` on its own actor thread in
    THIS process, when this thread runs on the worker hosting the actor (a task there);
    ``None`` otherwise. The call skips the socket and serialization of an actor call to
    the same worker, and keeps the actor's one-thread rule (methods still run on the
    worker's actor thread, one at a time). Never from the actor thread itself: waiting on
    it there would wait forever."""
    instance = local_instance(handle)
    if instance is None:
        return None
    from distributed import get_worker

    worker = get_worker()
    if dask_compat.in_actor_thread(worker):
        return None
    executor = dask_compat.actor_executor(worker)
    bound = getattr(instance, method)
    return lambda *args: executor.submit(bound, *args)


def local_instance(handle: Actor) -> object | None:
    """The object behind actor ``handle`` when it lives in THIS worker process (asked from
    a task, an actor method or the worker's loop there); ``None`` elsewhere."""
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not on a worker
        return None
    return dask_compat.hosted_actor(worker, getattr(handle, "key", None))
