"""The controller's state of one rollout: what it needs to survive the loss of its actor.

Its gate (chain and cumulative hashing of completed calls), its turn, the last
``policy.window`` tokens and its generated tokens (for the reward); the actor holding its
in-flight call is ``slot``.
"""
from __future__ import annotations

import numpy as np

from tasks.gate import CaptureGate
from tasks.receipts import Receipt
from tasks.toy.rollouts import RolloutSpec, call_id


class RolloutState:
    """Controller state of one rollout."""

    __slots__ = ("spec", "slot", "gate", "turn", "prev_len", "tail", "generated", "final")

    def __init__(self, spec: RolloutSpec, slot: int, gate: CaptureGate):
        self.spec = spec
        self.slot = slot  # index of the generation actor holding its in-flight call
        self.gate = gate
        self.turn = 0  # turn of the in-flight call
        self.prev_len = 0  # tokens of the rollout before that call (tokens)
        self.tail = np.zeros(0, np.int64)  # the last policy.window of them
        self.generated: list[np.ndarray] = []  # generated tokens per completed call (reward)
        self.final: Receipt | None = None  # set once the rollout ends (done or poisoned)

    @property
    def active(self) -> bool:
        return self.final is None and self.turn < self.spec.turns

    @property
    def call(self) -> tuple[str, str]:
        return (self.spec.rollout_id, call_id(self.turn))
