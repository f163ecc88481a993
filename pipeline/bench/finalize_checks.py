"""The output checks of ``bench finalize``: every run accepts every rollout, and every mode
of a round finalizes the same tokens, its sampled groups bit-identical to the graph's. A
check that fails adds one line to ``failures`` (the run then reports ``ok: false``).
A sampled group is kept as its :class:`GroupPrint` (every tensor's dtype, shape and a
digest of its bytes), not its tensors: a round of five modes would otherwise hold five
copies of a group (hundreds of MB at the qwen3-moe profile) and crowd the controller's
receive pool while the next mode runs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import blake3

if TYPE_CHECKING:
    from tasks.finalize.assemble import FinalizedGroup

    from .finalize_modes import ModeRun

# The training tensors of a FinalizedGroup compared bit for bit.
TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts", "has_routes")


@dataclass(frozen=True)
class GroupPrint:
    """What :func:`group_diff` compares of a FinalizedGroup: its rows' ids and statuses and,
    per tensor of :data:`TENSORS`, ``(dtype, shape, BLAKE3 of its bytes)`` (None: absent)."""

    rollout_ids: tuple[str, ...]
    status: tuple[str, ...]
    tensors: tuple[tuple[str, tuple[int, ...], bytes] | None, ...]


def fingerprint(group: FinalizedGroup | GroupPrint | None) -> GroupPrint | None:
    """``group``'s :class:`GroupPrint` (a print or None as it is)."""
    if group is None or isinstance(group, GroupPrint):
        return group
    tensors = []
    for name in TENSORS:
        t = getattr(group, name)
        if t is None:
            tensors.append(None)
            continue
        a = t.contiguous().numpy()
        tensors.append((str(t.dtype), tuple(t.shape), blake3.blake3(memoryview(a).cast("B")).digest()))
    return GroupPrint(tuple(group.rollout_ids), tuple(group.status), tuple(tensors))


def group_diff(a: FinalizedGroup | GroupPrint | None, b: FinalizedGroup | GroupPrint | None) -> str | None:
    """``None`` when two FinalizedGroups (or their prints) hold bit-identical training rows,
    else what differs."""
    a, b = fingerprint(a), fingerprint(b)
    if a is None or b is None:
        return "group missing"
    if a.rollout_ids != b.rollout_ids:
        return "rollout_ids differ"
    if a.status != b.status:
        return f"status {list(a.status)} vs {list(b.status)}"
    for name, x, y in zip(TENSORS, a.tensors, b.tensors):
        if (x is None) != (y is None):
            return f"{name}: present in one only"
        if x != y:
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
