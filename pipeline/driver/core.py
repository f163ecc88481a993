"""RolloutDriver: drives multi-turn rollouts on GenerationWorker actors, round by round.

The controller side of checkpointable generation: one generation actor per Dask worker
holds the in-flight calls; the driver stages completed calls through each rollout's gate
and opens their next turns. Cutting (:mod:`.cut`) and recovering (:mod:`.recovery`) are
mixed in.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from tasks.errors import DriverError, InvalidRecord
from tasks.gate import CaptureGate
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from tasks.receipts import Receipt
from tasks.toy.environment import ToolEnvironment
from tasks.toy.rollouts import RolloutSpec, call_id, parent_call_id, toy_reward

from .. import config
from ..actors import current_workers, start_pinned_actors
from ..capture import policy_from_config
from .cut import CutMixin
from .recovery import DriverSnapshot, RecoveryMixin
from .state import RolloutState

if TYPE_CHECKING:
    from distributed import Client

    from pipeline.store.client import StagingStore

    from .handles import CutStore, GenerationActor


class RolloutDriver(CutMixin, RecoveryMixin):
    """Places rollouts on GenerationWorker actors and drives them turn by turn.

    client: a ``distributed.Client``; store: the
    :class:`~pipeline.store.client.StagingStore` completed calls are staged in.
    n_workers: generation actors, one per Dask worker (default: every worker now).
    policy: policy settings overrides (default config ``token-capture.policy``).
    cut_store: the store actors write cut prefixes to (default ``store``; a
    :class:`~pipeline.testing.faults.FaultyStore` in tests).
    step_tokens: tokens per call per round (default ``driver.step-tokens``).
    """

    def __init__(
        self,
        client: Client,
        store: StagingStore,
        n_workers: int | None = None,
        *,
        policy: Mapping[str, Any] | None = None,
        with_routes: bool = True,
        weight_version: int = 0,
        cut_store: CutStore | None = None,
        step_tokens: int | None = None,
        workers: Sequence[str] | None = None,
    ):
        self.client = client
        self.store = store
        self.cut_store: CutStore = store if cut_store is None else cut_store
        self.policy_overrides = dict(policy or {})
        self.policy = policy_from_config(self.policy_overrides)
        self.with_routes = bool(with_routes)
        self.weight_version = int(weight_version)
        self.step_tokens = int(config.get("driver.step-tokens") if step_tokens is None else step_tokens)
        if self.step_tokens < 1:
            raise DriverError(f"step_tokens {self.step_tokens} must be >= 1")
        self.env = ToolEnvironment(seed=self.policy.config.seed, vocab_size=self.policy.vocab_size)
        self._rollouts: dict[str, RolloutState] = {}
        self._order: list[str] = []
        self.snapshot: DriverSnapshot | None = None
        self.rounds = 0  # rounds run (count)
        self.stage_puts = 0  # put_many calls that staged completed calls (count)
        self._start_actors(n_workers, workers)

    # ---- actors -------------------------------------------------------------------------

    def _start_actors(self, n_workers: int | None, workers: Sequence[str] | None) -> None:
        from ..generation.worker import GenerationWorker

        workers = current_workers(self.client) if workers is None else list(workers)
        if n_workers is not None:
            workers = workers[: int(n_workers)]
        if not workers:
            raise DriverError("no workers to host generation actors")
        settings = dict(config.get("policy"))
        settings.update(self.policy_overrides)
        # Completed calls carry their tokens: the handles talk to their worker directly.
        actors, self._futures = start_pinned_actors(
            self.client, GenerationWorker, workers, args=[(self.cut_store,)] * len(workers),
            policy=settings, with_routes=self.with_routes,
        )
        self.actors: list[GenerationActor] = list(actors)
        self.workers: list[str] = workers

    def kill(self) -> list[str]:
        """Drop the generation actors (a simulated crash): their in-flight calls are lost.

        Releases the actors' futures and handles, so the workers delete them; returns the
        actors' keys. The driver is unusable afterwards: recover with :meth:`recover`.
        """
        keys = [f.key for f in self._futures]
        self.client.cancel(self._futures, force=True)
        self._futures, self.actors = [], []
        return keys

    # ---- submission -----------------------------------------------------------------------

    def submit(self, groups: Sequence[Sequence[RolloutSpec]]) -> None:
        """Place every rollout (round-robin over the actors, submission order) and open
        its first call. ``groups``: lists of specs, or one flat list of specs."""
        specs = [s for g in groups for s in (g if isinstance(g, (list, tuple)) else [g])]
        ids = [s.rollout_id for s in specs]
        if len(set(ids)) != len(ids) or any(i in self._rollouts for i in ids):
            raise DriverError("duplicate rollout_id (in this submission or already driven)")
        if not self.actors:
            raise DriverError("the driver has no generation actors (killed?)")
        opened = []
        for s in specs:
            r = RolloutState(s, len(self._order) % len(self.actors), self._new_gate(s))
            self._rollouts[s.rollout_id] = r
            self._order.append(s.rollout_id)
            p = s.prompt_tokens
            if p.size and (int(p.min()) < 0 or int(p.max()) >= self.policy.vocab_size):
                # A prompt this policy cannot read poisons its rollout only.
                self._poison(r, f"invalid_token: prompt of {s.rollout_id!r} holds ids outside [0, {self.policy.vocab_size})")
                continue
            opened.append(r)
        self._start(opened)

    def _new_gate(self, spec: RolloutSpec) -> CaptureGate:
        return CaptureGate(spec.rollout_id, vocab_size=self.policy.vocab_size, num_experts=self.policy.num_experts,
                           group_id=spec.group_id)

    def _call_specs(self, rollouts: Sequence[RolloutState]) -> list[dict]:
        """Start specs of each rollout's current call (tool tokens drawn in one pass)."""
        later = [r for r in rollouts if r.turn > 0]
        tools = self.env.tool_outputs([r.spec.rollout_id for r in later], [r.turn for r in later],
                                      [r.spec.tool_tokens for r in later])
        tool_of = {r.spec.rollout_id: t for r, t in zip(later, tools)}
        return [
            {
                "rollout_id": r.spec.rollout_id,
                "model_call_id": call_id(r.turn),
                "parent_call_id": parent_call_id(r.turn),
                "context": r.spec.prompt_tokens if r.turn == 0 else tool_of[r.spec.rollout_id],
                "history": r.tail,
                "prev_len": r.prev_len,
                "max_new_tokens": r.spec.tokens_per_turn,
                "weight_version": self.weight_version,
            }
            for r in rollouts
        ]

    def _start(self, rollouts: Sequence[RolloutState]) -> None:
        """Open the current call of each rollout: one ``start_calls`` per actor, all at once."""
        by_slot: dict[int, list[RolloutState]] = defaultdict(list)
        for r in rollouts:
            by_slot[r.slot].append(r)
        futures = {slot: self.actors[slot].start_calls(self._call_specs(rs)) for slot, rs in by_slot.items()}
        for slot, fut in futures.items():
            fut.result()

    # ---- rounds -------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Rollouts with a call in flight."""
        return sum(r.active for r in self._rollouts.values())

    def run_rounds(self, n: int) -> int:
        """Run up to ``n`` rounds (fewer if every rollout finishes); returns rounds run."""
        done = 0
        while done < n and self.active:
            self._round()
            done += 1
        return done

    def finish(self, max_rounds: int | None = None) -> dict[str, list[Receipt]]:
        """Run rounds until every rollout has finished; returns :meth:`receipts`."""
        limit = max_rounds if max_rounds is not None else self._rounds_left() + 1
        self.run_rounds(limit)
        if self.active:
            raise DriverError(f"{self.active} rollouts still running after {limit} rounds")
        return self.receipts()

    def _rounds_left(self) -> int:
        per_turn = lambda s: math.ceil(s.tokens_per_turn / self.step_tokens)  # noqa: E731
        return max((per_turn(r.spec) * (r.spec.turns - r.turn) for r in self._rollouts.values() if r.active), default=0)

    def _round(self) -> None:
        slots = sorted({r.slot for r in self._rollouts.values() if r.active})
        steps = {s: self.actors[s].step(self.step_tokens) for s in slots}
        finished = [s for s in slots if steps[s].result()["completed"]]
        self._collect(finished)
        self.rounds += 1

    def _collect(self, slots: Sequence[int]) -> list[RolloutState]:
        """Take completed calls from ``slots``, stage them (one put), open next turns."""
        taken = {s: self.actors[s].take_completed() for s in slots}
        outputs = [o for s in slots for o in taken[s].result()]
        if not outputs:
            return []
        rows, owners = [], []
        for out in outputs:
            r = self._rollouts.get(out["rollout_id"])
            if r is None or not r.active or out["model_call_id"] != call_id(r.turn):
                continue  # not a call of ours (or a stale one): nothing to stage
            try:
                row = r.gate.stage_call(
                    out["model_call_id"], parent_call_id(r.turn), out["token_ids"], out["token_mask"], out["logprobs"],
                    routed_experts=out.get("routed_experts"), weight_version=self.weight_version,
                )
            except InvalidRecord as e:
                self._poison(r, f"{e.reason}: {e.detail}")
                continue
            rows.append(row)
            owners.append((r, row, int(out["context_tokens"])))
        if rows:
            result = self.store.put_many(pack_rows(rows, with_routes=self.with_routes), partition=STAGING_PARTITION)
            self.stage_puts += 1
        nxt = []
        for r, row, n_ctx in owners:
            bad = result.failed.get(row.staging_key)
            if bad is not None:
                self._poison(r, f"staging_failed: {bad[0]}: {bad[1]}")
                continue
            self._advance(r, row.token_ids, n_ctx)
            if r.active:
                nxt.append(r)
            else:
                r.final = r.gate.receipt(self._reward(r))
        self._start(nxt)
        return nxt

    def _advance(self, r: RolloutState, delta_ids: np.ndarray, n_ctx: int) -> None:
        r.generated.append(np.asarray(delta_ids[n_ctx:]))
        r.prev_len += len(delta_ids)
        r.tail = np.concatenate([r.tail, delta_ids])[-self.policy.window :]
        r.turn += 1

    def _reward(self, r: RolloutState) -> float:
        gen = np.concatenate(r.generated) if r.generated else np.zeros(0, np.int64)
        return toy_reward(gen)

    def _poison(self, r: RolloutState, reason: str) -> None:
        r.gate.poison(reason)
        r.final = r.gate.receipt(self._reward(r))

    def receipts(self) -> dict[str, list[Receipt]]:
        """Receipts per group (submission order); running rollouts get their receipt so far."""
        out: dict[str, list[Receipt]] = {}
        for rid in self._order:
            r = self._rollouts[rid]
            rec = r.final if r.final is not None else r.gate.receipt(self._reward(r))
            out.setdefault(r.spec.group_id, []).append(rec)
        return out
