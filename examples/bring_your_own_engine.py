"""Bring your own engine: a generation process outside this project stages its calls
through the capture client; the controller finalizes the receipts it sends back.

    python examples/bring_your_own_engine.py --groups 2 --rollouts 4 --turns 3

The controller (this process) starts an embedded LocalCluster on 127.0.0.1 and a
StagingStore, publishes the store as a Dask named dataset, and launches the engine as a
SEPARATE plain Python process (this file with ``--engine``): not a Dask worker, not a
project actor. The engine connects with ``CaptureClient.connect(scheduler_address)``,
samples multi-turn rollouts with its own numpy "model" (one thread per GRPO group),
stages every call, and writes the token-free receipts to a msgpack file. One call is
deliberately bad (a token id outside the vocabulary): the capture gate refuses it with
``InvalidRecord`` and the engine carries on. The controller then finalizes the receipts
in one step and prints accepted/rejected counts and a ``summary: {json}`` line.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import msgpack
import numpy as np

# ---- the engine: an RL team's own generation process ---------------------------------


class NumpyEngine:
    """A stand-in for vLLM / SGLang / HF generate: samples tokens from random logits and
    returns each token's log-probability and (MoE) routed experts [n, L, K]."""

    def __init__(self, vocab_size: int, layers: int, top_k: int, experts: int, seed: int):
        self.vocab_size, self.layers, self.top_k, self.experts = vocab_size, layers, top_k, experts
        self.rng = np.random.default_rng(seed)

    def generate(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        logits = self.rng.standard_normal((n_tokens, self.vocab_size))
        logp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
        cdf = np.cumsum(np.exp(logp), axis=1)
        u = self.rng.random((n_tokens, 1)) * cdf[:, -1:]
        ids = np.minimum((u > cdf).sum(axis=1), self.vocab_size - 1)
        lp = np.minimum(logp[np.arange(n_tokens), ids], 0.0).astype(np.float32)
        return ids.astype(np.int64), lp, self.route(n_tokens)

    def route(self, n_tokens: int) -> np.ndarray:
        # Any integer dtype: the capture gate checks the ids and stages them in one byte
        # each when the rollout was opened with num_experts <= 256 (else int16).
        return self.rng.integers(0, self.experts, (n_tokens, self.layers, self.top_k))


def run_rollout(cap, engine: NumpyEngine, rollout_id: str, group_id: str, args, bad: bool) -> tuple[dict, dict | None]:
    """One multi-turn rollout: call t's delta = context tokens (prompt or tool output,
    mask 0) + generated tokens (mask 1). Returns the receipt dict and the bad call's report."""
    from tasks.errors import InvalidRecord

    rc = cap.open(rollout_id, group_id, vocab_size=engine.vocab_size, num_experts=engine.experts)
    report = None
    generated = []
    parent = None
    for turn in range(args.turns):
        n_ctx = args.prompt_tokens if turn == 0 else args.tool_tokens
        context = engine.rng.integers(0, engine.vocab_size, n_ctx)
        ids, lp, routes = engine.generate(args.tokens_per_turn)
        token_ids = np.concatenate([context, ids])
        mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(len(ids), np.float32)])
        logprobs = np.concatenate([np.zeros(n_ctx, np.float32), lp])
        routed = np.concatenate([engine.route(n_ctx), routes])
        if bad and turn == 1:
            # ---- DELIBERATELY BAD CALL (for the demonstration) ------------------------
            # A token id outside the vocabulary: the gate refuses the call before anything
            # is staged; the rollout's other calls and every other rollout are unaffected.
            broken = token_ids.copy()
            broken[-1] = engine.vocab_size
            try:
                rc.stage("bad-call", parent, broken, mask, logprobs, routed_experts=routed)
            except InvalidRecord as e:
                report = {"rollout_id": rollout_id, "reason": e.reason, "detail": e.detail}
                print(f"[engine] deliberately bad call refused by the gate: {e.reason}: {e.detail}", file=sys.stderr)
        call = f"turn-{turn}"
        rc.stage(call, parent, token_ids, mask, logprobs, routed_experts=routed, weight_version=args.weight_version)
        generated.append(ids)
        parent = call
    reward = float(np.mean(np.concatenate(generated) % 2 == 0))
    return rc.finish(reward).to_dict(), report


