"""Soak: many training steps through the embedded cluster; the store must stay bounded.

Generates each step's GRPO groups with the toy engine on the workers
(:func:`pipeline.capture.submit_generation`), finalizes them with
:class:`~pipeline.finalize.Finalizer` (several steps in flight, ``finalize.clear-staged``
on), and samples, after step ``--first-step`` is collected and after the last step
collected at the same point of the pipeline: store bytes (used + pinned) and rows, the
scheduler's task count, controller and worker RSS (bytes, psutil). Exits 1 when a step
fails or a target is missed: store bytes last/first <= ``--max-store-growth``, every
worker's RSS last/first <= ``--max-rss-growth``. Progress on stderr, JSON on stdout.

``--profile`` sets the toy policy's routing shape (layers, top-k, experts) for the run, so
the staged rows carry a real MoE model's routes; the JSON reports the staged tokens,
``bytes_per_token`` and ``gb_s`` (staged payload over the run's wall) beside the steps.

    python -m pipeline bench soak --json
    python -m pipeline bench soak --json --profile qwen3-moe --steps 60
    python -m pipeline bench soak --json --steps 400 --in-flight 3
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Callable, Mapping, TypedDict

from .. import config
from .common import add_cluster_arguments, bench_client, main, notes
from .profile_args import add_profile_argument, payload_figures, profile_from_args, rounded_gb_s, route_id_bytes

if TYPE_CHECKING:
    from distributed import Client, Future, Scheduler

    from tasks.toy.rollouts import RolloutSpec

    from ..finalize.controller import Finalizer, StepHandle
    from ..store.client import StagingStore


class Sample(TypedDict):
    """One measurement of the cluster (:func:`sample`): store, scheduler, RSS (bytes)."""

    store_bytes: int  # used + pinned, every unit
    store_rows: int
    store_spilled_bytes: int
    store_answer_buffer_bytes: int
    store_pending_deletes: int
    store_delete_calls: int
    scheduler_tasks: int
    scheduler_events: int
    scheduler_task_groups: int
    scheduler_task_prefixes: int
    controller_rss: int
    worker_rss: dict[str, int]  # by worker address


class SoakResult(TypedDict, total=False):
    """What ``bench soak`` reports: the steps, the first and last samples, the verdict."""

    steps: int
    failed_steps: dict[str, str]  # step id -> its error
    rejected_rollouts: int
    first_sample_after_step: int
    store_bytes_first: int
    store_bytes_last: int
    store_growth_ratio: float
    store_rows_first: int
    store_rows_last: int
    scheduler_tasks_first: int
    scheduler_tasks_last: int
    scheduler_events_first: int
    scheduler_events_last: int
    scheduler_task_groups_last: int
    scheduler_task_prefixes_last: int
    controller_rss_first: int
    controller_rss_last: int
    worker_rss_first: dict[str, int]
    worker_rss_last: dict[str, int]
    store_spilled_bytes_last: int
    store_answer_buffer_bytes_last: int
    store_delete_calls: int
    worker_rss_growth: dict[str, float]
    controller_rss_growth: float
    wall_s: float
    tokens: int  # tokens of every collected step (the finalized batches)
    tokens_per_s: float  # tokens / wall_s
    profile: str
    layers: int
    top_k: int
    experts: int
    route_id_bytes: int  # bytes per expert id as the engine staged them
    bytes_per_token: int
    gb_s: float  # tokens_per_s * bytes_per_token / 1e9
    store_rows_end: int
    store_bytes_end: int
    targets: dict[str, float]
    missed: list[str]
    ok: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench soak``."""
    p.add_argument("--steps", type=int, default=200, help="training steps to finalize (default 200, at least --first-step + 1)")
    p.add_argument("--first-step", type=int, default=10, help="step after which the first sample is taken (default 10)")
    p.add_argument("--groups", type=int, default=2, help="GRPO groups per step (default 2)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per group (default 4)")
    p.add_argument("--turns", type=int, default=2, help="model calls per rollout (default 2)")
    p.add_argument("--tokens-per-turn", type=int, default=8, help="tokens each call generates (default 8)")
    p.add_argument("--in-flight", type=int, default=config.get("demo.steps-in-flight"), help="finalization steps in flight (default %(default)s)")
    p.add_argument("--max-store-growth", type=float, default=1.1, help="target: store bytes last / first at most this (default 1.1)")
    p.add_argument("--max-rss-growth", type=float, default=1.2, help="target: each worker's RSS last / first at most this (default 1.2)")
    add_profile_argument(p)
    p.add_argument("--hidden", type=int, default=None,
                   help="toy policy hidden width (default: policy.hidden at the toy profile, 4 at a bigger one; it sets "
                   "the engine's compute only, not the rows: at qwen3-moe a step generates in ~46 s at 32, ~0.8 s at 4)")
    add_cluster_arguments(p)


