"""Assembly: a group's verify results become the padded torch tensors training consumes.

The group keeps its shape however many rows are rejected: a rejected row is all zeros
with length 0 and ``sample_mask`` 0, its ``status`` names the reason and its ``details``
entry says what failed (field, call, the store's reason). A verified row too stale for
the trainer (``stale``) is dropped the same way but keeps its weight versions. Rows are
filled with one slice assignment each into preallocated numpy buffers (per-row Python,
never per-token), then handed to torch without a copy.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .. import reasons as R
from ..packed import Allocator
from .linearize import Linearized
from .verify import RolloutResult


@dataclass
class FinalizedGroup:
    """One group's training tensors (``n`` rows, padded to ``max_len`` tokens).

    ``rewards`` are the receipts' rewards as given, rejected rows included: use
    ``sample_mask`` to drop them. ``routed_experts`` is ``None`` unless some accepted
    row has routes; ``has_routes`` says which rows carry them (others are zeros). Routes
    keep the width they were stored in: uint8 when every routed row of the group was
    staged as uint8, else int16 (the same values either way).
    ``details[i]`` is row ``i``'s rejection detail (which field, which call, the store's
    reason; ``""`` for an accepted row).
    ``weight_version_oldest`` / ``weight_version_newest`` (int64 [n]): the oldest and
    newest ``weight_version`` over the row's verified calls; 0 for a row rejected before
    its calls were verified (its other fields are zeros too). A group built without them
    (an older pickle, a hand-made group) gets zeros.
    ``verified_tokens`` (int64 [n]): each verified row's tokens, a row dropped ``stale``
    included (its ``input_lengths`` is 0); 0 for a row rejected for its data. A group
    built without it gets its ``input_lengths``.
    """

    rollout_ids: list[str]
    input_ids: torch.Tensor  # int64 [n, max_len]
    input_lengths: torch.Tensor  # int64 [n] (tokens)
    prompt_lengths: torch.Tensor  # int64 [n] (tokens)
    logprobs: torch.Tensor  # float32 [n, max_len]
    token_mask: torch.Tensor  # float32 [n, max_len]
    sample_mask: torch.Tensor  # float32 [n]
    rewards: torch.Tensor  # float32 [n]
    routed_experts: torch.Tensor | None  # uint8 or int16 [n, max_len, L, K]
    has_routes: torch.Tensor  # bool [n]
    status: list[str]
    details: list[str] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    weight_version_oldest: torch.Tensor | None = None  # int64 [n]
    weight_version_newest: torch.Tensor | None = None  # int64 [n]
    verified_tokens: torch.Tensor | None = None  # int64 [n] (tokens)

    def __post_init__(self) -> None:
        ids = self.input_ids
        n = int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() else len(getattr(self, "status", None) or ())
        for name in VERSION_FIELDS:
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(n, dtype=torch.int64))
        if self.verified_tokens is None:
            lengths = self.input_lengths
            fits = isinstance(lengths, torch.Tensor) and tuple(lengths.shape) == (n,)
            self.verified_tokens = lengths.to(torch.int64, copy=True) if fits else torch.zeros(n, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.status)

    def __reduce__(self) -> tuple:
        # Tensors travel as numpy arrays (zero-copy views): pickle protocol 5 then sends
        # their buffers out of band instead of copying each through torch's own pickling.
        state = {n: _to_numpy(getattr(self, n)) for n in _TENSOR_FIELDS}
        return rebuild_group, (self.rollout_ids, state, self.status, self.details, self.metrics)


VERSION_FIELDS = ("weight_version_oldest", "weight_version_newest")
_TENSOR_FIELDS = (
    "input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask",
    "sample_mask", "rewards", "routed_experts", "has_routes", *VERSION_FIELDS, "verified_tokens",
)


def _to_numpy(t: torch.Tensor | None) -> np.ndarray | torch.Tensor | None:
    """A CPU tensor's numpy view (zero-copy), anything else as it is."""
    if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad and t.layout == torch.strided:
        return t.numpy()
    return t


def _from_numpy(a: np.ndarray | torch.Tensor | None) -> torch.Tensor | None:
    """:func:`_to_numpy` undone (a read-only buffer is copied: torch needs it writable)."""
    if not isinstance(a, np.ndarray):
        return a
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def rebuild_group(
    rollout_ids: list[str],
    tensors: dict[str, np.ndarray | torch.Tensor | None],
    status: list[str],
    details: list[str],
    metrics: dict[str, Any],
) -> FinalizedGroup:
    """A :class:`FinalizedGroup` from its pickled parts (numpy arrays as tensors' buffers;
    a pickle without the weight versions gets zeros, without ``verified_tokens`` its
    ``input_lengths``)."""
    return FinalizedGroup(rollout_ids, **{n: _from_numpy(a) for n, a in tensors.items()}, status=status, details=details, metrics=metrics)


