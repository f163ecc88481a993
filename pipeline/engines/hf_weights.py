"""The HF MoE engine at the trainer's weights, as Dask work: the trainer publishes a
:class:`tasks.engines.weights.WeightSnapshot` per version (scattered to every worker), and
generation tasks sample and stage with the engine holding it, each call tagged with the
snapshot's ``weight_version``. A worker builds the engine of a version once (a small
per-process cache keyed by config and fingerprint, :class:`EngineCache`), so a step's
groups share it.

Ranges and architecture as :mod:`pipeline.engines.hf` (``token-capture.policy`` plus
overrides). Needs the ``hf`` extra. ``examples/grpo_tiny_moe.py`` drives it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

from tasks.engines.hf_moe import HFMoEConfig, HFMoEEngine
from tasks.engines.weights import WeightSnapshot, load_engine
from tasks.receipts import Receipt
from tasks.toy.rollouts import RolloutSpec, toy_reward

from ..process_state import process_state
from ..store.protocol import StoreLike
from .hf import engine_config, stage_generated, submit_per_group

if TYPE_CHECKING:
    from distributed import Client, Future

# Engines kept per process: the version generating now and the one before (a step's
# groups may still run on the previous version while the next one arrives).
CACHED_VERSIONS = 2


class EngineCache:
    """The process's engines at trainer snapshots (a :class:`~pipeline.process_state.ProcessState`
    component): keyed by config and snapshot fingerprint, the :data:`CACHED_VERSIONS`
    most recently used kept; each built once, under the lock (worker threads share it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: OrderedDict[tuple[HFMoEConfig, str], HFMoEEngine] = OrderedDict()

    def at(self, cfg: HFMoEConfig, snapshot: WeightSnapshot) -> HFMoEEngine:
        """The engine of ``cfg`` holding ``snapshot``'s weights (loaded on first ask)."""
        key = (cfg, snapshot.fingerprint)
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = self._engines[key] = load_engine(cfg, snapshot)
                while len(self._engines) > CACHED_VERSIONS:
                    self._engines.popitem(last=False)
            else:
                self._engines.move_to_end(key)
            return engine

    def close(self) -> None:
        with self._lock:
            self._engines.clear()


def publish(client: Client, snapshot: WeightSnapshot) -> Future:
    """Scatter ``snapshot`` to every worker once; pass the future to :func:`submit_generation`
    (tasks then read the worker's local copy instead of shipping the weights per task)."""
    return client.scatter(snapshot, broadcast=True, hash=False)


def engine_at(snapshot: WeightSnapshot, overrides: Mapping[str, object] | None = None) -> HFMoEEngine:
    """The engine of :func:`pipeline.engines.hf.engine_config` holding ``snapshot``'s
    weights, built once per process and version (its fingerprint is the snapshot's)."""
    return process_state().get(EngineCache).at(engine_config(overrides), snapshot)


def generate_and_stage(
    store: StoreLike,
    specs: Sequence[RolloutSpec],
    snapshot: WeightSnapshot,
    overrides: Mapping[str, object] | None = None,
    reward: Callable[[np.ndarray], float] = toy_reward,
    digest_version: int | None = None,
) -> list[Receipt]:
    """Task body: :func:`pipeline.engines.hf.stage_generated` with the engine at
    ``snapshot`` (calls staged with ``weight_version = snapshot.version``)."""
    return stage_generated(store, specs, engine_at(snapshot, overrides), weight_version=snapshot.version,
                           digest_version=digest_version, reward=reward)


def submit_generation(
    client: Client,
    store: StoreLike,
    groups: Sequence[Sequence[RolloutSpec]],
    weights: Future | WeightSnapshot,
    **kwargs: object,
) -> list[Future]:
    """One generation task per group at ``weights`` (a :func:`publish` future, or a
    snapshot shipped with each task); futures of each group's receipts. ``kwargs``:
    ``overrides``, ``reward``, ``digest_version`` (default: the caller's ``capture.digest``)."""
    return submit_per_group(client, generate_and_stage, store, groups, weights, **kwargs)
