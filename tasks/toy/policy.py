"""A small integer mixture-of-experts policy that decodes reproducibly, whatever the batch.

Weights and activations are int64 (integer sums are exact, so no kernel, blocking or batch
size can change a row); only the row-local sampling step is floating point. A token, its
logprob and its routed experts depend only on (weights, the ``window`` tokens before it,
its absolute position, the rollout key). Why integers, and the routes convention:
docs/design.md, "The toy engine".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping

import numpy as np
import torch

from ..engines.shapes import ConfigShapes
from ..engines.threads import torch_threads
from ..errors import InvalidPolicyConfig
from .sampling import STREAM_SAMPLE, uniforms

# Fixed architecture constants (not tuning knobs: changing any changes every token).
_FFN_MULT = 2  # expert MLP inner width = _FFN_MULT * hidden
_POS_PERIOD = 64  # position embedding table rows (position % period)
_WEIGHT_MAX = 7  # weights are integers in [-7, 7]
_EMB_MAX = 64  # embeddings are integers in [-64, 64]
_CLAMP = 1 << 12  # hidden activations are kept in [-4096, 4096]
_TEMP_DIV = 32  # logit units per table step (the sampling temperature)
_TABLE_STEPS = 1024  # weights exp(-k / 16) for k in [0, 1023]; beyond: the floor weight
_TABLE_TAU = 16.0


@dataclass(frozen=True)
class PolicyConfig:
    """Shape and seed of a :class:`MoEPolicy` (config section ``token-capture.policy``).

    vocab_size: token ids are in ``[0, vocab_size)``.
    hidden: hidden width (integers per token state).
    layers: MoE layers (the ``L`` of routed experts ``[L, K]``).
    experts: experts per layer (``E``; expert ids are in ``[0, E)``).
    top_k: experts each token is routed to per layer (``K``).
    seed: weights and sampling streams derive from it.
    window: tokens of context the policy conditions on (plus the absolute position).
    threads: torch intra-op threads while decoding; 0 leaves torch's setting alone.
        Results are exact integers, so this never changes a token. The ops are tiny:
        on 2 shared cores, measured, the thread pool's wake-ups made a 4x4x3x32 step
        take 2.6-3.3 s at 2 threads against 0.3-0.4 s at 1.
    """

    vocab_size: int = 512
    hidden: int = 32
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    seed: int = 0
    window: int = 8
    threads: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InvalidPolicyConfig(f"{f.name} must be an int, got {v!r}")
        checks = {
            "vocab_size": 2 <= self.vocab_size < 2**24,
            "hidden": 1 <= self.hidden <= 4096,
            "layers": 1 <= self.layers <= 256,
            "experts": 1 <= self.experts <= 4096,
            "top_k": 1 <= self.top_k <= self.experts,
            "window": 1 <= self.window <= 4096,
            "threads": 0 <= self.threads <= 1024,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidPolicyConfig(f"{name}={getattr(self, name)} out of range (top_k <= experts)")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> "PolicyConfig":
        """Build from a config section, e.g. ``pipeline.config.get("policy")``.

        Keys may use dashes (``vocab-size``, the YAML spelling) or underscores; missing
        keys take the defaults above, unknown keys raise :class:`InvalidPolicyConfig`.
        """
        known = {f.name for f in fields(cls)}
        kw = {}
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise InvalidPolicyConfig(f"unknown policy setting {key!r} (known: {sorted(known)})")
            kw[name] = value
        return cls(**kw)


@dataclass
class Step:
    """One decoded token per call: ``tokens`` int64[B], ``logprobs`` float32[B] (<= 0,
    finite), ``routes`` [B, L, K] in the policy's ``routes_dtype`` (uint8 up to 256
    experts, else int16)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    routes: np.ndarray


