"""Route replay ("R3"): recompute a step batch's logprobs with every token's experts
FORCED to the routes captured at sampling time, differentiably.

Only the selection is forced: the weights come from the router's own logits at the forced
experts, normalized as the architecture does (Mixtral: renormalized softmax; Qwen2-MoE:
softmax over all experts, renormalized only with ``norm_topk_prob``). Without replay the
model's own top-k is used (and recorded). Mechanism: a forward hook on each router module
(:func:`forced_routes`), removed on exit even on error; the transformers names it relies
on live in :data:`_ROUTERS` only.

Alignment (the step batch's): ``token_logprobs[b, t]`` is the logprob of token ``t``
under the logits of position ``t - 1`` (0 at ``t = 0`` and on padding), and
``routed_experts[b, t]`` are the experts of the pass over ``t - 1``, so the pass over
position ``q`` is forced to ``routed_experts[b, q + 1]`` for ``q < length - 1``; the last
real position and padding keep the model's own top-k. Rows must be right-padded.
docs/design.md, "Route replay".
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from ..errors import InvalidInput

try:  # transformers 5: the router is a module returning (logits, weights, indices)
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
except ImportError as e:  # transformers 4 routed inside the sparse MoE block's forward
    raise ImportError(f"route replay needs transformers >= 5 (router modules Mixtral/Qwen2MoeTopKRouter): {e}") from e


@dataclass(frozen=True)
class RoutedForward:
    """One forward's results.

    token_logprobs: float32 ``[B, T]`` (nats, differentiable): logprob of token ``t``
        predicted at position ``t - 1``; 0 at ``t = 0`` and where ``attention_mask`` is 0.
    routes: int64 ``[B, T, L, K]`` (detached): the experts actually used, in the capture
        convention (``routes[:, t]`` = the pass over ``max(t - 1, 0)``); 0 on padding.
    """

    token_logprobs: torch.Tensor
    routes: torch.Tensor


def _mixtral_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """MixtralTopKRouter's weights at experts ``idx``: float32 softmax, renormalized."""
    top = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
    return top / top.sum(dim=-1, keepdim=True)


