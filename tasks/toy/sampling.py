"""Counter-based randomness: every draw is a pure function of (seed, rollout, counter).

Generation must be reproducible bit for bit when a call is resumed from a saved prefix,
possibly in another process and in a batch of different calls. A stateful RNG cannot give
that (its stream depends on everything drawn before), so each random number here is a
hash of its coordinates instead: ``(seed, rollout_id)`` picks a 64-bit key once per
rollout, and the draw at ``counter`` (an absolute token position, or a turn and an index)
in ``stream`` (sampling, tool tokens, prompts, ...) is ``mix(key, stream, counter)``,
computed for whole arrays at once in numpy ``uint64`` (wrapping arithmetic, no Python
per draw).

The mixer is SplitMix64's finalizer (Steele, Lea & Flood, 2014), applied twice; the
rollout key is BLAKE2b-64 of the seed and the UTF-8 rollout id, so ids of any length and
alphabet spread evenly.
"""
from __future__ import annotations

import hashlib

import numpy as np

# Independent streams: the same (rollout, counter) gives unrelated draws in each.
STREAM_SAMPLE = 1  # token sampling, counter = absolute position in the rollout
STREAM_TOOL = 2  # environment tool tokens, counter = turn * 2**32 + index
STREAM_PROMPT = 3  # synthetic prompts, counter = index

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_S11 = np.uint64(11)
_TWO_M53 = 2.0**-53


def rollout_key(seed: int, rollout_id: str) -> np.uint64:
    """The 64-bit key of one rollout's random streams (BLAKE2b of seed and id)."""
    h = hashlib.blake2b(digest_size=8, person=b"tc-sample-v1")
    h.update(int(seed).to_bytes(8, "little", signed=True))
    h.update(rollout_id.encode("utf-8"))
    return np.uint64(int.from_bytes(h.digest(), "little"))


def _splitmix(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def mix(keys: np.ndarray, stream: int, counters: np.ndarray) -> np.ndarray:
    """uint64 hash of (key, stream, counter), elementwise with numpy broadcasting."""
    keys = np.asarray(keys, dtype=np.uint64)
    counters = np.asarray(counters).astype(np.uint64)
    with np.errstate(over="ignore"):
        inner = _splitmix(counters ^ (np.uint64(stream) * _M2))
        return _splitmix(keys ^ inner)


def uniforms(keys: np.ndarray, stream: int, counters: np.ndarray) -> np.ndarray:
    """float64 uniforms in ``[0, 1)`` (53 random bits), one per (key, counter) pair."""
    return (mix(keys, stream, counters) >> _S11).astype(np.float64) * _TWO_M53


def integers(keys: np.ndarray, stream: int, counters: np.ndarray, high: int) -> np.ndarray:
    """int64 draws in ``[0, high)`` (multiply-shift: bias below 2**-40 for high < 2**24)."""
    if not 0 < high < 2**24:
        raise ValueError(f"high must be in [1, 2**24), got {high}")
    u = mix(keys, stream, counters) >> np.uint64(24)  # 40 random bits
    return ((u * np.uint64(high)) >> np.uint64(40)).astype(np.int64)
