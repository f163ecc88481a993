"""Turning the store's per-key refusals into poisoned receipts: the one place it happens.

A row the store refused (``key_conflict``, ``store_full``, ...) or a put that raised
makes its rollout's receipt poisoned with ``failure_reason = "staging_failed: <reason>:
<detail>"``, so the finalizer rejects that rollout alone (``capture_poisoned``) and
nothing is silently missing. Used by :mod:`pipeline.capture` and the capture client.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from tasks.receipts import Receipt

STAGING_FAILED = "staging_failed"
PUT_FAILED = "put_failed"  # the whole put raised (store closed, lost, unreachable)
MISSING_ACK = "missing_ack"  # the store answered neither ok nor failed for the key
FLUSH_TIMEOUT = "flush_timeout"  # the rollout's rows were not confirmed in time

Refusal = tuple[str, str]  # (reason word, detail)


def staging_failure(reason: str, detail: str) -> str:
    """The ``failure_reason`` of a receipt whose rows could not all be staged."""
    return f"{STAGING_FAILED}: {reason}: {detail}"


def put_error(error: BaseException) -> Refusal:
    """The refusal every row of a put that raised ``error`` gets."""
    return PUT_FAILED, f"{type(error).__name__}: {error}"


def refusals_of(keys: Sequence[str], ok: Iterable[str], failed: Mapping[str, Refusal]) -> dict[str, Refusal]:
    """The refusal of every key of a put of ``keys`` the store did not store: ``failed``,
    plus :data:`MISSING_ACK` for a key in neither ``ok`` nor ``failed``."""
    refused = dict(failed)
    stored = set(ok)
    for k in keys:
        if k not in stored and k not in refused:
            refused[k] = (MISSING_ACK, "the store answered neither ok nor failed for this key")
    return refused


def first_refusal(keys: Sequence[str], failed: Mapping[str, Refusal]) -> Refusal | None:
    """The first of ``keys`` (call order) the store refused, or ``None``."""
    if not failed:
        return None
    return next((failed[k] for k in keys if k in failed), None)


def poison(receipt: Receipt, refusal: Refusal) -> None:
    """Mark ``receipt`` poisoned by ``refusal`` unless it already is (the first reason wins)."""
    if not receipt.poisoned:
        receipt.poisoned = True
        receipt.failure_reason = staging_failure(*refusal)


def poison_refused(receipts: Iterable[Receipt], failed: Mapping[str, Refusal]) -> int:
    """Poison every receipt one of whose staging keys is in ``failed``; how many were."""
    n = 0
    if not failed:
        return n
    for receipt in receipts:
        refusal = first_refusal(receipt.staging_keys, failed)
        if refusal is not None:
            poison(receipt, refusal)
            n += 1
    return n
