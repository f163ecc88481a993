"""The checkpoint sequence record: the highest checkpoint sequence seen per store name.

Signed checkpoints carry ``"sequence": n`` in their manifest (covered by the HMAC). The
controller keeps, next to the manifest key file, ``<key file>.sequence.json``::

    {"format": "dask-token-capture/checkpoint-sequence", "version": 1,
     "stores": {"<store name>": <highest sequence saved or restored>}}

so that an older signed checkpoint put back in place of a newer one is recognised (the
key file and this record are kept by the same trusted controller; whoever can rewrite
the record can read the key too). The record is replaced atomically (temp, fsync,
rename, fsync dir) and only ever raised, under an flock on ``<record>.lock``
(:mod:`~pipeline.store.location_lock`), so concurrent saves and restores never lose an
update. A missing record means nothing was recorded yet (every sequence is 0).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Iterator

from tasks.errors import CheckpointError

from . import batch_file
from .location_lock import file_lock
from .regular_file import read_regular_bounded

RECORD_SUFFIX = ".sequence.json"
RECORD_FORMAT = "dask-token-capture/checkpoint-sequence"
RECORD_VERSION = 1
_MAX_RECORD_BYTES = 1 << 20  # one small entry per store name


def record_path(key_path: str) -> str:
    """The record file kept next to the key file ``key_path``."""
    return os.path.expanduser(str(key_path)) + RECORD_SUFFIX


def is_sequence(value: object) -> bool:
    """Whether ``value`` is a usable sequence number (an int >= 0, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse(record: str, data: bytes) -> dict[str, int]:
    """The ``{store name: sequence}`` of a record file's bytes; else :class:`CheckpointError`."""
    try:
        body = json.loads(data)
    except ValueError as e:
        body = e
    stores = body.get("stores") if isinstance(body, dict) else None
    if (not isinstance(body, dict) or body.get("format") != RECORD_FORMAT or body.get("version") != RECORD_VERSION
            or not isinstance(stores, dict) or not all(isinstance(k, str) and is_sequence(v) for k, v in stores.items())):
        raise CheckpointError(
            f"checkpoint sequence record {record!r} is damaged; restore it from a backup (deleting it "
            "forgets every recorded sequence, so older signed checkpoints are accepted again)"
        )
    return dict(stores)


def read_record(record: str) -> dict[str, int]:
    """``{store name: highest sequence}`` of the record file ``record`` ({} if missing)."""
    if not os.path.lexists(record):
        return {}
    return _parse(record, read_regular_bounded(record, _MAX_RECORD_BYTES, None))


def recorded(record: str, store: str) -> int:
    """The highest sequence recorded for ``store`` (0 if none)."""
    return read_record(record).get(store, 0)


def _write_record(record: str, stores: dict[str, int]) -> None:
    """Replace the record file atomically (temp, fsync, rename, fsync dir)."""
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "stores": dict(sorted(stores.items()))}
    try:
        batch_file.write_atomic(record, [json.dumps(body, indent=1).encode()])
        batch_file.fsync_dir(os.path.dirname(os.path.abspath(record)))
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint sequence record {record!r}: {e}; the directory of "
            "store.checkpoint-key's key file must be writable by the controller"
        ) from None


@contextmanager
def updating(record: str) -> Iterator[dict[str, int]]:
    """Hold the record's lock for the ``with`` block; yields its ``{store: sequence}``
    mapping, written back atomically on a normal exit if the block changed it. Waits for
    the lock at most ``token-capture.store.checkpoint-lock-timeout-s`` seconds."""
    with file_lock(record + ".lock", what=f"checkpoint sequence record {record!r}"):
        stores = read_record(record)
        before = dict(stores)
        yield stores
        if stores != before:
            _write_record(record, stores)


def raise_to(record: str, store: str, sequence: int) -> int:
    """Raise ``store``'s recorded sequence to ``sequence`` (never lower it); the result."""
    with updating(record) as stores:
        stores[store] = max(stores.get(store, 0), int(sequence))
        return stores[store]
