"""The mismatch monitor on a finalized step: the trainer's logprobs (and routes) against
the sampler's over the step batch, published as ONE ``token-capture-mismatch`` event.

:func:`report_mismatch` is :meth:`~pipeline.finalize.controller.StepResult.report_mismatch`;
the figures are :func:`tasks.mismatch.mismatch_stats` over the batch's loss-mask tokens,
split by each row's lag ``weight_version - weight_version_oldest`` (versions).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol

from tasks.errors import InvalidInput
from tasks.finalize.step_batch import check_version, weight_lag
from tasks.mismatch import MismatchReport, check_eps, mismatch_stats

from .. import config, events
from . import collect
from .settings import mismatch_eps_setting

EVENT_KIND = "mismatch"
# What the monitor reads of a step batch.
BATCH_FIELDS = ("old_logprobs", "loss_mask", "has_routes", "weight_version_oldest")


class FinalizedStep(Protocol):
    """What the monitor reads of a :class:`~pipeline.finalize.controller.StepResult`."""

    step_id: str
    client: Any  # distributed.Client | None
    mismatch_eps: tuple[float, ...] | None

    def to_batch(self, **kwargs: Any) -> Any: ...


def mismatch_event(step_id: str, weight_version: int, report: MismatchReport) -> dict[str, Any]:
    """The ``token-capture-mismatch`` event of ``report`` (:data:`pipeline.events.MISMATCH`)."""
    return {"kind": EVENT_KIND, "step_id": step_id, "weight_version": int(weight_version), **report.figures(),
            "by_lag": {str(lag): sub.figures() for lag, sub in sorted(report.by_lag.items())}}


def report_mismatch(
    step: FinalizedStep, trainer_logprobs: Any, *, weight_version: int, trainer_routes: Any = None,
    eps: Any = None, batch: Mapping[str, Any] | None = None,
) -> MismatchReport:
    """Compare ``trainer_logprobs`` ([B, T], the trainer's logprobs of the step batch's
    tokens, aligned as ``old_logprobs``: ``[b, t]`` is the logprob of ``input_ids[b, t]``,
    not of the next token) with the sampler's, publish the event and return the report.

    ``weight_version``: the trainer's weight version (lags are measured from it);
    ``trainer_routes``: the trainer's routed experts [B, T, L, K] (route agreement over
    the rows that carry sampler routes); ``eps``: ratio bounds (default the finalizer's
    ``monitor.mismatch-eps``); ``batch``: this step's ``to_batch()`` as the trainer
    already holds it (any ``trainer_version``; lags are taken from its
    ``weight_version_oldest``), so it is not built a second time. Bad input raises
    :class:`tasks.errors.InvalidInput` naming the field; nothing is published then.
    """
    check_version(weight_version, "report_mismatch: weight_version")
    if eps is not None:
        eps = check_eps(eps, "report_mismatch: eps")
    elif step.mismatch_eps is not None:
        eps = step.mismatch_eps
    else:  # a StepResult made by hand: the config now
        eps = mismatch_eps_setting(config.get("monitor.mismatch-eps"))
    if batch is None:
        batch = step.to_batch()
    missing = [k for k in BATCH_FIELDS if k not in batch.keys()]
    if missing:
        raise InvalidInput(f"report_mismatch: batch lacks {', '.join(missing)} (pass the step's to_batch())")
    lags = weight_lag(weight_version, batch["weight_version_oldest"])  # as to_batch(trainer_version=weight_version) has it
    sampler_routes = batch.get("routed_experts")
    if trainer_routes is not None and sampler_routes is None:
        raise InvalidInput("trainer_routes given, but no row of the step carries sampler routes to compare them with")
    report = mismatch_stats(
        batch["old_logprobs"], trainer_logprobs, batch["loss_mask"], weight_lag=lags, eps=eps,
        sampler_routes=sampler_routes if trainer_routes is not None else None, trainer_routes=trainer_routes,
        route_rows=batch["has_routes"],
    )
    event = mismatch_event(step.step_id, weight_version, report)
    if step.client is not None:
        collect.publish(step.client, events.MISMATCH, [event])
    else:
        events.publish(events.MISMATCH, event)
    return report
