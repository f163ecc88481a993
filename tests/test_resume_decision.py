"""The resume-or-regenerate decision (tasks.cut.resume.decide), one test per branch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tasks.cut.prefix import PrefixVerdict, ResumePrefix
from tasks.cut.receipt import COMPLETED, CONTROL_DEADLINE, DURABLE_PREFIX, CallAck, prefix_digest
from tasks.cut.resume import (
    CONTEXT_MISMATCH,
    NOT_CUT,
    REGENERATE,
    RESTORE,
    RESUME,
    RESUME_FAILED,
    UNUSABLE_PREFIX,
    ResumeDecision,
    decide,
)

CALL = ("r-0", "call-1")
CONTEXT = np.array([5, 6, 7], np.int64)  # the tool output the call carries
GENERATED = np.array([11, 12], np.int64)


def durable_ack() -> CallAck:
    ids = np.concatenate([CONTEXT, GENERATED])
    return CallAck(*CALL, DURABLE_PREFIX, staging_keys=("__cut__/ck/r-0/call-1/0",), prefix_tokens=len(ids),
                   prefix_digest=prefix_digest(ids))


def usable(token_ids: np.ndarray | None = None, context_tokens: int = len(CONTEXT)) -> PrefixVerdict:
    ids = np.concatenate([CONTEXT, GENERATED]) if token_ids is None else np.asarray(token_ids, np.int64)
    mask = (np.arange(len(ids)) >= context_tokens).astype(np.float32)
    prefix = ResumePrefix(
        rollout_id=CALL[0], model_call_id=CALL[1], parent_call_id="call-0", weight_version=0,
        keys=("__cut__/ck/r-0/call-1/0",), chunk_lengths=(len(ids),), token_ids=ids, token_mask=mask,
        logprobs=np.zeros(len(ids), np.float32), routed_experts=None, context_tokens=context_tokens,
        prefix_digest=prefix_digest(ids),
    )
    return PrefixVerdict(True, prefix=prefix)


def test_call_the_cut_never_listed_regenerates_not_cut():
    d = decide(None)
    assert d == ResumeDecision(REGENERATE, NOT_CUT)
    assert d.regenerate


def test_durable_failure_regenerates_with_the_cut_reason():
    d = decide(CallAck.failure(CALL, CONTROL_DEADLINE, "deadline passed"))
    assert d.action == REGENERATE and d.reason == CONTROL_DEADLINE


def test_ack_without_reason_regenerates_with_its_status():
    d = decide(CallAck(*CALL, COMPLETED, total_tokens=9))
    assert d.action == REGENERATE and d.reason == COMPLETED


def test_durable_prefix_not_read_yet_asks_for_a_restore():
    d = decide(durable_ack())
    assert d == ResumeDecision(RESTORE)
    assert not d.regenerate and d.reason is None


def test_unusable_prefix_regenerates_with_the_verdict_reason():
    d = decide(durable_ack(), PrefixVerdict.unusable("corrupt_digest", "recomputed digest differs"), CONTEXT)
    assert d.action == REGENERATE and d.reason == "corrupt_digest"


def test_unusable_prefix_without_reason_regenerates_unusable_prefix():
    d = decide(durable_ack(), PrefixVerdict(False), CONTEXT)
    assert d.action == REGENERATE and d.reason == UNUSABLE_PREFIX


def test_prefix_whose_context_is_another_calls_regenerates_context_mismatch():
    other = np.concatenate([[5, 6, 8], GENERATED])  # same length, one context token differs
    d = decide(durable_ack(), usable(other), CONTEXT)
    assert d.action == REGENERATE and d.reason == CONTEXT_MISMATCH


def test_prefix_carrying_a_longer_context_regenerates_context_mismatch():
    # Same leading tokens, but the prefix says its context is 4 tokens long.
    d = decide(durable_ack(), usable(context_tokens=len(CONTEXT) + 1), CONTEXT)
    assert d.action == REGENERATE and d.reason == CONTEXT_MISMATCH


def test_usable_prefix_with_the_calls_context_resumes():
    d = decide(durable_ack(), usable(), CONTEXT.tolist())  # any int sequence is a context
    assert d == ResumeDecision(RESUME, None, len(CONTEXT) + len(GENERATED))
    assert not d.regenerate


def test_worker_accepting_the_resume_keeps_it_resumed():
    d = decide(durable_ack(), usable(), CONTEXT, resumed=True)
    assert d.action == RESUME and d.prefix_tokens == 5


def test_worker_refusing_the_resume_regenerates_resume_failed():
    d = decide(durable_ack(), usable(), CONTEXT, resumed=False)
    assert d.action == REGENERATE and d.reason == RESUME_FAILED and d.prefix_tokens == 0


def test_the_cut_ack_is_decisive_whatever_comes_after():
    # A call the cut did not seal never resumes, even with a usable prefix at hand.
    d = decide(CallAck.failure(CALL, CONTROL_DEADLINE), usable(), CONTEXT, resumed=True)
    assert d.action == REGENERATE and d.reason == CONTROL_DEADLINE


def test_usable_prefix_without_a_context_is_refused():
    with pytest.raises(ValueError, match="context"):
        decide(durable_ack(), usable())


def test_decision_is_frozen():
    d = decide(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.reason = "other"  # type: ignore[misc]
