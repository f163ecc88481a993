"""A real MoE architecture as an engine: a tiny Hugging Face causal LM (Qwen2-MoE or
Mixtral, random float32 weights from a seed, eager kernels) decodes multi-turn rollouts
with a KV cache, every call staged through the capture gate; a teacher-forced check
recomputes a finalized row's logprobs and routes in ONE forward and compares.

Units: lengths and positions in tokens; logprobs in nats (float32, temperature 1);
routes int16 ``[T, L, K]``, expert ids in ``[0, E)``, by decreasing router probability.
Routes convention (the toy engine's): ``routes[p]`` are the experts of the forward pass
whose distribution gave token ``p`` its logprob, i.e. the pass over input position
``p - 1``; context tokens get theirs from the prefill. No pass predicts a rollout's first
token: ``routes[0]`` holds the pass over position 0. Sampling draws are counter-based,
keyed by (seed, rollout_id, absolute position). Needs the ``hf`` extra (transformers);
nothing is downloaded. docs/design.md, "A real MoE engine".
"""
from __future__ import annotations

import hashlib
import inspect
import math
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import torch
# Imported here, not lazily: concurrent first uses of transformers' lazy module from two
# worker threads raced ("cannot import name 'Qwen2MoeConfig'"); module import is locked.
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from ..errors import InvalidCall, InvalidPolicyConfig, InvalidRecord
from ..gate import CaptureGate
from ..hashing import DIGEST_VERSION
from ..schema import StagedRow
from ..toy.environment import ToolEnvironment
from .shapes import ConfigShapes
from .threads import torch_threads
from ..toy.rollouts import GeneratedRollout, RolloutSpec, call_id, parent_call_id, toy_reward
from ..toy.sampling import STREAM_SAMPLE, rollout_key, uniforms

if TYPE_CHECKING:
    from ..finalize.assemble import FinalizedGroup

# A row's field as numpy or torch gives it.
RowArray = npt.ArrayLike | torch.Tensor

ARCHITECTURES = ("qwen2_moe", "mixtral")

# Max |logprob(KV-cached decode) - logprob(one teacher-forced forward)| accepted, in nats.
# Both paths run the same float32 ops, but the cache splits attention and matmul
# reductions differently (other shapes, other blockings), so they agree to a few float32
# ulps only (ulp = 4.8e-7 for logprobs in [-8, -4)). Measured over 49,152 generated
# tokens (256 rollouts x 3 turns x 16 tokens; qwen2_moe and mixtral; 2 and 4 layers;
# init_std 0.1): max 2.4e-6 (5 ulps), mean 3.1e-7. 1e-4 leaves a 40x margin (init_std 0.2:
# max 8.6e-6) and is 100x below a real bug (temperature 1.01: >= 1.3e-2 per row).
# Sharper random weights amplify the noise (init_std 0.5: up to 1.5e-4): pass a
# tolerance to FidelityReport.ok there. docs/design.md, "A real MoE engine".
LOGPROB_TOLERANCE = 1e-4


