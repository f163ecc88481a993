"""The step's tail on the controller: its verified rows gathered, its groups assembled there.

A step's verify tasks run where their rows are stored; each answers its rollouts'
training rows as views of the rows it fetched (a :class:`~pipeline.finalize.task_outputs.VerifyOut`,
shipped as one buffer per field: :mod:`pipeline.finalize.serializers`). The controller
gathers every verify output straight from the workers holding them (all sites at once)
and pads each group into its training tensors here, into memory this process already
touched (its receive pool), so no row crosses between workers, no worker assembles while
another idles, and every byte of the tensors moves once. Units: ``_ms`` milliseconds,
``_s`` wall-clock seconds since the epoch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from tasks.finalize.assemble import BufferSource

from ..store import receive_pool
from .task_outputs import VerifyOut
from .worker_tasks import assemble_outs

if TYPE_CHECKING:
    from distributed import Client, Future

    from tasks.finalize.assemble import FinalizedGroup

    from .graph import StepGraph

__all__ = ["assemble_step", "gather", "gather_as_done", "pooled_buffers", "publish"]


def _direct(client: Client, gather_direct: bool) -> bool:
    direct = getattr(client, "direct_to_workers", None)
    return gather_direct if direct is None else bool(direct)


def gather(client: Client, futures: Sequence[Future], timeout: float | None, gather_direct: bool) -> list:
    """The futures' results, in order, straight from the workers holding them
    (``gather_direct``, unless the client was made with ``direct_to_workers`` set):
    through the scheduler every byte would cross the network twice. ``timeout`` (s)
    bounds the wait for every future. Large frames land in this process's receive pool
    (memory it already touched: the previous step's, once released)."""
    from distributed import wait

    if timeout is not None:
        wait(list(futures), timeout=timeout)
    receive_pool.install()
    return client.gather(list(futures), errors="raise", direct=_direct(client, gather_direct))


def gather_as_done(client: Client, futures: Sequence[Future], timeout: float | None, gather_direct: bool) -> list:
    """:func:`gather`, each batch of futures fetched as soon as it is done: the rows of
    the sites that finished verifying travel while the others still verify. ``timeout``
    (s) bounds the whole wait (``TimeoutError`` past it); a failed task raises its
    exception."""
    from distributed import as_completed

    receive_pool.install()
    direct = _direct(client, gather_direct)
    index = {f.key: i for i, f in enumerate(futures)}
    out: list = [None] * len(futures)
    for batch in as_completed(list(futures), timeout=timeout).batches():
        for f, value in zip(batch, client.gather(batch, errors="raise", direct=direct)):
            out[index[f.key]] = value
    return out


def pooled_buffers() -> BufferSource:
    """Where the controller's assembled tensors go: slabs of its receive pool (one per
    group), reused once the caller drops a step's tensors; plain memory when the pool is
    full or off (``store.receive-buffer-bytes``)."""
    pool = receive_pool.pool()
    return pool.allocator


def assemble_step(graph: StepGraph, outs: Sequence[VerifyOut], buffers: BufferSource | None = None) -> dict[str, FinalizedGroup]:
    """Every group of ``graph`` (submission order) from its verify outputs (``outs[t]``:
    verify task ``t``'s); each group's metrics are its group event."""
    layout = graph.layout
    if layout is None:  # pragma: no cover - submit_graph always sets it
        raise ValueError("a step graph without its layout cannot be assembled")
    groups: dict[str, FinalizedGroup] = {}
    for gid, group in zip(graph.group_ids, layout.groups):
        mine = [outs[t] for t in group.tasks]
        groups[gid] = assemble_outs(graph.step_id, gid, graph.slots[gid], graph.submitted_s, graph.queue_depth, mine, buffers,
                                    staleness=graph.staleness)
    return groups


def publish(client: Client, topic: str, payloads: Sequence[Mapping[str, object]]) -> None:
    """Log ``payloads`` (in order) under ``topic`` from the controller, without waiting:
    one coroutine on the client's event loop sends them one after the other (a blocking
    ``log_event`` is one round trip to the scheduler each). Never raises: metrics must not
    fail the work they describe; an event the scheduler does not take is dropped."""
    msgs = [dict(p) for p in payloads]

    async def send() -> None:
        for msg in msgs:
            try:
                await client.scheduler.log_event(topic=topic, msg=msg)
            except Exception:  # noqa: BLE001 - the scheduler is gone or refused it
                return

    try:
        client.loop.add_callback(send)
    except Exception:  # noqa: BLE001 - a closed client
        pass
