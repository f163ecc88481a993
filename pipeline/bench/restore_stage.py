"""What ``bench restore`` reads: its scenarios, the cut rows it stages, and their shape.

Rows are real cut rows (a :class:`~pipeline.generation.call_buffer.CallBuffer` frozen),
eight templates reused under many keys, carrying the routed experts of ``--profile``
(expert ids in ``[0, experts)``, kept in the dtype the engine picks for that expert count,
as a generation worker's buffers are) unless ``--no-routes``. A profile bigger than toy keeps the scenarios
(workers, restores) and shrinks the default tokens per restore so a row holds toy's
bytes at 16,384 tokens (:func:`restore_tokens`): a 16,384-token qwen3-moe table would be
13 GB on this 23 GB machine.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from tasks.keys import CUT_PARTITION
from tasks.packed import PackedBatch, pack_rows
from tasks.schema import ALL_FIELDS

from .call_buffers import call_buffers
from .common import notes
from .profile_args import routes_profile, toy_bytes_scale

if TYPE_CHECKING:
    from tasks.profiles import MoeProfile

    from ..store.protocol import StoreLike

GAPS_MS = (5, 10, 20, 50)  # arrival gaps of the gap_* scenarios (ms between one worker's restores)
CONTEXT_TOKENS = 16
TEMPLATES = 8  # distinct payload rows, reused under many keys
TOY_TOKENS = 16384  # default tokens per restore at the toy profile (the reference's)


def restore_fields(tmpl: PackedBatch) -> list[str]:
    """Every field verify_prefix checks that rows like ``tmpl`` hold: the staging fields,
    and their routes field when they carry routes (whichever encoding the cut chose)."""
    return [f for f in ALL_FIELDS if f in tmpl.fields]


def restore_tokens(args: argparse.Namespace) -> int:
    """Tokens per restore: ``--tokens``, else 16,384 scaled by toy's bytes per token over
    the profile's (int16 ids; at least 64, rounded down)."""
    if args.tokens:
        return int(args.tokens)
    return max(64, int(TOY_TOKENS * toy_bytes_scale(routes_profile(args))))


# ---- scenarios and staged rows --------------------------------------------------------


# A scenario: ``workers`` simulated workers, ``restores`` each of ``chunks`` cut rows,
# ``period_s`` apart (0 = all at once), run ``repeats`` times per mode.
Scenario = TypedDict("Scenario", {"name": str, "workers": int, "restores": int, "chunks": int, "period_s": float, "repeats": int})
# Staged key -> (template batch, row) it was written from.
Expected = dict[str, tuple[PackedBatch, int]]


def scenario_names() -> list[str]:
    """Every scenario's name, in run order."""
    return ["mass_resume", "mass_resume_4chunks", *(f"gap_{g}ms" for g in GAPS_MS)]


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    """Each: name, workers, restores per worker, chunks per restore, period (s between one
    worker's restores; 0 = all at once), runs per mode."""
    W, R, GW, GR = args.workers, args.restores, args.gap_workers, args.gap_restores
    out = [
        Scenario(name="mass_resume", workers=W, restores=R, chunks=1, period_s=0.0, repeats=args.repeats),
        Scenario(name="mass_resume_4chunks", workers=W, restores=R, chunks=4, period_s=0.0, repeats=args.repeats),
        *(Scenario(name=f"gap_{g}ms", workers=GW, restores=GR, chunks=1, period_s=g / 1000.0, repeats=args.gap_repeats) for g in GAPS_MS),
    ]
    if args.scenarios != "all":
        wanted = {s.strip() for s in args.scenarios.split(",")}
        unknown = wanted - {s["name"] for s in out}
        if unknown:
            raise SystemExit(f"unknown scenario(s) {sorted(unknown)}; choose from {[s['name'] for s in out]}")
        out = [s for s in out if s["name"] in wanted]
    return out


def templates(tokens: int, prof: MoeProfile | None, seed: int = 0, n: int = TEMPLATES) -> PackedBatch:
    """``n`` real cut rows (CallBuffer freeze) of ``tokens`` tokens, with ``prof``'s routes
    unless None: the payload to replicate."""
    ctx = min(CONTEXT_TOKENS, tokens - 1)
    calls = call_buffers(np.random.default_rng(seed), [f"tmpl{i}" for i in range(n)], "c0", ctx, tokens, prof)
    return pack_rows([b.freeze("bench").row for b in calls])


def restore_keys(sc: Scenario) -> list[list[str]]:
    """Cut keys of every restore of a scenario, chain order; restore ``w * R + r``."""
    from tasks.keys import cut_key

    ck = f"{sc['chunks']}x"  # one checkpoint per chunking: rows differ in size
    return [
        [cut_key(ck, f"w{w}r{r}", "c0", s) for s in range(sc["chunks"])]
        for w in range(sc["workers"])
        for r in range(sc["restores"])
    ]


def stage(store: StoreLike, scs: list[Scenario], tokens: int, args: argparse.Namespace, expect: Expected | None = None) -> dict[int, int]:
    """Put every key the scenarios (and the warm-up) read, once per chunking, in puts of <= 64 MB.
    With ``expect``, record for every key the (template batch, row) it was written from.
    Returns ``{chunks per restore: tokens per chunk}``."""
    need: dict[int, set[str]] = {1: set()}
    for sc in scs + [warm_up(args)]:
        need.setdefault(sc["chunks"], set()).update(k for ks in restore_keys(sc) for k in ks)
    staged = {}
    for chunks, keys in need.items():
        chunk_tokens = max(1, tokens // chunks)
        tmpl = templates(chunk_tokens, routes_profile(args), seed=chunks)
        keys = sorted(keys)
        per_put = max(1, min(256, (64 << 20) // max(1, tmpl.nbytes // len(tmpl))))
        notes("restore", args.quiet)(f"staging {len(keys)} cut rows of {chunk_tokens} tokens ({tmpl.nbytes // len(tmpl) * len(keys) / 1e6:.0f} MB)")
        for i in range(0, len(keys), per_put):
            part = keys[i : i + per_put]
            rows = np.arange(len(part)) % len(tmpl)
            batch = tmpl.take(rows)
            if expect is not None:
                expect.update((k, (tmpl, int(r))) for k, r in zip(part, rows))
            res = store.put_many(PackedBatch(part, batch.fields), partition=CUT_PARTITION)
            if res.failed:
                raise RuntimeError(f"staging failed: {next(iter(res.failed.items()))}")
        staged[chunks] = chunk_tokens
    return staged


def warm_up(args: argparse.Namespace) -> Scenario:
    """The untimed mass resume that opens every connection before anything is measured."""
    return Scenario(name="warm-up", workers=args.workers, restores=args.restores, chunks=1, period_s=0.0, repeats=1)

