"""Multi-turn rollouts of the toy policy, call by call, through the capture gate.

High level (examples, tests, benchmarks): build GRPO groups of :class:`RolloutSpec` and
:func:`generate_rollouts` turn by turn, returning each rollout's staged rows and receipt.
Low level (generation actors that cut and restore in-flight calls), re-exported here:
:class:`CallState` (:mod:`.call_state`), :func:`start_calls`, :func:`advance` (one batch
for many calls, batch-invariant) and :func:`resume_state` (continue a saved prefix bit for
bit) from :mod:`.inflight_calls`. docs/design.md, "The toy engine".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InvalidCall, InvalidRecord
from ..gate import CaptureGate
from ..hashing import DIGEST_VERSION
from ..keys import check_id
from ..receipts import Receipt
from ..schema import StagedRow
from .call_inputs import checked_tokens
from .call_state import CallDelta, CallState, readonly_view
from .environment import ToolEnvironment, synthetic_prompt
from .inflight_calls import advance, resume_state, start_calls
from .policy import MoEPolicy

__all__ = [
    "CallDelta",
    "CallState",
    "GeneratedRollout",
    "InvalidCall",
    "RolloutSpec",
    "advance",
    "call_id",
    "generate_rollouts",
    "make_group_specs",
    "make_step_specs",
    "parent_call_id",
    "resume_state",
    "start_calls",
    "start_turns",
    "toy_reward",
]


def call_id(turn: int) -> str:
    """The model_call_id of a rollout's turn ``turn`` (0-based)."""
    return f"call-{turn}"


def parent_call_id(turn: int) -> str | None:
    """The parent call id of turn ``turn``: the previous turn, none for turn 0."""
    return None if turn == 0 else call_id(turn - 1)


@dataclass(frozen=True, eq=False)
class RolloutSpec:
    """One rollout to generate.

    rollout_id, group_id: identities (no '/', not empty); a GRPO group shares group_id
        and prompt.
    prompt_tokens: int64 prompt ids (the first call's context).
    turns: model calls in the chain (>= 1).
    tokens_per_turn: tokens each call generates (>= 1).
    tool_tokens: tool tokens the environment appends before each later call (>= 0).
    """

    rollout_id: str
    group_id: str
    prompt_tokens: np.ndarray
    turns: int
    tokens_per_turn: int
    tool_tokens: int

    def __post_init__(self) -> None:
        check_id(self.rollout_id, "rollout_id")
        check_id(self.group_id, "group_id")
        p = np.asarray(self.prompt_tokens)
        if p.ndim != 1 or not (p.dtype.kind in "iu" or p.size == 0):
            raise InvalidCall("invalid_argument", f"prompt_tokens must be a 1-d integer array, got {p.dtype}{list(p.shape)}")
        object.__setattr__(self, "prompt_tokens", readonly_view(np.ascontiguousarray(p, dtype=np.int64)))
        if self.turns < 1 or self.tokens_per_turn < 1 or self.tool_tokens < 0:
            raise InvalidCall(
                "invalid_argument",
                f"turns {self.turns} and tokens_per_turn {self.tokens_per_turn} must be >= 1, tool_tokens {self.tool_tokens} >= 0",
            )


@dataclass
class GeneratedRollout:
    """A generated rollout: its staged rows (one per call, chain order) and receipt."""

    spec: RolloutSpec
    rows: list[StagedRow]
    receipt: Receipt
    tokens: np.ndarray = field(repr=False)  # int64: the linearized chain (all deltas)

    @property
    def staging_keys(self) -> list[str]:
        """The staging keys of its rows, in chain order."""
        return [r.staging_key for r in self.rows]


def toy_reward(generated_tokens: np.ndarray) -> float:
    """Fraction of even ids among generated tokens (0.0 when there are none)."""
    g = np.asarray(generated_tokens)
    return float(np.count_nonzero(g % 2 == 0)) / len(g) if len(g) else 0.0


def make_group_specs(
    prompt_id: str,
    n_rollouts: int,
    *,
    turns: int,
    tokens_per_turn: int,
    tool_tokens: int,
    prompt_tokens: int | np.ndarray,
    vocab_size: int,
    seed: int = 0,
) -> list[RolloutSpec]:
    """A GRPO group: ``n_rollouts`` specs sharing one prompt, group_id = ``prompt_id``.

    Rollout ids are ``f"{prompt_id}-{i}"``. ``prompt_tokens`` is the prompt itself, or a
    length (tokens) for a synthetic prompt drawn from (seed, prompt_id).
    """
    check_id(prompt_id, "prompt_id")
    if n_rollouts < 1:
        raise InvalidCall("invalid_argument", f"n_rollouts {n_rollouts} must be >= 1")
    if np.isscalar(prompt_tokens):
        prompt = synthetic_prompt(seed, prompt_id, int(prompt_tokens), vocab_size)
    else:
        prompt = checked_tokens(prompt_tokens, f"prompt of {prompt_id!r}", vocab_size)
    return [
        RolloutSpec(f"{prompt_id}-{i}", prompt_id, prompt, turns, tokens_per_turn, tool_tokens)
        for i in range(n_rollouts)
    ]


def make_step_specs(prefix: str, n_groups: int, n_rollouts: int, **kwargs) -> list[list[RolloutSpec]]:
    """``n_groups`` groups (prompt ids ``f"{prefix}p{g}"``) of :func:`make_group_specs`."""
    return [make_group_specs(f"{prefix}p{g}", n_rollouts, **kwargs) for g in range(n_groups)]


