"""One training batch per step: a step's FinalizedGroups become one dict of torch tensors.

``B`` rows (every row of every group, rejected rows included, in group order) right-padded
to the step's longest row ``T`` (tokens). Keys and dtypes: ``input_ids`` int64 [B, T]
(``pad_id`` past each row's length), ``attention_mask`` int64 [B, T] (1 on real tokens),
``position_ids`` int64 [B, T] (0..len-1, 0 on padding), ``loss_mask`` float32 [B, T]
(generated tokens of accepted rows), ``old_logprobs`` float32 [B, T] (0 off ``loss_mask``),
``rewards``, ``advantages``, ``sample_mask`` float32 [B], ``token_advantages`` float32
[B, T], ``group_index``, ``input_lengths``, ``prompt_lengths``, ``weight_version_oldest``,
``weight_version_newest`` int64 [B] (0 on rows rejected before verification),
``weight_lag`` int64 [B] (with a ``trainer_version``: trainer_version -
weight_version_oldest on every row), ``has_routes`` bool [B], and ``routed_experts``
[B, T, L, K] only when some row has routes: in the ``routes_dtype`` the trainer asks for
(e.g. ``torch.int64``), by default as stored (uint8 or int16; the same values). Rows of
another routes ``[L, K]`` than the step's, or whose lag leaves int64, are rejected here
(:mod:`tasks.finalize.batch_reject`; :func:`batch_rejections` lists them).
Advantages are GRPO's outcome advantages over each group's ACCEPTED rows only (mean and
unbiased ``torch.std``, as verl's ``compute_grpo_outcome_advantage``), computed in float64
and never NaN or inf; rejected rows and groups with fewer than two accepted rows get 0.
Vectorized (Python loops over groups and rejected rows only); see docs/design.md 4, 14.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import InvalidInput
from .assemble import FinalizedGroup
from .batch_reject import BatchRejection, rows_rejected, step_route_shape
from .lags import I64_MAX, I64_MIN, saturated_lags

logger = logging.getLogger(__name__)

_F32_MAX = float(torch.finfo(torch.float32).max)
# What a FinalizedGroup's routes may be (as stored), and what a trainer may ask for.
_STORED_ROUTES = (torch.uint8, torch.int16)
ROUTES_DTYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)

# (field, dtype, trailing shape rule): "n" = [n], "nt" = [n, t]
_FIELDS: tuple[tuple[str, torch.dtype, str], ...] = (
    ("input_ids", torch.int64, "nt"),
    ("logprobs", torch.float32, "nt"),
    ("token_mask", torch.float32, "nt"),
    ("input_lengths", torch.int64, "n"),
    ("prompt_lengths", torch.int64, "n"),
    ("sample_mask", torch.float32, "n"),
    ("rewards", torch.float32, "n"),
    ("has_routes", torch.bool, "n"),
    ("weight_version_oldest", torch.int64, "n"),
    ("weight_version_newest", torch.int64, "n"),
)


def _bad(gi: int, what: str) -> InvalidInput:
    return InvalidInput(f"step_batch: group {gi}: {what}")


def _check_group(gi: int, g: Any) -> tuple[int, int]:
    """Structure and finiteness of one group; returns its (rows, padded length)."""
    if not isinstance(g, FinalizedGroup):
        raise _bad(gi, f"expected a FinalizedGroup, got {type(g).__name__}")
    ids = g.input_ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise _bad(gi, f"input_ids must be a 2-d tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    n, t = (int(s) for s in ids.shape)
    for name, dtype, rule in _FIELDS:
        x = getattr(g, name)
        want = (n, t) if rule == "nt" else (n,)
        if not isinstance(x, torch.Tensor) or x.dtype != dtype or tuple(x.shape) != want:
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise _bad(gi, f"{name} must be {dtype} {list(want)}, got {got}")
    re = g.routed_experts
    if re is not None and (not isinstance(re, torch.Tensor) or re.dtype not in _STORED_ROUTES or re.dim() != 4 or tuple(re.shape[:2]) != (n, t)):
        got = f"{re.dtype} {tuple(re.shape)}" if isinstance(re, torch.Tensor) else type(re).__name__
        raise _bad(gi, f"routed_experts must be None or uint8/int16 [{n}, {t}, L, K], got {got}")
    lengths, prompts = g.input_lengths, g.prompt_lengths
    if n and bool(((lengths < 0) | (lengths > t) | (prompts < 0) | (prompts > lengths)).any()):
        raise _bad(gi, f"lengths out of range: need 0 <= prompt_lengths <= input_lengths <= {t}")
    if n and not bool(((g.sample_mask == 0) | (g.sample_mask == 1)).all()):
        raise _bad(gi, "sample_mask must hold only 0 and 1")
    if n and not bool(torch.isfinite(g.rewards).all()):
        row = int((~torch.isfinite(g.rewards)).nonzero()[0, 0])
        raise _bad(gi, f"reward of row {row} is {float(g.rewards[row])} (rewards must be finite float32: |r| < 3.4e38)")
    if n * t and not bool(torch.isfinite(g.logprobs).all()):
        raise _bad(gi, "logprobs hold NaN or inf")
    return n, t


def check_version(version: object, what: str, error: type[Exception] = InvalidInput) -> int:
    """``version`` as a weight version: an int (not a bool) in int64, else ``error``
    naming ``what``."""
    if isinstance(version, bool) or not isinstance(version, int) or not I64_MIN <= version <= I64_MAX:
        raise error(f"{what} must be an int64 weight version, got {version!r}")
    return version


def _check_options(eps: float, pad_id: int, routes_dtype: torch.dtype | None) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise InvalidInput(f"step_batch: eps must be a finite number >= 0, got {eps!r}")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not -(2**63) <= pad_id < 2**63:
        raise InvalidInput(f"step_batch: pad_id must be an int64 token id, got {pad_id!r}")
    if routes_dtype is not None and routes_dtype not in ROUTES_DTYPES:
        raise InvalidInput(f"step_batch: routes_dtype must be None (as stored) or one of {list(ROUTES_DTYPES)}, got {routes_dtype!r}")


def _routes_dtype(groups: Sequence[FinalizedGroup], route_shape: tuple[int, ...], asked: torch.dtype | None) -> torch.dtype:
    """The batch's routes dtype: ``asked``, or the widest the groups of ``route_shape``
    store; uint8 asked of int16-stored routes only when every id fits a byte, ``[0, 255]``
    (else :class:`InvalidInput`: a negative id would wrap)."""
    stored = [g.routed_experts for g in groups if _fits(g, route_shape)]
    widest = torch.uint8 if all(r.dtype == torch.uint8 for r in stored) else torch.int16
    if asked is None:
        return widest
    if asked == torch.uint8 and any(r.dtype != torch.uint8 and r.numel() and (int(r.max()) > 255 or int(r.min()) < 0) for r in stored):
        raise InvalidInput("step_batch: routes_dtype uint8 asked, but int16-stored routes hold expert ids above 255 or below 0")
    return asked


def group_advantages(
    rewards: torch.Tensor,
    accepted: torch.Tensor,
    group_index: torch.Tensor,
    n_groups: int,
    *,
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> torch.Tensor:
    """GRPO outcome advantages, float32 [B]: per group, over accepted rows only,
    ``(r - mean) / (std + eps)`` (``std`` unbiased) or ``r - mean`` without ``normalize_std``.

    ``rewards`` float [B] (finite), ``accepted`` bool [B], ``group_index`` int64 [B] in
    ``[0, n_groups)``. Rejected rows and groups with fewer than two accepted rows get 0.
    Statistics are taken in float64: sums of float32 rewards cannot overflow there, and k
    equal float32 rewards sum exactly, so a zero-spread group gets exactly 0 however large
    its rewards. The result is clamped to float32's range (``r - mean`` can exceed it).
    """
    r = rewards.to(torch.float64)
    acc = accepted.to(torch.float64)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, acc)
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, r * acc)
    mean = total / count.clamp(min=1)
    dev = (r - mean[group_index]) * acc  # 0 on rejected rows
    live = count >= 2
    if normalize_std:
        ss = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_index, dev * dev)
        std = torch.sqrt(ss / (count - 1).clamp(min=1))
        denom = std + eps
        # A zero-spread group (std 0) with eps 0 would divide 0 by 0: its deviations are 0.
        dev = dev / torch.where(denom > 0, denom, 1.0)[group_index]
    out = torch.where(live[group_index] & accepted, dev, 0.0)
    return out.clamp(-_F32_MAX, _F32_MAX).to(torch.float32)


def _fits(g: FinalizedGroup, route_shape: tuple[int, ...] | None) -> bool:
    """The group stores routes of the batch's ``[L, K]`` (others are rejected)."""
    return g.routed_experts is not None and tuple(g.routed_experts.shape[2:]) == route_shape


