"""Test helper: a finalized step as plain tensors (what a resubmission must reproduce) and
a bit-for-bit comparison of two of them.

``step_tensors`` keeps every field of every group (tensors, rollout ids, statuses,
details) and every field of ``StepResult.to_batch()``; not the metrics (timings, step
ids: they describe the run, they are not training data). Plain dicts, lists, strings and
tensors only, so ``torch.save`` / ``torch.load(weights_only=True)`` carry it between
processes.
"""
from __future__ import annotations

from typing import Any

import torch

GROUP_TENSORS = (
    "input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask",
    "sample_mask", "rewards", "routed_experts", "has_routes",
)
GROUP_LISTS = ("rollout_ids", "status", "details")


def step_tensors(step: Any) -> dict[str, Any]:
    """``{"groups": {group id: {field: value}}, "batch": to_batch()}`` of a StepResult."""
    groups = {
        gid: {**{n: getattr(g, n) for n in GROUP_TENSORS}, **{n: list(getattr(g, n)) for n in GROUP_LISTS}}
        for gid, g in step.groups.items()
    }
    return {"groups": groups, "batch": dict(step.to_batch())}


def _same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{where}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"
    assert torch.equal(a, b), f"{where}: values differ"
    # torch.equal takes -0.0 for 0.0 (and never NaN for NaN): the bytes say bit for bit.
    assert a.contiguous().view(torch.uint8).numpy().tobytes() == b.contiguous().view(torch.uint8).numpy().tobytes(), f"{where}: bits differ"


def assert_identical(a: Any, b: Any, where: str = "step") -> None:
    """``a`` and ``b`` (nested dicts/lists of tensors, strings, numbers, None) are equal,
    tensors bit for bit (dtype, shape, every byte); the message names the first field
    that differs."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{where}: {type(a).__name__} != {type(b).__name__}"
        _same_tensor(a, b, where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b) if isinstance(b, dict) else b!r}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def n_fields(tensors: dict[str, Any]) -> int:
    """How many tensor fields ``tensors`` holds (so a test can say it compared some)."""
    if isinstance(tensors, torch.Tensor):
        return 1
    if isinstance(tensors, dict):
        return sum(n_fields(v) for v in tensors.values())
    return 0
