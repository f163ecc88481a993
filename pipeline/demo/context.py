"""What every phase of the demo runs with: the knobs it reads from the configuration
(:class:`DemoSettings`, read once) and the run's objects (:class:`DemoRun`)."""
from __future__ import annotations

import argparse
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from .. import config
from .reporter import Reporter

if TYPE_CHECKING:
    from distributed import Client

    from ..finalize.controller import Finalizer
    from ..scaling.adaptive import TokenCaptureAdaptive
    from ..store.client import StagingStore

# One finalized step (or phase) as the summary records it: JSON-like figures.
Row = dict[str, Any]


def new_run_id() -> str:
    """A short random id that prefixes this run's step ids (two runs on one cluster differ)."""
    return secrets.token_hex(3)


@dataclass(frozen=True)
class DemoSettings:
    """The configuration the demo reads (``token-capture.*``), read once by :meth:`from_config`."""

    prompt_tokens: int  # demo.prompt-tokens
    tool_tokens: int  # demo.tool-tokens
    vocab_size: int  # policy.vocab-size
    seed: int  # policy.seed
    adaptive_interval_s: float  # demo.adaptive-interval-s
    adaptive_maximum: int | float  # cluster.adaptive-maximum
    dashboard_page: str  # dashboard.page
    scale_bursts: int  # demo.scale-bursts
    scale_verify_share: float  # demo.scale-verify-share
    verify_dominant_share: float  # scaling.verify-dominant-share (the deployment default)
    idle_s: float  # scaling.idle-s
    window_s: float  # scaling.window-s

    @classmethod
    def from_config(cls) -> DemoSettings:
        """The current configuration's values."""
        return cls(
            prompt_tokens=config.get("demo.prompt-tokens"),
            tool_tokens=config.get("demo.tool-tokens"),
            vocab_size=config.get("policy.vocab-size"),
            seed=config.get("policy.seed"),
            adaptive_interval_s=float(config.get("demo.adaptive-interval-s")),
            adaptive_maximum=config.get("cluster.adaptive-maximum"),
            dashboard_page=config.get("dashboard.page"),
            scale_bursts=int(config.get("demo.scale-bursts")),
            scale_verify_share=float(config.get("demo.scale-verify-share")),
            verify_dominant_share=float(config.get("scaling.verify-dominant-share")),
            idle_s=float(config.get("scaling.idle-s")),
            window_s=float(config.get("scaling.window-s")),
        )

    def spec_sizes(self) -> dict[str, int]:
        """The rollout-shape keywords of :func:`tasks.toy.rollouts.make_step_specs`."""
        return dict(tool_tokens=self.tool_tokens, prompt_tokens=self.prompt_tokens, vocab_size=self.vocab_size, seed=self.seed)


@dataclass
class DemoRun:
    """One demo run as its phases see it: the cluster's client, the staging store, the
    finalizer (None for a phase that brings its own), the parsed flags, the reporter,
    the settings, the run id and, on an embedded cluster, its adaptive policy.

    ``args`` may come from the parser or be a bare namespace (tests): flags a phase does
    not strictly need are read with defaults, once, here.
    """

    client: Client
    store: StagingStore
    finalizer: Finalizer | None
    args: argparse.Namespace
    report: Reporter
    settings: DemoSettings = field(default_factory=DemoSettings.from_config)
    run_id: str = ""
    quiet: bool = True
    adaptive: TokenCaptureAdaptive | None = None

    @classmethod
    def build(cls, client: Client, store: StagingStore, finalizer: Finalizer | None, args: argparse.Namespace,
              out: TextIO, *, settings: DemoSettings | None = None, adaptive: TokenCaptureAdaptive | None = None) -> DemoRun:
        """The run of ``args`` (its ``run_id``, or a new one) printing to ``out``."""
        return cls(
            client=client,
            store=store,
            finalizer=finalizer,
            args=args,
            report=Reporter(out),
            settings=settings or DemoSettings.from_config(),
            run_id=getattr(args, "run_id", None) or new_run_id(),
            quiet=getattr(args, "quiet", True),
            adaptive=adaptive,
        )

    @property
    def steps_finalizer(self) -> Finalizer:
        """The run's finalizer, for the phases that submit steps to it (a programming
        error, RuntimeError, when the run was built without one)."""
        if self.finalizer is None:
            raise RuntimeError("this demo phase finalizes on the run's Finalizer; build the DemoRun with one")
        return self.finalizer