def start_turns(
    policy: MoEPolicy,
    env: ToolEnvironment,
    specs: Sequence[RolloutSpec],
    turn: int,
    histories: Sequence[np.ndarray],
    *,
    prev_lens: Sequence[int] | None = None,
    with_routes: bool = True,
) -> list[CallState]:
    """Open call ``turn`` of each rollout: context = prompt (turn 0) or tool tokens.

    ``histories`` (and ``prev_lens``) as in :func:`start_calls`: the tokens of the
    rollout's earlier calls.
    """
    if turn == 0:
        contexts = [s.prompt_tokens for s in specs]
    else:
        contexts = env.tool_outputs([s.rollout_id for s in specs], [turn] * len(specs), [s.tool_tokens for s in specs])
    return start_calls(
        policy,
        [s.rollout_id for s in specs],
        histories,
        contexts,
        [s.tokens_per_turn for s in specs],
        prev_lens=prev_lens,
        with_routes=with_routes,
    )


@dataclass(eq=False)
class _RolloutInProgress:
    """One rollout while :func:`generate_rollouts` runs: its gate and what it has staged."""

    spec: RolloutSpec
    gate: CaptureGate
    rows: list[StagedRow] = field(default_factory=list)
    deltas: list[np.ndarray] = field(default_factory=list)  # int64 token ids, per staged call
    generated: list[np.ndarray] = field(default_factory=list)  # int64 generated ids, per staged call
    tail: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # its last `window` tokens
    length: int = 0  # tokens staged so far: the next call's prev_len
    alive: bool = True

    def poison(self, reason: str) -> None:
        """End the rollout: its receipt's ``failure_reason`` is ``reason``."""
        self.gate.poison(reason)
        self.alive = False

    def stage(self, turn: int, state: CallState, *, weight_version: int, window: int) -> None:
        """Stage the finished call ``turn`` through the gate, or poison the rollout with the
        gate's reason when the gate refuses it."""
        d = state.delta(0)
        try:
            row = self.gate.stage_call(
                call_id(turn),
                parent_call_id(turn),
                d.token_ids,
                d.token_mask,
                d.logprobs,
                routed_experts=d.routed_experts,
                weight_version=weight_version,
            )
        except InvalidRecord as e:
            self.poison(f"{e.reason}: {e.detail}")
            return
        self.rows.append(row)
        self.deltas.append(d.token_ids)
        self.generated.append(state.tokens)
        self.length += len(d)
        self.tail = np.concatenate([self.tail, d.token_ids])[-window:]

    def finish(self) -> GeneratedRollout:
        """The rollout's rows, its receipt (rewarded by :func:`toy_reward`) and tokens."""
        gen = np.concatenate(self.generated) if self.generated else np.zeros(0, np.int64)
        return GeneratedRollout(
            spec=self.spec,
            rows=self.rows,
            receipt=self.gate.receipt(toy_reward(gen)),
            tokens=np.concatenate(self.deltas) if self.deltas else np.zeros(0, np.int64),
        )


def generate_rollouts(
    policy: MoEPolicy,
    specs: Sequence[RolloutSpec],
    *,
    env: ToolEnvironment | None = None,
    weight_version: int = 0,
    with_routes: bool = True,
    digest_version: int = DIGEST_VERSION,
) -> list[GeneratedRollout]:
    """Generate every rollout, all of them batched together turn by turn.

    Each call's delta goes through a :class:`CaptureGate` (vocab and expert ranges of the
    policy). A delta the gate refuses poisons that rollout's receipt (``failure_reason``
    names the gate's reason) and ends that rollout; the others go on.
    env: defaults to ``ToolEnvironment(policy seed, vocab)``. ``digest_version``: the
    gates' hash algorithm (:mod:`tasks.digests`).
    Returns one :class:`GeneratedRollout` per spec, in order.
    """
    ids = [s.rollout_id for s in specs]
    if len(set(ids)) != len(ids):
        raise InvalidCall("invalid_argument", "duplicate rollout_id in specs")
    env = env or ToolEnvironment(seed=policy.config.seed, vocab_size=policy.vocab_size)
    rollouts = [
        _RolloutInProgress(s, CaptureGate(s.rollout_id, vocab_size=policy.vocab_size, num_experts=policy.num_experts,
                                          group_id=s.group_id, digest_version=digest_version))
        for s in specs
    ]
    for r in rollouts:
        # A prompt this policy cannot read poisons its rollout only, not the batch.
        p = r.spec.prompt_tokens
        if p.size and (int(p.min()) < 0 or int(p.max()) >= policy.vocab_size):
            r.poison(f"invalid_token: prompt of {r.spec.rollout_id!r} holds ids outside [0, {policy.vocab_size})")
    for turn in range(max((s.turns for s in specs), default=0)):
        live = [r for r in rollouts if r.alive and turn < r.spec.turns]
        if not live:
            break
        states = start_turns(
            policy,
            env,
            [r.spec for r in live],
            turn,
            [r.tail for r in live],
            prev_lens=[r.length for r in live],
            with_routes=with_routes,
        )
        advance(policy, states, max(s.max_new_tokens for s in states))
        for r, st in zip(live, states):
            r.stage(turn, st, weight_version=weight_version, window=policy.window)
    return [r.finish() for r in rollouts]
