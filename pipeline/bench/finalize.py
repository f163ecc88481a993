"""Finalization: per-rollout fetch + per-token verify vs the one-union-fetch graph.

Three workloads (short: 8 x 1 call x 256 tokens; agentic: 8 x 16 calls x 1,024 tokens;
long: 8 x 8 turns x 4,096 tokens; the last two routed at ``--profile``'s shape) are staged
once and finalized by every mode side by side, ``--repeats`` times (interleaved; speedups
on medians): ``baseline`` (one task per group, ONE fetch PER ROLLOUT, the per-token verify
as published: :mod:`tasks.finalize.reference`, the tests' oracle), ``rollout_fetch_vec``
(the same fetches, vectorized verify), ``union_fetch_token`` (ONE fetch per step, the
per-token verify), ``graph`` (:mod:`pipeline.finalize` on rows hashed with
``capture.digest``, BLAKE3 by default) and ``graph_sha256`` (the same graph on a SHA-256
copy of the rows, which the first three read too: the seed's path keeps SHA-256). Then
``--in-flight N``: agentic steps with N in flight, against the hashing and transfer floors
(:mod:`pipeline.bench.finalize_inflight`). Every run's output is checked (every rollout
accepted, the same tokens, sampled groups bit-identical to the graph's); any failure:
``ok: false``, ``failures``, no speedups, exit 1. Figures: docs/performance.md.

    python -m pipeline bench finalize --json
    python -m pipeline bench finalize --json --profile qwen3-moe
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from tasks.digests import DIGEST_SHA256, algorithm_of, scheme
from tasks.gate import CaptureGate
from tasks.hashing import DIGEST_VERSION
from tasks.packed import pack_rows
from tasks.profiles import DEFAULT_PROFILE, MoeProfile, profile
from tasks.receipts import Receipt

from .. import config
from ..actors import workers_now
from .common import add_cluster_arguments, bench_client, main, notes
from .finalize_checks import TENSORS, check_all_accepted, check_same_output, fingerprint, group_diff
from .finalize_figures import WorkloadShape, drop_speedups, workload_figures
from .finalize_modes import (
    EXPERTS,
    MODES,
    SHA256_MODES,
    VOCAB,
    ModeRun,
    per_rollout_group,
    per_token_verify_rollout,
    run_baseline,
    run_graph,
    run_mode,
    run_per_rollout,
    run_union_per_token,
    union_fetch,
    union_group,
)
from .finalize_hash_streams import hash_streams
from .finalize_inflight import cores, floors, in_flight_figures, loopback_recv, sustained_run
from .finalize_profile import default_groups, payload, workload_shape
from .finalize_verify_vs_hash import Fetched, VerifyVsHash, fetch_step, verify_vs_hash
from .profile_args import add_profile_argument, profile_from_args

if TYPE_CHECKING:
    from distributed import Client

    from tasks.schema import StagedRow

    from ..store import StagingStore

__all__ = [
    "EXPERTS", "MODES", "TARGETS", "TENSORS", "VOCAB", "WORKLOADS", "add_arguments", "exit_status", "group_diff",
    "make_rollout", "per_rollout_group", "per_token_verify_rollout", "run", "run_baseline", "run_graph", "run_mode",
    "run_per_rollout", "run_union_per_token", "stage_workload", "union_fetch", "union_group", "verify_vs_hash",
]

WORKLOADS: dict[str, WorkloadShape] = {
    # name: (rollouts per group, calls per rollout, tokens per delta, routes (L, K) or None);
    # a routed workload's routes follow --profile (toy: 4 x 2 over 8 experts)
    "short": (8, 1, 256, None),
    "agentic": (8, 16, 1024, (4, 2)),
    "long": (8, 8, 4096, (4, 2)),  # long-context agentic: 8 turns, 32,768 tokens per rollout
}
DEFAULT_GROUPS = {"short": 32, "agentic": 8, "long": 4}  # at the toy profile (bigger ones: about toy's bytes)
TARGETS: dict[str, dict[str, float]] = {
    "agentic": {"speedup": 6.0, "fetch_calls_per_site_graph": 2, "graph_verify_vs_hash": 2.0, "in_flight_vs_hashing_floor": 0.5},
    "short": {"speedup": 1.0},
    "long": {},
}
IN_FLIGHT_STEPS = 16  # steps per --in-flight run


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline bench finalize``."""
    from ..cli_args import non_negative_int, positive_int

    p.add_argument("--short-groups", type=non_negative_int, default=32, help="groups in the short workload (default 32; 0 skips it)")
    p.add_argument("--agentic-groups", type=non_negative_int, default=None,
                   help="groups in the agentic workload (default 8 at the toy profile, about its bytes at a bigger one; 0 skips it)")
    p.add_argument("--long-groups", type=non_negative_int, default=None,
                   help="groups in the long-context workload, 8 turns x 4,096 tokens (default 4 at the toy profile, "
                   "about its bytes at a bigger one; 0 skips it)")
    p.add_argument("--in-flight", type=non_negative_int, default=4,
                   help=f"sustained mode: {IN_FLIGHT_STEPS} agentic steps with this many in flight, per repeat (default 4; 0 skips it)")
    p.add_argument("--groups-per-step", type=non_negative_int, default=0, help="groups per graph step (default 0: all in one step)")
    p.add_argument("--workers", type=positive_int, default=2, help="LocalCluster workers (default 2, one thread each)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed of the staged data")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per mode and workload, interleaved (default 3; min and median reported)")
    p.add_argument("--graph-assembly", choices=("controller", "cluster"), default="controller",
                   help="where the graph modes assemble the groups: the controller (default) or the cluster "
                   "(StepHandle.group_futures: one assemble task per group, the layout before the controller did it)")
    add_profile_argument(p)
    add_cluster_arguments(p)


