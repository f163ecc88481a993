"""Linearization: a verified root -> terminal chain of deltas becomes one training row.

Each call's delta holds only the tokens new since its parent, so the training row is
the concatenation of the chain's deltas in order (one copy per field, numpy only).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .schema import ROUTES_DTYPE, TOKEN_FIELDS


@dataclass
class Linearized:
    """One rollout's training row (``T`` tokens).

    ``spans`` holds ``(model_call_id, start, end)`` token offsets of each call's delta in
    the row; ``prompt_length`` is the number of leading context (mask 0) tokens of the
    root call, i.e. the prompt before the first generated token.
    """

    input_ids: np.ndarray  # int64[T]
    token_mask: np.ndarray  # float32[T]
    logprobs: np.ndarray  # float32[T]
    routed_experts: Optional[np.ndarray]  # int16[T, L, K] or None
    prompt_length: int
    spans: list[tuple[str, int, int]]

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return int(self.input_ids.shape[0])


def _cat(parts: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    # One output buffer; a single part is copied too so the row never aliases a batch.
    out = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)
    return out.astype(dtype, copy=False)


def linearize(
    call_ids: Sequence[str],
    token_ids: Sequence[np.ndarray],
    token_mask: Sequence[np.ndarray],
    logprobs: Sequence[np.ndarray],
    routed_experts: Optional[Sequence[np.ndarray]],
) -> Linearized:
    """Concatenate the chain's deltas (root first); the inputs are already verified.

    ``routed_experts`` is ``None`` for an unrouted chain, else one ``[delta_len, L, K]``
    array per call with the same ``[L, K]``.
    """
    ids = _cat(token_ids, TOKEN_FIELDS["token_ids"])
    mask = _cat(token_mask, TOKEN_FIELDS["token_mask"])
    lps = _cat(logprobs, TOKEN_FIELDS["logprobs"])
    routes = None if routed_experts is None else _cat(routed_experts, ROUTES_DTYPE)
    spans = []
    start = 0
    for cid, part in zip(call_ids, token_ids):
        end = start + int(part.shape[0])
        spans.append((cid, start, end))
        start = end
    root_mask = token_mask[0]
    # Zeros-then-ones was verified, so the prompt is the root's zeros.
    prompt_length = int(root_mask.shape[0] - np.count_nonzero(root_mask))
    return Linearized(ids, mask, lps, routes, prompt_length, spans)
