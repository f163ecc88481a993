"""The trainer-side mismatch monitor: how far the trainer's logprobs (and routes) are from
what the sampler recorded, over a step batch's loss-mask tokens.

``delta = trainer - sampler`` (nats) per token; ``r = exp(delta)`` is the importance ratio
trainer / sampler. ``k3 = (r - 1) - log r`` is Schulman's third estimator of
``KL(sampler || trainer)`` from the sampler's own samples: unbiased, and never negative.
Route agreement is the fraction of (token, layer) pairs whose top-k expert SET is the
same (both sorted along K first). Every figure is also split by the row's weight-version
lag. Vectorized over the selected tokens (numpy; one pass per lag value at most).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidInput

DEFAULT_EPS: tuple[float, ...] = (0.1, 0.2)


@dataclass(frozen=True)
class MismatchReport:
    """Figures over ``tokens`` loss-mask tokens (0: every figure 0.0, route agreement None).

    ``mean_abs_delta`` / ``max_abs_delta``: |trainer - sampler| logprob (nats);
    ``k3_mean``: mean k3 estimate of KL(sampler || trainer) (nats); ``frac_outside[e]``:
    fraction of tokens whose ratio lies outside ``[1 - e, 1 + e]``; ``route_agreement``:
    fraction of (token, layer) pairs whose expert set matches (None without routes),
    over ``route_pairs`` pairs; ``by_lag``: the same per weight-version lag (versions),
    each without a ``by_lag`` of its own.
    """

    tokens: int
    mean_abs_delta: float
    max_abs_delta: float
    k3_mean: float
    frac_outside: dict[float, float]
    route_agreement: float | None = None
    route_pairs: int = 0
    by_lag: dict[int, MismatchReport] = field(default_factory=dict)

    def figures(self) -> dict[str, Any]:
        """The figures as plain JSON-able data (``frac_outside`` keyed by ``str(eps)``)."""
        out: dict[str, Any] = {
            "tokens": self.tokens, "mean_abs_delta": self.mean_abs_delta, "max_abs_delta": self.max_abs_delta,
            "k3_mean": self.k3_mean, "frac_outside": {str(e): f for e, f in self.frac_outside.items()},
            "route_pairs": self.route_pairs,
        }
        if self.route_agreement is not None:
            out["route_agreement"] = self.route_agreement
        return out


def check_eps(eps: object, what: str = "eps") -> tuple[float, ...]:
    """``eps`` as a tuple of finite numbers > 0 (at least one), else :class:`InvalidInput`."""
    items = list(eps) if isinstance(eps, (list, tuple)) else None
    if not items or any(isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e <= 0 for e in items):
        raise InvalidInput(f"{what} must be a non-empty list of finite numbers > 0 (ratio bounds 1 +- eps), got {eps!r}")
    return tuple(float(e) for e in items)


def _array(x: Any, name: str) -> np.ndarray:
    """A torch tensor or array-like as a numpy array (float tensors via float32 or wider)."""
    try:
        import torch

        if isinstance(x, torch.Tensor):
            x = x.detach().cpu()
            if x.is_floating_point() and x.dtype not in (torch.float32, torch.float64):
                x = x.float()
            return x.numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if x is None or isinstance(x, (str, bytes)):
        raise InvalidInput(f"{name} must be a tensor or array, got {type(x).__name__}")
    return np.asarray(x)


def _finite_on(values: np.ndarray, where: np.ndarray, name: str) -> None:
    bad = where & ~np.isfinite(values)
    if bad.any():
        row, tok = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidInput(f"{name} holds {values[row, tok]} at row {row}, token {tok} (a loss-mask token): logprobs must be finite")


def _checked(old: Any, new: Any, mask: Any, weight_lag: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The three [B, T] arrays and the lags [B], checked (names the bad field)."""
    old_a, new_a, mask_a = _array(old, "old_logprobs"), _array(new, "trainer_logprobs"), _array(mask, "loss_mask")
    if old_a.ndim != 2:
        raise InvalidInput(f"old_logprobs must be [B, T], got shape {list(old_a.shape)}")
    for name, a in (("trainer_logprobs", new_a), ("loss_mask", mask_a)):
        if a.shape != old_a.shape:
            raise InvalidInput(f"{name} must match the batch's [B, T] = {list(old_a.shape)}, got shape {list(a.shape)}")
    for name, a in (("old_logprobs", old_a), ("trainer_logprobs", new_a), ("loss_mask", mask_a)):
        if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer) or a.dtype == bool):
            raise InvalidInput(f"{name} must hold numbers, got dtype {a.dtype}")
    if not np.isfinite(mask_a.astype(np.float64)).all():
        raise InvalidInput("loss_mask holds NaN or inf")
    where = mask_a > 0
    _finite_on(new_a, where, "trainer_logprobs")
    _finite_on(old_a, where, "old_logprobs")
    lag = None
    if weight_lag is not None:
        lag = _array(weight_lag, "weight_lag")
        if lag.shape != old_a.shape[:1] or not np.issubdtype(lag.dtype, np.integer):
            raise InvalidInput(f"weight_lag must be integers [B] = [{old_a.shape[0]}], got {lag.dtype} {list(lag.shape)}")
    return old_a, new_a, where, lag


