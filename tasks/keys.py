"""Staging and cut key derivation, and row placement on storage units.

Keys are ``/``-separated, so ids may not contain ``/``: that keeps every key parseable
back into its identity (a finalizer checks a row's ids against its key).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import InvalidKey
from .placement_hash import default_unit_ids, primaries

STAGING_PARTITION = "staging"
"""Store partition of staged call deltas (keys from :func:`staging_key`)."""
CUT_PARTITION = "cut"
"""Store partition of checkpoint-cut prefix chunks (keys from :func:`cut_key`)."""
CUT_PREFIX = "__cut__"
MAX_ID_BYTES = 512
"""Longest id (UTF-8 bytes): rollout, model call and checkpoint ids alike."""
MAX_SEQ = 2**64 - 1
"""Largest cut chunk sequence number (20 decimal digits)."""
MAX_KEY_BYTES = len(CUT_PREFIX) + 3 * (1 + MAX_ID_BYTES) + 1 + len(str(MAX_SEQ))
"""Longest legal key (UTF-8 bytes): a cut key of three maximal ids and the largest seq
(1,567 bytes). The store refuses longer keys ``invalid_key`` (:func:`key_problem`)."""


def check_id(value: object, what: str) -> str:
    """Return ``value`` if it is a usable id, else raise :class:`InvalidKey` naming it."""
    if type(value) is str and value.isascii() and 0 < len(value) <= MAX_ID_BYTES and "/" not in value and value != CUT_PREFIX:
        return value  # the usual id, checked without encoding it (ASCII: one byte a character)
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
    if not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
        raise InvalidKey(f"seq must be an int in [0, {MAX_SEQ}], got {seq!r}")
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


def _short(key: str) -> str:
    """``key`` as it reads in a detail: repr, cut to about 80 characters."""
    return repr(key) if len(key) <= 80 else f"{key[:60]!r}... ({len(key)} characters)"


def key_problem(key: object) -> str | None:
    """``None`` if ``key`` is a storable staging/cut key, else why not (the store's
    ``invalid_key`` detail). What the gate guarantees of every key it makes: a str that
    is valid UTF-8 (no lone surrogates), a staging or cut key shape with non-empty
    parts, each id at most :data:`MAX_ID_BYTES` and the whole key at most
    :data:`MAX_KEY_BYTES` bytes.

    Per key a few C-level string calls, no per-character Python: an ASCII key is its
    own byte length, and a key no longer than :data:`MAX_ID_BYTES` needs no per-id check.
    """
    if not isinstance(key, str):
        return f"key must be str, got {type(key).__name__}"
    if key.isascii():
        n = len(key)
    else:
        try:
            n = len(key.encode("utf-8"))
        except UnicodeEncodeError as e:
            return f"key {_short(key)} is not valid UTF-8 ({e.reason} at character {e.start})"
    if n > MAX_KEY_BYTES:
        return f"key {_short(key)} is {n} bytes, limit {MAX_KEY_BYTES}"
    parts = key.split("/")
    if parts[0] == CUT_PREFIX:
        if len(parts) != 5 or not (parts[1] and parts[2] and parts[3] and parts[4]):
            return f"malformed cut key {_short(key)}"
    elif len(parts) != 2 or not parts[0] or not parts[1]:
        return f"malformed staging key {_short(key)}"
    if n > MAX_ID_BYTES:  # only then can an id be too long
        for part in parts[1:4] if parts[0] == CUT_PREFIX else parts:
            m = len(part.encode("utf-8"))
            if m > MAX_ID_BYTES:
                return f"key {_short(key)}: id {_short(part)} is {m} bytes, limit {MAX_ID_BYTES}"
    return None


def unit_for_rollout(rollout_id: str, n_units: int) -> int:
    """Storage unit index for a rollout among ``n_units`` units with the default ids
    ``"0".."n-1"``: its top-ranked unit by rendezvous hashing
    (:mod:`tasks.placement_hash`), the same in every process. Adding a unit moves about
    1/(n+1) of the rollouts, all to the new unit.

    Raises :class:`InvalidKey` for an id that is not valid UTF-8 (a lone surrogate)."""
    if n_units <= 0:
        raise ValueError(f"n_units must be positive, got {n_units}")
    return primary_unit(rollout_id, default_unit_ids(n_units))


def unit_for_key(key: str, n_units: int) -> int:
    """Storage unit index for a key: all of a rollout's rows land on one unit."""
    return unit_for_rollout(rollout_of_key(key), n_units)


def primary_unit(rollout_id: str, unit_ids: Sequence[str]) -> int:
    """Index (into ``unit_ids``) of the unit a rollout's rows live on (their primary)."""
    if not isinstance(rollout_id, str):
        raise InvalidKey(f"rollout id must be str, got {type(rollout_id).__name__}")
    try:
        rollout_id.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidKey(f"rollout id {_short(rollout_id)} is not valid UTF-8 ({e.reason} at character {e.start})") from None
    return 0 if len(unit_ids) == 1 else int(primaries([rollout_id], unit_ids)[0])


def primary_units(keys: Sequence[str], units: int | Sequence[str]) -> np.ndarray:
    """int64 primary unit index per staging/cut key, vectorised: ``units`` is the unit ids
    of the table (or a unit count: the default ids). Raises :class:`InvalidKey` for a
    malformed key."""
    ids = default_unit_ids(units) if isinstance(units, int) else tuple(units)
    return primaries([rollout_of_key(k) for k in keys], ids)
