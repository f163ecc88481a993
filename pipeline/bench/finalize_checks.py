"""The output checks of ``bench finalize``: every run accepts every rollout, and every mode
of a round finalizes the same tokens, its sampled groups bit-identical to the graph's. A
check that fails adds one line to ``failures`` (the run then reports ``ok: false``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from tasks.finalize.assemble import FinalizedGroup

    from .finalize_modes import ModeRun

# The training tensors of a FinalizedGroup compared bit for bit.
TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts", "has_routes")


def group_diff(a: FinalizedGroup | None, b: FinalizedGroup | None) -> str | None:
    """``None`` when two FinalizedGroups hold bit-identical training rows, else what differs."""
    if a is None or b is None:
        return "group missing"
    if list(a.rollout_ids) != list(b.rollout_ids):
        return "rollout_ids differ"
    if list(a.status) != list(b.status):
        return f"status {a.status} vs {b.status}"
    for name in TENSORS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return f"{name}: present in one only"
        if x is not None and (x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape) or x.numpy().tobytes() != y.numpy().tobytes()):
            return f"{name} differs"
    return None


def check_all_accepted(what: str, run: ModeRun, expected: int, failures: list[str]) -> None:
    """Every one of the ``expected`` rollouts accepted, none rejected (``what``: which
    workload, mode and run, for the failure line)."""
    if run["accepted"] != expected or run["rejected"]:
        failures.append(f"{what}: {expected - run['accepted']} of {expected} rollouts rejected: {run['rejected']}")


def check_same_output(name: str, k: int, round_runs: Mapping[str, ModeRun], failures: list[str]) -> None:
    """Round ``k`` of workload ``name``: every mode's tokens equal the reference mode's
    (``graph``, else the first that ran) and its sampled groups are bit-identical to it."""
    ref_mode = "graph" if "graph" in round_runs else next(iter(round_runs), None)
    for mode, r in round_runs.items():
        if mode == ref_mode:
            continue
        ref = round_runs[ref_mode]
        if r["tokens"] != ref["tokens"]:
            failures.append(f"{name} {mode} run {k}: {r['tokens']} tokens, {ref_mode} {ref['tokens']}")
        for gid, g in r["sample"].items():
            diff = group_diff(ref["sample"].get(gid), g)
            if diff:
                failures.append(f"{name} {mode} run {k}: group {gid} not bit-identical to {ref_mode}: {diff}")
