"""A training controller loop: generate, stage and finalize step after step, with several
finalization steps in flight while the next step's rollouts are generated.

    python examples/controller_loop.py --steps 4 --in-flight 2

Each step: GRPO groups are generated on the Dask workers (rows staged from there, only
token-free receipts come back), then ONE finalization graph per step turns them into padded
torch tensors. The loop does not wait for a step before generating the next one; it collects
the oldest step when ``--in-flight`` steps are pending. The "train" function stands in for
an optimizer step: it consumes the tensors exactly as GRPO would (masked by token_mask and
sample_mask).

A step is acknowledged only after its training step (``result(acknowledge=False)``, then
``acknowledge()``): with ``--journal DIR`` a controller that dies in between leaves the
step's receipts and rows for its replacement's ``Finalizer.resume()``. Rollouts a step
rejected only because their rows could not be read just then (``StepResult.retryable``)
go into the next step again.
"""
from __future__ import annotations

import argparse

import torch

from pipeline import config
from pipeline.capture import submit_generation
from pipeline.cluster import connect, dashboard_url
from pipeline.finalize.controller import Finalizer
from pipeline.store.client import StagingStore
from tasks.toy.rollouts import make_step_specs


def train_on(group) -> float:
    """A stand-in for a GRPO update: group-normalized advantages x masked logprobs."""
    rewards = group.rewards
    keep = group.sample_mask > 0
    adv = torch.zeros_like(rewards)
    if keep.sum() > 1:
        r = rewards[keep]
        adv[keep] = (r - r.mean()) / (r.std() + 1e-6)
    per_token = group.logprobs * group.token_mask
    return float((adv[:, None] * per_token).sum() / group.token_mask.sum().clamp(min=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", help="existing scheduler address (default: embedded LocalCluster)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="GRPO groups per step")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per group")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--in-flight", type=int, default=2, help="finalization steps kept in flight")
    p.add_argument("--journal", help="step journal directory or URL (a replacement controller resumes from it)")
    args = p.parse_args()

    with connect(args.scheduler) as (client, _):
        print("dashboard:", dashboard_url(client, "token-capture"))
        store = StagingStore.start(client)
        finalizer = Finalizer(client, store, journal=args.journal)
        # First a dead predecessor's undelivered steps (each handle keeps its receipts).
        in_flight = finalizer.resume() if args.journal else []
        retry: dict[str, list] = {}  # group id -> receipts of rollouts to finalize again
        for step in range(args.steps):
            groups = make_step_specs(
                f"step{step}-",
                args.groups,
                args.rollouts,
                turns=args.turns,
                tokens_per_turn=config.get("demo.tokens-per-turn"),
                tool_tokens=config.get("demo.tool-tokens"),
                prompt_tokens=config.get("demo.prompt-tokens"),
                vocab_size=config.get("policy.vocab-size"),
            )
            receipts = client.gather(submit_generation(client, store, groups))
            submitted = {**retry, **{g[0].group_id: r for g, r in zip(groups, receipts)}}
            retry = {}
            in_flight.append(finalizer.submit_step(submitted))
            print(f"step {step}: submitted; queue depth {finalizer.queue_depth} groups")
            while len(in_flight) >= args.in_flight or (step == args.steps - 1 and in_flight):
                handle = in_flight.pop(0)
                result = handle.result(acknowledge=False)
                m = result.metrics
                losses = [train_on(g) for g in result.groups.values()]
                handle.acknowledge()  # trained on: its journal record and rows may go now
                again = set(result.retryable)
                for gid, rs in handle.receipts.items():  # as submitted
                    kept = [r for r in rs if r.rollout_id in again]
                    if kept:
                        retry[gid] = kept
                print(
                    f"{result.step_id}: {m['accepted']}/{m['rollouts']} accepted, fetch {m['fetch_ms']:.1f} ms, "
                    f"verify {m['verify_ms']:.1f} ms, mean loss {sum(losses) / len(losses):+.4f}, acknowledged"
                    + (f", {len(again)} rollout(s) to finalize again" if again else "")
                )
        finalizer.drain()
        store.close()


if __name__ == "__main__":
    main()