@dataclass(frozen=True)
class Staleness:
    """Drop verified rows whose oldest ``weight_version`` lags ``trainer_version`` by more
    than ``max_staleness`` versions (``finalize.max-staleness``)."""

    trainer_version: int
    max_staleness: int

    def lag(self, oldest: int) -> int:
        """Versions the row's oldest call is behind the trainer."""
        return self.trainer_version - oldest


def _drop_stale(results: Sequence[RolloutResult], status: list[str], details: list[str],
                lins: list[Linearized | None], staleness: Staleness) -> None:
    """Turn each accepted row that is too stale into a ``stale`` rejection (in place)."""
    for i, r in enumerate(results):
        if lins[i] is None or r.weight_versions is None:
            continue
        lag = staleness.lag(r.weight_versions[0])
        if lag > staleness.max_staleness:
            status[i] = R.STALE
            details[i] = (f"oldest weight_version {r.weight_versions[0]} is {lag} versions behind trainer_version "
                          f"{staleness.trainer_version} (finalize.max-staleness {staleness.max_staleness})")
            lins[i] = None


def _training_rows(
    results: Sequence[RolloutResult], staleness: Staleness | None = None,
) -> tuple[list[str], list[str], list[Linearized | None], tuple[int, ...] | None]:
    """Each row's status, detail and training row (None: rejected), and the group's routes
    ``[L, K]`` (:func:`group_route_shape`; None: no routes).

    An accepted result without a training row becomes empty_training_row; one too stale
    for ``staleness`` becomes stale; an accepted row whose routes' ``[L, K]`` differs from
    the group's becomes invalid_routes.
    """
    status = [r.status for r in results]
    details = ["" if r.status == R.OK else str(r.detail) for r in results]
    lins = [r.linearized if r.ok else None for r in results]
    for i, lin in enumerate(lins):
        if status[i] == R.OK and lin is None:
            status[i] = R.EMPTY_TRAINING_ROW
            details[i] = "accepted without a training row"
    if staleness is not None:
        _drop_stale(results, status, details, lins, staleness)
    route_shape = group_route_shape(lins)
    for i, lin in enumerate(lins):
        if lin is not None and lin.routed_experts is not None and lin.routed_experts.shape[1:] != route_shape:
            status[i] = R.INVALID_ROUTES
            details[i] = f"routes [L, K] = {list(lin.routed_experts.shape[1:])}, the group's routed rows mostly have {list(route_shape)}"
            lins[i] = None
    return status, details, lins, route_shape


def group_route_shape(lins: Sequence[Linearized | None]) -> tuple[int, ...] | None:
    """The routes ``[L, K]`` most of the group's routed rows have (ties: the first row's
    of them), so one rollout of other dimensions is the one rejected, never its
    group-mates; None when no row is routed."""
    shapes = [lin.routed_experts.shape[1:] for lin in lins if lin is not None and lin.routed_experts is not None]
    if not shapes:
        return None
    counts = Counter(shapes)
    return max(counts, key=lambda shape: (counts[shape], -shapes.index(shape)))


def routes_dtype(lins: Sequence[Linearized | None]) -> np.dtype:
    """The dtype holding every routed row's ids as stored: uint8 when all are uint8, int16
    as soon as one is (rows of old int16 and new uint8 rollouts in one group)."""
    return np.result_type(*(lin.routed_experts.dtype for lin in lins if lin is not None and lin.routed_experts is not None))


@dataclass
class _Buffers:
    """The group's padded numpy buffers, ``[n, max_len]`` (routes ``[n, max_len, L, K]``)."""

    ids: np.ndarray
    mask: np.ndarray
    lps: np.ndarray
    routes: np.ndarray | None
    has_routes: np.ndarray


# Where a group's padded buffers go: given each big buffer's bytes (ids, mask, logprobs,
# then routes if any), an allocator handing them out in that order, or None (np.empty).
BufferSource = Callable[[Sequence[int]], Allocator | None]


