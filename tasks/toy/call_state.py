"""One in-flight model call of the toy engine: :class:`CallState` (what it carries and has
generated so far) and :class:`CallDelta` (the arrays a staged or cut row holds).

Opened, advanced and resumed by :mod:`tasks.toy.inflight_calls`; docs/design.md, "The toy
engine".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidCall
from .sampling import rollout_key

I64 = np.dtype(np.int64)  # token ids
F32 = np.dtype(np.float32)  # token mask, logprobs
I16 = np.dtype(np.int16)  # routed expert ids of a policy with more than 256 experts
U8 = np.dtype(np.uint8)  # routed expert ids of a policy with at most 256 experts


def readonly_view(a: np.ndarray) -> np.ndarray:
    """A view of ``a`` that cannot be written through (``a`` itself stays writable)."""
    v = a.view()
    v.flags.writeable = False
    return v


@dataclass(frozen=True)
class CallDelta:
    """A call's delta (or a slice of it): the arrays a staged or cut row carries.

    token_ids int64[n], token_mask float32[n] (0 context, then 1 generated), logprobs
    float32[n] (0 where mask is 0), routed_experts [n, L, K] (the policy's routes dtype:
    uint8 up to 256 experts, else int16) or None.
    """

    token_ids: np.ndarray
    token_mask: np.ndarray
    logprobs: np.ndarray
    routed_experts: np.ndarray | None

    def __len__(self) -> int:
        """Tokens in the delta."""
        return len(self.token_ids)


class CallState:
    """One in-flight model call. Build with :func:`start_calls` or :func:`resume_state`.

    Attributes (read-only by convention):
        rollout_id: the rollout this call belongs to.
        seed: the policy seed its sampling keys derive from (checked by :func:`advance`).
        prev_len: tokens of the rollout before this call's delta (its ``prev_len``).
        history_tail: int64, the last ``min(window, prev_len)`` of those tokens.
        context: int64[c], the delta's carried tokens (prompt or tool tokens, mask 0).
        context_routes: [c, L, K] or None: routes of the context tokens.
        max_new_tokens: tokens this call generates in total.
        with_routes: whether routes are kept (and staged).
        routes_dtype: the routes' dtype (the policy's: uint8 or int16).
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
        routes_dtype: np.dtype = I16,
    ):
        self.rollout_id = rollout_id
        self.seed = int(seed)
        self.key = rollout_key(self.seed, rollout_id)
        self.prev_len = int(prev_len)
        self.history_tail = readonly_view(history_tail)
        self.context = readonly_view(context)
        self.context_routes = None if context_routes is None else readonly_view(context_routes)
        self.max_new_tokens = int(max_new_tokens)
        self.routes_shape = tuple(routes_shape)
        self.with_routes = with_routes
        self.routes_dtype = np.dtype(routes_dtype)
        self._n = 0
        self._grow(0)

    # ---- generated tokens ----------------------------------------------------------------

    def _grow(self, need: int) -> None:
        """Ensure buffer room for ``need`` tokens. A new buffer is a fresh copy, so views
        handed out earlier keep pointing at the old, never-again-written buffer."""
        cap = max(need, min(self.max_new_tokens, 64), 1)
        if self._n == 0 and need == 0:
            self._tok = np.empty(cap, I64)
            self._lp = np.empty(cap, F32)
            self._rt = np.empty((cap, *self.routes_shape), self.routes_dtype) if self.with_routes else None
            return
        if need <= len(self._tok):
            return
        cap = min(max(need, 2 * len(self._tok)), max(need, self.max_new_tokens))
        n = self._n
        tok, lp = np.empty(cap, I64), np.empty(cap, F32)
        tok[:n], lp[:n] = self._tok[:n], self._lp[:n]
        self._tok, self._lp = tok, lp
        if self.with_routes:
            rt = np.empty((cap, *self.routes_shape), self.routes_dtype)
            rt[:n] = self._rt[:n]
            self._rt = rt

    def _append(self, tokens: np.ndarray, logprobs: np.ndarray, routes: np.ndarray | None) -> None:
        """Add generated tokens (int64[m]), their logprobs (float32[m]) and, when routes
        are kept, their routes ([m, L, K], cast to ``routes_dtype``) past the end."""
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
        return readonly_view(self._tok[: self._n])

    @property
    def logprobs(self) -> np.ndarray:
        """float32[n_generated]: their sampling logprobs (finite, <= 0)."""
        return readonly_view(self._lp[: self._n])

    @property
    def routes(self) -> np.ndarray | None:
        """int16[n_generated, L, K] routed experts of the generated tokens, or None."""
        return None if self._rt is None else readonly_view(self._rt[: self._n])

    # ---- lengths -------------------------------------------------------------------------

    @property
    def n_generated(self) -> int:
        """Tokens generated so far."""
        return self._n

    @property
    def remaining(self) -> int:
        """Tokens still to generate."""
        return self.max_new_tokens - self._n

    @property
    def done(self) -> bool:
        """Whether the call has generated all of its ``max_new_tokens``."""
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
        mask = np.concatenate([np.zeros(n_ctx, F32), np.ones(n_gen, F32)])
        lps = np.concatenate([np.zeros(n_ctx, F32), self._lp[gs : self._n]])
        routes = None
        if self.with_routes:
            routes = np.concatenate([self.context_routes[cs:], self._rt[gs : self._n]])
        return CallDelta(ids, mask, lps, routes)

    def __repr__(self) -> str:
        return (
            f"CallState({self.rollout_id!r}, prev_len={self.prev_len}, context={len(self.context)}, "
            f"generated={self._n}/{self.max_new_tokens})"
        )
