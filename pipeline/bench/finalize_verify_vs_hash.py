"""``verify_vs_hash``: what the vectorized verify costs next to ONE pass of the digest
algorithm in use (BLAKE3 by default; SHA-256 too, for ``graph_sha256``) over the same
fetched bytes, all timed on the controller (the floor any verify that reads every byte
once pays)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypedDict, TypeVar

import numpy as np

from tasks.digests import BLAKE3, SHA256, file_hash
from tasks.receipts import Receipt
from tasks.schema import ROUTES_FIELDS, STAGING_FIELDS

from .finalize_modes import EXPERTS, VOCAB

if TYPE_CHECKING:
    from tasks.finalize.plan import StepPlan
    from tasks.packed import PackedBatch

    from ..store import StagingStore

T = TypeVar("T")


@dataclass(frozen=True)
class Fetched:
    """A workload's step as the controller fetched it, once for every measurement here:
    its plan, the staged rows (every staging field) and their routes (every routes
    field; None: no routed call)."""

    plan: StepPlan
    rows: PackedBatch
    routes: PackedBatch | None

    def buffers(self) -> list[np.ndarray]:
        """Every fetched field's packed buffer (contiguous): what one pass hashes."""
        return [np.ascontiguousarray(f.values) for b in (self.rows, self.routes) if b is not None for f in b.fields.values()]


def fetch_step(store: StagingStore, groups: list[list[Receipt]]) -> Fetched:
    """Plan the step of ``groups`` and fetch its rows and routes from ``store``."""
    from tasks.finalize.plan import plan_step

    plan = plan_step([r for g in groups for r in g])
    rows = store.get_many(plan.staging_keys, list(STAGING_FIELDS)).batch
    routes = store.get_many(plan.routes_keys, list(ROUTES_FIELDS)).batch if plan.routes_keys else None
    return Fetched(plan, rows, routes)


class VerifyVsHash(TypedDict):
    """Best of the repeats of each, in milliseconds (wall, and this thread's CPU)."""

    verify_ms: float
    verify_cpu_ms: float
    hash_ms: float  # one pass of ``algorithm``, the digest in use
    hash_cpu_ms: float
    hash_sha256_ms: float  # one SHA-256 pass over the same bytes
    hash_sha256_cpu_ms: float
    bytes: int  # bytes hashed: every field's packed buffer of the fetched rows, once
    algorithm: str  # of hash_ms: the digest the rows were hashed with


def verify_vs_hash(fetched: Fetched, repeats: int = 3, algorithm: str = BLAKE3,
                   num_experts: int = EXPERTS) -> VerifyVsHash:
    """Vectorized verify of every rollout vs ONE pass of ``algorithm`` (the digest the rows
    were hashed with; single-threaded, as the pipeline hashes) and one SHA-256 pass over
    the same fetched bytes.

    All run here, on the controller, on the same two fetched batches (``fetched``), interleaved and
    best of ``repeats`` each, so machine load hits them alike. Hashed: every field's
    packed buffer (ids, scalars, hashes, tokens, mask, logprobs, routes) once. Wall time
    (``*_ms``) and this thread's CPU time (``*_cpu_ms``) of each.
    """
    from tasks.finalize.verify import verify_many

    plan, rows, routes = fetched.plan, fetched.rows, fetched.routes
    buffers = fetched.buffers()
    best = {f"{k}{t}_ms": float("inf") for k in ("verify", "hash", "hash_sha256") for t in ("", "_cpu")}

    def timed(what: str, fn: Callable[[], T]) -> T:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn()
        best[f"{what}_ms"] = min(best[f"{what}_ms"], (time.perf_counter() - t0) * 1e3)
        best[f"{what}_cpu_ms"] = min(best[f"{what}_cpu_ms"], (time.thread_time() - c0) * 1e3)
        return out

    def hash_all(name: str) -> None:
        for b in buffers:
            h = file_hash(name)
            h.update(memoryview(b).cast("B"))
            h.digest()

    for _ in range(repeats):
        results = timed("verify", lambda: verify_many(plan.rollouts, rows, routes, vocab_size=VOCAB, num_experts=num_experts))
        timed("hash", lambda: hash_all(algorithm))
        timed("hash_sha256", lambda: hash_all(SHA256))
    if not all(r.ok for r in results):
        raise RuntimeError("verify_vs_hash: staged rows did not verify")
    return {**best, "bytes": int(sum(b.nbytes for b in buffers)), "algorithm": algorithm}  # type: ignore[typeddict-item]
