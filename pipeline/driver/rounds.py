"""RoundRunner: opening calls, stepping the actors and staging what they complete.

Over an :class:`~pipeline.driver.pool.ActorPool`, a :class:`~pipeline.driver.book.RolloutBook`,
the staging store, the tool environment and :class:`~pipeline.driver.settings.RoundSettings`:
a round is one ``step`` per busy actor (all at once); the calls completed are taken, staged
through their gates in one ``put_many`` and their rollouts' next turns opened.
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Sequence

from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from tasks.schema import StagedRow
from tasks.toy.environment import ToolEnvironment
from tasks.toy.rollouts import call_id, parent_call_id

from .book import RolloutBook
from .handles import CallSpec
from .pool import ActorPool
from .settings import RoundSettings
from .state import RolloutState

if TYPE_CHECKING:
    from pipeline.store.client import StagingStore


class RoundRunner:
    """Runs rounds; counts them (``rounds``) and the staging puts (``stage_puts``)."""

    def __init__(self, pool: ActorPool, book: RolloutBook, store: StagingStore, env: ToolEnvironment,
                 settings: RoundSettings):
        self.pool = pool
        self.book = book
        self.store = store
        self.env = env
        self.settings = settings
        self.rounds = 0  # rounds run (count)
        self.stage_puts = 0  # put_many calls that staged completed calls (count)

    def call_specs(self, rollouts: Sequence[RolloutState]) -> list[CallSpec]:
        """Start specs of each rollout's current call (tool tokens drawn in one pass)."""
        later = [r for r in rollouts if r.turn > 0]
        tools = self.env.tool_outputs([r.spec.rollout_id for r in later], [r.turn for r in later],
                                      [r.spec.tool_tokens for r in later])
        tool_of = {r.spec.rollout_id: t for r, t in zip(later, tools)}
        return [
            CallSpec(
                rollout_id=r.spec.rollout_id,
                model_call_id=call_id(r.turn),
                parent_call_id=parent_call_id(r.turn),
                context=r.spec.prompt_tokens if r.turn == 0 else tool_of[r.spec.rollout_id],
                history=r.tail,
                prev_len=r.prev_len,
                max_new_tokens=r.spec.tokens_per_turn,
                weight_version=self.settings.weight_version,
            )
            for r in rollouts
        ]

    def start(self, rollouts: Sequence[RolloutState]) -> None:
        """Open the current call of each rollout: one ``start_calls`` per actor, all at once."""
        by_slot: dict[int, list[RolloutState]] = defaultdict(list)
        for r in rollouts:
            by_slot[r.slot].append(r)
        self.pool.fan_out(by_slot, lambda slot, actor: actor.start_calls(self.call_specs(by_slot[slot])),
                          what="start_calls")

    def step(self) -> None:
        """One round: ``step`` on every actor holding a call; collect those that completed one."""
        n = self.settings.step_tokens
        steps = self.pool.fan_out(self.book.active_slots(), lambda slot, actor: actor.step(n), what="step")
        self.collect([s for s, st in steps.items() if st["completed"]])
        self.rounds += 1

    def collect(self, slots: Sequence[int]) -> list[RolloutState]:
        """Take completed calls from ``slots``, stage them (one put), open next turns."""
        taken = self.pool.fan_out(slots, lambda slot, actor: actor.take_completed(), what="take_completed")
        outputs = [o for s in slots for o in taken[s]]
        if not outputs:
            return []
        staged: list[tuple[RolloutState, StagedRow, int]] = []
        for out in outputs:
            got = self.book.stage(out, self.settings.weight_version)
            if got is not None:
                staged.append((got[0], got[1], int(out["context_tokens"])))
        failed: dict[str, tuple[str, str]] = {}
        if staged:
            batch = pack_rows([row for _, row, _ in staged], with_routes=self.settings.with_routes)
            failed = self.store.put_many(batch, partition=STAGING_PARTITION).failed
            self.stage_puts += 1
        nxt = []
        for r, row, n_ctx in staged:
            bad = failed.get(row.staging_key)
            if bad is not None:
                self.book.poison(r, f"staging_failed: {bad[0]}: {bad[1]}")
                continue
            self.book.advance(r, row.token_ids, n_ctx)
            if r.active:
                nxt.append(r)
            else:
                self.book.finalize(r)
        self.start(nxt)
        return nxt
