"""Rewards a tiny random-weight policy can learn: the fraction of its generated tokens in
a target set of ids (the toy engines' :func:`tasks.toy.rollouts.toy_reward` is the set of
even ids). A reward is a picklable callable ``int64 tokens [N] -> float in [0, 1]``, so it
ships to the generation tasks that write it into each rollout's receipt."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInput


@dataclass(frozen=True)
class TargetTokensReward:
    """Fraction of generated tokens with ids in ``[0, below)`` (0.0 when there are none).

    below: the target set's bound (token ids); ``vocab_size // 8`` makes a random policy
    score about 0.125 and a trained one up to 1.0.
    """

    below: int

    def __post_init__(self) -> None:
        if isinstance(self.below, bool) or not isinstance(self.below, (int, np.integer)) or self.below < 1:
            raise InvalidInput(f"TargetTokensReward: below must be an int >= 1 (token ids), got {self.below!r}")

    def __call__(self, generated_tokens: np.ndarray) -> float:
        g = np.asarray(generated_tokens)
        return float(np.count_nonzero((g >= 0) & (g < self.below))) / len(g) if len(g) else 0.0
