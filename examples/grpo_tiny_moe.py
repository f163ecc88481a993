"""GRPO on a tiny MoE model through the capture path, asynchronous (one step ahead), with
and without route replay, side by side.

    pip install -e ".[hf,test]"                      # transformers; matplotlib (test extra)
    python examples/grpo_tiny_moe.py                 # default size: a few minutes on CPU
    python examples/grpo_tiny_moe.py --small --json out.json --plot out.png

A tiny Hugging Face Qwen2-MoE (random weights from a seed) samples GROUPS of rollouts as
Dask tasks on the workers (every call through the capture gate, tagged with its weight
version); the Finalizer verifies them and builds each step's batch; a trainer in this
process takes one GRPO step per batch (a clipped ratio objective with the batch's
``old_logprobs`` and group advantages, AdamW; see grpo_loss) on a learnable task: reward =
the fraction of generated tokens with ids below vocab/8. After each step the trainer publishes
its weights (a WeightSnapshot scattered to the workers) and generation of step k+2 starts
with them while step k+1 (sampled with the weights of version k) is trained on: every
batch after the first is one version stale. Before each update the trainer's logprobs of
the batch (current weights) are compared with the sampler's (the mismatch monitor).

The same loop runs twice: with route replay (the trainer's MoE layers forced to the
experts captured at sampling time) and without (the trainer routes with its own, newer
router). Prints per step the mean reward and the mismatch figures; writes a PNG of both
runs and, with --json, every figure. README, "Training with it", says what each means.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.cluster import connect
from pipeline.engines import hf, hf_weights
from pipeline.finalize.controller import Finalizer
from pipeline.store.client import StagingStore
from tasks.engines.hf_moe import LOGPROB_TOLERANCE, HFMoEEngine
from tasks.engines.route_replay import RoutedForward, batch_logprobs
from tasks.engines.weights import WeightSnapshot
from tasks.mismatch import MismatchReport, mismatch_stats
from tasks.toy.rewards import TargetTokensReward
from tasks.toy.rollouts import make_step_specs

RUNS = {"replay": True, "no_replay": False}
DEFAULT_PLOT = Path(__file__).resolve().parent.parent / "docs" / "img" / "grpo_tiny_moe.png"
# --small: the CI size (one worker, a minute on 2 loaded cores).
SMALL = dict(steps=12, groups=4, rollouts=8, turns=1, tokens_per_turn=12, lr=1e-2)


@dataclass
class StepFigures:
    """One training step of one run: rewards in [0, 1]; the mismatch monitor's figures
    (:class:`tasks.mismatch.MismatchReport`): logprob deltas in nats, fractions in [0, 1]."""

    step: int
    trainer_version: int
    sampler_version: int
    mean_reward: float
    accepted: int
    rollouts: int
    tokens: int
    weight_lag: int
    mean_abs_delta: float
    max_abs_delta: float
    k3_mean: float
    frac_outside_0_1: float
    frac_outside_0_2: float
    route_agreement: float
    # Paired, on this batch and these weights: |trainer - sampler| with the trainer's
    # forward forced to the captured routes, and with its own routes (one of the two is
    # the run's own forward, the other a no-grad forward in the other mode).
    replay_mean_abs_delta: float
    free_mean_abs_delta: float
    loss: float
    step_s: float  # wall time of the step (seconds), of which:
    wait_s: float  # waiting for the step's rollouts (generation not hidden behind training)
    finalize_s: float  # waiting for its verification (the Finalizer's graph, not hidden)
    train_s: float  # batch, trainer forward, monitor, updates, weights published


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheduler", help="existing scheduler address (default: embedded LocalCluster)")
    p.add_argument("--small", action="store_true", help=f"CI size: {SMALL}")
    p.add_argument("--steps", type=int, default=30, help="training steps per run")
    p.add_argument("--groups", type=int, default=8, help="GRPO groups (prompts) per step")
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per group")
    p.add_argument("--turns", type=int, default=2, help="model calls per rollout")
    p.add_argument("--tokens-per-turn", type=int, default=12)
    p.add_argument("--tool-tokens", type=int, default=4, help="tool tokens between turns")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    p.add_argument("--clip", type=float, default=0.2, help="ratio clip epsilon")
    p.add_argument("--objective", choices=["decoupled", "ppo"], default="decoupled",
                   help="clip against this step's weights with a truncated importance weight (decoupled), or against the sampler's logprobs (ppo)")
    p.add_argument("--is-cap", type=float, default=2.0, help="decoupled: importance weight cap")
    p.add_argument("--updates", type=int, default=1, help="optimizer steps per batch")
    p.add_argument("--arch", choices=["qwen2_moe", "mixtral"], default="qwen2_moe")
    p.add_argument("--layers", type=int, default=2, help="decoder layers, all MoE")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer (0: torch's default)")
    p.add_argument("--runs", default="replay,no_replay", help="comma-separated: replay, no_replay")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PATH", default=str(DEFAULT_PLOT), help="PNG to write ('' for none)")
    args = p.parse_args(argv)
    if args.small:
        for k, v in SMALL.items():
            if p.get_default(k) == getattr(args, k):
                setattr(args, k, v)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        p.error(f"--runs: comma-separated names out of {list(RUNS)}, got {args.runs!r}")
    args.runs = runs
    return args


def grpo_loss(logprobs: torch.Tensor, batch: dict[str, torch.Tensor], proximal: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The clipped ratio objective, token-mean over the batch's ``loss_mask``, advantages
    ``token_advantages``: ``-w * min(r * A, clip(r, 1 - e, 1 + e) * A)``.

    ``--objective ppo``: ``r = exp(logprobs - old_logprobs)``, ``w = 1`` (the clip is
    against the SAMPLER's logprobs). ``decoupled`` (default; AReaL's decoupled PPO with
    a truncated importance weight): ``r = exp(logprobs - proximal)`` against this step's
    weights before the update (``proximal``, detached), ``w = min(exp(proximal -
    old_logprobs), --is-cap)`` corrects for the sampler's older weights.
    """
    mask, adv, old = batch["loss_mask"], batch["token_advantages"], batch["old_logprobs"]
    if args.objective == "ppo":
        ratio, weight = torch.exp((logprobs - old) * mask), torch.ones_like(mask)
    else:
        ratio = torch.exp((logprobs - proximal) * mask)
        weight = torch.exp((proximal - old) * mask).clamp(max=args.is_cap)
    per_token = weight * torch.minimum(ratio * adv, ratio.clamp(1 - args.clip, 1 + args.clip) * adv)
    return -(per_token * mask).sum() / mask.sum().clamp(min=1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], fwd: RoutedForward,
               args: argparse.Namespace, replay: bool) -> float:
    """``--updates`` AdamW steps on one batch, the first from ``fwd`` (this version's
    forward); returns the first update's loss."""
    proximal = fwd.token_logprobs.detach()
    losses = []
    for u in range(args.updates):
        if u:
            fwd = batch_logprobs(model, batch, replay=replay)
        loss = grpo_loss(fwd.token_logprobs, batch, proximal, args)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses[0]


