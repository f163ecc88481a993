"""Rendezvous (highest-random-weight) ranking of storage units for rollouts, and the
choice of a key's copies from that ranking (pure: numpy, no Dask).

Every (rollout id, unit id) pair has a 64-bit score: ``splitmix64(h(rollout) XOR h(unit))``,
``h`` being an 8-byte BLAKE2b digest read as a little-endian uint64 (personalised per
kind, so a rollout id and a unit id spelled alike hash apart), forced odd so that no
score is 0 (0 marks a unit excluded from a choice). A rollout's units rank by score,
highest first; its primary is the top one. Adding a unit moves to it exactly the
rollouts it now tops (about 1/(n+1) of them); removing one moves only its own rollouts,
each to its next-ranked unit. Unit ids are stable names, so nothing depends on the
order of the units in a table.

Scores are computed for keys x units at once in numpy; per rollout id the only Python
is its BLAKE2b digest.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

from .errors import InvalidKey, InvalidStoreRequest

_ROLLOUT_PERSON = b"tc-rollout"
_UNIT_PERSON = b"tc-unit"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ONE = np.uint64(1)


def default_unit_ids(n_units: int) -> tuple[str, ...]:
    """The ids of a store of ``n_units`` units that named none: ``"0"`` .. ``"n-1"``."""
    if not isinstance(n_units, int) or isinstance(n_units, bool) or n_units <= 0:
        raise ValueError(f"n_units must be a positive int, got {n_units!r}")
    return _default_ids(n_units)


@lru_cache(maxsize=256)
def _default_ids(n_units: int) -> tuple[str, ...]:
    return tuple(str(u) for u in range(n_units))


def check_unit_ids(unit_ids: Iterable[object]) -> tuple[str, ...]:
    """``unit_ids`` as a tuple if they are usable (non-empty, distinct str, valid UTF-8),
    else :class:`~tasks.errors.InvalidStoreRequest` naming the bad one."""
    out = tuple(unit_ids)
    if not out:
        raise InvalidStoreRequest("a placement needs at least one storage unit id")
    for uid in out:
        if not isinstance(uid, str) or not uid:
            raise InvalidStoreRequest(f"a storage unit id must be a non-empty str, got {uid!r}")
        try:
            uid.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidStoreRequest(f"storage unit id {uid!r} is not valid UTF-8") from None
    if len(set(out)) != len(out):
        dup = next(u for i, u in enumerate(out) if u in out[:i])
        raise InvalidStoreRequest(f"storage unit id {dup!r} appears twice")
    return out


@lru_cache(maxsize=64)
def unit_hashes(unit_ids: tuple[str, ...]) -> np.ndarray:
    """uint64 per unit id (read-only; cached per tuple of ids)."""
    raw = b"".join(hashlib.blake2b(u.encode("utf-8"), digest_size=8, person=_UNIT_PERSON).digest() for u in unit_ids)
    out = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    out.flags.writeable = False
    return out


@lru_cache(maxsize=1 << 16)
def _rollout_digest(rollout_id: str) -> bytes:
    try:
        data = rollout_id.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = repr(rollout_id) if len(rollout_id) <= 80 else f"{rollout_id[:60]!r}... ({len(rollout_id)} characters)"
        raise InvalidKey(f"rollout id {shown} is not valid UTF-8 ({e.reason} at character {e.start})") from None
    return hashlib.blake2b(data, digest_size=8, person=_ROLLOUT_PERSON).digest()


def rollout_hashes(rollout_ids: Sequence[str]) -> np.ndarray:
    """uint64 per rollout id (one BLAKE2b digest per distinct id, cached).

    Raises :class:`~tasks.errors.InvalidKey` for an id that is not valid UTF-8."""
    raw = b"".join(map(_rollout_digest, rollout_ids))
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of every uint64 in ``x`` (wrapping arithmetic, a bijection)."""
    z = x + _GOLDEN
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


def scores(rollout_h: np.ndarray, unit_h: np.ndarray) -> np.ndarray:
    """``[keys, units]`` uint64 rendezvous scores, all odd (never 0)."""
    return splitmix64(rollout_h[:, None] ^ unit_h[None, :]) | _ONE


def ranking(rollout_ids: Sequence[str], unit_ids: Sequence[str]) -> np.ndarray:
    """``[keys, units]`` unit indices (into ``unit_ids``), each row best first."""
    s = scores(rollout_hashes(rollout_ids), unit_hashes(tuple(unit_ids)))
    return np.argsort(s, axis=1, kind="stable")[:, ::-1]


def primaries(rollout_ids: Sequence[str], unit_ids: Sequence[str]) -> np.ndarray:
    """int64 primary unit index (into ``unit_ids``) per rollout id: its top-ranked unit."""
    if not len(rollout_ids):
        return np.zeros(0, dtype=np.int64)
    s = scores(rollout_hashes(rollout_ids), unit_hashes(tuple(unit_ids)))
    return np.argmax(s, axis=1).astype(np.int64)


def _best_where(s: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Per row the index of the highest score among ``allowed`` units, -1 where none is."""
    masked = np.where(allowed, s, np.uint64(0))
    best = np.argmax(masked, axis=1).astype(np.int64)
    best[masked[np.arange(len(s)), best] == 0] = -1
    return best


def copies(
    rollout_h: np.ndarray, unit_h: np.ndarray, domain: np.ndarray, worker: np.ndarray, replicas: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(primary, replica, witness) unit index per rollout hash, vectorised over keys x units.

    ``domain[u]``: unit ``u``'s failure domain (its host when the table spans several
    hosts, else its worker); ``worker[u]``: its worker, both as small ints. The primary is
    the top-ranked unit; with ``replicas == 2`` the replica is the top-ranked unit in
    another domain than the primary (-1 if there is none), the witness the top-ranked
    unit on a worker hosting neither copy (-1 if there is none). ``None`` for both with
    one copy."""
    s = scores(rollout_h, unit_h)
    primary = np.argmax(s, axis=1).astype(np.int64)
    if replicas == 1:
        return primary, None, None
    replica = _best_where(s, domain[None, :] != domain[primary][:, None])
    rep_worker = np.where(replica >= 0, worker[np.maximum(replica, 0)], -1)
    free = (worker[None, :] != worker[primary][:, None]) & (worker[None, :] != rep_worker[:, None])
    witness = _best_where(s, free & (replica >= 0)[:, None])
    return primary, replica, witness
