"""``bench finalize --profile``: the routed workloads carry the profile's routes, and the
figures say what each token weighs.

A routed workload's rows carry ``layers x top_k`` expert ids per token over the profile's
experts (the capture gate picks their stored encoding). A bigger profile keeps each
workload's rows and scales its default group count down to about toy's bytes (at least
one group), so a default run stays short: the agentic workload at qwen3-moe is one group.
"""
from __future__ import annotations

from typing import Any, Mapping

from tasks.profiles import MoeProfile

from .profile_args import payload_figures, route_id_bytes, toy_bytes_scale

# (rollouts per group, calls per rollout, tokens per delta, routes (L, K) or None)
WorkloadShape = tuple[int, int, int, tuple[int, int] | None]


def workload_shape(shape: WorkloadShape, prof: MoeProfile) -> WorkloadShape:
    """``shape`` with the profile's routes ``(layers, top_k)`` when it is routed."""
    rollouts, calls, delta, routes = shape
    return rollouts, calls, delta, None if routes is None else (prof.layers, prof.top_k)


def default_groups(groups: int | None, toy_default: int, shape: WorkloadShape, prof: MoeProfile) -> int:
    """``groups`` when given, else ``toy_default`` scaled by toy's bytes per token over the
    profile's (int16 ids; unrouted workloads keep theirs), at least one."""
    if groups is not None:
        return groups
    return max(1, round(toy_default * toy_bytes_scale(None if shape[3] is None else prof)))


def payload(prof: MoeProfile, routed: bool, figures: Mapping[str, Any]) -> dict[str, object]:
    """The payload keys of a workload's figures (:func:`~.finalize_figures.workload_figures`:
    every mode's, the graph's without runs just empty): the profile and bytes per staged
    token (nominal, :func:`~pipeline.bench.profile_args.payload_figures`), GB/s of the
    graph at its median run, and what the graph fetched per token and per second
    (measured)."""
    graph = figures["modes"]["graph"]
    rate = graph.get("tokens_per_s_median")
    id_bytes = route_id_bytes(prof) if routed else 0
    out = payload_figures(prof, route_id_bytes=id_bytes, tokens_per_s=rate)
    if not routed:
        out["ids_per_token"] = 0
    out["route_id_bytes"] = id_bytes
    tokens, fetched = graph.get("tokens"), figures.get("graph_bytes_fetched")
    if tokens and fetched and rate:
        out["fetched_bytes_per_token"] = round(float(fetched) / float(tokens), 2)
        out["graph_fetched_gb_s"] = float(fetched) / float(tokens) * float(rate) / 1e9
    return out
