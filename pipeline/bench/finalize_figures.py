"""The figures ``bench finalize`` reports per workload, from its timed runs: per mode the
wall seconds of every run with their min and median, speedups over ``baseline`` (on medians
and on mins), the graph's own step metrics (medians over runs) and the verify-vs-hash
ratios. docs/design.md, "Benchmarks", defines each figure."""
from __future__ import annotations

import statistics
from typing import Mapping, Sequence, TypedDict

from .finalize_modes import MODES, GraphRun, ModeRun
from .finalize_verify_vs_hash import VerifyVsHash

# (rollouts per group, calls per rollout, tokens per delta, routes (L, K) or None)
WorkloadShape = tuple[int, int, int, tuple[int, int] | None]

# A mode's speedup figures: (mode, suffix of its speedup keys).
SPEEDUPS = (("graph", ""), ("rollout_fetch_vec", "_rollout_fetch_vec"), ("union_fetch_token", "_union_fetch_token"),
            ("graph_sha256", "_graph_sha256"))


class ModeFigures(TypedDict, total=False):
    """One mode's figures over its runs (only ``wall_s_runs``, empty, when none passed)."""

    wall_s_runs: list[float]  # seconds, every run, rounded to 0.1 ms
    wall_s_min: float
    wall_s_median: float
    fetch_calls_per_group: float
    tokens: int
    tokens_per_s_median: float


def wall_stats(runs: list[float]) -> ModeFigures:
    """Every run's wall seconds, their min and median (rounded to 0.1 ms)."""
    return {"wall_s_runs": [round(w, 4) for w in runs], "wall_s_min": round(min(runs), 4), "wall_s_median": round(statistics.median(runs), 4)}


def mode_figures(runs: Mapping[str, Sequence[ModeRun]]) -> dict[str, ModeFigures]:
    """Per mode: :func:`wall_stats` of its runs, its fetches per group and tokens (the
    first run's) and tokens per second at the median run."""
    modes: dict[str, ModeFigures] = {}
    for mode, rs in runs.items():
        if not rs:
            modes[mode] = {"wall_s_runs": []}
            continue
        st = wall_stats([r["wall_s"] for r in rs])
        st["fetch_calls_per_group"] = rs[0]["fetch_calls_per_group"]
        st["tokens"] = rs[0]["tokens"]
        st["tokens_per_s_median"] = round(rs[0]["tokens"] / st["wall_s_median"], 1)
        modes[mode] = st
    return modes


def speedups(modes: Mapping[str, ModeFigures]) -> dict[str, float]:
    """Baseline seconds over each mode's, on medians and on mins; none unless every mode
    has runs."""
    if not all(modes[m].get("wall_s_runs") for m in MODES):
        return {}
    base = modes["baseline"]
    out: dict[str, float] = {}
    for mode, suffix in SPEEDUPS:
        out[f"speedup_median{suffix}"] = round(base["wall_s_median"] / modes[mode]["wall_s_median"], 2)
        out[f"speedup_min{suffix}"] = round(base["wall_s_min"] / modes[mode]["wall_s_min"], 2)
    # The digest's share: the same graph on SHA-256 rows over the default digest's.
    out["graph_sha256_vs_graph"] = round(modes["graph_sha256"]["wall_s_median"] / modes["graph"]["wall_s_median"], 2)
    return out


def graph_figures(g: Sequence[GraphRun]) -> dict[str, float | int]:
    """The graph's step metrics: counts from its first run, times (ms) the median over runs."""

    def med(key: str) -> float:
        return statistics.median(r[key] for r in g)

    return {
        "fetch_calls_per_step_graph": g[0]["fetch_calls_per_step"],
        "graph_sites": g[0]["sites"],
        "fetch_calls_per_site_graph": round(g[0]["fetch_calls_per_step"] / max(g[0]["sites"], 1), 2),
        "graph_steps": g[0]["steps"],
        "graph_fetch_ms": round(med("fetch_ms"), 2),
        "graph_verify_ms": round(med("verify_ms"), 2),
        "graph_verify_cpu_ms": round(med("verify_cpu_ms"), 2),
        "graph_verify_tasks": g[0]["verify_tasks"],
        "graph_assemble_ms": round(med("assemble_ms"), 2),
        "graph_queue_wait_ms": round(med("queue_wait_ms"), 2),
        "graph_bytes_fetched": g[0]["bytes_fetched"],
    }


