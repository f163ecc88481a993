"""Trainer weights for the HF MoE engine: a versioned snapshot of a model's parameters
that a generation process loads, so rollouts are sampled with the weights the trainer
published (and tagged with that ``weight_version``).

A :class:`WeightSnapshot` holds float32 CPU copies of every ``state_dict`` entry (the tiny
engines here weigh about 1.3 MB, cheap to ship to every worker) and their SHA-256
fingerprint (:func:`tasks.engines.hf_moe.fingerprint`, as an engine's), so a
loaded engine proves it holds exactly the trainer's weights. Needs the ``hf`` extra.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidInput
from .hf_moe import HFMoEConfig, HFMoEEngine, fingerprint


@dataclass(frozen=True, eq=False)
class WeightSnapshot:
    """The weights of one trainer version.

    version: the trainer's weight version (updates applied), staged as each call's
        ``weight_version``. tensors: parameter name -> float32 CPU tensor (a copy, never
        shared with the live model). fingerprint: :func:`fingerprint` of ``tensors``.
    """

    version: int
    tensors: dict[str, torch.Tensor] = field(repr=False)
    fingerprint: str

    @classmethod
    def of(cls, model: torch.nn.Module, version: int) -> WeightSnapshot:
        """Copy ``model``'s ``state_dict`` (detached, float32, CPU) as version ``version``."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"weight snapshot: version must be an int >= 0, got {version!r}")
        tensors = {k: v.detach().to("cpu", torch.float32).clone().contiguous() for k, v in model.state_dict().items()}
        return cls(version, tensors, fingerprint(tensors))

    @property
    def nbytes(self) -> int:
        """Bytes of parameter data."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def load_engine(config: HFMoEConfig, snapshot: WeightSnapshot) -> HFMoEEngine:
    """A new :class:`HFMoEEngine` of ``config`` holding ``snapshot``'s weights (built once:
    the snapshot is loaded before the engine fingerprints its weights).

    Raises :class:`InvalidInput` when the snapshot's names or shapes are not the config's
    model's (a snapshot of another architecture or size), or when the loaded weights'
    fingerprint differs from the snapshot's (a snapshot altered after it was taken).
    """
    engine = HFMoEEngine(config, load=lambda model: _load(model, config, snapshot))
    if engine.fingerprint != snapshot.fingerprint:
        raise InvalidInput(
            f"weight snapshot v{snapshot.version}: loaded weights fingerprint {engine.fingerprint[:12]} != snapshot's "
            f"{snapshot.fingerprint[:12]} (its tensors changed after WeightSnapshot.of); take a new snapshot"
        )
    return engine


def _load(model: torch.nn.Module, config: HFMoEConfig, snapshot: WeightSnapshot) -> None:
    """``snapshot``'s tensors into ``model`` (:class:`InvalidInput` when they do not fit it)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(snapshot.tensors))
    extra = sorted(set(snapshot.tensors) - set(own))
    shapes = sorted(k for k in set(own) & set(snapshot.tensors) if tuple(own[k].shape) != tuple(snapshot.tensors[k].shape))
    if missing or extra or shapes:
        raise InvalidInput(
            f"weight snapshot v{snapshot.version} does not fit the engine config (arch {config.arch}, "
            f"hidden {config.hidden}, layers {config.layers}, experts {config.experts}): missing {missing[:3]}, "
            f"unexpected {extra[:3]}, other shapes {shapes[:3]}; snapshot a model built from the same HFMoEConfig"
        )
    with torch.no_grad():
        model.load_state_dict(snapshot.tensors, strict=True)