def engine_main(scheduler: str, out_path: str, args) -> int:
    """The engine process: connect, generate and stage, write receipts to ``out_path``."""
    from distributed import get_worker

    from pipeline import config
    from pipeline.client import CaptureClient

    try:
        get_worker()
        is_worker = True
    except ValueError:
        is_worker = False
    shape = dict(vocab_size=int(config.get("policy.vocab-size")), layers=int(config.get("policy.layers")),
                 top_k=int(config.get("policy.top-k")), experts=int(config.get("policy.experts")))

    def one_group(g: int) -> tuple[list[dict], list[dict]]:
        engine = NumpyEngine(**shape, seed=1000 + g)  # one engine (and rng) per thread
        receipts, reports = [], []
        for r in range(args.rollouts):
            receipt, report = run_rollout(cap, engine, f"byoe-g{g}-r{r}", f"byoe-g{g}", args, bad=(g == 0 and r == 0))
            receipts.append(receipt)
            reports += [report] if report else []
        return receipts, reports

    with CaptureClient.connect(scheduler) as cap:
        with ThreadPoolExecutor(max_workers=args.groups) as pool:  # engine threads stage concurrently
            results = list(pool.map(one_group, range(args.groups)))
        cap.flush()
        stats = cap.stats()
    out = {
        "pid": os.getpid(),
        "is_dask_worker": is_worker,
        "receipts": [rec for recs, _ in results for rec in recs],
        "bad_calls": [rep for _, reps in results for rep in reps],
        "stats": stats,
    }
    with open(out_path, "wb") as f:
        f.write(msgpack.packb(out, use_bin_type=True))
    print(f"[engine pid {os.getpid()}] staged {stats['rows']} rows in {stats['puts']} puts, refused {stats['refused']}", file=sys.stderr)
    return 0


# ---- the controller: the training side ------------------------------------------------


def controller_main(args) -> int:
    from distributed import Client

    from pipeline.client import publish_store, unpublish_store
    from pipeline.cluster import local_cluster
    from pipeline.finalize.controller import Finalizer
    from pipeline.store.client import StagingStore
    from tasks.receipts import Receipt

    with local_cluster(n_workers=2, threads_per_worker=1) as cluster, Client(cluster) as client:
        store = StagingStore.start(client)
        try:
            publish_store(client, store)
            with tempfile.TemporaryDirectory(prefix="byoe-") as tmp:
                out_path = os.path.join(tmp, "receipts.msgpack")
                cmd = [sys.executable, os.path.abspath(__file__), "--engine", cluster.scheduler_address, "--out", out_path,
                       *_engine_flags(args)]
                print(f"scheduler: {cluster.scheduler_address}; launching the engine process ...", flush=True)
                subprocess.run(cmd, check=True, timeout=args.engine_timeout_s)
                with open(out_path, "rb") as f:
                    sent = msgpack.unpackb(f.read(), raw=False)
            receipts = [Receipt.from_dict(d) for d in sent["receipts"]]
            groups: dict[str, list[Receipt]] = {}
            for r in receipts:
                groups.setdefault(r.group_id, []).append(r)
            result = Finalizer(client, store).submit_step(groups).result()
            for gid, g in result.groups.items():
                print(f"{gid}: {int(g.sample_mask.sum())}/{len(g)} accepted, statuses {g.status}")
            m = result.metrics
            print(f"{result.step_id}: {m['accepted']}/{m['rollouts']} accepted, rejected {result.rejected}")
            worker_pids = sorted(client.run(os.getpid).values())
            summary = {
                "accepted": m["accepted"], "rollouts": m["rollouts"], "rejected": result.rejected,
                "engine_pid": sent["pid"], "engine_is_dask_worker": sent["is_dask_worker"],
                "controller_pid": os.getpid(), "worker_pids": worker_pids,
                "bad_calls": sent["bad_calls"], "engine_stats": sent["stats"],
            }
            print("summary: " + json.dumps(summary), flush=True)
            unpublish_store(client)
        finally:
            store.close()
    return 0


def _engine_flags(args) -> list[str]:
    return [f"--groups={args.groups}", f"--rollouts={args.rollouts}", f"--turns={args.turns}",
            f"--tokens-per-turn={args.tokens_per_turn}", f"--prompt-tokens={args.prompt_tokens}",
            f"--tool-tokens={args.tool_tokens}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=2, help="GRPO groups (one engine thread each)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per group")
    p.add_argument("--turns", type=int, default=3, help="model calls per rollout")
    p.add_argument("--tokens-per-turn", type=int, default=32, help="tokens each call generates")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens (mask 0) of the first call")
    p.add_argument("--tool-tokens", type=int, default=8, help="tool tokens (mask 0) before each later call")
    p.add_argument("--weight-version", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--engine-timeout-s", type=float, default=300.0, help="how long the engine process may run (s)")
    p.add_argument("--engine", metavar="SCHEDULER", help=argparse.SUPPRESS)  # internal: run as the engine
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.engine:
        return engine_main(args.engine, args.out, args)
    return controller_main(args)


if __name__ == "__main__":
    sys.exit(main())
