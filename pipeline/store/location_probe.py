"""Probe a remote checkpoint location from the controller before any unit writes.

:func:`probe` writes a small object ``.probe-<id>``, reads it back and removes it, all
within ``token-capture.store.checkpoint-probe-timeout-s`` seconds. A location that is
unreachable, hangs, refuses the credentials, does not exist or cannot be written fails
the save there, as ONE line naming the URL and the fix (:class:`CheckpointError`), before
any unit opened the checkpoint: the previous checkpoint stays current and readable.
"""
from __future__ import annotations

import concurrent.futures
import errno
import uuid

from tasks.errors import CheckpointError

from .. import config
from .location import Location, _one_line

PROBE_TIMEOUT_CONFIG = "store.checkpoint-probe-timeout-s"
OPTIONS_KNOB = "token-capture.store.checkpoint-storage-options"
_CONNECTION_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


def probe_timeout_s() -> float:
    """``token-capture.store.checkpoint-probe-timeout-s`` (seconds > 0), read now."""
    value = config.get(PROBE_TIMEOUT_CONFIG)
    try:
        timeout_s = float(value)
    except (TypeError, ValueError):
        timeout_s = -1.0
    if not timeout_s > 0:
        raise CheckpointError(f"token-capture.{PROBE_TIMEOUT_CONFIG} must be a number of seconds > 0, got {value!r}")
    return timeout_s


def _is_connection_error(e: BaseException) -> bool:
    """A failure to reach the endpoint at all (refused, reset, no route, DNS, timeout)."""
    for err in (e, e.__cause__, e.__context__):
        if err is None:
            continue
        if isinstance(err, (ConnectionError, TimeoutError)) or getattr(err, "errno", None) in _CONNECTION_ERRNOS:
            return True
        if any("Connect" in k.__name__ or "Timeout" in k.__name__ for k in type(err).__mro__):
            return True
    return False


def explain(loc: Location, e: BaseException) -> str:
    """One line: what went wrong at ``loc`` and what to do about it."""
    what = f"{type(e).__name__}: {_one_line(e)}"[:300]
    creds = f"the backend's usual credentials (for s3://: AWS_* environment variables or ~/.aws) or {OPTIONS_KNOB}"
    if isinstance(e, PermissionError):
        return f"checkpoint location {loc.url!r} refused access ({what}); check {creds} and that they may read and write there"
    if isinstance(e, FileNotFoundError):
        return f"checkpoint location {loc.url!r} does not exist ({what}); create the bucket or fix the URL"
    if _is_connection_error(e):
        return (
            f"checkpoint location {loc.url!r} cannot be reached ({what}); check that its endpoint (for s3://: "
            f"AWS_ENDPOINT_URL or endpoint_url in {OPTIONS_KNOB}) is up and reachable"
        )
    return f"checkpoint location {loc.url!r} cannot be written ({what}); check the URL, {creds}, and that the location is writable"


def _write_read_remove(loc: Location) -> None:
    name = f".probe-{uuid.uuid4().hex}"
    payload = f"dask-token-capture checkpoint probe {name}\n".encode()
    loc.write(name, [payload])
    try:
        got = loc.read(name, len(payload), None, CheckpointError)
    finally:
        loc.remove(name)
    if got != payload:
        raise CheckpointError(f"checkpoint location {loc.url!r} gave back other bytes than were written; check the backend")


def probe(loc: Location, timeout_s: float) -> None:
    """Write, read back and remove a small object at ``loc`` within ``timeout_s`` seconds;
    else raise :class:`CheckpointError` (one line naming the URL and the fix)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-probe")
    try:
        pool.submit(_write_read_remove, loc).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise CheckpointError(
            f"checkpoint location {loc.url!r} did not answer within {timeout_s:g} s; check that its endpoint is up "
            f"and reachable, or raise token-capture.{PROBE_TIMEOUT_CONFIG}"
        ) from None
    except CheckpointError:
        raise
    except Exception as e:  # whatever the backend raises: named in one line
        raise CheckpointError(explain(loc, e)) from None
    finally:
        pool.shutdown(wait=False)
