"""The test oracle: finalized rows compared, bit for bit, with an uninterrupted run.

A cut-and-resumed (or faulted) run must finalize exactly the rows the same rollouts give
when generated in one go (:func:`tasks.toy.rollouts.generate_rollouts`);
:func:`reference_mismatches` names every field that differs. Used by the tests, the demo
and the examples.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from tasks.toy.rollouts import GeneratedRollout

if TYPE_CHECKING:  # torch: only for the annotation
    from tasks.finalize.assemble import FinalizedGroup

TENSOR_FIELDS = ("input_ids", "logprobs", "token_mask", "routed_experts", "input_lengths", "prompt_lengths", "rewards")


def reference_mismatches(groups: Mapping[str, FinalizedGroup], reference: Sequence[GeneratedRollout]) -> dict[str, list[str]]:
    """Compare finalized groups with uninterrupted rollouts (:func:`tasks.toy.rollouts.generate_rollouts`).

    For every rollout of ``groups`` (``{group_id: FinalizedGroup}``), the finalized row
    must be ``ok`` and equal, bit for bit, the linearized reference chain: ids, logprobs
    (bytes), mask, routes, lengths (tokens), prompt length, reward; padding must be zeros.
    Returns ``{rollout_id: [mismatching fields]}`` for the rollouts that differ (empty:
    all matched). A reference rollout absent from ``groups`` is reported ``missing``.
    """
    ref = {g.spec.rollout_id: g for g in reference}
    bad: dict[str, list[str]] = {}
    seen = set()
    for group in groups.values():
        for i, rid in enumerate(group.rollout_ids):
            seen.add(rid)
            want = ref.get(rid)
            if want is None:
                bad[rid] = ["unexpected"]
                continue
            diffs = [] if group.status[i] == "ok" else [f"status={group.status[i]}"]
            ids = np.concatenate([r.token_ids for r in want.rows])
            exp = {
                "input_ids": ids,
                "logprobs": np.concatenate([r.logprobs for r in want.rows]),
                "token_mask": np.concatenate([r.token_mask for r in want.rows]),
            }
            if want.rows[0].routed_experts is not None:
                exp["routed_experts"] = np.concatenate([r.routed_experts for r in want.rows])
            n = len(ids)
            if int(group.input_lengths[i]) != n:
                diffs.append("input_lengths")
            if int(group.prompt_lengths[i]) != int(want.rows[0].delta_len - np.count_nonzero(want.rows[0].token_mask)):
                diffs.append("prompt_lengths")
            if np.float32(want.receipt.reward).tobytes() != group.rewards[i].numpy().tobytes():
                diffs.append("rewards")
            for name, arr in exp.items():
                t = getattr(group, name)
                got = None if t is None else t[i].numpy()
                if got is None or got[:n].tobytes() != np.ascontiguousarray(arr).astype(got.dtype).tobytes() or got[n:].any():
                    diffs.append(name)
            if diffs:
                bad[rid] = diffs
    for rid in ref:
        if rid not in seen:
            bad[rid] = ["missing"]
    return bad

