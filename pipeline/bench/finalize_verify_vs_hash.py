"""``verify_vs_hash``: what the vectorized verify costs next to ONE SHA-256 pass over the
same fetched bytes, both timed on the controller (the floor any verify that reads every
byte once pays)."""
from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Callable, TypedDict, TypeVar

import numpy as np

from tasks.receipts import Receipt
from tasks.schema import ROUTES_FIELD, STAGING_FIELDS

from .finalize_modes import EXPERTS, VOCAB

if TYPE_CHECKING:
    from ..store import StagingStore

T = TypeVar("T")


class VerifyVsHash(TypedDict):
    """Best of the repeats of each, in milliseconds (wall, and this thread's CPU)."""

    verify_ms: float
    verify_cpu_ms: float
    hash_ms: float
    hash_cpu_ms: float
    bytes: int  # bytes hashed: every field's packed buffer of the fetched rows, once


def verify_vs_hash(store: StagingStore, groups: list[list[Receipt]], repeats: int = 3) -> VerifyVsHash:
    """Vectorized verify of every rollout vs ONE SHA-256 pass over the same fetched bytes.

    Both run here, on the controller, on the same two fetched batches, interleaved and
    best of ``repeats`` each, so machine load hits both alike. Hashed: every field's
    packed buffer (ids, scalars, hashes, tokens, mask, logprobs, routes) once. Wall time
    (``*_ms``) and this thread's CPU time (``*_cpu_ms``) of each.
    """
    from tasks.finalize.plan import plan_step
    from tasks.finalize.verify import verify_many

    plan = plan_step([r for g in groups for r in g])
    rows = store.get_many(plan.staging_keys, list(STAGING_FIELDS)).batch
    routes = store.get_many(plan.routes_keys, [ROUTES_FIELD]).batch if plan.routes_keys else None
    buffers = [np.ascontiguousarray(f.values) for b in (rows, routes) if b is not None for f in b.fields.values()]
    best = {"verify_ms": float("inf"), "verify_cpu_ms": float("inf"), "hash_ms": float("inf"), "hash_cpu_ms": float("inf")}

    def timed(what: str, fn: Callable[[], T]) -> T:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn()
        best[f"{what}_ms"] = min(best[f"{what}_ms"], (time.perf_counter() - t0) * 1e3)
        best[f"{what}_cpu_ms"] = min(best[f"{what}_cpu_ms"], (time.thread_time() - c0) * 1e3)
        return out

    def hash_all() -> None:
        for b in buffers:
            hashlib.sha256(memoryview(b).cast("B")).digest()

    for _ in range(repeats):
        results = timed("verify", lambda: verify_many(plan.rollouts, rows, routes, vocab_size=VOCAB, num_experts=EXPERTS))
        timed("hash", hash_all)
    if not all(r.ok for r in results):
        raise RuntimeError("verify_vs_hash: staged rows did not verify")
    return {**best, "bytes": int(sum(b.nbytes for b in buffers))}
