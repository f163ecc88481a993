"""RolloutBook: the controller's record of every rollout a driver drives.

Each rollout's :class:`~pipeline.driver.state.RolloutState` in submission order, its gate
(built for the policy's shapes), its advance through completed calls, its receipt (final
once it ends, done or poisoned), the in-flight inventory by actor slot, and the
:class:`~pipeline.driver.snapshot.DriverSnapshot` taken at a cut. No I/O.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, Sequence

import numpy as np

from tasks.cut.receipt import CallAck
from tasks.errors import InvalidRecord
from tasks.gate import CaptureGate
from tasks.hashing import DIGEST_VERSION
from tasks.receipts import CallRecord, Receipt
from tasks.schema import StagedRow
from tasks.toy.policy import MoEPolicy
from tasks.toy.rollouts import RolloutSpec, call_id, parent_call_id, toy_reward

from .handles import CompletedCall
from .snapshot import DriverSettings, DriverSnapshot
from .state import RolloutState


class RolloutBook:
    """Rollout states by id, in submission order, with gates for ``policy``'s shapes,
    hashing with ``digest_version`` (:mod:`tasks.digests`)."""

    def __init__(self, policy: MoEPolicy, digest_version: int = DIGEST_VERSION):
        self.policy = policy
        self.digest_version = digest_version
        self._rollouts: dict[str, RolloutState] = {}
        self._order: list[str] = []

    # ---- rollouts -----------------------------------------------------------------------

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self._rollouts

    def __len__(self) -> int:
        """Rollouts placed (count)."""
        return len(self._order)

    def get(self, rollout_id: str) -> RolloutState | None:
        return self._rollouts.get(rollout_id)

    def add(self, spec: RolloutSpec, slot: int) -> RolloutState:
        """A new rollout on actor ``slot``, at turn 0 with a fresh gate, appended to the order."""
        r = RolloutState(spec, slot, self.new_gate(spec))
        self._rollouts[spec.rollout_id] = r
        self._order.append(spec.rollout_id)
        return r

    def new_gate(self, spec: RolloutSpec) -> CaptureGate:
        return CaptureGate(spec.rollout_id, vocab_size=self.policy.vocab_size, num_experts=self.policy.num_experts,
                           group_id=spec.group_id, digest_version=self.digest_version)

    def resume_gate(self, spec: RolloutSpec, chain: Sequence[StagedRow], records: Sequence[CallRecord]) -> CaptureGate:
        """The gate of ``spec`` with its staged ``chain`` replayed (raises :class:`InvalidRecord`;
        it keeps the chain's digest version)."""
        return CaptureGate.resume(spec.rollout_id, chain, vocab_size=self.policy.vocab_size,
                                  num_experts=self.policy.num_experts, group_id=spec.group_id, records=records,
                                  digest_version=self.digest_version)

    @property
    def active(self) -> int:
        """Rollouts with a call in flight."""
        return sum(r.active for r in self._rollouts.values())

    def active_slots(self) -> list[int]:
        """Slots holding an in-flight call, ascending."""
        return sorted({r.slot for r in self._rollouts.values() if r.active})

    def inventory(self) -> dict[int, list[tuple[str, str]]]:
        """In-flight calls by slot, submission order: what each actor's cut lists."""
        out: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for rid in self._order:
            r = self._rollouts[rid]
            if r.active:
                out[r.slot].append(r.call)
        return out

    def rounds_left(self, step_tokens: int) -> int:
        """Rounds of ``step_tokens`` the longest-running rollout still needs, at most."""
        per_turn = lambda s: math.ceil(s.tokens_per_turn / step_tokens)  # noqa: E731
        return max((per_turn(r.spec) * (r.spec.turns - r.turn) for r in self._rollouts.values() if r.active), default=0)

    # ---- calls ----------------------------------------------------------------------------

    def stage(self, out: CompletedCall, weight_version: int) -> tuple[RolloutState, StagedRow] | None:
        """The gate's row for a completed call, or None: not a call of ours (or a stale
        one), or one the gate refuses (its rollout is poisoned)."""
        r = self._rollouts.get(out["rollout_id"])
        if r is None or not r.active or out["model_call_id"] != call_id(r.turn):
            return None
        try:
            row = r.gate.stage_call(
                out["model_call_id"], parent_call_id(r.turn), out["token_ids"], out["token_mask"], out["logprobs"],
                routed_experts=out.get("routed_experts"), weight_version=weight_version,
            )
        except InvalidRecord as e:
            self.poison(r, f"{e.reason}: {e.detail}")
            return None
        return r, row

    def advance(self, r: RolloutState, delta_ids: np.ndarray, n_ctx: int) -> None:
        """Past a staged call: ``delta_ids`` (the call's tokens, ``n_ctx`` of them context)."""
        r.generated.append(np.asarray(delta_ids[n_ctx:]))
        r.prev_len += len(delta_ids)
        r.tail = np.concatenate([r.tail, delta_ids])[-self.policy.window :]
        r.turn += 1

    # ---- receipts ---------------------------------------------------------------------------

    @staticmethod
    def reward(r: RolloutState) -> float:
        gen = np.concatenate(r.generated) if r.generated else np.zeros(0, np.int64)
        return toy_reward(gen)

    def finalize(self, r: RolloutState) -> None:
        """End ``r``: its receipt, rewarded, is final."""
        r.final = r.gate.receipt(self.reward(r))

    def poison(self, r: RolloutState, reason: str) -> None:
        r.gate.poison(reason)
        self.finalize(r)

    def receipts(self) -> dict[str, list[Receipt]]:
        """Receipts per group (submission order); running rollouts get their receipt so far."""
        out: dict[str, list[Receipt]] = {}
        for rid in self._order:
            r = self._rollouts[rid]
            rec = r.final if r.final is not None else r.gate.receipt(self.reward(r))
            out.setdefault(r.spec.group_id, []).append(rec)
        return out

    def snapshot(self, checkpoint_id: str, acks: Mapping[tuple[str, str], CallAck],
                 settings: DriverSettings) -> DriverSnapshot:
        """The state at cut ``checkpoint_id`` (``acks``: the cut's acks by call)."""
        receipts = {
            rid: (r.final if r.final is not None else r.gate.receipt(0.0)) for rid, r in self._rollouts.items()
        }
        return DriverSnapshot(
            checkpoint_id=checkpoint_id,
            specs=[self._rollouts[rid].spec for rid in self._order],
            turns={rid: r.turn for rid, r in self._rollouts.items()},
            receipts=receipts,
            acks=dict(acks),
            settings=settings,
        )
