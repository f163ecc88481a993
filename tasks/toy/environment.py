"""A toy tool environment: between model calls it appends tool-result tokens.

Tool tokens are carried context in the next call's delta (token_mask 0, logprob 0). They
are a pure function of (seed, rollout_id, turn), drawn from the counter-based streams of
:mod:`tasks.toy.sampling`, so a restarted rollout sees the same tool output again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .sampling import STREAM_PROMPT, STREAM_TOOL, integers, rollout_key


@dataclass(frozen=True)
class ToolEnvironment:
    """Deterministic tool output.

    seed: environment seed (independent of the policy seed).
    vocab_size: tool tokens are in ``[0, vocab_size)``.
    tool_tokens: default tokens appended per turn (a per-call count can override it).
    """

    seed: int
    vocab_size: int
    tool_tokens: int = 8

    def __post_init__(self) -> None:
        if not 0 < self.vocab_size < 2**24:
            raise ValueError(f"vocab_size {self.vocab_size} must be in [1, 2**24)")
        if self.tool_tokens < 0:
            raise ValueError(f"tool_tokens {self.tool_tokens} must be >= 0")

    def tool_output(self, rollout_id: str, turn: int, n_tokens: int | None = None) -> np.ndarray:
        """int64[n_tokens] tool tokens shown to the model before call ``turn`` (turn >= 1)."""
        n = self.tool_tokens if n_tokens is None else n_tokens
        if turn < 0 or n < 0:
            raise ValueError(f"turn {turn} and n_tokens {n} must be >= 0")
        key = rollout_key(self.seed, rollout_id)
        counters = (np.int64(turn) << np.int64(32)) + np.arange(n, dtype=np.int64)
        return integers(key, STREAM_TOOL, counters, self.vocab_size)

    def tool_outputs(self, rollout_ids: Sequence[str], turns: Sequence[int], n_tokens: Sequence[int]) -> list[np.ndarray]:
        """:meth:`tool_output` for many rollouts at once (one vectorized draw)."""
        if not len(rollout_ids):
            return []
        counts = np.asarray(n_tokens, dtype=np.int64)
        keys = np.repeat(np.array([rollout_key(self.seed, r) for r in rollout_ids], dtype=np.uint64), counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        index = np.arange(int(counts.sum()), dtype=np.int64) - starts
        counters = (np.repeat(np.asarray(turns, dtype=np.int64), counts) << np.int64(32)) + index
        flat = integers(keys, STREAM_TOOL, counters, self.vocab_size)
        return np.split(flat, np.cumsum(counts)[:-1])


def synthetic_prompt(seed: int, prompt_id: str, n_tokens: int, vocab_size: int) -> np.ndarray:
    """int64[n_tokens]: a deterministic prompt for ``prompt_id`` (shared by its group)."""
    if n_tokens < 0:
        raise ValueError(f"n_tokens {n_tokens} must be >= 0")
    key = rollout_key(seed, prompt_id)
    return integers(key, STREAM_PROMPT, np.arange(n_tokens, dtype=np.int64), vocab_size)