def trainer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, result: Any, step: int, args: argparse.Namespace,
                 replay: bool) -> tuple[dict[str, torch.Tensor], MismatchReport, dict[bool, float], float]:
    """The trainer at version ``step`` on one finalized step (``result``): its batch, the
    monitor's report, the paired mean |trainer - sampler| (nats) keyed by replay, and the
    loss. A step whose every rollout was rejected (no loss-mask token, no routes) gets no
    forward and no update: an empty report (still published) and loss 0.0."""
    batch = result.to_batch(routes_dtype=torch.int64, trainer_version=step)
    if not bool(batch["loss_mask"].any()):
        rep = result.report_mismatch(batch["old_logprobs"], weight_version=step, batch=batch)
        return batch, rep, {True: 0.0, False: 0.0}, 0.0
    fwd = batch_logprobs(model, batch, replay=replay)
    # The monitor: this version's logprobs (and routes) of the batch against the sampler's.
    rep = result.report_mismatch(fwd.token_logprobs.detach(), weight_version=step, trainer_routes=fwd.routes, batch=batch)
    with torch.no_grad():  # the other mode, for the paired figures
        other = batch_logprobs(model, batch, replay=not replay)
    # The run's own mode is the monitor's figure; only the other forward is measured here.
    paired = {replay: rep.mean_abs_delta,
              not replay: mismatch_stats(batch["old_logprobs"], other.token_logprobs, batch["loss_mask"]).mean_abs_delta}
    return batch, rep, paired, train_step(model, opt, batch, fwd, args, replay)


