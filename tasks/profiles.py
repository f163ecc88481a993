"""MoE payload profiles: how many routed-expert ids a token carries.

A profile names a model family's routing shape: ``layers`` MoE layers, each choosing
``top_k`` of ``experts`` experts per token, so a token carries ``layers * top_k`` expert
ids beside its id, mask and log-probability. Benchmarks take ``--profile NAME`` and build
their rows from it; :func:`bytes_per_token` says what a staged token costs on the wire.
Pure data, no Dask.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UnknownProfileError

# Bytes per token of the fields every row has: token id (int64), loss mask and
# sampling log-probability (float32 each).
BASE_BYTES_PER_TOKEN = 8 + 4 + 4


@dataclass(frozen=True)
class MoeProfile:
    """The routing shape of one model family (counts, not bytes)."""

    name: str
    layers: int  # MoE layers that route each token
    top_k: int  # experts chosen per token per layer
    experts: int  # experts per layer (expert ids are in [0, experts))

    @property
    def ids_per_token(self) -> int:
        """Routed-expert ids one token carries (``layers * top_k``)."""
        return self.layers * self.top_k

    def bytes_per_token(self, route_id_bytes: int) -> int:
        """Bytes of one staged token with routes stored ``route_id_bytes`` bytes per id."""
        return BASE_BYTES_PER_TOKEN + self.ids_per_token * route_id_bytes


PROFILES: dict[str, MoeProfile] = {
    p.name: p
    for p in (
        MoeProfile("toy", layers=4, top_k=2, experts=8),
        # Qwen3-30B-A3B-like: 48 MoE layers, top-8 of 128 experts.
        MoeProfile("qwen3-moe", layers=48, top_k=8, experts=128),
        # DeepSeek-V3-like: 58 MoE layers (of 61), top-8 of 256 routed experts.
        MoeProfile("deepseek-v3", layers=58, top_k=8, experts=256),
    )
}
DEFAULT_PROFILE = "toy"


def profile(name: str) -> MoeProfile:
    """The profile called ``name``; :class:`UnknownProfileError` names the choices."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownProfileError(f"unknown MoE profile {name!r}; choose one of {', '.join(PROFILES)}") from None