# ---- staged data -------------------------------------------------------------------------


def make_rollout(rng: np.random.Generator, rid: str, gid: str, calls: int, delta: int,
                 routes: tuple[int, int] | None, digest_version: int = DIGEST_VERSION,
                 experts: int = EXPERTS) -> tuple[list[StagedRow], Receipt]:
    """One rollout through the capture gate: a chain of ``calls`` deltas of ``delta`` tokens
    (the root: a quarter prompt; later calls: a quarter tool tokens; the rest generated),
    hashed with ``digest_version``; routed expert ids in ``[0, experts)``."""
    gate = CaptureGate(rid, vocab_size=VOCAB, num_experts=experts, group_id=gid, digest_version=digest_version)
    n_ctx = delta // 4
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(delta - n_ctx, np.float32)])
    rows, parent = [], None
    for c in range(calls):
        ids = rng.integers(0, VOCAB, delta)
        lps = np.where(mask > 0, -rng.random(delta, dtype=np.float32) - 0.01, 0.0).astype(np.float32)
        # Ids as drawn: the gate stages them in the encoding EXPERTS calls for (uint8 up to 256).
        chosen = None if routes is None else rng.integers(0, experts, (delta,) + tuple(routes))
        rows.append(gate.stage_call(f"c{c}", parent, ids, mask, lps, routed_experts=chosen))
        parent = f"c{c}"
    return rows, gate.receipt(float(rng.random()))


def stage_group(store: StagingStore, group_id: str, rollouts: int, shape: tuple[int, int, tuple[int, int] | None],
                rng: np.random.Generator, digest_version: int = DIGEST_VERSION, experts: int = EXPERTS) -> list[Receipt]:
    """Stage one group of ``rollouts`` rollouts (``shape``: calls, new tokens per call,
    routes) hashed with ``digest_version`` in ONE put; their receipts. Raises naming the
    group if a row is refused."""
    calls, delta, routes = shape
    rows, receipts = [], []
    for r in range(rollouts):
        rr, rec = make_rollout(rng, f"{group_id}-r{r}", group_id, calls, delta, routes, digest_version=digest_version,
                               experts=experts)
        rows += rr
        receipts.append(rec)
    res = store.put_many(pack_rows(rows))
    if res.failed:
        raise RuntimeError(f"staging group {group_id} failed: {dict(list(res.failed.items())[:3])}")
    return receipts