def train_run(client: Any, store: Any, args: argparse.Namespace, overrides: dict[str, object], name: str) -> list[StepFigures]:
    """One asynchronous GRPO run (``name`` in RUNS); returns its figures per step.

    Step k trains version k on rollouts sampled with version k - 1 (step 0: version 0):
    generation of step k + 2 starts as soon as version k + 1 is published, and step k + 1
    is verified while step k trains.
    """
    replay = RUNS[name]
    cfg = hf.engine_config(overrides)
    model = HFMoEEngine(cfg).model.train()  # the same seed: the workers' version-0 weights
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    finalizer = Finalizer(client, store, **hf.finalizer_ranges(overrides))
    reward = TargetTokensReward(max(cfg.vocab_size // 8, 1))
    shape = dict(turns=args.turns, tokens_per_turn=args.tokens_per_turn, tool_tokens=args.tool_tokens,
                 prompt_tokens=args.prompt_tokens, vocab_size=cfg.vocab_size, seed=cfg.seed)

    def generate(step: int, weights: Any) -> tuple[list, list]:
        groups = make_step_specs(f"{name.replace('_', '')}-s{step}-", args.groups, args.rollouts, **shape)
        return groups, hf_weights.submit_generation(client, store, groups, weights, overrides=overrides, reward=reward)

    def finalize(step: int) -> tuple[Any, float]:
        """Submit step ``step``'s verification once its rollouts are in (it will train version ``step``)."""
        t = time.perf_counter()
        groups, futures = generating.pop(step)
        receipts = client.gather(futures)
        waited = time.perf_counter() - t
        return finalizer.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)}, trainer_version=step), waited

    weights = hf_weights.publish(client, WeightSnapshot.of(model, 0))
    generating = {k: generate(k, weights) for k in range(min(2, args.steps))}
    handle, wait_s = finalize(0)
    figures: list[StepFigures] = []
    for step in range(args.steps):  # the trainer is at version `step`
        t0 = time.perf_counter()
        current = handle
        result = current.result(acknowledge=False)  # rows kept until trained on
        t1 = time.perf_counter()
        if step + 1 < args.steps:
            handle, next_wait_s = finalize(step + 1)
        t2 = time.perf_counter()
        batch, rep, paired, loss = trainer_step(model, opt, result, step, args, replay)
        current.acknowledge()  # trained on: the step's rows may be cleared now
        if step + 2 < args.steps:
            weights = hf_weights.publish(client, WeightSnapshot.of(model, step + 1))
            generating[step + 2] = generate(step + 2, weights)
        t3 = time.perf_counter()
        accepted = batch["sample_mask"] > 0
        any_accepted = bool(accepted.any())  # a step whose every rollout was rejected: -1 and 0
        f = StepFigures(
            step=step,
            trainer_version=step,
            sampler_version=int(batch["weight_version_newest"][accepted].max()) if any_accepted else -1,
            weight_lag=int(batch["weight_lag"][accepted].max()) if any_accepted else -1,
            mean_reward=float(batch["rewards"][accepted].mean()) if any_accepted else 0.0,
            accepted=int(result.metrics["accepted"]),
            rollouts=int(result.metrics["rollouts"]),
            tokens=int(batch["loss_mask"].sum()),
            loss=loss,
            step_s=t3 - t0 + wait_s,
            wait_s=wait_s,
            finalize_s=t1 - t0,
            train_s=t3 - t2,
            mean_abs_delta=rep.mean_abs_delta,
            max_abs_delta=rep.max_abs_delta,
            k3_mean=rep.k3_mean,
            frac_outside_0_1=rep.frac_outside[0.1],
            frac_outside_0_2=rep.frac_outside[0.2],
            route_agreement=float("nan") if rep.route_agreement is None else rep.route_agreement,  # None: no token
            replay_mean_abs_delta=paired[True],
            free_mean_abs_delta=paired[False],
        )
        wait_s = next_wait_s if step + 1 < args.steps else 0.0
        figures.append(f)
        print(
            f"[{name}] step {step:3d} trainer v{f.trainer_version} sampler v{f.sampler_version} (lag {f.weight_lag}) "
            f"reward {f.mean_reward:.3f} |dlp| mean {f.mean_abs_delta:.2e} max {f.max_abs_delta:.2e} k3 {f.k3_mean:.2e} "
            f"ratio out 0.2 {100 * f.frac_outside_0_2:.1f}% routes {100 * f.route_agreement:.2f}% "
            f"({f.accepted}/{f.rollouts} accepted; wait {f.wait_s:.2f} s, finalize {f.finalize_s:.2f}, train {f.train_s:.2f})",
            flush=True,
        )
    return figures


