"""The unit directory: ONE shared record of which actor serves each storage unit.

A :class:`~pipeline.store.client.StagingStore` is pickled into tasks and actors; when a
lost unit is replaced, every copy must find the replacement. The current
:class:`UnitTable` lives in a Dask ``Variable`` on the scheduler (it survives any worker),
as pickled bytes (actor handles pickle to their address and key). Copies cache the table
they were made with and fetch it again only when a call finds a unit unavailable, so the
common path pays no extra round trip.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Client, Variable

    from .moving import MovingTable
    from .placement import Placement


@dataclass
class UnitTable:
    """Unit handles and their workers, numbered by ``version`` (bumped on each replacement)."""

    version: int
    units: list["Actor"]
    unit_workers: list[str]
    replica: list[int] | None = field(default=None)
    placement: "Placement | None" = None  # the whole table (ids, homes, replicas)
    moving: "MovingTable | None" = None  # a move in progress (``units``: both tables' units)


class UnitDirectory:
    """The named ``Variable`` holding the current :class:`UnitTable`. Picklable (its name)."""

    def __init__(self, name: str):
        self.name = name

    def _variable(self, client: "Client | None" = None) -> "Variable":
        from distributed import Variable

        return Variable(self.name, client)

    def publish(self, client: "Client", table: UnitTable) -> None:
        self._variable(client).set(pickle.dumps(table))

    def fetch(self, timeout: float | None = None) -> UnitTable | None:
        """The current table (sync: a client, a task or an actor thread); None if unreachable."""
        try:
            return pickle.loads(self._variable().get(timeout=timeout))
        except Exception:  # noqa: BLE001 - no client, scheduler gone: keep the cached table
            return None

    async def fetch_async(self, timeout: float | None = None) -> UnitTable | None:
        """The current table from a coroutine on a worker's event loop; None if unreachable."""
        try:
            return pickle.loads(await self._variable().get(timeout=timeout, asynchronous=True))
        except Exception:  # noqa: BLE001
            return None

    def delete(self, client: "Client") -> None:
        try:
            self._variable(client).delete()
        except Exception:  # noqa: BLE001 - the cluster may be gone
            pass