def _route_match(sampler: Any, trainer: Any, batch: tuple[int, ...], rows: np.ndarray, toks: np.ndarray) -> np.ndarray:
    """Whether the two expert sets match at each selected token (``rows``, ``toks``) and
    layer: bool [N, L]. Only the selected tokens are sorted (along K)."""
    if (sampler is None) != (trainer is None):
        missing = "trainer_routes" if trainer is None else "sampler_routes"
        raise InvalidInput(f"{missing} is missing: route agreement needs both sampler_routes and trainer_routes")
    s, t = _array(sampler, "sampler_routes"), _array(trainer, "trainer_routes")
    for name, a in (("sampler_routes", s), ("trainer_routes", t)):
        if a.ndim != 4 or a.shape[:2] != batch or a.shape[3] < 1 or not np.issubdtype(a.dtype, np.integer):
            raise InvalidInput(f"{name} must be integer expert ids [B, T, L, K] with [B, T] = {list(batch)}, got {a.dtype} {list(a.shape)}")
    if s.shape != t.shape:
        raise InvalidInput(f"trainer_routes must match sampler_routes' shape {list(s.shape)}, got {list(t.shape)}")
    s_sel, t_sel = s[rows, toks], t[rows, toks]  # [N, L, K], C-contiguous
    if s_sel.dtype != t_sel.dtype:  # e.g. uint8 as stored against the trainer's int64: the same values
        s_sel, t_sel = s_sel.astype(np.int64), t_sel.astype(np.int64)
    match = _rows_equal(s_sel, t_sel)  # the same order: the same set
    odd = ~match  # the order differs: compare the sets, each sorted along K
    if odd.any():
        a, b = _sorted_columns(s_sel[odd]), _sorted_columns(t_sel[odd])
        same = np.ones(a[0].shape, dtype=bool)
        for x, y in zip(a, b):
            same &= x == y
        match[odd] = same
    return match


def _rows_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a == b).all(axis=-1)`` for C-contiguous [..., K] arrays of one dtype, comparing
    each pair's K ids as a few machine words (numpy reduces a short last axis slowly)."""
    nbytes = a.shape[-1] * a.dtype.itemsize
    word = next(w for w in (8, 4, 2, 1) if nbytes % w == 0)
    wa, wb = a.view(f"u{word}"), b.view(f"u{word}")
    out = wa[..., 0] == wb[..., 0]
    for j in range(1, wa.shape[-1]):
        out &= wa[..., j] == wb[..., j]
    return out


