"""Opening, advancing and resuming in-flight toy calls, many at a time.

:func:`start_calls` opens calls (one prefill pass routes every context token),
:func:`advance` decodes more tokens for many calls as one batch (batch-invariant), and
:func:`resume_state` rebuilds a call from a saved prefix so that continuing it is bit for
bit the uninterrupted call. Used by the generation actors that cut and restore calls and
by :func:`tasks.toy.rollouts.generate_rollouts`; docs/design.md, "The toy engine".
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidCall
from .call_inputs import checked_rollout_id, checked_tokens, history_tail, per_call_values, prefix_context_len
from .call_state import CallState
from .policy import MoEPolicy

# A call checked and ready to open: (rollout_id, prev_len in tokens, int64 history tail,
# int64 context tokens).
_Prepared = tuple[str, int, np.ndarray, np.ndarray]


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
    maxes = per_call_values(max_new_tokens, n, "max_new_tokens")
    plens = [None] * n if prev_lens is None else per_call_values(prev_lens, n, "prev_lens")
    prepared: list[_Prepared] = []
    for i, rid in enumerate(rollout_ids):
        checked_rollout_id(rid)
        plen, tail = history_tail(policy, histories[i], plens[i], f"history of call {i} ({rid!r})")
        ctx = checked_tokens(contexts[i], f"context of call {i} ({rid!r})", policy.vocab_size)
        prepared.append((rid, plen, tail, ctx))
    routes_of = _context_routes(policy, prepared) if with_routes else [None] * n
    return [
        CallState(
            rollout_id=rid,
            seed=policy.config.seed,
            prev_len=plen,
            history_tail=tail,
            context=ctx,
            context_routes=None if not with_routes else np.ascontiguousarray(routes_of[i]),
            max_new_tokens=maxes[i],
            routes_shape=policy.routes_shape,
            with_routes=with_routes,
            routes_dtype=policy.routes_dtype,
        )
        for i, (rid, plen, tail, ctx) in enumerate(prepared)
    ]


def _context_routes(policy: MoEPolicy, prepared: Sequence[_Prepared]) -> list[np.ndarray]:
    """Per prepared call, [len(context), L, K] (``policy.routes_dtype``): the routes of its context tokens,
    from ONE prefill pass over every context token of every call."""
    L, K = policy.routes_shape
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
        routes = np.zeros((0, L, K), policy.routes_dtype)
    splits = np.cumsum([len(p[3]) for p in prepared])[:-1]
    return np.split(routes, splits) if prepared else []


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
        int16 or uint8 [n, L, K], or None for a call without routes). The prefix must hold the
        call's WHOLE context (its mask-0 part; any ``CallState.delta(0)`` does) and may
        end anywhere in the generation, also before its first token. A prefix cut
        inside the context cannot be told apart from a shorter context: don't write one.
    max_new_tokens: the call's total generation budget in tokens (as when it was started).
    verify: re-decode the saved generated tokens and require bitwise equality (costs one
        decode of the prefix; the store's digest check is the normal guard).

    Raises :class:`InvalidCall` (``invalid_prefix``, ``invalid_token``, ``short_history``,
    ``prefix_mismatch``).
    """
    checked_rollout_id(rollout_id)
    plen, tail = history_tail(policy, history, prev_len, f"history of {rollout_id!r}")
    ids = checked_tokens(prefix_ids, f"prefix_ids of {rollout_id!r}", policy.vocab_size)
    c = prefix_context_len(policy, len(ids), prefix_mask, prefix_logprobs, prefix_routes, max_new_tokens)
    with_routes = prefix_routes is not None
    state = CallState(
        rollout_id=rollout_id,
        seed=policy.config.seed,
        prev_len=plen,
        history_tail=tail,
        context=ids[:c].copy(),
        context_routes=prefix_routes[:c].copy() if with_routes else None,
        max_new_tokens=max_new_tokens,
        routes_shape=policy.routes_shape,
        with_routes=with_routes,
        # A resumed call keeps its prefix's routes dtype (a cut of int16 routes resumes as int16).
        routes_dtype=prefix_routes.dtype if with_routes else policy.routes_dtype,
    )
    state._append(ids[c:], np.asarray(prefix_logprobs[c:]), prefix_routes[c:] if with_routes else None)
    if verify and len(ids) - c:
        _check_regenerates(policy, state, max_new_tokens)
    return state


def _check_regenerates(policy: MoEPolicy, saved: CallState, max_new_tokens: int) -> None:
    """Raise ``prefix_mismatch`` unless a fresh call on the same history and context,
    advanced by as many tokens as ``saved`` holds, is bitwise ``saved``'s delta."""
    rid, generated = saved.rollout_id, saved.n_generated
    fresh = start_calls(
        policy, [rid], [saved.history_tail], [saved.context], [max_new_tokens],
        prev_lens=[saved.prev_len], with_routes=saved.with_routes,
    )[0]
    advance(policy, [fresh], generated)
    same = fresh.delta(0)
    kept = saved.delta(0)
    if not (
        np.array_equal(same.token_ids, kept.token_ids)
        and same.logprobs.tobytes() == kept.logprobs.tobytes()
        and (not saved.with_routes or np.array_equal(same.routed_experts, kept.routed_experts))
    ):
        raise InvalidCall("prefix_mismatch", f"saved prefix of {rid!r} is not what this policy generates")