def _padded(
    groups: Sequence[FinalizedGroup], shapes: list[tuple[int, int]], T: int, pad_id: int,
    route_shape: tuple[int, ...] | None, routes_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The groups' ids, mask, logprobs (and routes, in :func:`_routes_dtype`) stacked and
    right-padded to ``T`` tokens: one slice copy per field and group."""
    B = sum(n for n, _ in shapes)
    input_ids = torch.full((B, T), pad_id, dtype=torch.int64)
    token_mask = torch.zeros((B, T), dtype=torch.float32)
    logprobs = torch.zeros((B, T), dtype=torch.float32)
    routes = None
    if route_shape is not None:
        routes = torch.zeros((B, T) + route_shape, dtype=_routes_dtype(groups, route_shape, routes_dtype))
    row = 0
    for g, (n, t) in zip(groups, shapes):
        input_ids[row:row + n, :t] = g.input_ids
        token_mask[row:row + n, :t] = g.token_mask
        logprobs[row:row + n, :t] = g.logprobs
        if routes is not None and _fits(g, route_shape):
            routes[row:row + n, :t] = g.routed_experts  # cast to the asked dtype: same values
        row += n
    return input_ids, token_mask, logprobs, routes


def weight_lag(trainer_version: int, oldest: torch.Tensor) -> torch.Tensor:
    """``trainer_version - oldest`` (int64 [B], versions): each row's ``weight_lag``. A lag
    past int64 (an absurd weight version; :func:`step_batch` rejects such a row ``stale``)
    is saturated at int64's nearest bound, never wrapped (:mod:`tasks.finalize.lags`)."""
    return torch.from_numpy(saturated_lags(trainer_version, oldest.numpy())[0])


def _checked_groups(groups: object) -> list[tuple[int, int]]:
    """Each group's (rows, padded length), after :func:`_check_group`."""
    if isinstance(groups, (FinalizedGroup, Mapping, str, bytes)) or not isinstance(groups, Sequence):
        hint = " (pass list(step.groups.values()))" if isinstance(groups, Mapping) else ""
        raise InvalidInput(f"step_batch: groups must be a sequence of FinalizedGroup, got {type(groups).__name__}{hint}")
    return [_check_group(gi, g) for gi, g in enumerate(groups)]


def batch_rejections(groups: Sequence[FinalizedGroup], *, trainer_version: int | None = None) -> list[BatchRejection]:
    """The rows :func:`step_batch` (same groups and ``trainer_version``) rejects itself, in
    step order, each with its group and row index, rollout id, reason and detail (the
    rules: :mod:`tasks.finalize.batch_reject`). Bad input raises as :func:`step_batch`."""
    _checked_groups(groups)
    if trainer_version is not None:
        check_version(trainer_version, "step_batch: trainer_version")
    return rows_rejected(groups, step_route_shape(groups), trainer_version)


def _reject(rejected: list[BatchRejection], shapes: list[tuple[int, int]], fields: tuple[torch.Tensor, ...]) -> None:
    """Make the ``rejected`` rows all padding (in the batch's own copies of the per-row
    fields: lengths, ``sample_mask``, ``has_routes``) and log them."""
    start = [0]
    for n, _ in shapes:
        start.append(start[-1] + n)
    rows = torch.tensor([start[r.group] + r.row for r in rejected], dtype=torch.int64)
    for x in fields:
        x[rows] = 0
    logger.warning("step_batch: %d row(s) rejected: %s", len(rejected),
                   "; ".join(f"group {r.group} row {r.row} ({r.rollout_id}) {r.reason}: {r.detail}" for r in rejected[:5]))


def step_batch(
    groups: Sequence[FinalizedGroup],
    *,
    eps: float = 1e-6,
    pad_id: int = 0,
    normalize_std: bool = True,
    routes_dtype: torch.dtype | None = None,
    trainer_version: int | None = None,
) -> dict[str, torch.Tensor]:
    """Stack a step's groups (step order) into one padded batch; see the module docstring.

    ``trainer_version``: the trainer's weight version; adds ``weight_lag`` (int64 [B]).

    ``routes_dtype``: the dtype of ``routed_experts`` (one of :data:`ROUTES_DTYPES`);
    ``None`` keeps them as stored (the widest of the groups'). Rows of another routes
    ``[L, K]`` than the step's (the one most routed rows have) are rejected
    ``invalid_routes``, and with a ``trainer_version`` accepted rows whose lag leaves
    int64 ``stale``: all padding with ``sample_mask`` 0, logged as a warning and listed by
    :func:`batch_rejections`; their groups are not modified. Raises
    :class:`tasks.errors.InvalidInput` naming the group and field for a group that is not
    a well-formed FinalizedGroup, a non-finite reward or logprob, a negative or
    non-finite ``eps``, a bad ``pad_id`` or ``routes_dtype``, or a ``trainer_version``
    that is not an int64.
    """
    shapes = _checked_groups(groups)
    _check_options(eps, pad_id, routes_dtype)
    if trainer_version is not None:
        check_version(trainer_version, "step_batch: trainer_version")
    B = sum(n for n, _ in shapes)
    T = max((t for _, t in shapes), default=0)
    route_shape = step_route_shape(groups)
    rejected = rows_rejected(groups, route_shape, trainer_version)
    input_ids, token_mask, logprobs, routes = _padded(groups, shapes, T, pad_id, route_shape, routes_dtype)

    def cat(name: str, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([getattr(g, name) for g in groups]) if B else torch.zeros(0, dtype=dtype)

    input_lengths = cat("input_lengths", torch.int64)
    prompt_lengths = cat("prompt_lengths", torch.int64)
    sample_mask = cat("sample_mask", torch.float32)
    rewards = cat("rewards", torch.float32)
    has_routes = cat("has_routes", torch.bool)
    if rejected:
        _reject(rejected, shapes, (input_lengths, prompt_lengths, sample_mask, has_routes))
    group_index = torch.repeat_interleave(torch.arange(len(groups), dtype=torch.int64), torch.tensor([n for n, _ in shapes], dtype=torch.int64))

    positions = torch.arange(T, dtype=torch.int64).expand(B, T)
    real = positions < input_lengths[:, None]
    attention_mask = real.to(torch.int64)
    position_ids = positions * attention_mask
    input_ids.masked_fill_(~real, pad_id)  # the groups were padded with their own pad_id
    accepted = sample_mask > 0
    loss_mask = token_mask * real * sample_mask[:, None]
    old_logprobs = torch.where(loss_mask > 0, logprobs, 0.0)
    if routes is not None:
        routes.masked_fill_(~(real & has_routes[:, None])[:, :, None, None], 0)
    advantages = group_advantages(rewards, accepted, group_index, len(groups), eps=float(eps), normalize_std=normalize_std)

    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "rewards": rewards,
        "advantages": advantages,
        "token_advantages": advantages[:, None] * loss_mask,
        "sample_mask": sample_mask,
        "group_index": group_index,
        "input_lengths": input_lengths,
        "prompt_lengths": prompt_lengths,
        "has_routes": has_routes,
        "weight_version_oldest": cat("weight_version_oldest", torch.int64),
        "weight_version_newest": cat("weight_version_newest", torch.int64),
    }
    if trainer_version is not None:
        batch["weight_lag"] = weight_lag(trainer_version, batch["weight_version_oldest"])
    if routes is not None:
        batch["routed_experts"] = routes
    return batch
