"""The checks on what opens or resumes a toy call: token arrays, rollout histories,
per-call values and saved prefixes. Each raises :class:`~tasks.errors.InvalidCall`
naming what is wrong, before any state is built.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidCall, TokenCaptureError
from ..keys import check_id
from .call_state import F32, I16, U8
from .policy import MoEPolicy


def checked_rollout_id(rollout_id: str) -> None:
    """Raise ``invalid_argument`` unless ``rollout_id`` is a valid id (no '/', not empty)."""
    try:
        check_id(rollout_id, "rollout_id")
    except TokenCaptureError as e:
        raise InvalidCall("invalid_argument", str(e)) from None


def checked_tokens(a: object, what: str, vocab_size: int) -> np.ndarray:
    """``a`` as a contiguous int64[n] array of ids in ``[0, vocab_size)``.

    Raises ``invalid_argument`` (not a 1-d integer array) or ``invalid_token``.
    """
    a = np.asarray(a)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise InvalidCall("invalid_argument", f"{what} must be a 1-d integer array, got {a.dtype}{list(a.shape)}")
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.size and (int(a.min()) < 0 or int(a.max()) >= vocab_size):
        raise InvalidCall("invalid_token", f"{what} holds ids outside [0, {vocab_size})")
    return a


def history_tail(policy: MoEPolicy, history: object, prev_len: int | None, what: str) -> tuple[int, np.ndarray]:
    """(prev_len in tokens, int64 copy of the last ``min(window, prev_len)`` tokens) of a
    full history (``prev_len`` None) or of a tail of one (``prev_len`` its full length).

    Raises ``invalid_argument`` (longer than ``prev_len``) or ``short_history`` (fewer
    tokens than the policy's window needs).
    """
    h = checked_tokens(history, what, policy.vocab_size)
    if prev_len is None:
        prev_len = len(h)
    if prev_len < len(h):
        raise InvalidCall("invalid_argument", f"{what} has {len(h)} tokens but prev_len is {prev_len}")
    need = min(policy.window, prev_len)
    if len(h) < need:
        raise InvalidCall("short_history", f"{what} has {len(h)} tokens; the policy needs the last {need} of {prev_len}")
    return int(prev_len), h[len(h) - need :].copy()


def per_call_values(value: int | Sequence[int], n: int, what: str) -> list[int]:
    """``n`` ints >= 0: ``value`` for every call, or one given per call."""
    vals = [int(value)] * n if np.isscalar(value) else [int(v) for v in value]
    if len(vals) != n:
        raise InvalidCall("invalid_argument", f"{what}: {len(vals)} values for {n} calls")
    if any(v < 0 for v in vals):
        raise InvalidCall("invalid_argument", f"{what} must be >= 0")
    return vals


def prefix_context_len(
    policy: MoEPolicy,
    n: int,
    prefix_mask: np.ndarray,
    prefix_logprobs: np.ndarray,
    prefix_routes: np.ndarray | None,
    max_new_tokens: int,
) -> int:
    """The context length (tokens, the mask-0 part) of a saved prefix of ``n`` tokens,
    after checking its mask (float32[n], zeros then ones), logprobs (float32[n], finite,
    <= 0, 0 on the context), generated length (<= ``max_new_tokens``) and routes
    (int16 or uint8 [n, L, K] of expert ids in range, or None).

    Raises ``invalid_prefix`` naming the first check that fails.
    """
    for name, arr in (("prefix_mask", prefix_mask), ("prefix_logprobs", prefix_logprobs)):
        if not isinstance(arr, np.ndarray) or arr.dtype != F32 or arr.shape != (n,):
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
        if not isinstance(prefix_routes, np.ndarray) or prefix_routes.dtype not in (I16, U8) or prefix_routes.shape != (n, L, K):
            raise InvalidCall("invalid_prefix", f"prefix_routes must be int16 or uint8 [{n}, {L}, {K}], got {getattr(prefix_routes, 'dtype', None)}{list(np.shape(prefix_routes))}")
        if prefix_routes.size and (int(prefix_routes.min()) < 0 or int(prefix_routes.max()) >= policy.num_experts):
            raise InvalidCall("invalid_prefix", f"prefix_routes hold expert ids outside [0, {policy.num_experts})")
    return c
