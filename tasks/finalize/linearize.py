"""Linearization: a verified root -> terminal chain of deltas becomes one training row.

Each call's delta holds only the tokens new since its parent, so the training row is
the concatenation of the chain's deltas in order: one output buffer per field, filled by
slice assignment (numpy only, no per-token Python), carved from an :class:`OutputArena`
when the verifier hands one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..schema import TOKEN_FIELDS


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
    routed_experts: np.ndarray | None  # [T, L, K] as stored (int16 or uint8), or None
    prompt_length: int
    spans: list[tuple[str, int, int]]

    @property
    def length(self) -> int:
        """Tokens in the row."""
        return int(self.input_ids.shape[0])


# A field's rows within a batch: (values [total, *trailing], starts, ends), in elements
# along axis 0 (tokens).
Ranges = tuple[np.ndarray, Sequence[int], Sequence[int]]


# Returns a new, writable array of the given shape and dtype (``np.empty`` or a view of
# an :class:`OutputArena`).
Alloc = Callable[[tuple, np.dtype], np.ndarray]

_ALIGN = 64  # bytes: every array carved from an arena starts on a cache line


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class OutputArena:
    """ONE buffer for the training rows of many rollouts (a verify task's), carved into
    per-rollout slots.

    Why: each fresh page of output costs a page fault (measured ~3 us per 4 KiB page on
    these machines, as much as hashing the page twice); one big allocation faults far
    less (numpy asks for transparent huge pages from 4 MiB on). Rows are views of the
    arena, never of a fetched batch; the arena lives while any of its rows does.
    ``slot_bytes[k]`` sizes slot ``k`` (see :func:`row_bytes`); a slot that runs out (or
    has size 0) falls back to ``np.empty``.
    """

    def __init__(self, slot_bytes: Sequence[int]) -> None:
        self._starts = [0] * len(slot_bytes)
        at = 0
        for k, n in enumerate(slot_bytes):
            self._starts[k] = at
            at += _aligned(n)
        self._sizes = list(slot_bytes)
        self.buf = np.empty(at, dtype=np.uint8)

    def alloc(self, k: int) -> Alloc:
        """An allocator carving arrays from slot ``k``, in order."""
        state = [self._starts[k], self._starts[k] + self._sizes[k]]

        def take(shape: tuple, dtype: np.dtype) -> np.ndarray:
            dtype = np.dtype(dtype)
            nbytes = math.prod(shape) * dtype.itemsize
            at, end = state
            if at + nbytes > end:
                return np.empty(shape, dtype=dtype)
            state[0] = at + _aligned(nbytes)
            return self.buf[at : at + nbytes].view(dtype).reshape(shape)

        return take


def row_bytes(n_tokens: int, route_bytes_per_token: int = 0) -> int:
    """Bytes one training row of ``n_tokens`` takes in an :class:`OutputArena` slot."""
    per_field = [TOKEN_FIELDS[name].itemsize * n_tokens for name in TOKEN_FIELDS]
    if route_bytes_per_token:
        per_field.append(route_bytes_per_token * n_tokens)
    return sum(_aligned(n) for n in per_field)


def _empty(shape: tuple, dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def VIEWS(shape: tuple, dtype: np.dtype) -> np.ndarray:  # noqa: N802 - a marker allocator
    """The allocator that lets :func:`gather_ranges` return a view of the batch buffer
    when the ranges are back to back (else it allocates like ``np.empty``). Only for a
    caller that owns the batch and never changes it while the rows live."""
    return np.empty(shape, dtype=dtype)


def gather_ranges(
    values: np.ndarray, starts: Sequence[int], ends: Sequence[int], dtype: np.dtype, alloc: Alloc = _empty
) -> np.ndarray:
    """``values[starts[k]:ends[k]]`` for every k, concatenated into one NEW array.

    The output comes from ``alloc`` and is filled by slice assignment (back-to-back
    ranges: one copy). It never aliases ``values`` (a training row outlives its batch),
    except with ``alloc=VIEWS``: back-to-back ranges of ``dtype`` come back as a view.
    """
    n = len(starts)
    contiguous = all(starts[k + 1] == ends[k] for k in range(n - 1))
    if alloc is VIEWS and n and contiguous and values.dtype == dtype:
        return values[starts[0] : ends[-1]]
    total = ends[-1] - starts[0] if n and contiguous else sum(e - s for s, e in zip(starts, ends))
    out = alloc((total,) + values.shape[1:], dtype)
    if contiguous:
        if n:
            out[...] = values[starts[0] : ends[-1]]
        return out
    at = 0
    for s, e in zip(starts, ends):
        out[at : at + e - s] = values[s:e]
        at += e - s
    return out


def _spans(call_ids: Sequence[str], lengths: Sequence[int]) -> list[tuple[str, int, int]]:
    spans = []
    start = 0
    for cid, n in zip(call_ids, lengths):
        spans.append((cid, start, start + n))
        start += n
    return spans


def linearize_ranges(
    call_ids: Sequence[str],
    token_ids: Ranges,
    token_mask: Ranges,
    logprobs: Ranges,
    routed_experts: Ranges | None,
    alloc: Alloc = _empty,
) -> Linearized:
    """:func:`linearize` over deltas given as ranges of whole-batch buffers (verified).

    Each field comes with its own ranges (a malformed batch may cut its fields
    differently); every call's ranges have the same length in every field. Output
    arrays come from ``alloc`` (e.g. an :class:`OutputArena` slot).
    """
    ids_v, ids_s, ids_e = token_ids
    mask_v, mask_s, mask_e = token_mask
    ids = gather_ranges(ids_v, ids_s, ids_e, TOKEN_FIELDS["token_ids"], alloc)
    mask = gather_ranges(mask_v, mask_s, mask_e, TOKEN_FIELDS["token_mask"], alloc)
    lps = gather_ranges(*logprobs, TOKEN_FIELDS["logprobs"], alloc)
    # Routes keep the dtype they were stored in (int16 or uint8, one per chain).
    routes = None if routed_experts is None else gather_ranges(*routed_experts, routed_experts[0].dtype, alloc)
    # Zeros-then-ones was verified, so the prompt is the root's zeros.
    root = mask_v[mask_s[0] : mask_e[0]] if len(mask_s) else mask_v[:0]
    prompt_length = int(root.shape[0] - np.count_nonzero(root))
    spans = _spans(call_ids, [e - s for s, e in zip(ids_s, ids_e)])
    return Linearized(ids, mask, lps, routes, prompt_length, spans)


def linearize(
    call_ids: Sequence[str],
    token_ids: Sequence[np.ndarray],
    token_mask: Sequence[np.ndarray],
    logprobs: Sequence[np.ndarray],
    routed_experts: Sequence[np.ndarray] | None,
) -> Linearized:
    """Concatenate the chain's deltas (root first); the inputs are already verified.

    ``routed_experts`` is ``None`` for an unrouted chain, else one ``[delta_len, L, K]``
    array per call with the same ``[L, K]`` and dtype (kept: int16 or uint8).
    """

    def cat(parts: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
        # One output buffer; a single part is copied too so the row never aliases a batch.
        out = np.concatenate(parts) if len(parts) > 1 else np.array(parts[0], copy=True)
        return out.astype(dtype, copy=False)

    ids = cat(token_ids, TOKEN_FIELDS["token_ids"])
    mask = cat(token_mask, TOKEN_FIELDS["token_mask"])
    lps = cat(logprobs, TOKEN_FIELDS["logprobs"])
    routes = None if routed_experts is None else cat(routed_experts, routed_experts[0].dtype)
    root_mask = token_mask[0]
    prompt_length = int(root_mask.shape[0] - np.count_nonzero(root_mask))
    return Linearized(ids, mask, lps, routes, prompt_length, _spans(call_ids, [int(p.shape[0]) for p in token_ids]))
