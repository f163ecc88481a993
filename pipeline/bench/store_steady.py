"""``bench store --steady``: what a training loop does to the store, round after round.

Each round puts one step's rows (one call of ``--batch-size`` rows under fresh keys),
reads them back (one get) and deletes them (one delete), so the store holds one step at a
time and every round's puts land in memory the previous round's delete freed. Rounds
after :data:`WARM_ROUNDS` untimed ones are timed, each operation apart; the units'
receive-pool counters over the timed rounds say whether the memory was recycled
(``receive_buffers_allocated`` 0: every put landed in memory a delete gave back). A refused put,
get or delete and a sampled row read back that is not bit-exact are failures.
"""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import numpy as np

from tasks.packed import PackedBatch

from .common import compare_rows, refused
from .store_rows import with_keys

if TYPE_CHECKING:
    from ..store import StagingStore

WARM_ROUNDS = 3  # untimed rounds first: connections, code paths and every pool warmed
SAMPLE_ROWS = 4  # rows of the first and last timed round compared bit-exact
POOL_COUNTERS = ("receive_buffers_allocated", "receive_buffers_reused", "receive_buffers_unpooled",
                 "answer_buffers_allocated", "answer_buffers_reused", "answer_buffers_unpooled")


def _pools(store: StagingStore) -> dict[str, int]:
    """The units' pool counters, summed (each unit's receive pool is its worker's)."""
    stats = store.stats()
    seen: dict[str, dict] = {s["worker"]: s for s in stats}  # one receive pool per worker
    out = {k: sum(s[k] for s in stats) for k in POOL_COUNTERS if k.startswith("answer")}
    out.update({k: sum(s[k] for s in seen.values()) for k in POOL_COUNTERS if k.startswith("receive")})
    return out


def steady_once(store: StagingStore, template: PackedBatch, rounds: int, tag: str, where: str,
                failures: list[str]) -> dict:
    """``WARM_ROUNDS`` + ``rounds`` rounds of put, get, delete of ``template``'s rows under
    fresh keys; wall seconds of the timed rounds' puts, gets and deletes, and the units'
    pool counters' growth over them (``pools``). Problems go to ``failures``."""
    secs = {"put": 0.0, "get": 0.0, "delete": 0.0}
    sampled = (WARM_ROUNDS, WARM_ROUNDS + rounds - 1)
    before: dict[str, int] = {}
    k = min(SAMPLE_ROWS, len(template))
    for r in range(WARM_ROUNDS + rounds):
        if r == WARM_ROUNDS:
            before = _pools(store)
        batch = with_keys(template, f"{tag}{r}-", 0, len(template))
        t0 = time.perf_counter()
        put = store.put_many(batch)
        t1 = time.perf_counter()
        got = store.get_many(batch.keys)
        t2 = time.perf_counter()
        if r in sampled and not got.failed:
            failures.extend(compare_rows(batch.take(np.arange(k)), got.batch.take(np.arange(k)), what=where + "steady get "))
        n_got = len(got.batch)
        del got  # a training step lets go of its batch before the next
        gone = store.delete(batch.keys)
        t3 = time.perf_counter()
        for what, res in (("put", put), ("delete", gone)):
            if res.failed:
                failures.append(refused(f"{where}steady {what}", res.failed))
        if n_got != len(batch):
            failures.append(f"{where}steady get: {n_got} of {len(batch)} rows")
        if r >= WARM_ROUNDS:
            secs["put"] += t1 - t0
            secs["get"] += t2 - t1
            secs["delete"] += t3 - t2
    after = _pools(store)
    return {**secs, "pools": {k: after[k] - before.get(k, 0) for k in POOL_COUNTERS}}


def steady_figures(runs: list[dict], rows_per_round: int, rounds: int, row_bytes: float,
                   wire: list[dict[str, float]], target: float | None) -> dict[str, object]:
    """The medians of ``runs`` (rows/s, GB/s, each op's ratio to loopback TCP over the
    same runs' ``wire``), every run's rate, the pool counters of each run, the verdict."""
    out: dict[str, object] = {"rounds": rounds, "rows_per_round": rows_per_round, "warm_rounds": WARM_ROUNDS}
    rows = rows_per_round * rounds
    for op in ("put", "get", "delete"):
        rates = [rows / r[op] for r in runs]
        med = statistics.median(rates)
        out[f"{op}_rows_per_s"] = round(med, 1)
        out[f"{op}_rows_per_s_runs"] = [round(x, 1) for x in rates]
        if op == "delete":
            continue
        out[f"{op}_gb_s"] = round(med * row_bytes / 1e9, 3)
        if wire:
            side = "send" if op == "put" else "recv"
            out[f"{op}_vs_loopback"] = round(med * row_bytes / statistics.median(w[f"{side}_bytes_per_s"] for w in wire), 3)
            out[f"{op}_vs_loopback_runs"] = [round(x * row_bytes / w[f"{side}_bytes_per_s"], 3) for x, w in zip(rates, wire)]
    # Growth of the units' pool counters over each run's timed rounds: slabs allocated
    # (new memory), reused (memory a delete or a sent answer gave back), unpooled.
    out["pool_growth_runs"] = [r["pools"] for r in runs]
    if wire and target is not None:
        out["loopback_target"] = target
        out["meets_loopback_target"] = bool(min(out["put_vs_loopback"], out["get_vs_loopback"]) >= target)  # type: ignore[type-var]
    return out


def drop_ratios(figures: dict[str, object]) -> None:
    """No ratio or verdict over failed runs."""
    for key in [k for k in figures if "vs_loopback" in k or k.startswith("meets")]:
        figures.pop(key)
