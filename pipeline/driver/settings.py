"""The driver's knobs, read once when a driver is built, as frozen settings.

:class:`PoolSettings` is what every generation actor is built with (``token-capture.policy``
with the overrides applied, routes on or off) and how long the driver awaits the actors'
answers; :class:`RoundSettings` what the round loop uses (``driver.step-tokens``, the
weight version, routes). Nothing here is read per call.
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
    is still in the cluster (``cut.lost-actor-grace-s``); call_timeout_s: how long a round's
    or a recovery's actor call is awaited (``driver.actor-call-timeout-s``, s; None:
    unbounded); cut_deadline_s: the workers' default cut deadline (``cut.deadline-s``, s);
    cut_answer_margin_s: how long past its deadline a cut's answer is awaited
    (``driver.cut-answer-margin-s``, s)."""

    policy: PolicySettings
    with_routes: bool
    lost_actor_grace_s: float = 10.0
    call_timeout_s: float | None = 300.0
    cut_deadline_s: float = 60.0
    cut_answer_margin_s: float = 10.0

    @classmethod
    def from_config(cls, overrides: PolicySettings, with_routes: bool) -> PoolSettings:
        """Reads ``token-capture.policy``, ``cut.lost-actor-grace-s``, ``cut.deadline-s``,
        ``driver.actor-call-timeout-s`` and ``driver.cut-answer-margin-s`` now, once."""
        policy = dict(config.get("policy"))
        policy.update(overrides)
        grace = _seconds("cut.lost-actor-grace-s")
        timeout = _seconds("driver.actor-call-timeout-s")
        return cls(policy=MappingProxyType(policy), with_routes=bool(with_routes), lost_actor_grace_s=grace,
                   call_timeout_s=timeout or None, cut_deadline_s=_seconds("cut.deadline-s"),
                   cut_answer_margin_s=_seconds("driver.cut-answer-margin-s"))

    def cut_wait_s(self, deadline: float | None, now: float) -> float:
        """How long a cut's answer is awaited (s): to its ``deadline`` (absolute, the
        workers' ``time.time()`` seconds; None: ``cut_deadline_s`` from ``now``) plus the
        margin for clock skew and the answer's trip back. A worker's cut ends by its
        deadline, so an actor silent past this is hung, not slow."""
        left = self.cut_deadline_s if deadline is None else max(deadline - now, 0.0)
        return left + self.cut_answer_margin_s


def _seconds(key: str) -> float:
    """``token-capture.<key>`` as seconds >= 0; :class:`DriverError` naming the key if not."""
    value = float(config.get(key))
    if not value >= 0:
        raise DriverError(f"{key} {value} must be >= 0 seconds")
    return value


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
