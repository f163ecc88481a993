"""The controller's state at a cut (:class:`DriverSnapshot`) and the driver arguments it keeps.

Written by :meth:`~pipeline.driver.book.RolloutBook.snapshot` at each cut, read by
:mod:`.recovery` to continue the rollouts on fresh actors. Token-free apart from prompts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from tasks.cut.receipt import CallAck
from tasks.receipts import Receipt
from tasks.toy.rollouts import RolloutSpec


class DriverSettings(TypedDict):
    """A driver's construction arguments, as a snapshot keeps them."""

    policy: dict[str, int]  # policy settings overrides
    with_routes: bool
    weight_version: int
    step_tokens: int


@dataclass
class DriverSnapshot:
    """The controller's state at a cut: enough to recover after the actors are gone.

    Token-free apart from the specs' prompts: completed calls are their receipts
    (records with hashes; the rows are in the store), in-flight calls their cut acks.
    specs: every rollout, submission order; turns: rollout -> turn of its in-flight call
    (``spec.turns`` when finished); receipts: rollout -> receipt of its staged calls
    (final for finished rollouts, whose ``reward`` is set); acks: (rollout, call) -> ack;
    settings: the driver's construction arguments.
    """

    checkpoint_id: str
    specs: list[RolloutSpec]
    turns: dict[str, int]
    receipts: dict[str, Receipt]
    acks: dict[tuple[str, str], CallAck]
    settings: DriverSettings
