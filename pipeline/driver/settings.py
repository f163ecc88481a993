"""The driver's knobs, read once when a driver is built, as frozen settings.

:class:`PoolSettings` is what every generation actor is built with (``token-capture.policy``
with the overrides applied, routes on or off); :class:`RoundSettings` what the round loop
uses (``driver.step-tokens``, the weight version, routes). Nothing here is read per call.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from tasks.errors import DriverError

from .. import config

# Policy settings (``token-capture.policy`` keys, dashes or underscores): all ints.
PolicySettings = Mapping[str, int]


@dataclass(frozen=True)
class PoolSettings:
    """policy: the full policy settings (config section, overrides applied; read-only);
    with_routes: whether actors capture routed experts; lost_actor_grace_s: how long
    (seconds) a cut retries an actor whose call failed on the connection while its worker
    is still in the cluster (``cut.lost-actor-grace-s``)."""

    policy: PolicySettings
    with_routes: bool
    lost_actor_grace_s: float = 10.0

    @classmethod
    def from_config(cls, overrides: PolicySettings, with_routes: bool) -> PoolSettings:
        """Reads ``token-capture.policy`` and ``cut.lost-actor-grace-s`` now, once."""
        policy = dict(config.get("policy"))
        policy.update(overrides)
        grace = float(config.get("cut.lost-actor-grace-s"))
        if not grace >= 0:
            raise DriverError(f"cut.lost-actor-grace-s {grace} must be >= 0 seconds")
        return cls(policy=MappingProxyType(policy), with_routes=bool(with_routes), lost_actor_grace_s=grace)


@dataclass(frozen=True)
class RoundSettings:
    """step_tokens: tokens per call per round (>= 1); weight_version: staged on every row;
    with_routes: whether staged rows carry routed experts."""

    step_tokens: int
    weight_version: int
    with_routes: bool

    @classmethod
    def from_config(cls, step_tokens: int | None, weight_version: int, with_routes: bool) -> RoundSettings:
        """``step_tokens`` None: ``token-capture.driver.step-tokens``, read now, once."""
        routes, version = bool(with_routes), int(weight_version)
        n = int(config.get("driver.step-tokens") if step_tokens is None else step_tokens)
        if n < 1:
            raise DriverError(f"step_tokens {n} must be >= 1")
        return cls(step_tokens=n, weight_version=version, with_routes=routes)
