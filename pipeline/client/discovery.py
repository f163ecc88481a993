"""Finding the staging store from another process: a Dask named dataset on the scheduler.

The controller :func:`publish_store` s its :class:`~pipeline.store.client.StagingStore`
(picklable: actor handles and addresses only) under ``capture-client.store-name``; any
process with a Dask client on the same scheduler gets it back with :func:`lookup_store`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.errors import StoreUnavailable

from .. import config

if TYPE_CHECKING:
    from distributed import Client

    from ..store.client import StagingStore


def store_name(name: str | None = None) -> str:
    """``name``, or the configured ``capture-client.store-name``."""
    return str(config.get("capture-client.store-name") if name is None else name)


def publish_store(client: Client, store: StagingStore, name: str | None = None) -> str:
    """Publish ``store`` on ``client``'s scheduler (replacing any store of that name);
    returns the name used."""
    name = store_name(name)
    client.publish_dataset(store, name=name, override=True)
    return name


def unpublish_store(client: Client, name: str | None = None) -> None:
    """Withdraw the published store (nothing happens if none is published)."""
    name = store_name(name)
    if name in client.list_datasets():
        client.unpublish_dataset(name)


def lookup_store(client: Client, name: str | None = None) -> StagingStore:
    """The store published as ``name`` on ``client``'s scheduler.

    Raises :class:`~tasks.errors.StoreUnavailable` (one line: the dataset, the scheduler
    and the fix) when none is published.
    """
    name = store_name(name)
    try:
        return client.get_dataset(name)
    except KeyError:
        raise StoreUnavailable(missing_store_message(name, client.scheduler.address)) from None


def missing_store_message(name: str, address: str) -> str:
    """One line: no store is published as ``name`` on ``address``, and how to publish one."""
    return (
        f"no store is published as dataset {name!r} on {address}; start or publish it there first: "
        f"pipeline.store.hosted.start_hosted(client, name={name!r}) (a store that outlives its controller) "
        f"or pipeline.client.publish_store(client, store, name={name!r})"
    )
