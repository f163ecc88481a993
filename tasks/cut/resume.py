"""Resume or regenerate: what to do with one in-flight call after a restore. Pure.

:func:`decide` takes what is known so far about the call (its cut ack, then the verdict
on its restored prefix and the context the call must carry, then whether the worker
accepted the resume) and returns a frozen :class:`ResumeDecision`: read the prefix,
resume from it, or regenerate from scratch with a reason. The driver's recovery does the
I/O around it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .prefix import PrefixVerdict
from .receipt import CallAck

# Actions.
RESTORE = "restore"  # the cut sealed a prefix: read and verify it, then decide again
RESUME = "resume"  # continue the call from its verified prefix
REGENERATE = "regenerate"  # start the call over (sampling is keyed, the tokens come back identical)
ACTIONS = (RESTORE, RESUME, REGENERATE)

# Reasons to regenerate beyond the cut's durable_failure reasons and the prefix verdicts'.
NOT_CUT = "not_cut"  # started after the cut (or the cut never listed it)
UNUSABLE_PREFIX = "unusable_prefix"  # the verdict was unusable but named no reason
CONTEXT_MISMATCH = "context_mismatch"  # the prefix's carried context is not this call's
RESUME_FAILED = "resume_failed"  # the worker refused the verified prefix


@dataclass(frozen=True)
class ResumeDecision:
    """``action`` (:data:`ACTIONS`); ``reason`` set when it is :data:`REGENERATE`;
    ``prefix_tokens``: tokens not regenerated when it is :data:`RESUME` (tokens)."""

    action: str
    reason: str | None = None
    prefix_tokens: int = 0

    @property
    def regenerate(self) -> bool:
        return self.action == REGENERATE


def _regenerate(reason: str) -> ResumeDecision:
    return ResumeDecision(REGENERATE, reason)


def decide(
    ack: CallAck | None,
    verdict: PrefixVerdict | None = None,
    context: np.ndarray | None = None,
    resumed: bool | None = None,
) -> ResumeDecision:
    """The decision for one call, from what is known so far; first matching rule wins.

    ``ack``: the call's cut ack (None: the cut did not list it); ``verdict``: the restored
    prefix's (None: not read yet); ``context``: the tokens the call carries (prompt or tool
    output), which the prefix must start with (required with a usable ``verdict``);
    ``resumed``: whether the worker accepted the resume (None: not tried yet).
    """
    if ack is None:
        return _regenerate(NOT_CUT)
    if not ack.durable:
        return _regenerate(ack.reason or ack.status)
    if verdict is None:
        return ResumeDecision(RESTORE)
    if not verdict.usable:
        return _regenerate(verdict.reason or UNUSABLE_PREFIX)
    if context is None:
        raise ValueError("a usable prefix is checked against the call's context: pass context")
    p = verdict.prefix
    ctx = np.asarray(context, np.int64)
    if p.context_tokens != len(ctx) or not np.array_equal(p.token_ids[: len(ctx)], ctx):
        return _regenerate(CONTEXT_MISMATCH)
    if resumed is False:
        return _regenerate(RESUME_FAILED)
    return ResumeDecision(RESUME, prefix_tokens=p.tokens)