def _qwen2_moe_weights(router: nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Qwen2MoeTopKRouter's weights at experts ``idx``: float32 softmax over all experts,
    renormalized only with ``norm_topk_prob``, cast back to the logits' dtype."""
    top = torch.softmax(logits, dtype=torch.float, dim=-1).gather(-1, idx)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


WeightsFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
# The ONE place naming transformers internals: router class -> its weights at given
# experts. Each router has ``num_experts`` and ``top_k`` and returns
# ``(logits [N, E], weights [N, K], indices [N, K])`` from hidden states ``[N, H]``.
_ROUTERS: dict[type, WeightsFn] = {MixtralTopKRouter: _mixtral_weights, Qwen2MoeTopKRouter: _qwen2_moe_weights}

_ACTIVE: weakref.WeakSet = weakref.WeakSet()  # models inside forced_routes
_ACTIVE_LOCK = threading.Lock()


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's router modules in layer order (the ``L`` axis of routes)."""
    found = [m for m in model.modules() if type(m) in _ROUTERS]
    if not found:
        raise InvalidInput(f"model: {type(model).__name__} has no router module of {[c.__name__ for c in _ROUTERS]}; route replay supports Mixtral and Qwen2-MoE")
    return found


def route_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(L, K, E)``: routed layers, experts per token, experts per layer."""
    return _shape_of(routers(model))


def _shape_of(rs: list[nn.Module]) -> tuple[int, int, int]:
    """:func:`route_shape` of the routers :func:`routers` found."""
    return len(rs), int(rs[0].top_k), int(rs[0].num_experts)


class RouteRecorder:
    """What :func:`forced_routes` saw: per routed layer, the experts used ``[N, K]``."""

    def __init__(self, n_layers: int) -> None:
        self.used: list[torch.Tensor | None] = [None] * n_layers

    def routes(self, batch: int, seq: int) -> torch.Tensor:
        """int64 ``[B, S, L, K]``: each input position's experts (per input, not shifted)."""
        if any(u is None for u in self.used):
            raise InvalidInput("forced_routes: no forward ran inside the context (routes unknown)")
        return torch.stack([u.view(batch, seq, -1) for u in self.used], dim=2)


def _hook(layer: int, weights: WeightsFn, rec: RouteRecorder, forced: torch.Tensor | None, where: torch.Tensor | None):
    """A router forward hook: record (and with ``forced``, replace) the experts used."""

    def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise RuntimeError(f"{type(module).__name__} returned {type(output).__name__}, not (logits, weights, indices): this transformers version routes differently (update _ROUTERS)")
        logits, scores, idx = output
        if forced is None:
            rec.used[layer] = idx.detach().to(torch.int64)
            return None
        if idx.shape != forced.shape:
            raise InvalidInput(f"forced_routes: layer {layer}'s router saw {idx.shape[0]} tokens, routes were given for {forced.shape[0]} (run the forward over the input_ids the routes belong to)")
        new_idx = torch.where(where[:, None], forced, idx)
        new_scores = torch.where(where[:, None], weights(module, logits, new_idx).to(scores.dtype), scores)
        rec.used[layer] = new_idx.detach()
        return logits, new_scores, new_idx

    return hook


@contextmanager
def forced_routes(model: nn.Module, experts: torch.Tensor | None = None, where: torch.Tensor | None = None) -> Iterator[RouteRecorder]:
    """Inside, every forward of ``model`` over ``B x S`` tokens routes input position
    ``(b, s)`` of layer ``l`` to ``experts[b, s, l]`` where ``where[b, s]`` (the model's own
    top-k elsewhere, and everywhere with ``experts=None``); yields a :class:`RouteRecorder`
    of the experts used by the last forward.

    ``experts``: integer ``[B, S, L, K]`` per INPUT position (not the capture convention:
    :func:`input_routes` converts), ids in ``[0, E)`` where forced (else
    :class:`InvalidInput`). ``where``: bool ``[B, S]`` (default all). With gradient
    checkpointing, run backward inside too (the recomputed forward must be forced the same
    way). One context per model at a time.
    """
    rs = routers(model)
    if experts is not None:
        experts, where = _checked_forced(experts, where, _shape_of(rs))
    with _forcing(model, rs, experts, where) as rec:
        yield rec


@contextmanager
def _forcing(model: nn.Module, rs: list[nn.Module], experts: torch.Tensor | None, where: torch.Tensor | None) -> Iterator[RouteRecorder]:
    """:func:`forced_routes` over the model's routers ``rs`` (:func:`routers`), with
    ``experts`` int64 ``[B, S, L, K]`` and ``where`` bool ``[B, S]`` already checked."""
    flat = None
    if experts is not None:
        B, S = experts.shape[:2]
        flat = [experts[:, :, i].reshape(B * S, -1) for i in range(len(rs))]
        where = where.reshape(-1)
    with _ACTIVE_LOCK:
        if model in _ACTIVE:
            raise InvalidInput("forced_routes: already active on this model (one replay context per model at a time)")
        _ACTIVE.add(model)
    rec = RouteRecorder(len(rs))
    handles = []
    try:
        for i, r in enumerate(rs):
            fn = _hook(i, _ROUTERS[type(r)], rec, None if flat is None else flat[i].to(r.weight.device), None if where is None else where.to(r.weight.device))
            handles.append(r.register_forward_hook(fn))
        yield rec
    finally:
        for h in handles:
            h.remove()
        with _ACTIVE_LOCK:
            _ACTIVE.discard(model)


# ---- checks -------------------------------------------------------------------------------------


def _checked_forced(experts: object, where: object, lke: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forced_routes`' arguments as int64 ``[B, S, L, K]`` and bool ``[B, S]``, ids
    in ``[0, E)`` where forced."""
    L, K, E = lke
    e = _int_tensor(experts, "experts")
    if e.dim() != 4 or tuple(e.shape[2:]) != (L, K):
        raise InvalidInput(f"experts must be [B, S, L, K] with [L, K] = {[L, K]} (the model's routed layers and top_k), got {list(e.shape)}")
    w = torch.ones(e.shape[:2], dtype=torch.bool, device=e.device) if where is None else _int_tensor(where, "where", bool_ok=True).to(torch.bool)
    if tuple(w.shape) != tuple(e.shape[:2]):
        raise InvalidInput(f"where must be bool {list(e.shape[:2])} (experts' [B, S]), got {list(w.shape)}")
    e = e.to(torch.int64)
    used = e[w.to(e.device)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= E):
        raise InvalidInput(f"experts hold ids in [{int(used.min())}, {int(used.max())}] where forced, outside the model's experts [0, {E})")
    return e, w


def _int_tensor(x: object, name: str, *, bool_ok: bool = False) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InvalidInput(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if (x.dtype == torch.bool and not bool_ok) or x.dtype.is_floating_point or x.dtype.is_complex:
        raise InvalidInput(f"{name} must hold integers (int64 ids; uint8/int16 routes as stored), got {x.dtype}: cast it with .long()")
    return x


def _checked_mask(input_ids: torch.Tensor, attention_mask: object) -> torch.Tensor:
    """``attention_mask`` as bool ``[B, T]``, checked right-padded."""
    m = _int_tensor(attention_mask, "attention_mask", bool_ok=True)
    if tuple(m.shape) != tuple(input_ids.shape):
        raise InvalidInput(f"attention_mask must have input_ids' shape {list(input_ids.shape)}, got {list(m.shape)}")
    if m.numel() and not bool(((m == 0) | (m == 1)).all()):
        raise InvalidInput("attention_mask must hold only 0 and 1")
    real = m.to(torch.bool)
    if real.shape[1] > 1 and bool((real[:, 1:] & ~real[:, :-1]).any()):
        row = int((real[:, 1:] & ~real[:, :-1]).any(1).nonzero()[0, 0])
        raise InvalidInput(f"attention_mask row {row} is not right-padded (a run of 1 then 0): left-padded rows must be shifted to the left first")
    return real


def _checked_ids(input_ids: object) -> torch.Tensor:
    ids = _int_tensor(input_ids, "input_ids")
    if ids.dim() != 2:
        raise InvalidInput(f"input_ids must be [B, T], got shape {list(ids.shape)}")
    return ids.to(torch.int64)


def _checked_routes(routes: object, shape: tuple[int, int, int, int], experts: int, rows: torch.Tensor) -> torch.Tensor:
    """``routes`` as int64 ``[B, T, L, K]``; ids checked on ``rows`` (bool ``[B, T]``)."""
    r = _int_tensor(routes, "routed_experts")
    if tuple(r.shape) != shape:
        raise InvalidInput(f"routed_experts must be [B, T, L, K] = {list(shape)} (the model's routed layers and top_k), got {list(r.shape)}")
    r = r.to(torch.int64)
    used = r[rows]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= experts):
        raise InvalidInput(f"routed_experts hold ids in [{int(used.min())}, {int(used.max())}], outside the model's experts [0, {experts}): routes of another model?")
    if used.numel() and shape[3] > 1:
        s = used.sort(dim=-1).values
        if bool((s[..., 1:] == s[..., :-1]).any()):
            raise InvalidInput("routed_experts name an expert twice in one token's top-k (missing routes left as zeros? set has_routes false for such rows)")
    return r


# ---- the forward -----------------------------------------------------------------------------


def _shifted(used: torch.Tensor) -> torch.Tensor:
    """Per-input-position routes -> the capture convention (``[t]`` = pass over ``t - 1``)."""
    return torch.cat([used[:, :1], used[:, :-1]], dim=1)


def input_routes(routed_experts: torch.Tensor, attention_mask: torch.Tensor, has_routes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The capture convention -> :func:`forced_routes`' arguments: int64 ``[B, T, L, K]``
    experts per INPUT position (position ``q`` gets ``routed_experts[:, q + 1]``) and bool
    ``[B, T]`` where to force them (``q + 1`` a real token of a row with routes). For a
    trainer that runs its own forward (and backward, with gradient checkpointing)::

        with forced_routes(model, *input_routes(batch["routed_experts"], batch["attention_mask"], batch["has_routes"])):
            loss(model(input_ids=..., attention_mask=...)).backward()
    """
    r = _int_tensor(routed_experts, "routed_experts").to(torch.int64)
    real = _int_tensor(attention_mask, "attention_mask", bool_ok=True).to(device=r.device, dtype=torch.bool)
    if r.dim() != 4 or tuple(r.shape[:2]) != tuple(real.shape):
        raise InvalidInput(f"routed_experts must be [B, T, L, K] over attention_mask's [B, T] = {list(real.shape)}, got {list(r.shape)}")
    where = torch.cat([real[:, 1:], torch.zeros_like(real[:, :1])], dim=1)
    if has_routes is not None:
        where = where & torch.as_tensor(has_routes, device=r.device).to(torch.bool).reshape(-1, 1)
    return torch.cat([r[:, 1:], r[:, :1]], dim=1), where


def _forward(model: nn.Module, rs: list[nn.Module], ids: torch.Tensor, real: torch.Tensor, routes: torch.Tensor | None,
             routed_rows: torch.Tensor) -> RoutedForward:
    """Forward over the rows with a real token (right-padded ``ids``), on the model's
    device; see :func:`replay_logprobs`. ``rs``: the model's routers; ``routes``: ids
    already checked (:func:`_checked_routes`) on the rows and tokens they are forced at."""
    B, T = ids.shape
    L, K, _ = _shape_of(rs)
    device = next(model.parameters()).device
    ids, real, routed_rows = ids.to(device), real.to(device), routed_rows.to(device)
    live = real.any(dim=1).nonzero()[:, 0]
    n = int(real.sum(dim=1).max()) if len(live) else 0
    out_routes = torch.zeros((B, T, L, K), dtype=torch.int64, device=device)
    if n == 0:
        return RoutedForward(torch.zeros((B, T), dtype=torch.float32, device=device), out_routes)
    # Empty rows are left out (a row with every key masked has no defined attention) and
    # the batch is cut to its longest row; padding ids become 0 (any id would do).
    real_l = real[live, :n]
    ids_l = ids[live, :n].masked_fill(~real_l, 0)
    forced = where = None
    if routes is not None:
        forced, where = input_routes(routes.to(device)[live, :n], real_l, routed_rows[live])
        if torch.is_grad_enabled() and _checkpointing(model):  # (transformers walks the model to tell)
            raise InvalidInput("model: gradient checkpointing recomputes the forward during backward; run forward and backward inside forced_routes(model, *input_routes(...)) instead")
    with _forcing(model, rs, forced, where) as rec:
        out = model(input_ids=ids_l, attention_mask=real_l.to(torch.int64), use_cache=False)
        used = rec.routes(len(live), n)
    # log_softmax then gather: the ops the engines sample and check with.
    logp = torch.log_softmax(out.logits.float(), dim=-1)
    lp = torch.where(real_l[:, 1:], logp[:, :-1].gather(-1, ids_l[:, 1:, None])[..., 0], 0.0)
    lp = torch.nn.functional.pad(lp, (1, T - n))  # 0 at t = 0 and past the longest row
    logprobs = lp if len(live) == B else torch.zeros((B, T), dtype=torch.float32, device=device).index_put((live,), lp)
    out_routes[live, :n] = _shifted(used).masked_fill(~real_l[:, :, None, None], 0)
    return RoutedForward(logprobs, out_routes)


def _checkpointing(model: nn.Module) -> bool:
    """Whether transformers recomputes the model's layers in backward (activation
    checkpointing; ``is_gradient_checkpointing`` before transformers 5.x renamed it)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _check_vocab(model: nn.Module, ids: torch.Tensor, real: torch.Tensor) -> None:
    vocab = model.get_input_embeddings().num_embeddings
    if real.any() and (int(ids[real].min()) < 0 or int(ids[real].max()) >= vocab):
        raise InvalidInput(f"input_ids hold ids outside the model's vocabulary [0, {vocab}) on real tokens")


def replay_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, routed_experts: torch.Tensor | None = None) -> RoutedForward:
    """Token logprobs of ``input_ids`` (int ``[B, T]``, right-padded by ``attention_mask``)
    under ``model`` (a transformers Mixtral or Qwen2-MoE causal LM), with the experts of
    every real position forced to ``routed_experts`` (integer ``[B, T, L, K]`` in the
    capture convention, e.g. a step batch's) or, with ``None``, the model's own top-k.

    Runs under the caller's grad mode and module mode (``model.train()`` for training;
    dropout and Mixtral's router jitter then apply as usual). Raises
    :class:`tasks.errors.InvalidInput` naming the field for bad ids, masks or routes.
    """
    rs = routers(model)
    L, K, E = _shape_of(rs)
    ids = _checked_ids(input_ids)
    real = _checked_mask(ids, attention_mask)
    _check_vocab(model, ids, real)
    routes = None
    if routed_experts is not None:
        routes = _checked_routes(routed_experts, (*ids.shape, L, K), E, real)
    rows = torch.ones(ids.shape[0], dtype=torch.bool)
    return _forward(model, rs, ids, real, routes, rows)


def batch_logprobs(model: nn.Module, batch: Mapping[str, torch.Tensor], *, replay: bool) -> RoutedForward:
    """:func:`replay_logprobs` over a step batch (``tasks.finalize.step_batch``): its
    ``input_ids`` and ``attention_mask``, and with ``replay`` its ``routed_experts``.

    With ``replay``, rows with ``has_routes`` false keep the model's own routing, and
    :class:`InvalidInput` is raised if the batch has no routes or such a row has
    ``loss_mask`` tokens (its logprobs could not be replayed).
    """
    if not isinstance(batch, Mapping):
        raise InvalidInput(f"batch must be a step batch dict, got {type(batch).__name__}")
    for key in ("input_ids", "attention_mask"):
        if key not in batch:
            raise InvalidInput(f"batch has no {key!r} (a step_batch() dict has it)")
    if not replay:
        return replay_logprobs(model, batch["input_ids"], batch["attention_mask"])
    if batch.get("routed_experts") is None:
        raise InvalidInput("batch has no routed_experts: replay needs rows captured with routes (or call with replay=False)")
    rs = routers(model)
    L, K, E = _shape_of(rs)
    ids = _checked_ids(batch["input_ids"])
    real = _checked_mask(ids, batch["attention_mask"])
    B = ids.shape[0]
    has = batch.get("has_routes")
    has = torch.ones(B, dtype=torch.bool) if has is None else torch.as_tensor(has).to(torch.bool).reshape(-1)
    if has.shape != (B,):
        raise InvalidInput(f"has_routes must be bool [{B}], got {list(has.shape)}")
    loss = batch.get("loss_mask")
    needs = real.any(1) if loss is None else (torch.as_tensor(loss) > 0).any(1)
    missing = (needs.cpu() & ~has.cpu()).nonzero()[:, 0].tolist()
    if missing:
        raise InvalidInput(f"has_routes is false for rows {missing[:8]} that have loss_mask tokens: replay cannot recompute their logprobs (drop them from the loss, or replay=False)")
    _check_vocab(model, ids, real)
    routes = _checked_routes(batch["routed_experts"], (*ids.shape, L, K), E, real & has[:, None])
    return _forward(model, rs, ids, real, routes, has)
