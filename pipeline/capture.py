"""Generation + capture as Dask work: rollouts are generated on workers, their rows staged
from there, and only the token-free receipts travel back to the controller.

This is the no-checkpoint path (the demo's uninterrupted run, tests, benchmarks). The
checkpointable path runs calls on :class:`pipeline.generation.worker.GenerationWorker`
actors instead; both stage through the same :class:`~tasks.gate.CaptureGate`.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Mapping, Sequence

from tasks.keys import STAGING_PARTITION
from tasks.packed import PackedBatch, pack_rows
from tasks.toy.policy import MoEPolicy, PolicyConfig
from tasks.receipts import Receipt
from tasks.toy.rollouts import GeneratedRollout, RolloutSpec, generate_rollouts

from . import config
from .client.refusals import poison_refused, refusals_of
from .store.protocol import StoreLike

if TYPE_CHECKING:
    from distributed import Client, Future


@functools.lru_cache(maxsize=4)
def _policy(items: tuple) -> MoEPolicy:
    return MoEPolicy(PolicyConfig.from_mapping(dict(items)))


def policy_from_config(overrides: Mapping[str, object] | None = None) -> MoEPolicy:
    """The toy policy of ``token-capture.policy`` (cached per process: weights are derived
    from the seed, so every worker builds the same model)."""
    settings = dict(config.get("policy"))
    settings.update(overrides or {})
    return _policy(tuple(sorted(settings.items())))


def stage_rollouts(store: StoreLike, rollouts: Sequence[GeneratedRollout]) -> list[Receipt]:
    """Stage every row of ``rollouts`` in ONE batched put; return their receipts.

    A row the store refuses (``key_conflict``, ``store_full``, ...) or leaves out of its
    answer (``missing_ack``) poisons its rollout's receipt with that reason
    (:func:`pipeline.client.refusals.poison_refused`), so the finalizer rejects that
    rollout alone and nothing is silently missing.
    """
    rows = [r for ro in rollouts for r in ro.rows]
    receipts = [ro.receipt for ro in rollouts]
    if not rows:
        return receipts
    batch: PackedBatch = pack_rows(rows)
    result = store.put_many(batch, partition=STAGING_PARTITION)
    poison_refused(receipts, refusals_of(batch.keys, result.ok, result.failed))
    return receipts


def generate_and_stage(
    store: StoreLike, specs: Sequence[RolloutSpec], policy_overrides: Mapping[str, object] | None = None, weight_version: int = 0,
    digest_version: int | None = None,
) -> list[Receipt]:
    """Task body: generate ``specs`` with the toy policy, stage their rows (hashed with
    ``digest_version``; None: this process's ``capture.digest``), return receipts."""
    policy = policy_from_config(policy_overrides)
    version = config.digest_version() if digest_version is None else digest_version
    rollouts = generate_rollouts(policy, specs, weight_version=weight_version, digest_version=version)
    return stage_rollouts(store, rollouts)


def submit_generation(client: Client, store: StoreLike, groups: Sequence[Sequence[RolloutSpec]], **kwargs: object) -> list[Future]:
    """One generation task per group on the cluster; futures of each group's receipts.
    The rows are hashed with the caller's ``capture.digest`` (read here, sent along)."""
    kwargs.setdefault("digest_version", config.digest_version())
    return [
        client.submit(generate_and_stage, store, list(specs), pure=False, **kwargs)
        for specs in groups
        if specs
    ]