@dataclass(frozen=True)
class HFMoEConfig:
    """Shape and seed of an :class:`HFMoEEngine`.

    arch: ``"qwen2_moe"`` (shared expert + routed experts) or ``"mixtral"``.
    vocab_size: token ids in ``[0, vocab_size)``.
    hidden: hidden width; layers: decoder layers, every one MoE (the ``L`` of routes).
    experts: routed experts per layer (``E``); top_k: experts per token (``K``).
    heads: attention heads (``hidden % heads == 0``); key/value heads are ``heads // 2``.
    seed: weights (``torch.manual_seed`` around construction) and sampling streams.
    init_std: weight init standard deviation (sharper logits and routers than the
        transformers default 0.02, so logprobs and routes are not near-uniform).
    max_positions: longest rollout (tokens).
    threads: torch intra-op threads while running (0 leaves torch's setting alone).
    """

    arch: str = "qwen2_moe"
    vocab_size: int = 512
    hidden: int = 64
    layers: int = 2
    experts: int = 8
    top_k: int = 2
    heads: int = 4
    seed: int = 0
    init_std: float = 0.1
    max_positions: int = 4096
    threads: int = 1

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise InvalidPolicyConfig(f"arch must be one of {ARCHITECTURES}, got {self.arch!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "arch":
                continue
            if f.name == "init_std":
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                    raise InvalidPolicyConfig(f"init_std must be a positive number, got {v!r}")
                continue
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise InvalidPolicyConfig(f"{f.name} must be an int, got {v!r}")
        checks = {
            "vocab_size": 2 <= self.vocab_size < 2**24,
            "hidden": 2 <= self.hidden <= 8192 and self.hidden % self.heads == 0 and (self.hidden // self.heads) % 2 == 0,
            "layers": 1 <= self.layers <= 256,
            "experts": 1 <= self.experts <= 2**15,
            "top_k": 1 <= self.top_k <= self.experts,
            "heads": 1 <= self.heads <= self.hidden,
            "seed": 0 <= self.seed < 2**63,
            "max_positions": 1 <= self.max_positions,
            "threads": self.threads >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise InvalidPolicyConfig(f"out of range: {', '.join(f'{k}={getattr(self, k)}' for k in bad)}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> HFMoEConfig:
        """Build from settings whose keys use dashes (YAML spelling) or underscores;
        unknown keys raise :class:`InvalidPolicyConfig`."""
        known = {f.name for f in fields(cls)}
        kw = {}
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if name not in known:
                raise InvalidPolicyConfig(f"unknown HF engine setting {key!r} (known: {sorted(known)})")
            kw[name] = value
        return cls(**kw)

    def hf_config(self) -> Qwen2MoeConfig | MixtralConfig:
        """The transformers config: every layer sparse, eager attention and experts."""
        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=max(self.heads // 2, 1),
            num_experts_per_tok=self.top_k,
            max_position_embeddings=self.max_positions,
            initializer_range=float(self.init_std),
            tie_word_embeddings=False,
            use_cache=True,
            attn_implementation="eager",
            experts_implementation="eager",
        )
        if self.arch == "qwen2_moe":
            return Qwen2MoeConfig(
                **common,
                intermediate_size=2 * self.hidden,
                moe_intermediate_size=self.hidden,
                shared_expert_intermediate_size=2 * self.hidden,
                num_experts=self.experts,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=False,
                use_sliding_window=False,
            )
        return MixtralConfig(
            **common,
            intermediate_size=self.hidden,
            num_local_experts=self.experts,
            router_jitter_noise=0.0,
            sliding_window=None,
        )


_MODEL_CLASSES = {"qwen2_moe": Qwen2MoeForCausalLM, "mixtral": MixtralForCausalLM}
# Weights are drawn from torch's global generator (transformers' initializers): one build
# at a time per process, so two threads cannot interleave their draws.
_BUILD_LOCK = threading.Lock()


def _as_int64(a: RowArray) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().numpy()
    return np.ascontiguousarray(a, dtype=np.int64)


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 (hex) of every entry's name and bytes, in name order (a ``state_dict``)."""
    h = hashlib.sha256()
    for name, p in sorted(state.items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


class HFMoEEngine(ConfigShapes):
    """A tiny HF MoE causal LM in eval mode, float32, built from :class:`HFMoEConfig`.

    Every process building it from the same config gets the same weights (checked by
    :attr:`fingerprint`, :func:`fingerprint` of its ``state_dict``). ``load``: replaces the
    seeded model's weights before they are fingerprinted (:func:`.weights.load_engine`).
    """

    def __init__(self, config: HFMoEConfig, load: Callable[[torch.nn.Module], None] | None = None) -> None:
        self.config = config
        hf_config = config.hf_config()
        with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = _MODEL_CLASSES[config.arch](hf_config)
        self.model = model.to(torch.float32).eval()
        if load is not None:
            load(self.model)
        params = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values -> cache (the old name is deprecated).
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.fingerprint = fingerprint(self.model.state_dict())

    def forward(self, input_ids: torch.Tensor, cache: object = None, *, use_cache: bool = True) -> tuple[torch.Tensor, torch.Tensor, object]:
        """One forward over ``input_ids`` int64 ``[B, S]`` after ``cache`` (None: from 0).

        Returns (float32 logits ``[B, S, V]``, int16 routes ``[B, S, L, K]`` of each INPUT
        position, the updated cache or None).
        """
        B, S = input_ids.shape
        kwargs: dict[str, object] = {"input_ids": input_ids, "use_cache": use_cache, "output_router_logits": True}
        if cache is not None:
            kwargs[self._cache_arg] = cache
        with torch.inference_mode(), torch_threads(self.config.threads):
            out = self.model(**kwargs)
            routes = route_experts(out.router_logits, self.config.top_k).view(len(out.router_logits), B, S, -1)
        # The output field is named like the argument (cache in 5.x, past_key_values in 4.x).
        new_cache = out.get(self._cache_arg, None) if use_cache else None
        return out.logits.float(), routes.permute(1, 2, 0, 3).contiguous(), new_cache


def route_experts(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """int16 ``[L, N, K]``: per layer, the top-k experts of each of the N input tokens.

    The same ops the routers select with (float32 softmax, then ``torch.topk``), so the
    experts are those the forward pass used, by decreasing probability.
    """
    probs = torch.softmax(torch.stack([r.float() for r in router_logits]), dim=-1)
    return torch.topk(probs, top_k, dim=-1).indices.to(torch.int16)


def sample_tokens(logits: torch.Tensor, keys: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sample one token per row from float32 ``logits`` ``[B, V]`` at temperature 1.

    Inverse CDF of ``softmax(logits)`` (cumulated in float64) at a counter-based uniform
    keyed by (rollout key, absolute position): a row's draw never depends on the rest of
    the batch (its float32 logits may, in the last bits: float matmuls on CPU are not
    batch-invariant, see the toy engine). Returns (int64 tokens ``[B]``, float32 logprobs ``[B]`` = the sampled
    entries of ``log_softmax(logits)``).
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    cdf = torch.cumsum(logp.double().exp(), dim=-1)
    u = torch.from_numpy(uniforms(keys, STREAM_SAMPLE, positions)) * cdf[:, -1]
    tok = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=logits.shape[-1] - 1)
    lp = logp.gather(1, tok)[:, 0]
    return tok[:, 0].numpy().astype(np.int64), lp.numpy().astype(np.float32)


# ---- multi-turn rollouts through the capture gate --------------------------------------------


def generate_rollouts(
    engine: HFMoEEngine,
    specs: Sequence[RolloutSpec],
    *,
    env: ToolEnvironment | None = None,
    weight_version: int = 0,
    digest_version: int = DIGEST_VERSION,
    reward: Callable[[np.ndarray], float] = toy_reward,
) -> list[GeneratedRollout]:
    """Generate every rollout (KV-cached decoding), each call staged through a CaptureGate
    hashing with ``digest_version`` (:mod:`tasks.digests`).

    Rollouts of the same shape (prompt length, turns, tokens per turn, tool tokens) decode
    as one batch with one KV cache, kept across turns: call ``t`` prefills the previous
    call's last token plus the tool tokens, then decodes ``tokens_per_turn`` tokens. Call
    layout, ids, reward and receipts as :func:`tasks.toy.rollouts.generate_rollouts`; a
    delta the gate refuses poisons that rollout only. An empty prompt or one with ids
    outside the vocabulary poisons its rollout (``invalid_token``).
    env: defaults to ``ToolEnvironment(engine seed, vocab)``.
    reward: a rollout's generated tokens (int64, every turn's, in order) -> its receipt's
    reward (e.g. :class:`tasks.toy.rewards.TargetTokensReward`).
    """
    ids = [s.rollout_id for s in specs]
    if len(set(ids)) != len(ids):
        raise InvalidCall("invalid_argument", "duplicate rollout_id in specs")
    V = engine.vocab_size
    env = env or ToolEnvironment(seed=engine.config.seed, vocab_size=V)
    gates = [CaptureGate(s.rollout_id, vocab_size=V, num_experts=engine.num_experts, group_id=s.group_id,
                         digest_version=digest_version) for s in specs]
    rows: list[list[StagedRow]] = [[] for _ in specs]
    tokens: list[np.ndarray] = [np.zeros(0, np.int64) for _ in specs]
    generated: list[np.ndarray] = [np.zeros(0, np.int64) for _ in specs]
    buckets: dict[tuple[int, int, int, int], list[int]] = {}
    for i, s in enumerate(specs):
        p = s.prompt_tokens
        if p.size == 0 or int(p.min()) < 0 or int(p.max()) >= V:
            gates[i].poison(f"invalid_token: prompt of {s.rollout_id!r} is empty or holds ids outside [0, {V})")
            continue
        total = len(p) + s.turns * s.tokens_per_turn + (s.turns - 1) * s.tool_tokens
        if total > engine.config.max_positions:
            raise InvalidCall("invalid_argument", f"rollout {s.rollout_id!r} needs {total} positions > max_positions {engine.config.max_positions}")
        buckets.setdefault((len(p), s.turns, s.tokens_per_turn, s.tool_tokens), []).append(i)
    for idx in buckets.values():
        _generate_batch(engine, env, specs, idx, gates, rows, tokens, generated, weight_version)
    return [
        GeneratedRollout(spec=s, rows=rows[i], receipt=gates[i].receipt(reward(generated[i])), tokens=tokens[i])
        for i, s in enumerate(specs)
    ]


def _generate_batch(
    engine: HFMoEEngine,
    env: ToolEnvironment,
    specs: Sequence[RolloutSpec],
    idx: list[int],
    gates: list[CaptureGate],
    rows: list[list[StagedRow]],
    tokens: list[np.ndarray],
    generated: list[np.ndarray],
    weight_version: int,
) -> None:
    """Decode the same-shaped rollouts ``idx`` as one batch; stage each call per rollout."""
    first = specs[idx[0]]
    B, n_new = len(idx), first.tokens_per_turn
    keys = np.array([rollout_key(engine.config.seed, specs[i].rollout_id) for i in idx], dtype=np.uint64)
    alive = [True] * B
    cache, last, prev_len = None, None, 0
    for turn in range(first.turns):
        if turn == 0:
            context = np.stack([specs[i].prompt_tokens for i in idx])
            inputs = context  # input positions 0 .. c-1
        else:
            tool = env.tool_outputs([specs[i].rollout_id for i in idx], [turn] * B, [first.tool_tokens] * B)
            context = np.stack(tool) if first.tool_tokens else np.zeros((B, 0), np.int64)
            inputs = np.concatenate([last[:, None], context], axis=1)  # positions prev_len-1 ..
        c = context.shape[1]
        logits, routes_t, cache = engine.forward(torch.from_numpy(inputs), cache)
        routes = routes_t.numpy()
        # Input position a predicts token a + 1: shift the prefill's routes by one.
        ctx_routes = np.concatenate([routes[:, :1], routes[:, : c - 1]], axis=1) if turn == 0 else routes[:, :c]
        gen_tok = np.empty((B, n_new), np.int64)
        gen_lp = np.empty((B, n_new), np.float32)
        gen_rt = np.empty((B, n_new, *engine.routes_shape), engine.routes_dtype)  # uint8 up to 256 experts
        step_logits, step_routes = logits[:, -1], routes[:, -1]
        for j in range(n_new):
            pos = np.full(B, prev_len + c + j, dtype=np.int64)
            gen_tok[:, j], gen_lp[:, j] = sample_tokens(step_logits, keys, pos)
            gen_rt[:, j] = step_routes
            if j + 1 < n_new:
                logits, routes_t, cache = engine.forward(torch.from_numpy(gen_tok[:, j : j + 1]), cache)
                step_logits, step_routes = logits[:, -1], routes_t[:, -1].numpy()
        last = gen_tok[:, -1]
        mask = np.concatenate([np.zeros(c, np.float32), np.ones(n_new, np.float32)])
        for b, i in enumerate(idx):
            if not alive[b]:
                continue
            delta = np.concatenate([context[b], gen_tok[b]])
            try:
                row = gates[i].stage_call(
                    call_id(turn),
                    parent_call_id(turn),
                    delta,
                    mask,
                    np.concatenate([np.zeros(c, np.float32), gen_lp[b]]),
                    routed_experts=np.ascontiguousarray(np.concatenate([ctx_routes[b], gen_rt[b]])),
                    weight_version=weight_version,
                )
            except InvalidRecord as e:
                gates[i].poison(f"{e.reason}: {e.detail}")
                alive[b] = False
                continue
            rows[i].append(row)
            tokens[i] = np.concatenate([tokens[i], delta])
            generated[i] = np.concatenate([generated[i], gen_tok[b]])
        prev_len += c + n_new


# ---- the teacher-forced fidelity check --------------------------------------------------------


def teacher_forced(engine: HFMoEEngine, input_ids: RowArray) -> tuple[np.ndarray, np.ndarray]:
    """ONE forward over a whole row (no cache): what training would recompute.

    Returns float32 logprobs ``[T]`` (``logprobs[p]`` of token ``p`` under the pass over
    position ``p - 1``; ``logprobs[0] = 0``) and int16 routes ``[T, L, K]`` in the capture
    convention (``routes[p]`` = pass over position ``max(p - 1, 0)``).
    """
    ids = _as_int64(input_ids)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidCall("invalid_argument", f"input_ids must be a non-empty 1-d row, got shape {list(ids.shape)}")
    logits, routes, _ = engine.forward(torch.from_numpy(ids)[None], use_cache=False)
    logp = torch.log_softmax(logits[0], dim=-1)
    lps = np.zeros(len(ids), np.float32)
    lps[1:] = logp[:-1].gather(1, torch.from_numpy(ids[1:])[:, None])[:, 0].numpy()
    r = routes[0].numpy()
    return lps, np.concatenate([r[:1], r[:-1]])


@dataclass(frozen=True)
class FidelityReport:
    """Captured vs teacher-forced figures over some rows.

    Routes are compared as SETS per (token, layer): both sides sorted along ``K``, then
    entry by entry (the MoE output does not depend on the order, and two experts with
    float32-equal probabilities have no defined order). ``ordered_matches`` counts exact
    order agreement too. ``tokens``: generated tokens (mask 1) compared;
    ``context_*``: the same for context tokens (mask 0) past position 0, whose routes
    router replay also reuses. ``unrouted_rows``: accepted rows without routes.
    """

    rows: int = 0
    tokens: int = 0
    route_entries: int = 0
    route_matches: int = 0
    ordered_matches: int = 0
    context_route_entries: int = 0
    context_route_matches: int = 0
    max_abs_logprob_diff: float = 0.0
    sum_abs_logprob_diff: float = 0.0
    unrouted_rows: int = 0

    @property
    def route_agreement(self) -> float:
        """Percent of generated-token x layer x k entries equal (100.0 when none)."""
        return 100.0 * self.route_matches / self.route_entries if self.route_entries else 100.0

    @property
    def context_route_agreement(self) -> float:
        return 100.0 * self.context_route_matches / self.context_route_entries if self.context_route_entries else 100.0

    @property
    def mean_abs_logprob_diff(self) -> float:
        return self.sum_abs_logprob_diff / self.tokens if self.tokens else 0.0

    def ok(self, tolerance: float = LOGPROB_TOLERANCE) -> bool:
        """Every route equal (generated and context), every logprob within ``tolerance``."""
        return (
            self.route_matches == self.route_entries
            and self.context_route_matches == self.context_route_entries
            and self.max_abs_logprob_diff <= tolerance
            and self.unrouted_rows == 0
        )

    def __add__(self, other: FidelityReport) -> FidelityReport:
        return FidelityReport(
            **{
                f.name: (max if f.name == "max_abs_logprob_diff" else (lambda a, b: a + b))(getattr(self, f.name), getattr(other, f.name))
                for f in fields(self)
            }
        )

    def summary(self) -> str:
        return (
            f"route agreement {self.route_agreement:.2f}% ({self.route_matches}/{self.route_entries} entries, "
            f"context {self.context_route_agreement:.2f}%), max |dlogprob| {self.max_abs_logprob_diff:.3g}, "
            f"mean |dlogprob| {self.mean_abs_logprob_diff:.3g} over {self.tokens} generated tokens in {self.rows} rows"
        )


def check_row(engine: HFMoEEngine, input_ids: RowArray, token_mask: RowArray, logprobs: RowArray, routed_experts: RowArray) -> FidelityReport:
    """Teacher-force one finalized row (arrays of its own length ``T``) and compare.

    input_ids int ``[T]``, token_mask float ``[T]``, logprobs float32 ``[T]``,
    routed_experts ``[T, L, K]`` in any integer dtype (uint8 or int16 as staged; numpy or torch).
    """
    ids = _as_int64(input_ids)
    mask = np.asarray(token_mask.cpu().numpy() if isinstance(token_mask, torch.Tensor) else token_mask) > 0
    lps = np.asarray(logprobs.cpu().numpy() if isinstance(logprobs, torch.Tensor) else logprobs, dtype=np.float32)
    got = np.asarray(routed_experts.cpu().numpy() if isinstance(routed_experts, torch.Tensor) else routed_experts)
    T = len(ids)
    if mask.shape != (T,) or lps.shape != (T,) or got.shape != (T, *engine.routes_shape):
        raise InvalidCall("invalid_argument", f"row fields disagree: ids {T}, mask {mask.shape}, logprobs {lps.shape}, routes {got.shape}")
    ref_lps, ref_routes = teacher_forced(engine, ids)
    diff = np.abs(ref_lps[mask].astype(np.float64) - lps[mask].astype(np.float64))
    same = np.sort(got, axis=-1) == np.sort(ref_routes, axis=-1)
    ctx = ~mask
    ctx[0] = False
    return FidelityReport(
        rows=1,
        tokens=int(mask.sum()),
        route_entries=int(same[mask].size),
        route_matches=int(same[mask].sum()),
        ordered_matches=int((got == ref_routes)[mask].sum()),
        context_route_entries=int(same[ctx].size),
        context_route_matches=int(same[ctx].sum()),
        max_abs_logprob_diff=float(diff.max()) if diff.size else 0.0,
        sum_abs_logprob_diff=float(diff.sum()),
    )


def check_group(engine: HFMoEEngine, group: FinalizedGroup) -> FidelityReport:
    """:func:`check_row` over every accepted row of a ``FinalizedGroup`` (summed)."""
    report = FidelityReport()
    for i in range(len(group)):
        if float(group.sample_mask[i]) <= 0:
            continue
        if group.routed_experts is None or not bool(group.has_routes[i]):
            report = report + FidelityReport(rows=1, unrouted_rows=1)
            continue
        t = int(group.input_lengths[i])
        report = report + check_row(engine, group.input_ids[i, :t], group.token_mask[i, :t], group.logprobs[i, :t], group.routed_experts[i, :t])
    return report
