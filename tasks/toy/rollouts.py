"""Multi-turn rollouts of the toy policy, call by call, through the capture gate.

High level (examples, tests, benchmarks): build GRPO groups of :class:`RolloutSpec` and
:func:`generate_rollouts` turn by turn, returning each rollout's staged rows and receipt.
Low level (generation actors that cut and restore in-flight calls): :class:`CallState`,
:func:`start_calls`, :func:`advance` (one batch for many calls, batch-invariant) and
:func:`resume_state` (continue a saved prefix bit for bit). docs/design.md, "The toy engine".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .environment import ToolEnvironment, synthetic_prompt
from ..errors import InvalidCall, InvalidRecord, TokenCaptureError
from ..gate import CaptureGate
from ..keys import check_id
from .policy import MoEPolicy
from ..receipts import Receipt
from .sampling import rollout_key
from ..schema import StagedRow

_I64 = np.dtype(np.int64)
_F32 = np.dtype(np.float32)
_I16 = np.dtype(np.int16)


def call_id(turn: int) -> str:
    """The model_call_id of a rollout's turn ``turn`` (0-based)."""
    return f"call-{turn}"


def parent_call_id(turn: int) -> str | None:
    """The parent call id of turn ``turn``: the previous turn, none for turn 0."""
    return None if turn == 0 else call_id(turn - 1)


@dataclass(frozen=True)
class CallDelta:
    """A call's delta (or a slice of it): the arrays a staged or cut row carries.

    token_ids int64[n], token_mask float32[n] (0 context, then 1 generated), logprobs
    float32[n] (0 where mask is 0), routed_experts int16[n, L, K] or None.
    """

    token_ids: np.ndarray
    token_mask: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None

    def __len__(self) -> int:
        return len(self.token_ids)


