"""Asking the scheduler's store host for a store that outlives the asking process.

:func:`start_hosted` sends the caller's own store settings (units, replicas, memory limit,
capacity, spill directory, per-handle settings) to the :class:`~pipeline.store.host.StoreHost`
plugin, which starts the store from the scheduler process and publishes its handle under
``name``; the caller gets that handle back (it owns nothing: dying loses nothing).
:func:`close_hosted` ends such a store from any process; :func:`hosted_stores` lists them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tasks.errors import StoreUnavailable

from .. import config
from .host_messages import HostedStoreInfo
from .owner import unit_args_from_config
from .settings import StoreSettings

if TYPE_CHECKING:  # pragma: no cover
    from distributed import Client

    from .protocol import PlacedStoreLike

NO_HOST = (
    "the scheduler at {address} has no token-capture store host; start it with "
    "`dask scheduler --preload pipeline.dashboard.preload` or pipeline.dashboard.install(client)"
)


def start_hosted(
    client: Client,
    name: str | None = None,
    n_units: int | None = None,
    memory_limit: int | str | None = None,
    capacity: int | str | None = None,
    spill_directory: str | None = None,
    workers: Sequence[str] | None = None,
) -> PlacedStoreLike:
    """Start a store owned by the scheduler process and return its handle (a
    :class:`~pipeline.store.client.StagingStore`).

    ``name`` (default ``capture-client.store-name``) is the Dask dataset it is published
    under; the other arguments mean what they mean for ``StagingStore.start`` and default
    to THIS process's ``token-capture.store.*`` config (``replicas`` included).
    Raises :class:`~tasks.errors.StoreUnavailable` when the scheduler has no store host,
    :class:`~tasks.errors.InvalidStoreRequest` when a store of that name is hosted."""
    name = store_name(name)
    args = unit_args_from_config(memory_limit, capacity, spill_directory)
    message = {
        "name": name,
        "n_units": int(config.get("store.units") if n_units is None else n_units),
        "replicas": int(config.get("store.replicas")),
        "memory_limit": args.memory_limit,
        "capacity": args.capacity,
        "spill_directory": args.spill_directory,
        "workers": None if workers is None else list(workers),
        "store_settings": dataclasses.asdict(StoreSettings.from_config()),
    }
    _call(client, "token_capture_store_start", **message)
    return client.get_dataset(name)  # the host published it before answering


def close_hosted(client: Client, name: str | None = None) -> list[dict]:
    """Close the hosted store ``name``: its units, its repairer, its actors and dataset.
    Returns each unit's close record."""
    return _call(client, "token_capture_store_close", name=store_name(name))


def hosted_stores(client: Client) -> list[HostedStoreInfo]:
    """Every store the scheduler hosts (name, units, workers, version, repairs)."""
    return _call(client, "token_capture_store_list")


def store_name(name: str | None) -> str:
    """``name``, or the configured ``capture-client.store-name`` (the dataset a store is
    published under, as :func:`pipeline.client.discovery.lookup_store` reads it)."""
    return str(config.get("capture-client.store-name") if name is None else name)


def _call(client: Client, handler: str, **kwargs: object):
    """One RPC to the store host. A scheduler without it answers an unknown operation
    with None (every handler of the host answers something): a clear StoreUnavailable."""
    answer = client.sync(getattr(client.scheduler, handler), **kwargs)
    if answer is None:
        raise StoreUnavailable(NO_HOST.format(address=client.scheduler.address))
    return answer
