"""A controller's durable state: the steps it has not delivered and the rows it owes a clear.

A :class:`~pipeline.finalize.controller.Finalizer` given a journal (``finalize.journal``:
a local directory or an fsspec URL such as ``s3://bucket/prefix``) writes one record per
step there: its receipts before the step is submitted, then, once it was delivered, the
keys of the rows its clear must delete (one whole-object write replaces the other), and
removes the record once no clear still owes any of those keys. A controller that replaces
one that died calls :meth:`~pipeline.finalize.controller.Finalizer.resume`: every step
still recorded with its receipts is submitted again (the same receipts give the same
tensors bit for bit) and the rows still owed are cleared. Delivery is at least once: a
step delivered just before its controller died, its record not yet replaced, comes again
(its ``step_id`` lets the trainer skip it). One controller per journal at a time.
Records are msgpack objects, written whole (local: temp file, fsync, rename).
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

import msgpack

from tasks.errors import CheckpointError, FinalizeError
from tasks.receipts import Receipt

from ..store.location import Location, parse

logger = logging.getLogger(__name__)

FORMAT = "token-capture-step-journal"
VERSION = 1
PREFIX, SUFFIX = "step-", ".msgpack"
RECORD_LIMIT_BYTES = 1 << 30  # a record bigger than this is refused unread (bytes)
SUBMITTED, DELIVERED = "submitted", "delivered"


@dataclass(frozen=True)
class JournaledStep:
    """A step recorded with its receipts: submitted and not delivered."""

    step_id: str
    groups: dict[str, list[Any]]  # group id -> receipts (as dicts)
    trainer_version: int | None
    submitted_ns: int  # time.time_ns() when recorded: resubmission order


@dataclass(frozen=True)
class JournalState:
    """What a journal holds: steps to submit again (oldest first), keys owed per
    delivered step, and the names of records that could not be read (left in place)."""

    steps: list[JournaledStep]
    owed: dict[str, list[str]]  # step id -> keys its clear must still delete
    unreadable: list[str]


class StepJournal:
    """Step records at one location (see the module docstring)."""

    def __init__(self, where: str | os.PathLike | Location):
        self.location = parse(where)
        if self.location.local:
            try:
                os.makedirs(self.location.root, exist_ok=True)
            except OSError as e:
                raise FinalizeError(f"step journal {self.location.url!r} cannot be created ({e}); check the path "
                                    "(finalize.journal)") from None

    def submitted(self, step_id: str, groups: Mapping[str, Sequence[Any]], trainer_version: int | None) -> None:
        """Record a step's receipts before it is submitted; :class:`FinalizeError` if the
        record cannot be written (the step must not run unrecorded)."""
        as_dicts = {gid: [r.to_dict() if isinstance(r, Receipt) else r for r in rs] for gid, rs in groups.items()}
        record = {"step_id": step_id, "state": SUBMITTED, "groups": as_dicts, "trainer_version": trainer_version,
                  "submitted_ns": time.time_ns()}
        try:
            self._write(step_id, record)
        except (OSError, CheckpointError) as e:
            raise FinalizeError(f"step {step_id!r} was not submitted: its journal record at {self.location.url!r} "
                                f"cannot be written ({type(e).__name__}: {e})") from None

    def delivered(self, step_id: str, keys: Collection[str]) -> None:
        """The step was delivered: its record now holds the keys its clear must delete
        (none: the record goes). A failed write is logged: a replacement controller would
        deliver the step again."""
        try:
            if keys:
                self._write(step_id, {"step_id": step_id, "state": DELIVERED, "keys": list(keys)})
            else:
                self.location.remove(_name(step_id))
        except (OSError, CheckpointError) as e:
            logger.error("step %r was delivered but its journal record at %s could not be updated (%s: %s); a "
                         "controller resuming from this journal would deliver it again", step_id, self.location.url,
                         type(e).__name__, e)

    def cleared(self, step_ids: Collection[str]) -> None:
        """No clear owes the keys of these delivered steps any more: their records go."""
        for step_id in step_ids:
            try:
                self.location.remove(_name(step_id))
            except (OSError, CheckpointError) as e:  # the keys are cleared again on resume: harmless
                logger.warning("journal record of step %r not removed (%s: %s)", step_id, type(e).__name__, e)

    def read(self) -> JournalState:
        """Every record now: the steps to resubmit, oldest first, and the keys owed."""
        steps: list[JournaledStep] = []
        owed: dict[str, list[str]] = {}
        unreadable: list[str] = []
        for name in sorted(n for n in self.location.sizes() if n.startswith(PREFIX) and n.endswith(SUFFIX)):
            try:
                record = self._read(name)
                if record["state"] == DELIVERED:
                    owed[str(record["step_id"])] = [str(k) for k in record["keys"]]
                else:
                    steps.append(JournaledStep(str(record["step_id"]), dict(record["groups"]), record["trainer_version"],
                                               int(record["submitted_ns"])))
            except (OSError, CheckpointError, ValueError, KeyError, TypeError) as e:
                logger.error("step journal record %s/%s is unreadable (%s: %s); left in place", self.location.url, name,
                             type(e).__name__, e)
                unreadable.append(name)
        steps.sort(key=lambda s: s.submitted_ns)
        return JournalState(steps, owed, unreadable)

    def _write(self, step_id: str, record: dict[str, Any]) -> None:
        data = msgpack.packb({"format": FORMAT, "version": VERSION, **record}, use_bin_type=True, default=repr)
        self.location.write(_name(step_id), [data])

    def _read(self, name: str) -> dict[str, Any]:
        record = msgpack.unpackb(self.location.read(name, RECORD_LIMIT_BYTES, None, CheckpointError), raw=False)
        if not isinstance(record, dict) or record.get("format") != FORMAT or record.get("version") != VERSION:
            raise ValueError(f"not a version-{VERSION} step journal record")
        if record.get("state") not in (SUBMITTED, DELIVERED):
            raise ValueError(f"unknown state {record.get('state')!r}")
        return record


def _name(step_id: str) -> str:
    """The record's object name: a digest of the step id (any string), never the id itself."""
    return f"{PREFIX}{hashlib.blake2b(step_id.encode('utf-8', 'surrogatepass'), digest_size=16).hexdigest()}{SUFFIX}"