def _readonly(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


class CallState:
    """One in-flight model call. Build with :func:`start_calls` or :func:`resume_state`.

    Attributes (read-only by convention):
        rollout_id: the rollout this call belongs to.
        seed: the policy seed its sampling keys derive from (checked by :func:`advance`).
        prev_len: tokens of the rollout before this call's delta (its ``prev_len``).
        history_tail: int64, the last ``min(window, prev_len)`` of those tokens.
        context: int64[c], the delta's carried tokens (prompt or tool tokens, mask 0).
        context_routes: int16[c, L, K] or None: routes of the context tokens.
        max_new_tokens: tokens this call generates in total.
        with_routes: whether routes are kept (and staged).
    Generated so far (read-only views, never overwritten later): :attr:`tokens`,
    :attr:`logprobs`, :attr:`routes`.
    """

    def __init__(
        self,
        *,
        rollout_id: str,
        seed: int,
        prev_len: int,
        history_tail: np.ndarray,
        context: np.ndarray,
        context_routes: np.ndarray | None,
        max_new_tokens: int,
        routes_shape: tuple[int, int],
        with_routes: bool,
    ):
        self.rollout_id = rollout_id
        self.seed = int(seed)
        self.key = rollout_key(self.seed, rollout_id)
        self.prev_len = int(prev_len)
        self.history_tail = _readonly(history_tail)
        self.context = _readonly(context)
        self.context_routes = None if context_routes is None else _readonly(context_routes)
        self.max_new_tokens = int(max_new_tokens)
        self.routes_shape = tuple(routes_shape)
        self.with_routes = with_routes
        self._n = 0
        self._grow(0)

    # ---- generated tokens ----------------------------------------------------------------

    def _grow(self, need: int) -> None:
        """Ensure buffer room for ``need`` tokens. A new buffer is a fresh copy, so views
        handed out earlier keep pointing at the old, never-again-written buffer."""
        cap = max(need, min(self.max_new_tokens, 64), 1)
        if self._n == 0 and need == 0:
            self._tok = np.empty(cap, _I64)
            self._lp = np.empty(cap, _F32)
            self._rt = np.empty((cap, *self.routes_shape), _I16) if self.with_routes else None
            return
        if need <= len(self._tok):
            return
        cap = min(max(need, 2 * len(self._tok)), max(need, self.max_new_tokens))
        n = self._n
        tok, lp = np.empty(cap, _I64), np.empty(cap, _F32)
        tok[:n], lp[:n] = self._tok[:n], self._lp[:n]
        self._tok, self._lp = tok, lp
        if self.with_routes:
            rt = np.empty((cap, *self.routes_shape), _I16)
            rt[:n] = self._rt[:n]
            self._rt = rt

    def _append(self, tokens: np.ndarray, logprobs: np.ndarray, routes: np.ndarray) -> None:
        n, m = self._n, len(tokens)
        self._grow(n + m)
        self._tok[n : n + m] = tokens
        self._lp[n : n + m] = logprobs
        if self.with_routes:
            self._rt[n : n + m] = routes
        self._n = n + m

    @property
    def tokens(self) -> np.ndarray:
        """int64[n_generated]: generated token ids so far."""
        return _readonly(self._tok[: self._n])

    @property
    def logprobs(self) -> np.ndarray:
        """float32[n_generated]: their sampling logprobs (finite, <= 0)."""
        return _readonly(self._lp[: self._n])

    @property
    def routes(self) -> np.ndarray | None:
        """int16[n_generated, L, K] routed experts of the generated tokens, or None."""
        return None if self._rt is None else _readonly(self._rt[: self._n])

    # ---- lengths -------------------------------------------------------------------------

    @property
    def n_generated(self) -> int:
        return self._n

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return self.max_new_tokens - self._n

    @property
    def done(self) -> bool:
        return self._n >= self.max_new_tokens

    @property
    def delta_len(self) -> int:
        """Tokens in the delta so far: context + generated."""
        return len(self.context) + self._n

    @property
    def position(self) -> int:
        """Absolute position of the next token (= the call's ``cum_len`` so far)."""
        return self.prev_len + self.delta_len

    # ---- views ---------------------------------------------------------------------------

    def window_tail(self, window: int) -> np.ndarray:
        """The last ``window`` tokens before :attr:`position` (fewer near the start)."""
        if self._n >= window:
            return self._tok[self._n - window : self._n].copy()
        parts = [self.history_tail, self.context, self._tok[: self._n]]
        return np.concatenate(parts)[-window:]

    def delta(self, start: int = 0) -> CallDelta:
        """The delta from offset ``start`` (delta coordinates) to the current end.

        ``delta(0)`` is what the capture gate stages when the call is done, and what a
        first cut writes; a later cut writes ``delta(length already written)``. Fresh
        contiguous arrays (safe to hand to the gate or the store).
        """
        c = len(self.context)
        if not 0 <= start <= self.delta_len:
            raise InvalidCall("invalid_argument", f"start {start} outside [0, {self.delta_len}]")
        cs = min(start, c)  # where the context part of the slice starts
        gs = max(start - c, 0)  # where the generated part starts
        n_ctx, n_gen = c - cs, self._n - gs
        ids = np.concatenate([self.context[cs:], self._tok[gs : self._n]])
        mask = np.concatenate([np.zeros(n_ctx, _F32), np.ones(n_gen, _F32)])
        lps = np.concatenate([np.zeros(n_ctx, _F32), self._lp[gs : self._n]])
        routes = None
        if self.with_routes:
            routes = np.concatenate([self.context_routes[cs:], self._rt[gs : self._n]])
        return CallDelta(ids, mask, lps, routes)

    def __repr__(self) -> str:
        return (
            f"CallState({self.rollout_id!r}, prev_len={self.prev_len}, context={len(self.context)}, "
            f"generated={self._n}/{self.max_new_tokens})"
        )


# ---- opening, advancing, resuming calls ------------------------------------------------------


def _as_tokens(a, what: str, vocab_size: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise InvalidCall("invalid_argument", f"{what} must be a 1-d integer array, got {a.dtype}{list(a.shape)}")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        raise InvalidCall("invalid_token", f"{what} holds ids outside [0, {vocab_size})")
    return a


def _tail(policy: MoEPolicy, history, prev_len: int | None, what: str) -> tuple[int, np.ndarray]:
    """(prev_len, last min(window, prev_len) tokens) of a full history or a tail of it."""
    h = _as_tokens(history, what, policy.vocab_size)
    if prev_len is None:
        prev_len = len(h)
    if prev_len < len(h):
        raise InvalidCall("invalid_argument", f"{what} has {len(h)} tokens but prev_len is {prev_len}")
    need = min(policy.window, prev_len)
    if len(h) < need:
        raise InvalidCall("short_history", f"{what} has {len(h)} tokens; the policy needs the last {need} of {prev_len}")
    return int(prev_len), h[len(h) - need :].copy()


def _per_call(value: int | Sequence[int], n: int, what: str) -> list[int]:
    vals = [int(value)] * n if np.isscalar(value) else [int(v) for v in value]
    if len(vals) != n:
        raise InvalidCall("invalid_argument", f"{what}: {len(vals)} values for {n} calls")
    if any(v < 0 for v in vals):
        raise InvalidCall("invalid_argument", f"{what} must be >= 0")
    return vals


def start_calls(
    policy: MoEPolicy,
    rollout_ids: Sequence[str],
    histories: Sequence[np.ndarray],
    contexts: Sequence[np.ndarray],
    max_new_tokens: int | Sequence[int],
    *,
    prev_lens: Sequence[int] | None = None,
    with_routes: bool = True,
) -> list[CallState]:
    """Open one call per rollout, prefilling the routes of the context tokens.

    rollout_ids: the calls' rollouts (several calls of one rollout are allowed).
    histories: per call, int tokens of the rollout before this call's delta: the whole
        history, or (with ``prev_lens``) any tail of it holding at least its last
        ``policy.window`` tokens; only that tail and the length matter.
    contexts: per call, the delta's new context tokens (prompt or tool tokens, mask 0).
    max_new_tokens: tokens each call will generate (one int for all, or one per call).
    prev_lens: per call, the history's full length when ``histories`` are tails.
    with_routes: keep routed experts (for staging with ``routes_encoding`` 1).

    Raises :class:`InvalidCall` (``invalid_token``, ``short_history``,
    ``invalid_argument``) naming the call; nothing is returned on error.
    """
    n = len(rollout_ids)
    if len(histories) != n or len(contexts) != n:
        raise InvalidCall("invalid_argument", f"{n} rollout ids, {len(histories)} histories, {len(contexts)} contexts")
    maxes = _per_call(max_new_tokens, n, "max_new_tokens")
    plens = [None] * n if prev_lens is None else _per_call(prev_lens, n, "prev_lens")
    L, K = policy.routes_shape
    prepared = []
    for i, rid in enumerate(rollout_ids):
        try:
            check_id(rid, "rollout_id")
        except TokenCaptureError as e:
            raise InvalidCall("invalid_argument", str(e)) from None
        plen, tail = _tail(policy, histories[i], plens[i], f"history of call {i} ({rid!r})")
        ctx = _as_tokens(contexts[i], f"context of call {i} ({rid!r})", policy.vocab_size)
        prepared.append((rid, plen, tail, ctx))
    # One prefill pass over every context token of every call.
    routes_of: list[np.ndarray | None] = [None] * n
    if with_routes:
        windows, positions = [], []
        for rid, plen, tail, ctx in prepared:
            seq = np.concatenate([tail, ctx])
            windows.append(policy.windows_at(seq, len(tail) + np.arange(len(ctx))))
            positions.append(plen + np.arange(len(ctx), dtype=np.int64))
        all_windows = np.concatenate(windows) if windows else np.zeros((0, policy.window), np.int64)
        all_positions = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        if len(all_positions):
            routes = policy.route(all_windows, all_positions)
        else:
            routes = np.zeros((0, L, K), _I16)
        splits = np.cumsum([len(p[3]) for p in prepared])[:-1]
        routes_of = np.split(routes, splits) if n else []
    return [
        CallState(
            rollout_id=rid,
            seed=policy.config.seed,
            prev_len=plen,
            history_tail=tail,
            context=ctx,
            context_routes=None if not with_routes else np.ascontiguousarray(routes_of[i]),
            max_new_tokens=maxes[i],
            routes_shape=(L, K),
            with_routes=with_routes,
        )
        for i, (rid, plen, tail, ctx) in enumerate(prepared)
    ]


def advance(policy: MoEPolicy, states: Sequence[CallState], n_tokens: int) -> list[int]:
    """Decode up to ``n_tokens`` more tokens for every call, as one batch.

    Each call gets ``min(n_tokens, state.remaining)`` tokens; done calls are skipped.
    Returns the number of tokens added per state (in order). A call's tokens, logprobs
    and routes are bitwise the same whatever else is in ``states``.
    Not thread-safe per state: hold the call's lock (the arrays it already handed out
    stay valid and unchanged, see :class:`CallState`).
    """
    if not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
        raise InvalidCall("invalid_argument", f"n_tokens must be an int >= 0, got {n_tokens!r}")
    if len({id(s) for s in states}) != len(states):
        raise InvalidCall("invalid_argument", "the same CallState appears twice in one advance")
    counts = [min(int(n_tokens), max(s.remaining, 0)) for s in states]
    active = [i for i, c in enumerate(counts) if c > 0]
    if not active:
        return counts
    w = policy.window
    windows = np.full((len(active), w), -1, dtype=np.int64)
    for row, i in enumerate(active):
        s = states[i]
        if s.seed != policy.config.seed or s.routes_shape != policy.routes_shape:
            raise InvalidCall("policy_mismatch", f"call of {s.rollout_id!r} was opened with another policy")
        tail = s.window_tail(w)
        windows[row, w - len(tail) :] = tail
    positions = np.array([states[i].position for i in active], dtype=np.int64)
    keys = np.array([states[i].key for i in active], dtype=np.uint64)
    out = policy.decode(windows, positions, keys, max(counts[i] for i in active))
    for row, i in enumerate(active):
        c = counts[i]
        states[i]._append(out.tokens[row, :c], out.logprobs[row, :c], out.routes[row, :c])
    return counts


def resume_state(
    policy: MoEPolicy,
    rollout_id: str,
    history: np.ndarray,
    prefix_ids: np.ndarray,
    prefix_mask: np.ndarray,
    prefix_logprobs: np.ndarray,
    prefix_routes: np.ndarray | None,
    max_new_tokens: int,
    *,
    prev_len: int | None = None,
    verify: bool = False,
) -> CallState:
    """Rebuild an in-flight call from its saved prefix; continuing it with :func:`advance`
    yields exactly the tokens, logprobs and routes of the uninterrupted call.

    rollout_id: the call's rollout.
    history: the rollout's tokens before this call's delta (whole, or with ``prev_len``
        a tail holding at least the last ``policy.window`` tokens).
    prefix_ids, prefix_mask, prefix_logprobs, prefix_routes: the saved delta prefix, cut
        chunks concatenated in chain order (int64, float32 zeros-then-ones, float32,
        int16[n, L, K] or None for a call without routes). The prefix must hold the
        call's WHOLE context (its mask-0 part; any ``CallState.delta(0)`` does) and may
        end anywhere in the generation, also before its first token. A prefix cut
        inside the context cannot be told apart from a shorter context: don't write one.
    max_new_tokens: the call's total generation budget (as when it was started).
    verify: re-decode the saved generated tokens and require bitwise equality (costs one
        decode of the prefix; the store's digest check is the normal guard).

    Raises :class:`InvalidCall` (``invalid_prefix``, ``invalid_token``, ``short_history``,
    ``prefix_mismatch``).
    """
    try:
        check_id(rollout_id, "rollout_id")
    except TokenCaptureError as e:
        raise InvalidCall("invalid_argument", str(e)) from None
    plen, tail = _tail(policy, history, prev_len, f"history of {rollout_id!r}")
    ids = _as_tokens(prefix_ids, f"prefix_ids of {rollout_id!r}", policy.vocab_size)
    n = len(ids)
    for name, arr in (("prefix_mask", prefix_mask), ("prefix_logprobs", prefix_logprobs)):
        if not isinstance(arr, np.ndarray) or arr.dtype != _F32 or arr.shape != (n,):
            raise InvalidCall("invalid_prefix", f"{name} must be float32[{n}], got {getattr(arr, 'dtype', type(arr).__name__)}{list(np.shape(arr))}")
    ones = prefix_mask == 1.0
    if not np.all(ones | (prefix_mask == 0.0)):
        raise InvalidCall("invalid_prefix", "prefix_mask holds values other than 0 and 1")
    c = n - int(np.count_nonzero(ones))
    if ones[:c].any():
        raise InvalidCall("invalid_prefix", "prefix_mask is not zeros-then-ones")
    if not np.isfinite(prefix_logprobs).all() or (prefix_logprobs > 0).any() or (prefix_logprobs[:c] != 0).any():
        raise InvalidCall("invalid_prefix", "prefix_logprobs must be finite, <= 0, and 0 where mask is 0")
    if n - c > max_new_tokens:
        raise InvalidCall("invalid_prefix", f"{n - c} generated tokens exceed max_new_tokens {max_new_tokens}")
    L, K = policy.routes_shape
    if prefix_routes is not None:
        if not isinstance(prefix_routes, np.ndarray) or prefix_routes.dtype != _I16 or prefix_routes.shape != (n, L, K):
            raise InvalidCall("invalid_prefix", f"prefix_routes must be int16[{n}, {L}, {K}], got {getattr(prefix_routes, 'dtype', None)}{list(np.shape(prefix_routes))}")
        if prefix_routes.size and (int(prefix_routes.min()) < 0 or int(prefix_routes.max()) >= policy.num_experts):
            raise InvalidCall("invalid_prefix", f"prefix_routes hold expert ids outside [0, {policy.num_experts})")
    with_routes = prefix_routes is not None
    state = CallState(
        rollout_id=rollout_id,
        seed=policy.config.seed,
        prev_len=plen,
        history_tail=tail,
        context=ids[:c].copy(),
        context_routes=prefix_routes[:c].copy() if with_routes else None,
        max_new_tokens=max_new_tokens,
        routes_shape=(L, K),
        with_routes=with_routes,
    )
    state._append(ids[c:], np.asarray(prefix_logprobs[c:]), prefix_routes[c:] if with_routes else None)
    if verify and n - c:
        fresh = start_calls(policy, [rollout_id], [tail], [ids[:c]], [max_new_tokens], prev_lens=[plen], with_routes=with_routes)[0]
        advance(policy, [fresh], n - c)
        same = fresh.delta(0)
        saved = state.delta(0)
        if not (
            np.array_equal(same.token_ids, saved.token_ids)
            and same.logprobs.tobytes() == saved.logprobs.tobytes()
            and (not with_routes or np.array_equal(same.routed_experts, saved.routed_experts))
        ):
            raise InvalidCall("prefix_mismatch", f"saved prefix of {rollout_id!r} is not what this policy generates")
    return state


# ---- whole rollouts -----------------------------------------------------------------------------


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
        object.__setattr__(self, "prompt_tokens", _readonly(np.ascontiguousarray(p, dtype=np.int64)))
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
    length for a synthetic prompt drawn from (seed, prompt_id).
    """
    check_id(prompt_id, "prompt_id")
    if n_rollouts < 1:
        raise InvalidCall("invalid_argument", f"n_rollouts {n_rollouts} must be >= 1")
    if np.isscalar(prompt_tokens):
        prompt = synthetic_prompt(seed, prompt_id, int(prompt_tokens), vocab_size)
    else:
        prompt = _as_tokens(prompt_tokens, f"prompt of {prompt_id!r}", vocab_size)
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


def generate_rollouts(
    policy: MoEPolicy,
    specs: Sequence[RolloutSpec],
    *,
    env: ToolEnvironment | None = None,
    weight_version: int = 0,
    with_routes: bool = True,
) -> list[GeneratedRollout]:
    """Generate every rollout, all of them batched together turn by turn.

    Each call's delta goes through a :class:`CaptureGate` (vocab and expert ranges of the
    policy). A delta the gate refuses poisons that rollout's receipt (``failure_reason``
    names the gate's reason) and ends that rollout; the others go on.
    env: defaults to ``ToolEnvironment(policy seed, vocab)``.
    Returns one :class:`GeneratedRollout` per spec, in order.
    """
    ids = [s.rollout_id for s in specs]
    if len(set(ids)) != len(ids):
        raise InvalidCall("invalid_argument", "duplicate rollout_id in specs")
    env = env or ToolEnvironment(seed=policy.config.seed, vocab_size=policy.vocab_size)
    gates = [
        CaptureGate(s.rollout_id, vocab_size=policy.vocab_size, num_experts=policy.num_experts, group_id=s.group_id)
        for s in specs
    ]
    rows: list[list[StagedRow]] = [[] for _ in specs]
    deltas: list[list[np.ndarray]] = [[] for _ in specs]
    generated: list[list[np.ndarray]] = [[] for _ in specs]
    tails = [np.zeros(0, np.int64) for _ in specs]
    lens = [0] * len(specs)
    alive = [True] * len(specs)
    for i, s in enumerate(specs):
        # A prompt this policy cannot read poisons its rollout only, not the batch.
        p = s.prompt_tokens
        if p.size and (int(p.min()) < 0 or int(p.max()) >= policy.vocab_size):
            gates[i].poison(f"invalid_token: prompt of {s.rollout_id!r} holds ids outside [0, {policy.vocab_size})")
            alive[i] = False
    for turn in range(max((s.turns for s in specs), default=0)):
        idx = [i for i, s in enumerate(specs) if alive[i] and turn < s.turns]
        if not idx:
            break
        states = start_turns(
            policy,
            env,
            [specs[i] for i in idx],
            turn,
            [tails[i] for i in idx],
            prev_lens=[lens[i] for i in idx],
            with_routes=with_routes,
        )
        advance(policy, states, max(s.max_new_tokens for s in states))
        for i, st in zip(idx, states):
            d = st.delta(0)
            try:
                row = gates[i].stage_call(
                    call_id(turn),
                    parent_call_id(turn),
                    d.token_ids,
                    d.token_mask,
                    d.logprobs,
                    routed_experts=d.routed_experts,
                    weight_version=weight_version,
                )
            except InvalidRecord as e:
                gates[i].poison(f"{e.reason}: {e.detail}")
                alive[i] = False
                continue
            rows[i].append(row)
            deltas[i].append(d.token_ids)
            generated[i].append(st.tokens)
            lens[i] += len(d)
            tails[i] = np.concatenate([tails[i], d.token_ids])[-policy.window :]
    out = []
    for i, s in enumerate(specs):
        gen = np.concatenate(generated[i]) if generated[i] else np.zeros(0, np.int64)
        out.append(
            GeneratedRollout(
                spec=s,
                rows=rows[i],
                receipt=gates[i].receipt(toy_reward(gen)),
                tokens=np.concatenate(deltas[i]) if deltas[i] else np.zeros(0, np.int64),
            )
        )
    return out