def _sorted_columns(ids: np.ndarray) -> list[np.ndarray]:
    """``ids`` [M, K] sorted along K, as K contiguous [M] columns: an odd-even
    transposition network (K rounds of vectorized min/max) for small K, where ``np.sort``
    pays its per-row overhead on every pair."""
    k = ids.shape[-1]
    if k > 16:
        return list(np.sort(ids, axis=-1).T)
    cols = [np.ascontiguousarray(ids[..., j]) for j in range(k)]
    for r in range(k):
        for j in range(r % 2, k - 1, 2):
            lo = np.minimum(cols[j], cols[j + 1])
            np.maximum(cols[j], cols[j + 1], out=cols[j + 1])
            cols[j] = lo
    return cols


def _stats(delta: np.ndarray, eps: tuple[float, ...], agree: np.ndarray | None) -> MismatchReport:
    """The figures of one set of tokens: ``delta`` [N] (nats), ``agree`` [N, L] or None."""
    n = int(delta.size)
    if n == 0:
        return MismatchReport(0, 0.0, 0.0, 0.0, dict.fromkeys(eps, 0.0))
    absd = np.abs(delta)
    with np.errstate(over="ignore"):
        r = np.exp(delta)
        k3 = np.maximum(np.expm1(delta) - delta, 0.0)  # (r - 1) - log r, exactly 0 at r = 1
    outside = {e: float(((r < 1 - e) | (r > 1 + e)).mean()) for e in eps}
    route, pairs = None, 0
    if agree is not None and agree.size:
        route, pairs = float(agree.mean()), int(agree.size)
    return MismatchReport(n, float(absd.mean()), float(absd.max()), float(k3.mean()), outside, route, pairs)


def mismatch_stats(
    old_logprobs: Any,
    trainer_logprobs: Any,
    loss_mask: Any,
    *,
    weight_lag: Any = None,
    eps: Any = DEFAULT_EPS,
    sampler_routes: Any = None,
    trainer_routes: Any = None,
    route_rows: Any = None,
) -> MismatchReport:
    """Mismatch figures over the tokens where ``loss_mask > 0`` (torch or numpy in).

    ``old_logprobs`` (the sampler's), ``trainer_logprobs``, ``loss_mask``: [B, T];
    ``weight_lag`` int [B] (versions) fills ``by_lag``; ``sampler_routes`` and
    ``trainer_routes`` (both or neither) integer [B, T, L, K] give route agreement, over
    the rows ``route_rows`` (bool [B]; default all) marks as routed. Raises
    :class:`tasks.errors.InvalidInput` naming the field for shapes that do not match the
    batch, non-finite logprobs on loss-mask tokens, a bad ``eps``.
    """
    eps = check_eps(eps)
    old, new, where, lag = _checked(old_logprobs, trainer_logprobs, loss_mask, weight_lag)
    rows, toks = np.nonzero(where)
    delta = new[rows, toks].astype(np.float64) - old[rows, toks].astype(np.float64)
    agree, agree_rows = None, rows
    if sampler_routes is not None or trainer_routes is not None:
        keep = np.ones(old.shape[0], bool) if route_rows is None else _array(route_rows, "route_rows").astype(bool)
        if keep.shape != old.shape[:1]:
            raise InvalidInput(f"route_rows must be bool [B] = [{old.shape[0]}], got shape {list(keep.shape)}")
        routed = keep[rows]
        agree_rows = rows[routed]
        agree = _route_match(sampler_routes, trainer_routes, old.shape, agree_rows, toks[routed])
    report = _stats(delta, eps, agree)
    if lag is None:
        return report
    tok_lag = lag[rows].astype(np.int64)
    by_lag = {}
    for v in np.unique(tok_lag).tolist():
        sel = tok_lag == v
        sub = None if agree is None else agree[lag[agree_rows] == v]
        by_lag[int(v)] = _stats(delta[sel], eps, sub)
    return MismatchReport(report.tokens, report.mean_abs_delta, report.max_abs_delta, report.k3_mean,
                          report.frac_outside, report.route_agreement, report.route_pairs, by_lag)