def summary(figures: list[StepFigures]) -> dict[str, float]:
    """Reward at the start and end (mean of the first / last quarter of the steps), and the
    monitor's figures on the on-policy steps (lag 0: the first) and the stale ones (lag 1)."""
    q = max(len(figures) // 4, 1)
    on = [f for f in figures if f.weight_lag == 0]
    stale = [f for f in figures if f.weight_lag > 0]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    worst = lambda xs, pick: pick(xs) if xs else float("nan")  # noqa: E731
    return {
        "reward_first": mean([f.mean_reward for f in figures[:q]]),
        "reward_last": mean([f.mean_reward for f in figures[-q:]]),
        "on_policy_max_abs_delta": worst([f.max_abs_delta for f in on], max),
        "on_policy_route_agreement": worst([f.route_agreement for f in on], min),
        "stale_mean_abs_delta": mean([f.mean_abs_delta for f in stale]),
        "stale_max_abs_delta": worst([f.max_abs_delta for f in stale], max),
        "stale_k3_mean": mean([f.k3_mean for f in stale]),
        "stale_frac_outside_0_2": mean([f.frac_outside_0_2 for f in stale]),
        "stale_route_agreement": mean([f.route_agreement for f in stale]),
        "stale_route_agreement_min": worst([f.route_agreement for f in stale], min),
        "stale_paired_replay_mean_abs_delta": mean([f.replay_mean_abs_delta for f in stale]),
        "stale_paired_free_mean_abs_delta": mean([f.free_mean_abs_delta for f in stale]),
    }


PANELS = (  # (StepFigures field, title, log scale)
    ("mean_reward", "mean reward (fraction of generated ids < vocab/8)", False),
    ("mean_abs_delta", "mean |trainer - sampler logprob| (nats)", True),
    ("frac_outside_0_2", "tokens with ratio outside [0.8, 1.2]", False),
    ("route_agreement", "route agreement (token x layer expert sets)", False),
)
PAIRED = (("replay_mean_abs_delta", "forced to the captured routes"), ("free_mean_abs_delta", "own routes"))


def plot(runs: dict[str, list[StepFigures]], path: str, title: str) -> None:
    """:data:`PANELS` in the left 2 x 2 grid, one line per run, and the first run's
    :data:`PAIRED` figures on the right (log and linear); writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, (key, label, log) in zip(axes[:, :2].flat, PANELS):
        for name, figures in runs.items():
            ys = [max(getattr(f, key), 1e-9) if log else getattr(f, key) for f in figures]
            ax.plot([f.step for f in figures], ys, marker=".", label=name.replace("_", " "))
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step (step 0 on-policy, later ones one version stale)", fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    name, figures = next(iter(runs.items()))  # the same batches and weights (the first run's), both forwards
    steps, run = [f.step for f in figures], name.replace("_", " ")
    top, bottom = axes[0, 2], axes[1, 2]
    for key, label in PAIRED:
        top.plot(steps, [max(getattr(f, key), 1e-9) for f in figures], marker=".", label=label)
    top.set_title("paired: mean |trainer - sampler logprob| (nats)", fontsize=10)
    top.set_yscale("log")
    top.legend(fontsize=8)
    bottom.plot(steps, [f.free_mean_abs_delta - f.replay_mean_abs_delta for f in figures], marker=".", color="C2")
    bottom.axhline(0.0, color="grey", lw=0.8)
    bottom.set_title("paired: own routes minus forced (nats): what route flips add", fontsize=10)
    for ax in (top, bottom):
        ax.set_xlabel(f"step ({run} run)", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {"arch": args.arch, "layers": args.layers, "hidden": args.hidden}
    cfg = hf.engine_config(overrides)
    print(f"engine: {cfg.arch}, {cfg.layers} layers x {cfg.experts} experts, top-{cfg.top_k}, hidden {cfg.hidden}, "
          f"vocab {cfg.vocab_size}; {args.steps} steps x {args.groups} groups x {args.rollouts} rollouts x "
          f"{args.turns} turns x {args.tokens_per_turn} tokens; lr {args.lr:g}, {args.objective} objective, clip {args.clip:g}", flush=True)
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # 2 cores shared with the workers: one each contends least
    t0 = time.perf_counter()
    runs: dict[str, list[StepFigures]] = {}
    with connect(args.scheduler) as (client, _):
        store = StagingStore.start(client)
        try:
            for name in args.runs:
                runs[name] = train_run(client, store, args, overrides, name)
        finally:
            store.close()
    wall = time.perf_counter() - t0
    sums = {name: summary(f) for name, f in runs.items()}
    for name, s in sums.items():
        print(f"[{name}] reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}; on-policy: max |dlp| "
              f"{s['on_policy_max_abs_delta']:.2e} (tolerance {LOGPROB_TOLERANCE:g}), routes "
              f"{100 * s['on_policy_route_agreement']:.2f}%; stale: mean |dlp| {s['stale_mean_abs_delta']:.2e}, "
              f"max {s['stale_max_abs_delta']:.2e}, k3 {s['stale_k3_mean']:.2e}, ratio outside [0.8, 1.2] "
              f"{100 * s['stale_frac_outside_0_2']:.2f}%, routes {100 * s['stale_route_agreement']:.2f}% "
              f"(min {100 * s['stale_route_agreement_min']:.2f}%); paired on the same batches: mean |dlp| "
              f"{s['stale_paired_replay_mean_abs_delta']:.2e} forced to the captured routes, "
              f"{s['stale_paired_free_mean_abs_delta']:.2e} with its own")
    print(f"wall {wall:.1f} s")
    if args.plot:
        plot(runs, args.plot, f"GRPO on a tiny {cfg.arch} ({cfg.layers} layers x {cfg.experts} experts, top-{cfg.top_k}), "
                              f"sampling one step ahead")
        print(f"plot: {args.plot}")
    if args.json:
        doc = {
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "wall_s": wall,
            "summary": sums,
            "runs": {name: [asdict(f) for f in figs] for name, figs in runs.items()},
        }
        text = json.dumps(doc, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
