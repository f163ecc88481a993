"""One save at a time to a remote checkpoint location: a lease object ``<root>/.lease``.

A save takes the lease before it opens the checkpoint on any unit and holds it until it
has removed the older generations. The lease is a small JSON object (``owner``,
``acquired_unix_s``, ``expires_unix_s``) written with a conditional put
(:meth:`~pipeline.store.location.Location.create`: ``If-None-Match: *`` on S3, so of two
saves exactly one creates it) and read back. A lease held by another owner makes the save
wait, polling, at most ``token-capture.store.checkpoint-lock-timeout-s`` seconds, then
fail with :class:`CheckpointError` naming the holder and its expiry. A lease past its
expiry (its save died; ``store.checkpoint-lease-s`` after it was taken, by the holder's
clock; 0: never) is removed and taken. Before its manifest is written a save reads the
lease back again (:meth:`Lease.check`) and fails if it is no longer its own.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

from tasks.errors import CheckpointError

from .location import Location

LEASE_NAME = ".lease"
LEASE_MAX_BYTES = 64 << 10  # a lease object larger than this is not one of ours (bytes)
_FIRST_POLL_S = 0.01
_MAX_POLL_S = 0.5


class Lease:
    """The lease of one save on ``loc``: ``owner`` (host:pid:random), ``lease_s`` (s; 0: no expiry)."""

    def __init__(self, loc: Location, lease_s: float) -> None:
        self.loc = loc
        self.lease_s = float(lease_s)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"

    def _body(self) -> bytes:
        now = time.time()
        expires = now + self.lease_s if self.lease_s > 0 else None
        return json.dumps({"owner": self.owner, "acquired_unix_s": now, "expires_unix_s": expires}).encode()

    def read(self) -> dict | None:
        """The lease now at the location (``None``: none). A lease object this project did
        not write raises :class:`CheckpointError` (remove it by hand)."""
        if not self.loc.exists(LEASE_NAME):
            return None
        try:
            held = json.loads(self.loc.read(LEASE_NAME, LEASE_MAX_BYTES, None, CheckpointError))
        except CheckpointError as e:
            if not self.loc.exists(LEASE_NAME):
                return None  # released between the two calls
            raise CheckpointError(f"checkpoint location {self.loc.url!r}: its {LEASE_NAME} cannot be read ({e}); remove it") from None
        except ValueError:
            held = None
        expires = held.get("expires_unix_s") if isinstance(held, dict) else None
        if not isinstance(held, dict) or not isinstance(held.get("owner"), str) or not (
            expires is None or isinstance(expires, (int, float))
        ):
            raise CheckpointError(
                f"checkpoint location {self.loc.url!r}: {LEASE_NAME} is not a lease this project wrote; "
                "if no save is running there, remove it"
            )
        return held

    @staticmethod
    def expired(held: dict) -> bool:
        expires = held.get("expires_unix_s")
        return expires is not None and time.time() > float(expires)

    def acquire(self, timeout_s: float) -> None:
        """Take the lease, waiting at most ``timeout_s`` seconds for another holder."""
        deadline = time.monotonic() + timeout_s
        pause = _FIRST_POLL_S
        retries = 0
        while True:
            self.loc.create(LEASE_NAME, self._body())
            held = self.read()
            if held is not None and held["owner"] == self.owner:
                return  # created now, or by a retried put whose first answer was lost
            stale = held is not None and self.expired(held)
            if stale:
                self.loc.remove(LEASE_NAME)  # its save died: the next create takes it
            if (held is None or stale) and retries < 3:
                retries += 1
                continue  # released or removed meanwhile: try again at once
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(self._taken(held, timeout_s))
            time.sleep(min(pause, left))
            pause = min(pause * 2, _MAX_POLL_S)

    def _taken(self, held: dict | None, timeout_s: float) -> str:
        holder = held["owner"] if held else "another save"
        until = held.get("expires_unix_s") if held else None
        when = "no expiry" if until is None else time.strftime("until %Y-%m-%dT%H:%M:%SZ", time.gmtime(float(until)))
        return (
            f"checkpoint location {self.loc.url!r} is leased by {holder} ({when}) after waiting {timeout_s:g} s: "
            f"another save is running there; wait for it, raise token-capture.store.checkpoint-lock-timeout-s, "
            f"or, if that save died, remove {self.loc.url.rstrip('/')}/{LEASE_NAME}"
        )

    def check(self) -> None:
        """Raise :class:`CheckpointError` unless the lease is still this save's and unexpired."""
        held = self.read()
        if held is None or held["owner"] != self.owner or self.expired(held):
            who = "nobody" if held is None else held["owner"]
            raise CheckpointError(
                f"checkpoint location {self.loc.url!r}: this save lost its lease (now held by {who}) before writing "
                "its manifest; raise token-capture.store.checkpoint-lease-s and save again"
            )

    def release(self) -> None:
        """Remove the lease if it is still this save's (never another's)."""
        try:
            held = self.read()
        except CheckpointError:
            return
        if held is not None and held["owner"] == self.owner:
            self.loc.remove(LEASE_NAME)


@contextmanager
def location_lease(loc: Location, lease_s: float, timeout_s: float) -> Iterator[Lease]:
    """Hold the lease of ``loc`` for the ``with`` block (see the module docstring)."""
    lease = Lease(loc, lease_s)
    lease.acquire(timeout_s)
    try:
        yield lease
    finally:
        lease.release()
