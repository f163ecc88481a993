"""A real MoE model as the engine: multi-turn agentic rollouts of a tiny Hugging Face
Qwen2-MoE (or Mixtral) model, captured, finalized, and checked against one teacher-forced
forward per training row.

    pip install -e ".[hf]"
    python examples/hf_moe_rollouts.py --groups 2 --rollouts 4 --turns 3

The model is built from a config with random weights (nothing is downloaded). Rollouts
are generated and staged as Dask tasks on the workers (KV-cached decoding, every call
through the capture gate), ONE finalization graph turns them into padded tensors, then a
fidelity task per group re-runs each accepted row in one forward and compares the routed
experts and logprobs with the captured ones. Prints route agreement (%), max and mean
|delta logprob| (nats) and the tokens compared; exits 1 if the check fails.
"""
from __future__ import annotations

import argparse
import sys

from pipeline import config
from pipeline.cluster import connect
from pipeline.engines import hf
from pipeline.finalize.controller import Finalizer
from pipeline.store.client import StagingStore
from tasks.engines.hf_moe import LOGPROB_TOLERANCE, FidelityReport
from tasks.toy.rollouts import make_step_specs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", help="existing scheduler address (default: embedded LocalCluster)")
    p.add_argument("--groups", type=int, default=2, help="GRPO groups")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per group")
    p.add_argument("--turns", type=int, default=3, help="model calls per rollout")
    p.add_argument("--tokens-per-turn", type=int, default=16)
    p.add_argument("--arch", choices=["qwen2_moe", "mixtral"], default="qwen2_moe")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE (L)")
    p.add_argument("--hidden", type=int, default=64)
    args = p.parse_args()
    overrides = {"arch": args.arch, "layers": args.layers, "hidden": args.hidden}
    cfg = hf.engine_config(overrides)
    print(f"engine: {cfg.arch}, {cfg.layers} layers x {cfg.experts} experts, top-{cfg.top_k}, hidden {cfg.hidden}, vocab {cfg.vocab_size}")

    with connect(args.scheduler) as (client, _):
        store = StagingStore.start(client)
        try:
            groups = make_step_specs(
                "hf-",
                args.groups,
                args.rollouts,
                turns=args.turns,
                tokens_per_turn=args.tokens_per_turn,
                tool_tokens=config.get("demo.tool-tokens"),
                prompt_tokens=config.get("demo.prompt-tokens"),
                vocab_size=cfg.vocab_size,
            )
            receipts = client.gather(hf.submit_generation(client, store, groups, overrides=overrides))
            finalizer = Finalizer(client, store, **hf.finalizer_ranges(overrides))
            handle = finalizer.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)})
            fidelity = hf.submit_fidelity(client, handle.group_futures, overrides)
            result = handle.result()
            m = result.metrics
            print(f"{result.step_id}: {m['accepted']}/{m['rollouts']} accepted, rejected {result.rejected or 'none'}")
            report = sum(client.gather(fidelity).values(), FidelityReport())
        finally:
            store.close()
    print(f"route agreement: {report.route_agreement:.2f}% ({report.route_matches}/{report.route_entries} token x layer x k entries)")
    print(f"context route agreement: {report.context_route_agreement:.2f}% ({report.context_route_entries} entries)")
    print(f"max |dlogprob|: {report.max_abs_logprob_diff:.3g} nats (tolerance {LOGPROB_TOLERANCE:g})")
    print(f"mean |dlogprob|: {report.mean_abs_logprob_diff:.3g} nats")
    print(f"tokens compared: {report.tokens} generated tokens in {report.rows} rows")
    ok = report.ok() and m["accepted"] == m["rollouts"]
    print("fidelity:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
