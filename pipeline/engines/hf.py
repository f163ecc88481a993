"""The Hugging Face MoE engine as Dask work: rollouts generated and staged on workers
(only token-free receipts come back), and the teacher-forced fidelity check run where the
finalized groups live. Needs the ``hf`` extra (transformers).

The engine's data ranges come from ``token-capture.policy`` (``vocab-size``, ``layers``,
``experts``, ``top-k``, ``seed``, ``threads``), the keys the Finalizer's ranges default to,
so staged rows, verification and the model agree; the architecture (``arch``, ``hidden``,
``heads``, ...) is given as overrides. docs/design.md, "A real MoE engine".
"""
from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from tasks.engines.hf_moe import FidelityReport, HFMoEConfig, HFMoEEngine, check_group, generate_rollouts
from tasks.receipts import Receipt
from tasks.toy.rollouts import RolloutSpec, toy_reward

from .. import config
from ..capture import stage_rollouts
from ..store.protocol import StoreLike

if TYPE_CHECKING:
    from distributed import Client, Future

    from tasks.finalize.assemble import FinalizedGroup

# token-capture.policy keys the HF engine shares with the toy policy (data ranges and seed).
SHARED_POLICY_KEYS = ("vocab-size", "layers", "experts", "top-k", "seed", "threads")


def engine_config(overrides: Mapping[str, object] | None = None) -> HFMoEConfig:
    """The engine config: the shared ``policy`` keys, then ``overrides`` (dashes or underscores)."""
    policy = config.get("policy")
    settings: dict[str, object] = {k: policy[k] for k in SHARED_POLICY_KEYS}
    for key, value in (overrides or {}).items():
        settings.pop(str(key).replace("_", "-"), None)
        settings[key] = value
    return HFMoEConfig.from_mapping(settings)


_ENGINE_LOCK = threading.Lock()  # worker threads share one engine; build it once


@functools.lru_cache(maxsize=2)
def _engine(cfg: HFMoEConfig) -> HFMoEEngine:
    return HFMoEEngine(cfg)


def engine_from_config(overrides: Mapping[str, object] | None = None) -> HFMoEEngine:
    """The engine of :func:`engine_config`, built once per process (weights derive from the
    seed, so every worker builds the same model: compare :attr:`HFMoEEngine.fingerprint`)."""
    cfg = engine_config(overrides)
    with _ENGINE_LOCK:
        return _engine(cfg)


def finalizer_ranges(overrides: Mapping[str, object] | None = None) -> dict[str, int]:
    """``vocab_size`` and ``num_experts`` to give :class:`pipeline.finalize.controller.Finalizer`."""
    cfg = engine_config(overrides)
    return {"vocab_size": cfg.vocab_size, "num_experts": cfg.experts}


def stage_generated(
    store: StoreLike,
    specs: Sequence[RolloutSpec],
    engine: HFMoEEngine,
    *,
    weight_version: int,
    digest_version: int | None = None,
    reward: Callable[[np.ndarray], float] = toy_reward,
) -> list[Receipt]:
    """Generate ``specs`` with ``engine`` (calls staged with ``weight_version``, receipts
    rewarded by ``reward``), stage their rows in ONE put (hashed with ``digest_version``;
    None: this process's ``capture.digest``), return receipts. The body of both generation
    tasks: the seeded engine's (:func:`generate_and_stage`) and the trainer's weights'
    (:func:`pipeline.engines.hf_weights.generate_and_stage`)."""
    version = config.digest_version() if digest_version is None else digest_version
    rollouts = generate_rollouts(engine, specs, weight_version=weight_version, digest_version=version, reward=reward)
    return stage_rollouts(store, rollouts)


def generate_and_stage(
    store: StoreLike,
    specs: Sequence[RolloutSpec],
    overrides: Mapping[str, object] | None = None,
    weight_version: int = 0,
    digest_version: int | None = None,
) -> list[Receipt]:
    """Task body: :func:`stage_generated` with the engine of :func:`engine_from_config`."""
    return stage_generated(store, specs, engine_from_config(overrides), weight_version=weight_version, digest_version=digest_version)


def submit_per_group(client: Client, task: Callable[..., list[Receipt]], store: StoreLike,
                     groups: Sequence[Sequence[RolloutSpec]], *args: object, **kwargs: object) -> list[Future]:
    """One ``task(store, specs, *args, **kwargs)`` per non-empty group on the cluster;
    futures of each group's receipts. ``digest_version`` defaults to the caller's
    ``capture.digest``, read here."""
    kwargs.setdefault("digest_version", config.digest_version())
    return [
        client.submit(task, store, list(specs), *args, pure=False, **kwargs)
        for specs in groups
        if specs
    ]


def submit_generation(client: Client, store: StoreLike, groups: Sequence[Sequence[RolloutSpec]], **kwargs: object) -> list[Future]:
    """One HF generation task per group on the cluster; futures of each group's receipts.
    ``kwargs``: ``overrides``, ``weight_version``, ``digest_version`` (default: the
    caller's ``capture.digest``, read here)."""
    return submit_per_group(client, generate_and_stage, store, groups, **kwargs)


def check_fidelity(group: FinalizedGroup, overrides: Mapping[str, object] | None = None) -> FidelityReport:
    """Task body: the teacher-forced check over every accepted row of a FinalizedGroup."""
    return check_group(engine_from_config(overrides), group)


def submit_fidelity(client: Client, group_futures: Mapping[str, Future], overrides: Mapping[str, object] | None = None) -> dict[str, Future]:
    """One fidelity task per finalized group future (e.g. ``StepHandle.group_futures``,
    taken before ``result()`` frees them), run where the group's tensors are."""
    return {
        gid: client.submit(check_fidelity, fut, overrides, pure=False)
        for gid, fut in group_futures.items()
    }
