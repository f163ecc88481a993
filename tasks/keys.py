"""Staging and cut key derivation, and row placement on storage units.

Keys are ``/``-separated, so ids may not contain ``/``: that keeps every key parseable
back into its identity (a finalizer checks a row's ids against its key).
"""
from __future__ import annotations

import zlib

from .errors import InvalidKey

STAGING_PARTITION = "staging"
"""Store partition of staged call deltas (keys from :func:`staging_key`)."""
CUT_PARTITION = "cut"
"""Store partition of checkpoint-cut prefix chunks (keys from :func:`cut_key`)."""
CUT_PREFIX = "__cut__"
MAX_ID_BYTES = 512


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is a usable id, else raise :class:`InvalidKey` naming it."""
    if not isinstance(value, str):
        raise InvalidKey(f"{what} must be str, got {type(value).__name__}")
    if not value:
        raise InvalidKey(f"{what} is empty")
    if "/" in value:
        raise InvalidKey(f"{what} {value!r} contains '/'")
    if value == CUT_PREFIX:
        raise InvalidKey(f"{what} {value!r} is reserved")
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise InvalidKey(f"{what} {value!r} is not valid UTF-8: {e}") from None
    if n > MAX_ID_BYTES:
        raise InvalidKey(f"{what} is {n} bytes, limit {MAX_ID_BYTES}")
    return value


def staging_key(rollout_id: str, model_call_id: str) -> str:
    """``"{rollout_id}/{model_call_id}"``: the key of one call's staged delta."""
    return f"{check_id(rollout_id, 'rollout_id')}/{check_id(model_call_id, 'model_call_id')}"


def cut_key(checkpoint_id: str, rollout_id: str, model_call_id: str, seq: int) -> str:
    """``"__cut__/{checkpoint_id}/{rollout_id}/{model_call_id}/{seq}"``: one prefix chunk."""
    if not isinstance(seq, int) or seq < 0:
        raise InvalidKey(f"seq must be a non-negative int, got {seq!r}")
    return (
        f"{CUT_PREFIX}/{check_id(checkpoint_id, 'checkpoint_id')}/"
        f"{check_id(rollout_id, 'rollout_id')}/{check_id(model_call_id, 'model_call_id')}/{seq}"
    )


def rollout_of_key(key: str) -> str:
    """The rollout id a staging or cut key belongs to (placement is by rollout)."""
    parts = key.split("/")
    if parts[0] == CUT_PREFIX:
        if len(parts) != 5:
            raise InvalidKey(f"malformed cut key {key!r}")
        return parts[2]
    if len(parts) != 2 or not parts[0] or not parts[1]:
        raise InvalidKey(f"malformed staging key {key!r}")
    return parts[0]


def unit_for_rollout(rollout_id: str, n_units: int) -> int:
    """Storage unit index for a rollout: a stable hash (crc32), same in every process."""
    if n_units <= 0:
        raise ValueError(f"n_units must be positive, got {n_units}")
    return zlib.crc32(rollout_id.encode("utf-8")) % n_units


def unit_for_key(key: str, n_units: int) -> int:
    """Storage unit index for a key: all of a rollout's rows land on one unit."""
    return unit_for_rollout(rollout_of_key(key), n_units)
