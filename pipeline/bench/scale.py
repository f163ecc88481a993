"""How a finalize step's costs grow with hosts and with work, as counts (and times).

On one :class:`~pipeline.deploy.LocalHosts` cluster grown 1 -> 2 -> 4 hosts (a ``dask
scheduler`` and ``dask worker`` processes, each host on its own loopback address, one
worker per host with the ``storage`` and ``finalize`` roles; a fresh store of one unit
per host for each mode):

- weak scaling: 1, 2 and 4 hosts with the same rollouts per host;
- strong growth: 4 hosts with 1x to 16x those rollouts.

Per step: Dask tasks (from the step's layout), controller <-> scheduler stream messages
(the client's batched stream, both ways), controller CPU seconds per rollout
(``time.process_time()`` around submit + collect), store calls (the units' own put / get /
delete counters, ``store.stats()`` deltas, the step's clear included), bytes crossing hosts
per rollout (measured on the scheduler) and wall time. Each mode runs ``--runs`` times
(medians). A run that does not accept every rollout is a failure: the result then
carries the failures and no ratio, and the command exits 1.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from tasks.finalize.layout import StepLayout

from .common import main, notes
from .profile_args import add_profile_argument, payload_figures, profile_from_args, route_id_bytes
from .finalize import stage_group

if TYPE_CHECKING:
    from distributed import Client

    from tasks.profiles import MoeProfile

    from ..finalize import Finalizer

__all__ = ["add_arguments", "exit_status", "run", "step_tasks"]

ROLLOUTS_PER_GROUP = 8
CALLS, DELTA = 2, 256  # calls per rollout, tokens per call (routed experts: --profile's layers x top-k)
WEAK_HOSTS = (1, 2, 4)
GROWTH_HOSTS = 4
GROWTH = (1, 4, 16)
QUICK_GROWTH = (1, 4)
STORE_NAME = "bench-scale"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli_args import positive_int

    p.add_argument("--rollouts-per-host", type=positive_int, default=16, help="rollouts per host per step (default 16)")
    p.add_argument("--runs", type=positive_int, default=3, help="steps per mode, medians reported (default 3)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (8 rollouts per host, growth 1x and 4x): for tests")
    add_profile_argument(p)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def step_tasks(layout: StepLayout) -> int:
    """The Dask tasks one step's graph holds (:mod:`pipeline.finalize.graph`): per site one
    staging fetch, one routes fetch when it reads routes, one getitem piece per verify
    task and fetch when the site has more than one task; every verify task (the groups
    are assembled by the controller: no task)."""
    n = len(layout.tasks)
    for site in layout.sites:
        fetches = 1 + bool(site.routes.keys)
        n += fetches
        if len(site.tasks) > 1:
            n += len(site.tasks) + sum(p.stop > p.start for p in site.routes.pieces)
    return n


def _stage(store: Any, prefix: str, rollouts: int, rng: np.random.Generator, prof: MoeProfile) -> list[list[Any]]:
    n = -(-rollouts // ROLLOUTS_PER_GROUP)
    return [stage_group(store, f"{prefix}-g{g}", min(ROLLOUTS_PER_GROUP, rollouts - g * ROLLOUTS_PER_GROUP),
                        (CALLS, DELTA, (prof.layers, prof.top_k)), rng, experts=prof.experts) for g in range(n)]


def _store_calls(store: Any) -> int:
    return sum(int(u.get("puts", 0)) + int(u.get("gets", 0)) + int(u.get("deletes", 0)) for u in store.stats())


def _received(client: Client) -> int:
    """Messages the scheduler's stream has sent this client (read outside the timed part)."""
    cid = client.id
    return int(client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.client_comms[cid].message_count))


def _one_step(client: Client, store: Any, fin: Finalizer, prefix: str, rollouts: int, rng: np.random.Generator,
              prof: MoeProfile) -> dict[str, Any]:
    """Stage, then finalize one step of ``rollouts`` (routes of ``prof``) and count what it cost."""
    groups = _stage(store, prefix, rollouts, rng, prof)
    calls0, recv0, sent0 = _store_calls(store), _received(client), client.scheduler_comm.message_count
    cpu0, t0 = time.process_time(), time.perf_counter()
    handle = fin.submit_step(groups)
    step = handle.result(timeout=600)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - t0
    sent = client.scheduler_comm.message_count - sent0
    if handle.clear_future is not None:
        handle.clear_future.result(timeout=120)
    m = step.metrics
    return {
        "tasks": step_tasks(handle.graph.layout),
        "verify_tasks": m["verify_tasks"],
        "messages_sent": sent,
        "messages_received": _received(client) - recv0,
        "controller_cpu_s_per_rollout": cpu / rollouts,
        "store_calls": _store_calls(store) - calls0,
        "cross_host_bytes_per_rollout": m["cross_host_bytes"] / rollouts,
        "cross_host_bytes_planned_per_rollout": m["cross_host_bytes_planned"] / rollouts,
        "collected_bytes_per_rollout": m["collected_bytes"] / rollouts,
        "wall_s": wall,
        "gb_s": rollouts * CALLS * DELTA * _bytes_per_token(prof) / wall / 1e9,  # staged payload finalized
        "accepted": m["accepted"],
        "rollouts": rollouts,
    }