def _empty(dtype: np.dtype, shape: tuple) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def _fill(lins: list[Linearized | None], lengths: np.ndarray, route_shape: tuple[int, ...] | None, pad_id: int,
          source: BufferSource | None = None) -> _Buffers:
    """The padded buffers, each element written once: a row's tokens, then its padding
    (no zero-fill pass over the whole buffer before the rows are copied in). Routes in
    the narrowest dtype holding every routed row's (:func:`routes_dtype`). The four big
    buffers come from ``source`` (``np.empty`` without one)."""
    n = len(lins)
    max_len = int(lengths.max()) if n else 0
    specs = [(np.dtype(np.int64), (n, max_len)), (np.dtype(np.float32), (n, max_len)), (np.dtype(np.float32), (n, max_len))]
    if route_shape is not None:
        specs.append((np.dtype(routes_dtype(lins)), (n, max_len) + tuple(route_shape)))
    new = (source([dt.itemsize * int(np.prod(sh)) for dt, sh in specs]) if source is not None else None) or _empty
    ids, mask, lps = (new(*spec) for spec in specs[:3])
    has_routes = np.zeros(n, dtype=bool)
    routes = None if route_shape is None else new(*specs[3])
    for i in range(n):
        lin, t = lins[i], int(lengths[i])
        if lin is not None:
            ids[i, :t] = lin.input_ids
            mask[i, :t] = lin.token_mask
            lps[i, :t] = lin.logprobs
        ids[i, t:] = pad_id
        mask[i, t:] = 0.0
        lps[i, t:] = 0.0
        if routes is not None:
            if lin is not None and lin.routed_experts is not None:
                routes[i, :t] = lin.routed_experts
                has_routes[i] = True
                routes[i, t:] = 0
            else:
                routes[i] = 0
    return _Buffers(ids, mask, lps, routes, has_routes)


def _group_metrics(
    results: Sequence[RolloutResult], status: list[str], accepted: list[int], lengths: np.ndarray
) -> dict[str, Any]:
    """The group's counts (see :func:`assemble_group`)."""
    n = len(results)
    rejected = Counter(s for s in status if s != R.OK and s != R.INTERNAL_ERROR)
    internal_errors = status.count(R.INTERNAL_ERROR)
    return {
        "accepted": len(accepted),
        "rejected": n - len(accepted) - internal_errors,
        "rejected_by_reason": dict(rejected),
        "internal_errors": internal_errors,
        "tokens": int(lengths.sum()),
        "calls_per_rollout": float(np.mean([results[i].n_calls for i in accepted])) if accepted else 0.0,
        "max_len": int(lengths.max()) if n else 0,
    }


def _versions(results: Sequence[RolloutResult], status: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each row's oldest and newest weight version and verified tokens (rows kept or
    dropped stale; 0 for every other row)."""
    n = len(results)
    oldest, newest, tokens = np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    for i, r in enumerate(results):
        if status[i] in (R.OK, R.STALE) and r.weight_versions is not None and r.linearized is not None:
            oldest[i], newest[i] = r.weight_versions
            tokens[i] = r.linearized.length
    return oldest, newest, tokens


def assemble_group(
    results: Sequence[RolloutResult],
    rewards: Sequence[float],
    *,
    pad_id: int = 0,
    buffers: BufferSource | None = None,
    staleness: Staleness | None = None,
) -> FinalizedGroup:
    """Pad and stack one group's results (submission order) into a :class:`FinalizedGroup`.

    An accepted row whose routes' ``[L, K]`` differs from the one most of the group's routed
    rows have is rejected ``invalid_routes`` here rather than failing the whole group.
    ``metrics``: accepted, rejected (rows rejected for their data), rejected_by_reason,
    internal_errors (rows the verifier failed on: counted apart, never a reason), tokens
    (accepted tokens), calls_per_rollout (mean chain calls over accepted rows), max_len.
    ``buffers``: where the padded tensors' memory comes from (e.g. a pool of memory the
    process already touched); ``np.empty`` without it. ``staleness``: rows too stale for
    the trainer are rejected ``stale`` (None: none is).
    """
    n = len(results)
    if len(rewards) != n:
        raise ValueError(f"{n} results but {len(rewards)} rewards")
    status, details, lins, route_shape = _training_rows(results, staleness)
    oldest, newest, verified_tokens = _versions(results, status)
    accepted = [i for i, lin in enumerate(lins) if lin is not None]
    lengths = np.zeros(n, dtype=np.int64)
    prompts = np.zeros(n, dtype=np.int64)
    for i in accepted:
        lengths[i] = lins[i].length
        prompts[i] = lins[i].prompt_length
    buf = _fill(lins, lengths, route_shape, pad_id, buffers)
    sample_mask = np.zeros(n, dtype=np.float32)
    sample_mask[accepted] = 1.0
    return FinalizedGroup(
        rollout_ids=[r.rollout_id for r in results],
        input_ids=torch.from_numpy(buf.ids),
        input_lengths=torch.from_numpy(lengths),
        prompt_lengths=torch.from_numpy(prompts),
        logprobs=torch.from_numpy(buf.lps),
        token_mask=torch.from_numpy(buf.mask),
        sample_mask=torch.from_numpy(sample_mask),
        rewards=torch.tensor(np.asarray(rewards, dtype=np.float32)),
        routed_experts=None if buf.routes is None else torch.from_numpy(buf.routes),
        has_routes=torch.from_numpy(buf.has_routes),
        status=status,
        details=details,
        metrics=_group_metrics(results, status, accepted, lengths),
        weight_version_oldest=torch.from_numpy(oldest),
        weight_version_newest=torch.from_numpy(newest),
        verified_tokens=torch.from_numpy(verified_tokens),
    )
