"""A finalized step as the trainer gets it: :class:`StepResult` (its groups and metrics,
one training batch on demand, the mismatch report against the trainer's logprobs)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from tasks.finalize.step_batch import step_batch

from . import timing
from .kept_rows import kept_rollouts

if TYPE_CHECKING:
    import torch
    from distributed import Client
    from tensordict import TensorDict

    from tasks.finalize.assemble import FinalizedGroup
    from tasks.mismatch import MismatchReport


@dataclass
class StepResult:
    """A finalized step: ``groups`` (group id -> FinalizedGroup, submission order) and the
    step's ``metrics`` (the ``kind: "step"`` event of :mod:`pipeline.finalize.timing`).
    ``client`` (where :meth:`report_mismatch` publishes; None: the default client) and
    ``mismatch_eps`` (its default bounds; None: ``monitor.mismatch-eps`` read then) are
    the finalizer's."""

    step_id: str
    groups: dict[str, FinalizedGroup]
    metrics: timing.StepMetrics
    client: Client | None = field(default=None, repr=False, compare=False)
    mismatch_eps: tuple[float, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def rejected(self) -> dict[str, int]:
        """Rejected rollouts per reason (internal errors not included)."""
        return dict(self.metrics.get("rejected", {}))

    @property
    def internal_errors(self) -> int:
        """Rollouts the verifier failed on (bugs, logged on the workers; not rejections)."""
        return int(self.metrics.get("internal_errors", 0))

    @property
    def retryable(self) -> list[str]:
        """Rollout ids (submission order) rejected only because the store could not read
        their rows when the step ran (``missing_staging_row`` / ``missing_routes`` with a
        unit unreachable: both copies' units at once, say) or that the verifier failed on:
        their rows were kept (not cleared), so submitting their receipts again may
        finalize them."""
        kept = kept_rollouts(self.groups.values())
        return [rid for g in self.groups.values() for rid in g.rollout_ids if rid in kept]

    def to_batch(self, *, as_tensordict: bool = False, **kwargs: float | int | bool | torch.dtype | None) -> dict[str, torch.Tensor] | TensorDict:
        """The step as ONE training batch: :func:`tasks.finalize.step_batch.step_batch` over
        the groups in submission order (``kwargs``: ``eps``, ``pad_id``, ``normalize_std``,
        ``routes_dtype``: e.g. ``torch.int64``, default as stored; ``trainer_version``: adds
        ``weight_lag`` = trainer_version - weight_version_oldest per row). Rows the batch
        rejects itself (routes of another [L, K] than the step's, a lag past int64) are
        listed by :func:`tasks.finalize.step_batch.batch_rejections`.

        A ``dict[str, torch.Tensor]``, or with ``as_tensordict`` a ``tensordict.TensorDict``
        of ``batch_size=[B]`` (needs the ``tensordict`` extra).
        """
        batch = step_batch(list(self.groups.values()), **kwargs)
        if not as_tensordict:
            return batch
        try:
            from tensordict import TensorDict
        except ImportError as e:
            raise ModuleNotFoundError(
                "StepResult.to_batch(as_tensordict=True) needs the 'tensordict' package: "
                "pip install tensordict (or the project's 'tensordict' extra)",
                name="tensordict",
            ) from e
        return TensorDict(batch, batch_size=[int(batch["input_ids"].shape[0])])

    def report_mismatch(self, trainer_logprobs: Any, *, weight_version: int, trainer_routes: Any = None,
                        eps: Any = None, batch: Mapping[str, Any] | None = None) -> MismatchReport:
        """The trainer's logprobs ([B, T] over :meth:`to_batch`'s rows) against the
        sampler's: publishes ONE ``token-capture-mismatch`` event and returns the
        :class:`tasks.mismatch.MismatchReport` (lag per row: ``weight_version -
        weight_version_oldest``); ``batch``: this step's :meth:`to_batch` if the trainer
        already built it (not built again); see :func:`pipeline.finalize.monitor.report_mismatch`."""
        from .monitor import report_mismatch

        return report_mismatch(self, trainer_logprobs, weight_version=weight_version, trainer_routes=trainer_routes, eps=eps,
                               batch=batch)