class MoEPolicy(ConfigShapes):
    """The toy MoE policy. Stateless after construction; safe to share between threads.

    Inputs are ``windows`` int64[B, window] (the tokens before each position, oldest
    first, ``-1`` where the position has fewer predecessors than ``window``) and
    ``positions`` int64[B] (absolute position of the token being produced, which is the
    number of tokens before it). Build windows with :meth:`windows_at`.
    """

    def __init__(self, config: PolicyConfig | None = None):
        self.config = config or PolicyConfig()
        c = self.config
        g = torch.Generator().manual_seed(int(c.seed))
        w = _WEIGHT_MAX

        def ints(lo: int, hi: int, *shape: int) -> torch.Tensor:
            return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)

        ffn = _FFN_MULT * c.hidden
        # Row vocab_size is the padding embedding (window slots before position 0).
        self.embedding = ints(-_EMB_MAX, _EMB_MAX, c.vocab_size + 1, c.hidden)
        self.slot_weight = ints(1, 4, c.window)  # per window slot, oldest first
        self.position = ints(-_EMB_MAX // 2, _EMB_MAX // 2, _POS_PERIOD, c.hidden)
        self.router = ints(-w, w, c.layers, c.hidden, c.experts)
        self.w_in = ints(-w, w, c.layers, c.hidden, c.experts * ffn)
        self.w_out = ints(-w, w, c.layers, c.experts * ffn, c.hidden)
        self.unembed = ints(-w, w, c.hidden, c.vocab_size)
        self._ffn = ffn
        # Router tie-break: score * E + (E - 1 - id) makes every score distinct, so topk
        # is unique and lower ids win ties on every platform.
        self._tiebreak = torch.arange(c.experts - 1, -1, -1, dtype=torch.int64)
        # exp(-k / tau) computed once with libm; log of each entry is exactly -k / tau.
        self._table = np.array([math.exp(-k / _TABLE_TAU) for k in range(_TABLE_STEPS)], dtype=np.float64)
        self._log_table = -np.arange(_TABLE_STEPS, dtype=np.float64) / _TABLE_TAU

    # ---- shapes (vocab_size, num_experts, routes_shape: ConfigShapes) ------------------

    @property
    def window(self) -> int:
        return self.config.window

    # ---- inputs ------------------------------------------------------------------------

    def windows_at(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """int64[len(positions), window]: the tokens before each position of ONE sequence.

        ``tokens`` may be the whole sequence or any tail of it that still covers the
        ``window`` tokens before the first position, with ``positions`` relative to it.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        w = self.window
        padded = np.concatenate([np.full(w, -1, dtype=np.int64), tokens])
        idx = np.asarray(positions, dtype=np.int64)[:, None] + np.arange(w, dtype=np.int64)[None, :]
        return padded[idx]

    # ---- forward -----------------------------------------------------------------------

    def forward(self, windows: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Integer logits int64[B, vocab] and routes int64[B, L, K] for each position."""
        with torch_threads(self.config.threads):
            return self._forward(windows, positions)

    def _forward(self, windows: np.ndarray, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        win = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
        pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64))
        if win.ndim != 2 or win.shape[1] != c.window or pos.shape != (win.shape[0],):
            raise ValueError(f"windows {tuple(win.shape)} / positions {tuple(pos.shape)}: expected [B, {c.window}] / [B]")
        b = win.shape[0]
        win = torch.where(win < 0, c.vocab_size, win)
        h = (self.embedding[win] * self.slot_weight[None, :, None]).sum(1)
        h = (h >> 3) + self.position[pos % _POS_PERIOD]
        routes = torch.empty(b, c.layers, c.top_k, dtype=torch.int64)
        for layer in range(c.layers):
            score = (h @ self.router[layer]) * c.experts + self._tiebreak
            sel = torch.topk(score, c.top_k, dim=1, sorted=True).indices
            routes[:, layer] = sel
            keep = torch.zeros(b, c.experts, dtype=torch.int64)
            keep.scatter_(1, sel, 1)
            # Dense over all experts, unselected ones zeroed: exact, and one matmul each.
            a = torch.relu(h @ self.w_in[layer]) >> 6
            a = (a.view(b, c.experts, self._ffn) * keep[:, :, None]).view(b, -1)
            h = torch.clamp(h + ((a @ self.w_out[layer]) >> 4), -_CLAMP, _CLAMP)
        return h @ self.unembed, routes

    def route(self, windows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Routes [B, L, K] (``routes_dtype``) only (prefill of context tokens)."""
        return self.forward(windows, positions)[1].numpy().astype(self.routes_dtype)

    def step(self, windows: np.ndarray, positions: np.ndarray, keys: np.ndarray) -> Step:
        """Sample one token per row; row ``i`` depends only on row ``i`` of the inputs.

        ``keys`` are uint64[B] rollout keys (:func:`tasks.toy.sampling.rollout_key`).
        """
        logits, routes = self.forward(windows, positions)
        z = logits.numpy()
        # Steps below the row max, in table units (integers: exact).
        k = np.minimum((z.max(axis=1, keepdims=True) - z) // _TEMP_DIV, _TABLE_STEPS - 1)
        weights = self._table[k]
        cdf = np.cumsum(weights, axis=1)  # sequential per row: row-local, batch-invariant
        total = cdf[:, -1]
        u = uniforms(keys, STREAM_SAMPLE, positions)
        tokens = np.count_nonzero(cdf <= (u * total)[:, None], axis=1)
        np.minimum(tokens, self.vocab_size - 1, out=tokens)
        rows = np.arange(len(tokens))
        logprobs = self._log_table[k[rows, tokens]] - np.log(total)
        return Step(
            tokens.astype(np.int64),
            np.minimum(logprobs, 0.0).astype(np.float32),
            routes.numpy().astype(self.routes_dtype),
        )

    def decode(self, windows: np.ndarray, positions: np.ndarray, keys: np.ndarray, n_tokens: int) -> Step:
        """``n_tokens`` consecutive tokens per row: tokens int64[B, n], logprobs
        float32[B, n], routes [B, n, L, K] (``routes_dtype``). Equal to ``n_tokens`` :meth:`step` calls."""
        b = len(positions)
        L, K = self.routes_shape
        tokens = np.empty((b, n_tokens), dtype=np.int64)
        logprobs = np.empty((b, n_tokens), dtype=np.float32)
        routes = np.empty((b, n_tokens, L, K), dtype=self.routes_dtype)
        win = np.array(windows, dtype=np.int64, copy=True)
        pos = np.array(positions, dtype=np.int64, copy=True)
        with torch_threads(self.config.threads):  # once per decode, not per step
            for t in range(n_tokens):
                s = self.step(win, pos, keys)
                tokens[:, t], logprobs[:, t], routes[:, t] = s.tokens, s.logprobs, s.routes
                win[:, :-1] = win[:, 1:]
                win[:, -1] = s.tokens
                pos += 1
        return Step(tokens, logprobs, routes)