def _cluster() -> Any:
    """A LocalHosts scheduler (hosts are added by :func:`_grow`)."""
    from ..deploy import LocalHosts

    env = {"DASK_TOKEN_CAPTURE__STORE__REPLICAS": "1", "DASK_TOKEN_CAPTURE__STORE__REPORT_INTERVAL_S": "0"}
    cluster = LocalHosts(env=env)
    cluster.start(port=0, dashboard_address="127.0.0.1:0")
    return cluster


def _grow(cluster: Any, hosts: int) -> None:
    """Add hosts, one storage+finalize worker each, until the cluster has ``hosts``."""
    more = hosts - len(cluster.hosts)
    if more > 0:
        cluster.add_hosts([cluster.spec(("storage", "finalize")) for _ in range(more)])


def _mode(client: Any, cluster: Any, hosts: int, sizes: Mapping[str, int], runs: int, say: Callable[[str], None],
          failures: list[str], prof: MoeProfile) -> dict[str, dict[str, Any]]:
    """Every size (label -> rollouts) on the cluster as grown to ``hosts`` hosts, on a store
    of one unit per host made for this mode: medians of ``runs``."""
    from ..finalize import Finalizer
    from ..store.hosted import close_hosted, start_hosted

    out: dict[str, dict[str, Any]] = {}
    name = f"{STORE_NAME}-{hosts}"
    store = start_hosted(client, name, n_units=hosts, workers=cluster.role_workers("storage"))
    try:
        fin = Finalizer(client, store, num_experts=prof.experts)  # the verifier's range: the profile's experts
        rng = np.random.default_rng(hosts)
        _one_step(client, store, fin, f"warm{hosts}", hosts, rng, prof)  # imports, plugin, first graph
        for label, rollouts in sizes.items():
            samples = []
            for k in range(runs):
                s = _one_step(client, store, fin, f"h{hosts}-{label}-{k}", rollouts, rng, prof)
                if s["accepted"] != rollouts:
                    failures.append(f"{hosts} hosts, {label}, run {k}: {s['accepted']} of {rollouts} accepted")
                samples.append(s)
            out[label] = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
            out[label]["hosts"] = hosts
            say(f"{hosts} hosts {label}: {out[label]['tasks']:.0f} tasks, {out[label]['store_calls']:.0f} store calls, "
                f"{out[label]['wall_s']:.3f} s")
    finally:
        close_hosted(client, name)
    return out


def _modes(per_host: int, growth: tuple[int, ...], runs: int, say: Callable[[str], None],
           failures: list[str], prof: MoeProfile) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(weak, growth at 4 hosts): ONE cluster grown 1 -> 2 -> 4 hosts (a cluster per host
    count would start a scheduler and every host again), a fresh store per mode."""
    import dask
    from distributed import Client

    settings = {"token-capture.hosts.nanny": False, "token-capture.hosts.threads-per-worker": 1,
                "token-capture.hosts.workers-per-host": 1, "token-capture.store.replicas": 1}
    weak: dict[str, Any] = {}
    with dask.config.set(settings):
        cluster = _cluster()
        try:
            with Client(cluster.address) as client:
                for hosts in WEAK_HOSTS:
                    _grow(cluster, hosts)
                    if hosts == GROWTH_HOSTS:
                        at4 = _mode(client, cluster, hosts, {f"{g}x": per_host * hosts * g for g in growth}, runs, say, failures, prof)
                        weak[f"{hosts}"] = at4["1x"]
                    else:
                        weak[f"{hosts}"] = _mode(client, cluster, hosts, {"1x": per_host * hosts}, runs, say, failures, prof)["1x"]
        finally:
            cluster.close(graceful=False)
    return weak, at4


def run(args: argparse.Namespace) -> dict[str, Any]:
    say = notes("scale", args.quiet)
    per_host = 8 if args.quick else args.rollouts_per_host
    growth = QUICK_GROWTH if args.quick else GROWTH
    failures: list[str] = []
    prof = profile_from_args(args)
    weak, at4 = _modes(per_host, growth, args.runs, say, failures, prof)
    result: dict[str, Any] = {
        "rollouts_per_host": per_host, "runs": args.runs,
        "shape": {"rollouts_per_group": ROLLOUTS_PER_GROUP, "calls": CALLS, "tokens_per_call": DELTA,
                  "routes": [prof.layers, prof.top_k]},
        **payload_figures(prof, route_id_bytes=route_id_bytes(prof)),
        "weak": weak, "growth": at4, "failures": failures,
    }
    if not failures:
        top = f"{growth[-1]}x"
        result["ratios"] = {
            "weak_tasks_4_vs_1_hosts": weak["4"]["tasks"] / weak["1"]["tasks"],
            "weak_store_calls_4_vs_1_hosts": weak["4"]["store_calls"] / weak["1"]["store_calls"],
            f"growth_tasks_{top}_vs_1x": at4[top]["tasks"] / at4["1x"]["tasks"],
            f"growth_store_calls_{top}_vs_1x": at4[top]["store_calls"] / at4["1x"]["store_calls"],
            f"growth_wall_{top}_vs_1x": at4[top]["wall_s"] / at4["1x"]["wall_s"],
        }
    return result


def _bytes_per_token(prof: MoeProfile) -> int:
    """Bytes of one staged token at ``prof`` (ids, mask, logprob and its expert ids)."""
    return prof.bytes_per_token(route_id_bytes(prof))


def exit_status(result: Mapping[str, object]) -> int:
    """1 when a run failed (then no ratio was printed), else 0."""
    return 1 if result.get("failures") else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.modules[__name__]))
