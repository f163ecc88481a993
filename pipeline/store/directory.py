"""The unit directory: ONE shared record of which actor serves each storage unit.

A :class:`~pipeline.store.client.StagingStore` is pickled into tasks and actors; when a
lost unit is replaced, every copy must find the replacement. The current
:class:`UnitTable` lives in a Dask ``Variable`` on the scheduler (it survives any worker),
as pickled bytes (actor handles pickle to their address and key). Copies cache the table
they were made with and fetch it again only when a call finds a unit unavailable, so the
common path pays no extra round trip. Closing the store replaces the table by a marker
(:meth:`UnitDirectory.close`): a copy of a closed store's handle learns at once that no
table will come, instead of waiting for one.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Actor, Client, Variable

    from .moving import MovingTable
    from .placement import Placement

logger = logging.getLogger(__name__)

POLL_S = 0.05  # between fetches while waiting for a newer table (s)
FETCH_TIMEOUT_S = 2.0  # how long a fetch waits for a table that does not exist (s)
CLOSED = b"token-capture-store-closed"  # the directory's value once its store is closed
MOVED_WAIT_S = 5.0  # how long a handle a unit answered ``moved`` waits for the newer table to show (s)


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
    """The named ``Variable`` holding the current :class:`UnitTable`. Picklable (its name).
    ``closed``: a fetch found the store closed (no table will come)."""

    def __init__(self, name: str):
        self.name = name
        self.closed = False

    def _variable(self, client: "Client | None" = None) -> "Variable":
        from distributed import Variable

        return Variable(self.name, client)

    def publish(self, client: "Client", table: UnitTable) -> None:
        self._variable(client).set(pickle.dumps(table))

    def fetch(self, timeout: float = FETCH_TIMEOUT_S, quiet: bool = False) -> UnitTable | None:
        """The current table (sync: a client, a task or an actor thread); None if
        unreachable, absent after ``timeout`` seconds (logged unless ``quiet``) or closed
        (``closed`` set)."""
        try:
            return self._table(self._variable().get(timeout=timeout))
        except Exception as e:  # noqa: BLE001 - no client, scheduler gone: keep the cached table
            if not quiet:
                _log_failed(self.name, e)
            return None

    async def fetch_async(self, timeout: float = FETCH_TIMEOUT_S, quiet: bool = False) -> UnitTable | None:
        """:meth:`fetch` from a coroutine on a worker's event loop."""
        try:
            return self._table(await self._variable().get(timeout=timeout, asynchronous=True))
        except Exception as e:  # noqa: BLE001
            if not quiet:
                _log_failed(self.name, e)
            return None

    def _table(self, value: bytes) -> UnitTable | None:
        """The table a fetch got; None (and ``closed`` set) for a closed store's marker."""
        if value == CLOSED:
            self.closed = True
            return None
        return pickle.loads(value)

    def fetch_newer(self, version: int, moved: bool = False) -> UnitTable | None:
        """The current table; with ``moved`` (a unit refused a call as planned on an older
        table, so a newer one is published or the fetch failed) fetched again every
        ``POLL_S`` for up to ``MOVED_WAIT_S`` while it is not newer than ``version``. The
        last fetched (None if unreachable or closed) when none came; a run of failed
        fetches is logged once."""
        end = time.monotonic() + (MOVED_WAIT_S if moved else 0.0)
        table = self.fetch()
        while self._waiting(table, version, end):
            time.sleep(POLL_S)
            table = self.fetch(quiet=table is None)
        return table

    async def fetch_newer_async(self, version: int, moved: bool = False) -> UnitTable | None:
        """:meth:`fetch_newer` from a coroutine."""
        end = time.monotonic() + (MOVED_WAIT_S if moved else 0.0)
        table = await self.fetch_async()
        while self._waiting(table, version, end):
            await asyncio.sleep(POLL_S)
            table = await self.fetch_async(quiet=table is None)
        return table

    def _waiting(self, table: UnitTable | None, version: int, end: float) -> bool:
        """Fetch again: no table newer than ``version`` yet, the store not closed, time left."""
        return (table is None or table.version <= version) and not self.closed and time.monotonic() < end

    def close(self, client: "Client") -> None:
        """The store is closed: the table (and the actor handles it pickles) is replaced by
        the :data:`CLOSED` marker, which stays (a few bytes on the scheduler), so a copy's
        fetch answers at once."""
        try:
            self._variable(client).set(CLOSED)
        except Exception:  # noqa: BLE001 - the cluster may be gone
            pass


def _log_failed(name: str, error: Exception) -> None:
    if isinstance(error, TimeoutError):
        logger.warning("unit directory %s: no table within %.0f s (the directory does not exist)", name, FETCH_TIMEOUT_S)
    else:
        logger.warning("unit directory %s: the table could not be fetched (%s: %s)", name, type(error).__name__, error)