def hash_figures(vh: VerifyVsHash, graph: Mapping[str, float | int] | None,
                 graph_sha256: tuple[float, float] | None = None) -> dict[str, float | int | str]:
    """The in-process verify and hash passes (ms: the digest in use, ``hash_algorithm``,
    and SHA-256) and their ratio; with the ``graph``'s figures also its verify tasks' wall
    and CPU time over the hash pass's, and ``graph_sha256``'s (its verify tasks' ms, wall
    and CPU) over the SHA-256 pass's."""
    out: dict[str, float | int | str] = {
        "verify_ms_in_process": round(vh["verify_ms"], 3),
        "hash_algorithm": vh["algorithm"],
        "hash_ms": round(vh["hash_ms"], 3),
        "hash_cpu_ms": round(vh["hash_cpu_ms"], 3),
        "hash_sha256_ms": round(vh["hash_sha256_ms"], 3),
        "hash_bytes": vh["bytes"],
        "verify_vs_hash": round(vh["verify_ms"] / vh["hash_ms"], 2),
    }
    if graph_sha256 is not None:
        wall, cpu = graph_sha256
        out["graph_sha256_verify_ms"] = round(wall, 2)
        out["graph_sha256_verify_cpu_ms"] = round(cpu, 2)
        out["graph_sha256_verify_vs_hash"] = round(wall / vh["hash_sha256_ms"], 2)
        out["graph_sha256_verify_cpu_vs_hash"] = round(cpu / vh["hash_sha256_cpu_ms"], 2)
    if graph is not None:
        # The same ratio with the graph's own verify tasks (2 busy workers; median run): their
        # wall time (waits for a CPU and the GIL included), and their threads' CPU time
        # against the hash pass's (what the verify computed).
        out["graph_verify_vs_hash"] = round(graph["graph_verify_ms"] / vh["hash_ms"], 2)
        out["graph_verify_cpu_vs_hash"] = round(graph["graph_verify_cpu_ms"] / vh["hash_cpu_ms"], 2)
    return out


def workload_figures(shape: WorkloadShape, targets: dict[str, float], n_groups: int,
                     runs: Mapping[str, Sequence[ModeRun]], vh: VerifyVsHash | None) -> dict[str, object]:
    """One workload's entry of the result: its shape, every mode's figures, the speedups,
    the graph's and verify-vs-hash figures (when they ran) and its targets."""
    rollouts, calls, delta, routes = shape
    res: dict[str, object] = {
        "groups": n_groups,
        "rollouts_per_group": rollouts,
        "calls_per_rollout": calls,
        "tokens_per_delta": delta,
        "routes": None if routes is None else list(routes),
    }
    modes = mode_figures(runs)
    res["modes"] = modes
    res.update(speedups(modes))
    g = runs["graph"]
    graph = graph_figures(g) if g else None
    if graph is not None:
        res.update(graph)
    if vh is not None:
        g256 = runs.get("graph_sha256")
        sha256 = None
        if g256:  # the SHA-256 graph's verify tasks (ms): medians over its runs, wall and CPU
            sha256 = (statistics.median(r["verify_ms"] for r in g256), statistics.median(r["verify_cpu_ms"] for r in g256))
        res.update(hash_figures(vh, graph, sha256))
    res["targets"] = targets
    return res


def drop_speedups(figures: dict[str, object]) -> None:
    """No speedup or ratio over failed runs: remove them from a workload's figures."""
    for key in [k for k in figures if k.startswith("speedup") or k.endswith("vs_hash")]:
        del figures[key]