def policy_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The toy policy's routing shape for ``--profile`` (``token-capture.policy`` keys) and
    its hidden width (``--hidden``; 4 at a profile bigger than toy, whose dense forward
    over every expert would otherwise dominate the soak)."""
    prof = profile_from_args(args)
    out = {"layers": prof.layers, "top-k": prof.top_k, "experts": prof.experts}
    hidden = args.hidden if args.hidden is not None else (None if prof.name == "toy" else 4)
    if hidden is not None:
        out["hidden"] = hidden
    return out


def _rss() -> int:
    """This process's resident set size (bytes)."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _scheduler_counts(dask_scheduler: Scheduler) -> dict[str, int]:
    """Tasks the scheduler holds, and events it keeps (all topics)."""
    return {
        "tasks": len(dask_scheduler.tasks),
        "events": sum(len(events) for events in dask_scheduler.get_events().values()),
        "task_groups": len(getattr(dask_scheduler, "task_groups", ())),
        "task_prefixes": len(getattr(dask_scheduler, "task_prefixes", ())),
    }


def sample(client: Client, store: StagingStore) -> Sample:
    """One measurement of the cluster: store, scheduler, RSS (bytes)."""
    stats = store.stats()
    sched = client.run_on_scheduler(_scheduler_counts)
    return {
        "store_bytes": sum(s["used_bytes"] + s["pinned_bytes"] for s in stats),
        "store_rows": sum(s["rows"] for s in stats),
        "store_spilled_bytes": sum(s["spilled_bytes"] for s in stats),
        "store_answer_buffer_bytes": sum(s["answer_buffer_bytes"] for s in stats),
        "store_pending_deletes": sum(s.get("pending_deletes", 0) for s in stats),
        "store_delete_calls": sum(s["deletes"] for s in stats),
        "scheduler_tasks": sched["tasks"],
        "scheduler_events": sched["events"],
        "scheduler_task_groups": sched["task_groups"],
        "scheduler_task_prefixes": sched["task_prefixes"],
        "controller_rss": _rss(),
        "worker_rss": {addr: int(v) for addr, v in sorted(client.run(_rss).items())},
    }


def run(args: argparse.Namespace) -> SoakResult:
    from tasks.toy.rollouts import make_step_specs

    from ..capture import submit_generation
    from ..finalize.controller import Finalizer
    from ..store.client import StagingStore

    if args.steps <= args.first_step or args.first_step < 1 or args.in_flight < 1:
        raise SystemExit("need --steps > --first-step >= 1 and --in-flight >= 1")
    say = notes("soak", args.quiet)
    result: SoakResult = {"steps": 0}
    with bench_client(args) as client:
        store = StagingStore.start(client)
        try:
            prof, overrides = profile_from_args(args), policy_overrides(args)  # once per run
            # The verifier's expert range is the profile's (its default is policy.experts).
            fin = Finalizer(client, store, num_experts=overrides["experts"])
            say(f"{args.steps} steps of {args.groups} x {args.rollouts} rollouts ({args.turns} calls of "
                f"{args.tokens_per_turn} tokens, {prof.name} routes), {args.in_flight} in flight; "
                f"clear-staged={config.get('finalize.clear-staged')}")
            t0 = time.perf_counter()
            result.update(_soak(client, store, fin, args, overrides, make_step_specs, submit_generation, say))
            result["wall_s"] = round(time.perf_counter() - t0, 2)
            id_bytes = route_id_bytes(prof)  # the policy's experts are the profile's
            result["route_id_bytes"] = id_bytes
            result["tokens_per_s"] = round(result["tokens"] / result["wall_s"], 1)
            result.update(payload_figures(prof, route_id_bytes=id_bytes, tokens_per_s=result["tokens_per_s"]))
            result["gb_s"] = rounded_gb_s(result["gb_s"])
            end = sample(client, store)
            result["store_rows_end"] = end["store_rows"]  # every step collected and cleared
            result["store_bytes_end"] = end["store_bytes"]
        finally:
            store.close()
    result.update(_verdict(result, args))
    say(f"store bytes {result['store_bytes_first']} -> {result['store_bytes_last']} "
        f"(x{result['store_growth_ratio']:.3f}); ok={result['ok']}")
    return result


