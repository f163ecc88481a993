"""``--profile`` for every benchmark: the MoE routing shape its rows carry.

:func:`add_profile_argument` adds the flag (and keeps a benchmark's older ``--layers`` /
``--top-k`` as overrides); :func:`profile_from_args` resolves them into one
:class:`~tasks.profiles.MoeProfile`; :func:`payload_figures` is what each JSON report
puts next to rows/s (bytes per token, GB/s), from :func:`route_id_bytes` (the id
encoding the capture gate picks for the profile's experts).
"""
from __future__ import annotations

import argparse
import dataclasses

from tasks.profiles import DEFAULT_PROFILE, PROFILES, MoeProfile, profile
from tasks.schema import routes_dtype_for


def add_profile_argument(p: argparse.ArgumentParser) -> None:
    """``--profile toy|qwen3-moe|deepseek-v3`` (routed-experts layers, top-k, experts)."""
    p.add_argument("--profile", choices=tuple(PROFILES), default=DEFAULT_PROFILE,
                   help=f"MoE routing shape of the rows (layers x top-k over experts; default {DEFAULT_PROFILE}: "
                   + "; ".join(f"{q.name} {q.layers}x{q.top_k}/{q.experts}" for q in PROFILES.values()) + ")")


def profile_from_args(args: argparse.Namespace) -> MoeProfile:
    """The chosen profile, with ``--layers`` / ``--top-k`` (where a benchmark has them and
    they were given) replacing its layers and top-k."""
    chosen = profile(getattr(args, "profile", DEFAULT_PROFILE))
    layers, top_k = getattr(args, "layers", None), getattr(args, "top_k", None)
    if layers is not None and layers != chosen.layers or top_k is not None and top_k != chosen.top_k:
        chosen = dataclasses.replace(chosen, name=f"{chosen.name}+custom",
                                     layers=layers or chosen.layers, top_k=top_k or chosen.top_k)
    return chosen


def route_id_bytes(prof: MoeProfile | None) -> int:
    """Bytes per routed-expert id in rows staged at ``prof`` (0: no routes): the itemsize
    of the encoding the capture gate picks for its experts."""
    return 0 if prof is None else int(routes_dtype_for(prof.experts).itemsize)


def toy_bytes_scale(prof: MoeProfile | None) -> float:
    """Toy's bytes per staged token over ``prof``'s (int16 ids; 1.0 for rows without
    routes, None): the factor a count set at the toy profile (rows, groups, tokens) takes
    to move about toy's bytes at ``prof``."""
    return 1.0 if prof is None else profile("toy").bytes_per_token(2) / prof.bytes_per_token(2)


def routes_profile(args: argparse.Namespace) -> MoeProfile | None:
    """The profile whose routes a benchmark's rows carry: None with ``--no-routes``."""
    return None if getattr(args, "no_routes", False) else profile_from_args(args)


def payload_figures(prof: MoeProfile, *, route_id_bytes: int, tokens_per_s: float | None = None) -> dict:
    """The JSON keys every benchmark reports beside rows/s: the profile, bytes per staged
    token and, given a token rate, the payload's GB/s (1e9 bytes/s)."""
    bpt = prof.bytes_per_token(route_id_bytes)
    out = {"profile": prof.name, "layers": prof.layers, "top_k": prof.top_k, "experts": prof.experts,
           "bytes_per_token": bpt}
    if tokens_per_s is not None:
        out["gb_s"] = tokens_per_s * bpt / 1e9
    return out


def rounded_gb_s(gb_s: float) -> float:
    """A GB/s figure (1e9 bytes/s) as the reports give it: 4 significant digits."""
    return float(f"{gb_s:.4g}")
