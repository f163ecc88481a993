"""The shapes an engine answers from its config: vocabulary, experts, routes ``(L, K)``
and the dtype its routed expert ids are captured in."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from ..schema import routes_dtype_for


class ShapesConfig(Protocol):
    """What :class:`ConfigShapes` reads of an engine's config."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def experts(self) -> int: ...

    @property
    def layers(self) -> int: ...

    @property
    def top_k(self) -> int: ...


class ConfigShapes:
    """Mixin for an engine holding ``self.config`` with ``vocab_size``, ``experts``,
    ``layers`` and ``top_k`` (the toy policy's and the HF MoE engine's configs)."""

    config: ShapesConfig

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_experts(self) -> int:
        return self.config.experts

    @property
    def routes_shape(self) -> tuple[int, int]:
        """``(L, K)``: the trailing shape of routed experts per token."""
        return (self.config.layers, self.config.top_k)

    @property
    def routes_dtype(self) -> np.dtype:
        """The dtype routed expert ids are produced in: uint8 up to 256 experts, else int16
        (:func:`tasks.schema.routes_dtype_for`; the gate stages them in that encoding)."""
        return routes_dtype_for(self.config.experts)