def _soak(client: Client, store: StagingStore, fin: Finalizer, args: argparse.Namespace, overrides: dict[str, int],
          make_step_specs: Callable[..., list[list[RolloutSpec]]], submit_generation: Callable[..., list[Future]],
          say: Callable[[str], None]) -> SoakResult:
    pending: list[StepHandle] = []
    first: Sample | None = None
    last: Sample | None = None
    failed: dict[str, str] = {}
    rejected = collected = tokens = 0
    for s in range(args.steps):
        groups = make_step_specs(
            f"k{s}-", args.groups, args.rollouts, turns=args.turns, tokens_per_turn=args.tokens_per_turn,
            tool_tokens=config.get("demo.tool-tokens"), prompt_tokens=config.get("demo.prompt-tokens"),
            vocab_size=config.get("policy.vocab-size"), seed=config.get("policy.seed"),
        )
        receipts = client.gather(submit_generation(client, store, groups, policy_overrides=overrides))
        pending.append(fin.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)}, step_id=f"soak-{s}"))
        while len(pending) >= args.in_flight or (pending and s == args.steps - 1):
            steady = len(pending) >= args.in_flight  # the same point of the pipeline every time
            handle = pending.pop(0)
            try:
                step = handle.result()
                rejected += step.metrics["rollouts"] - step.metrics["accepted"]
                tokens += int(step.metrics["tokens"])
                if handle.clear_future is not None:
                    handle.clear_future.result()  # sample with this step's rows gone
            except Exception as e:  # noqa: BLE001 - a failed step fails the soak, reported below
                failed[handle.step_id] = f"{type(e).__name__}: {e}"
            collected += 1
            del handle
            # Sample at the first step, every 25th and the last steady one only: each sample
            # is itself work on the cluster (client.run logs a record on every worker).
            final = s == args.steps - 1
            if steady and (collected == args.first_step or (collected > args.first_step and (collected % 25 == 0 or final))):
                last = sample(client, store)
                if first is None:
                    first = last
                if collected % 25 == 0 or first is last:
                    say(f"step {collected}: store {last['store_rows']} rows / {last['store_bytes']} bytes, "
                        f"{last['scheduler_tasks']} scheduler tasks, workers RSS "
                        f"{[v >> 20 for v in last['worker_rss'].values()]} MiB")
    assert first is not None and last is not None
    out: SoakResult = {
        "steps": collected,
        "tokens": tokens,
        "failed_steps": failed,
        "rejected_rollouts": rejected,
        "first_sample_after_step": args.first_step,
        "store_bytes_first": first["store_bytes"],
        "store_bytes_last": last["store_bytes"],
        "store_growth_ratio": last["store_bytes"] / max(first["store_bytes"], 1),
        "store_rows_first": first["store_rows"],
        "store_rows_last": last["store_rows"],
        "scheduler_tasks_first": first["scheduler_tasks"],
        "scheduler_tasks_last": last["scheduler_tasks"],
        "scheduler_events_first": first["scheduler_events"],
        "scheduler_events_last": last["scheduler_events"],
        "scheduler_task_groups_last": last["scheduler_task_groups"],
        "scheduler_task_prefixes_last": last["scheduler_task_prefixes"],
        "controller_rss_first": first["controller_rss"],
        "controller_rss_last": last["controller_rss"],
        "worker_rss_first": first["worker_rss"],
        "worker_rss_last": last["worker_rss"],
        "store_spilled_bytes_last": last["store_spilled_bytes"],
        "store_answer_buffer_bytes_last": last["store_answer_buffer_bytes"],
        "store_delete_calls": last["store_delete_calls"],
    }
    out["worker_rss_growth"] = {
        w: out["worker_rss_last"][w] / max(rss, 1) for w, rss in out["worker_rss_first"].items() if w in out["worker_rss_last"]
    }
    out["controller_rss_growth"] = out["controller_rss_last"] / max(out["controller_rss_first"], 1)
    return out


def _verdict(result: SoakResult, args: argparse.Namespace) -> SoakResult:
    missed = []
    if result["failed_steps"]:
        missed.append(f"{len(result['failed_steps'])} steps failed")
    if result["rejected_rollouts"]:
        missed.append(f"{result['rejected_rollouts']} rollouts rejected")
    if result["store_growth_ratio"] > args.max_store_growth:
        missed.append(f"store_growth_ratio {result['store_growth_ratio']:.3f} > {args.max_store_growth}")
    for w, g in result["worker_rss_growth"].items():
        if g > args.max_rss_growth:
            missed.append(f"worker {w} RSS growth {g:.3f} > {args.max_rss_growth}")
    return {"targets": {"store_growth_ratio": args.max_store_growth, "worker_rss_growth": args.max_rss_growth},
            "missed": missed, "ok": not missed}


def exit_status(result: Mapping[str, object]) -> int:
    """The CLI's exit status: 0 when every step succeeded and every target was met."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