def stage_workload(store: StagingStore, name: str, n_groups: int, rng: np.random.Generator,
                   progress: Callable[[str], None], digest_version: int = DIGEST_VERSION,
                   prof: MoeProfile | None = None) -> list[list[Receipt]]:
    """Stage ``n_groups`` groups of workload ``name`` (one put per group, hashed with
    ``digest_version``; routed rows at ``prof``'s routes, toy's without one); their receipts."""
    prof = prof or profile(DEFAULT_PROFILE)
    rollouts, calls, delta, routes = workload_shape(WORKLOADS[name], prof)
    groups = []
    for g in range(n_groups):
        groups.append(stage_group(store, f"{name}-g{g}", rollouts, (calls, delta, routes), rng, digest_version, prof.experts))
        if (g + 1) % max(1, n_groups // 4) == 0 or g + 1 == n_groups:
            progress(f"staged {name} {g + 1}/{n_groups}")
    return groups


# ---- the run -----------------------------------------------------------------------------


@dataclass
class _Session:
    """What every timed run of one benchmark run shares."""

    client: Client
    store: StagingStore
    groups_per_step: int  # groups per step (0: all in one)
    say: Callable[[str], None]
    failures: list[str]  # one line per failed run or check
    sha256_store: StagingStore  # the SHA-256 copy of every workload (same tokens, own units)
    sha256_groups: dict[str, list[list[Receipt]]]  # workload -> its SHA-256 copy's receipts
    experts: int = EXPERTS  # routed expert ids lie in [0, experts) (the profile's)
    on_cluster: bool = False  # the graph modes assemble the groups on the cluster (--graph-assembly cluster)

    def data(self, mode: str, name: str, groups: list[list[Receipt]]) -> tuple[StagingStore, list[list[Receipt]]]:
        """The store and groups ``mode`` finalizes: the SHA-256 copy for :data:`SHA256_MODES`."""
        return (self.sha256_store, self.sha256_groups[name]) if mode in SHA256_MODES else (self.store, groups)


def _sample_groups(n: int) -> list[int]:
    """Indexes of the groups whose output is compared bit for bit: the first and the last."""
    return sorted({0, n - 1})


def _warm_up(s: _Session, staged: dict[str, list[list[Receipt]]]) -> None:
    """Untimed (imports, first-call costs on workers): one rollout per mode and workload is
    enough to load every module on both workers."""
    for name, groups in staged.items():
        for mode in MODES:
            store, data = s.data(mode, name, groups)
            run_mode(mode, s.client, store, [data[0][:1], data[-1][:1]], 0, experts=s.experts)


def _round(s: _Session, k: int, name: str, groups: list[list[Receipt]]) -> dict[str, ModeRun]:
    """Round ``k`` on workload ``name``: every mode once, in an order rotated by ``k`` (who
    goes first changes), each run checked; the runs that did not raise, by mode."""
    keep = _sample_groups(len(groups))
    order = MODES[k % len(MODES):] + MODES[: k % len(MODES)]  # interleaved, rotating who goes first
    if k % 2:  # the two graphs trade places every other round: neither always follows the other
        order = tuple({"graph": "graph_sha256", "graph_sha256": "graph"}.get(m, m) for m in order)
    this: dict[str, ModeRun] = {}
    for mode in order:
        try:
            r = run_mode(mode, s.client, *s.data(mode, name, groups), s.groups_per_step, keep, experts=s.experts,
                         on_cluster=s.on_cluster)
        except Exception as e:  # noqa: BLE001 - a failed run is reported, then fails the command
            s.failures.append(f"{name} {mode} run {k}: {type(e).__name__}: {e}")
            s.say(f"{name}: {mode} run {k} FAILED: {type(e).__name__}: {e}")
            continue
        s.say(f"{name}: {mode:18s} run {k}: {r['wall_s']:.3f}s")
        r["sample"] = {gid: fingerprint(g) for gid, g in r["sample"].items()}  # kept as prints, not tensors
        check_all_accepted(f"{name} {mode} run {k}", r, sum(len(g) for g in groups), s.failures)
        this[mode] = r
    # Output checks: the same tokens, and sampled groups bit-identical to the graph's.
    check_same_output(name, k, this, s.failures)
    return this


def _timed_rounds(s: _Session, staged: dict[str, list[list[Receipt]]], repeats: int) -> dict[str, dict[str, list[ModeRun]]]:
    """``repeats`` rounds over every workload; workload -> mode -> its runs, in order."""
    runs: dict[str, dict[str, list[ModeRun]]] = {name: {m: [] for m in MODES} for name in staged}
    for k in range(repeats):
        for name, groups in staged.items():
            for mode, r in _round(s, k, name, groups).items():
                runs[name][mode].append(r)
    return runs


def _in_flight(s: _Session, groups: list[list[Receipt]], vh: VerifyVsHash | None, in_flight: int, repeats: int,
               hash_streams_ms: float | None = None) -> dict[str, object]:
    """``repeats`` sustained runs of :data:`IN_FLIGHT_STEPS` steps of ``groups``, ``in_flight``
    at a time, against the hashing, transfer and mandatory floors measured now (the last
    from the step's ``hash_streams_ms``); a step that does not accept every rollout is a
    failure."""
    runs = []
    for k in range(repeats):
        r = sustained_run(s.client, s.store, groups, in_flight=in_flight, steps=IN_FLIGHT_STEPS,
                          vocab_size=VOCAB, num_experts=s.experts, on_cluster=s.on_cluster)
        s.say(f"agentic in flight {in_flight} run {k}: {r['tokens_per_s'] / 1e6:.2f} M tokens/s")
        if r["accepted"] != r["rollouts"] or r["rollouts"] != IN_FLIGHT_STEPS * sum(len(g) for g in groups):
            s.failures.append(f"agentic in-flight run {k}: {r['rollouts'] - r['accepted']} of {r['rollouts']} rollouts rejected")
        runs.append(r)
    if vh is None:
        return {"runs": len(runs), "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in runs]}
    floor = floors(vh, runs[0]["tokens"] // IN_FLIGHT_STEPS, runs[0]["collected_bytes_per_token"],
                   loopback_recv(), cores(), hash_streams_ms)
    return in_flight_figures(runs, floor, TARGETS["agentic"].get("in_flight_vs_hashing_floor"))


def _workload_out(s: _Session, name: str, groups: list[list[Receipt]], runs: dict[str, list[ModeRun]], prof: MoeProfile,
                  algorithm: str, in_flight: int, repeats: int) -> dict[str, object]:
    """One workload's figures: every mode's, verify vs hash, its payload per token and,
    for the agentic workload with ``in_flight``, the sustained mode's."""
    try:  # the rows both measurements below read, fetched once
        fetched: Fetched | None = fetch_step(s.store, groups)
    except Exception as e:  # noqa: BLE001
        s.failures.append(f"{name} fetch for verify_vs_hash and hash_streams: {type(e).__name__}: {e}")
        fetched = None
    vh = None
    if fetched is not None:
        try:
            vh = verify_vs_hash(fetched, algorithm=algorithm, num_experts=s.experts)
        except Exception as e:  # noqa: BLE001
            s.failures.append(f"{name} verify_vs_hash: {type(e).__name__}: {e}")
    shape = workload_shape(WORKLOADS[name], prof)
    out = workload_figures(shape, TARGETS.get(name, {}), len(groups), runs, vh)
    if fetched is not None:
        try:  # the verifier's three hash streams alone, against one pass (CPU): a floor under verify_vs_hash
            fields = scheme(config.digest_version()).field_new is not None  # the rows' layout (capture.digest)
            out.update(hash_streams(fetched, algorithm, field_digests=fields))
        except Exception as e:  # noqa: BLE001
            s.failures.append(f"{name} hash_streams: {type(e).__name__}: {e}")
        target = TARGETS.get(name, {}).get("graph_verify_vs_hash")
        if target is not None and "hash_streams_vs_hash" in out:  # the streams alone cost more passes than asked
            out["verify_target_out_of_reach"] = out["hash_streams_vs_hash"] > target
    out.update(payload(prof, shape[3] is not None, out))
    if name == "agentic" and in_flight:
        out["in_flight"] = _in_flight(s, groups, vh, in_flight, repeats, out.get("hash_streams_ms"))
    return out


def run(args: argparse.Namespace) -> dict[str, object]:
    """Stage every workload, run every mode ``--repeats`` times on each (interleaved),
    then the sustained mode (``--in-flight``), check every run's output, return the
    figures (``ok: false`` and ``failures`` when a check failed; no speedups then)."""
    import dask

    from pipeline.store import StagingStore

    repeats = getattr(args, "repeats", 3)
    if repeats < 3:
        raise SystemExit("--repeats must be at least 3 (min and median of 3 or more runs)")
    say = notes("finalize", args.quiet)
    prof = profile_from_args(args)
    rng = np.random.default_rng(args.seed)
    counts = {name: default_groups(getattr(args, f"{name}_groups", None), DEFAULT_GROUPS.get(name, 1), shape, prof)
              for name, shape in WORKLOADS.items()}
    failures: list[str] = []
    out: dict[str, object] = {"benchmark": "finalize", "repeats": repeats, "modes": list(MODES), "profile": prof.name,
                              "graph_assembly": getattr(args, "graph_assembly", "controller")}
    figures: dict[str, dict[str, object]] = {}
    # Every mode reads the same staged rows, run after run: the graph must not delete them.
    with dask.config.set({"token-capture.finalize.clear-staged": False}), bench_client(args, n_workers=args.workers) as client:
        say(f"cluster up: {len(workers_now(client))} workers")
        store, sha256_store = StagingStore.start(client), StagingStore.start(client)
        try:
            version = config.digest_version()  # the graph's digest: capture.digest (BLAKE3 by default)
            staged = {name: stage_workload(store, name, n, rng, say, version, prof) for name, n in counts.items() if n > 0}
            rng = np.random.default_rng(args.seed)  # the same draws again: the same tokens, hashed with SHA-256
            copy = {name: stage_workload(sha256_store, name, n, rng, say, DIGEST_SHA256, prof) for name, n in counts.items() if n > 0}
            session = _Session(client, store, args.groups_per_step, say, failures, sha256_store, copy, prof.experts,
                               getattr(args, "graph_assembly", "controller") == "cluster")
            _warm_up(session, staged)
            say("warm-up done")
            runs = _timed_rounds(session, staged, repeats)
            for name, groups in staged.items():
                figures[name] = out[name] = _workload_out(session, name, groups, runs[name], prof, algorithm_of(version),
                                                          getattr(args, "in_flight", 0), repeats)
        finally:
            store.close()
            sha256_store.close()
    out["failures"] = failures
    out["ok"] = not failures
    if failures:
        say(f"{len(failures)} check(s) failed: {failures[:5]}")
        for name in staged:
            drop_speedups(figures[name])
            sustained = figures[name].get("in_flight")
            for key in [k for k in sustained if k.startswith("vs_")] if isinstance(sustained, dict) else []:
                del sustained[key]
    return out


def exit_status(result: dict[str, object]) -> int:
    """The CLI's exit status: 0 when every run of every mode passed its checks, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
