"""``bench finalize --in-flight N``: sustained throughput with ``N`` steps in flight,
against floors measured in the same run.

:func:`sustained_run` keeps ``N`` steps of one workload (each: every group) submitted to
one :class:`~pipeline.finalize.Finalizer`, collects the oldest, submits the next, until
``steps`` were collected, as a training loop pipelining finalization does; its rate is
every collected step's tokens over the wall seconds from the first submit to the last
result. The floors (tokens/s): ``hashing_floor`` = cores x one core's hash rate of the
digest in use over the fetched bytes / hashed bytes per token (every fetched byte once,
the ids twice more: chain and cumulative hashes); ``transfer_floor`` = a raw loopback
receive rate here (:mod:`pipeline.bench.loopback`) / the bytes the controller gathers
per token (the rows must reach it); ``mandatory_floor`` = cores x tokens per step / the
CPU seconds the work every finalize must do costs here (the verifier's three hash streams
over bare buffers, ``hash_streams_ms``, and the loopback transfer of the gathered bytes,
both processes' CPU): ``mandatory_vs_hashing_floor`` is the most of the hashing floor
any implementation reaches here; ``cpu_floor`` = cores x tokens per step / the CPU seconds
per step of the run's own processes. Units: ``_s`` seconds, ``_ms`` milliseconds, rates
in tokens/s, ``gb_s`` 1e9 bytes/s.
"""
from __future__ import annotations

import os
import statistics
import time
from collections import deque
from typing import TYPE_CHECKING, Mapping, Sequence, TypedDict

if TYPE_CHECKING:
    from distributed import Client

    from tasks.receipts import Receipt

    from ..store import StagingStore
    from .finalize_verify_vs_hash import VerifyVsHash

TOKEN_ID_BYTES = 8  # int64 token ids: what the chain and cumulative hashes read per token
LOOPBACK_MESSAGE_BYTES = 16 << 20  # one loopback message: a site's share of a toy agentic step
LOOPBACK_MESSAGES = 8


class SustainedRun(TypedDict):
    """One ``--in-flight`` run: ``steps`` steps with ``in_flight`` submitted at a time."""

    wall_s: float  # first submit to last result
    steps: int
    in_flight: int
    tokens: int  # accepted tokens of every step
    tokens_per_s: float
    accepted: int  # rollouts, every step
    rollouts: int
    step_wall_ms_median: float  # each step's own submit -> collected (in flight: queueing included)
    collect_ms_median: float  # each step's result() call
    collected_bytes_per_token: float  # what the controller gathered per accepted token
    cpu_ms_per_step: dict[str, float]  # CPU ms per step: "controller" (its process) and each worker


def cores() -> int:
    """CPUs this process may run on (the machine's, for the hashing floor)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def sustained_run(client: Client, store: StagingStore, groups: Sequence[Sequence[Receipt]], *, in_flight: int,
                  steps: int, vocab_size: int, num_experts: int | None, on_cluster: bool = False) -> SustainedRun:
    """``steps`` steps of ``groups`` (each step: every group, under its receipts' own
    group ids), ``in_flight`` of them submitted at a time, oldest collected first;
    ``on_cluster``: each step's groups assembled on the cluster (``group_futures``)."""
    from pipeline.finalize import Finalizer

    fin = Finalizer(client, store, vocab_size=vocab_size, num_experts=num_experts)
    named = {(g[0].group_id or f"g{i}"): list(g) for i, g in enumerate(groups)}
    pending: deque = deque()
    metrics = []
    cpu0 = _cpu_s(client)
    t0 = time.perf_counter()
    submitted = 0
    while len(metrics) < steps:
        while submitted < steps and len(pending) < in_flight:
            handle = fin.submit_step(named, step_id=f"in-flight-{submitted}")
            if on_cluster:
                handle.group_futures  # one assemble task per group, on the cluster
            pending.append(handle)
            submitted += 1
        metrics.append(pending.popleft().result().metrics)
    wall = time.perf_counter() - t0
    cpu = {k: (v - cpu0.get(k, 0.0)) / steps * 1e3 for k, v in _cpu_s(client).items()}
    tokens = sum(m["tokens"] for m in metrics)
    return {
        "wall_s": wall,
        "steps": steps,
        "in_flight": in_flight,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "accepted": sum(m["accepted"] for m in metrics),
        "rollouts": sum(m["rollouts"] for m in metrics),
        "step_wall_ms_median": statistics.median(m["wall_ms"] for m in metrics),
        "collect_ms_median": statistics.median(m.get("collect_ms", 0.0) for m in metrics),
        "collected_bytes_per_token": sum(m.get("collected_bytes", 0) for m in metrics) / max(tokens, 1),
        "cpu_ms_per_step": cpu,
    }


def _cpu_s(client: Client) -> dict[str, float]:
    """CPU seconds so far of this process (``"controller"``) and of each worker."""
    out = {"controller": time.process_time()}
    try:
        out.update({f"worker-{i}": float(s) for i, s in enumerate(client.run(time.process_time).values())})
    except Exception:  # noqa: BLE001 - a figure never fails the run
        pass
    return out


class Wire(TypedDict):
    """Raw TCP receives over loopback here, now: their rate (bytes/s) and the CPU seconds
    both processes spent per byte received."""

    recv_bytes_per_s: float
    recv_cpu_s_per_byte: float


def loopback_recv() -> Wire:
    """Raw TCP receive rate over loopback here, now, and its CPU cost (:mod:`pipeline.bench.loopback`)."""
    from .loopback import measure

    m = measure(LOOPBACK_MESSAGE_BYTES, LOOPBACK_MESSAGES)
    return {"recv_bytes_per_s": float(m["recv_bytes_per_s"]), "recv_cpu_s_per_byte": float(m["recv_cpu_s_per_byte"])}


def floors(vh: VerifyVsHash, tokens_per_step: int, collected_bytes_per_token: float,
           wire: Wire, n_cores: int, hash_streams_ms: float | None = None) -> dict[str, float]:
    """The hashing, transfer and (given the step's ``hash_streams_ms``, thread CPU ms)
    mandatory floors (tokens/s) and what they are made of."""
    hash_bytes_per_s = vh["bytes"] / (vh["hash_ms"] / 1e3)
    hashed_per_token = (vh["bytes"] + 2 * TOKEN_ID_BYTES * tokens_per_step) / max(tokens_per_step, 1)
    loopback = wire["recv_bytes_per_s"]
    out = {
        "cores": n_cores,
        "hash_gb_s": hash_bytes_per_s / 1e9,
        "hashed_bytes_per_token": hashed_per_token,
        "hashing_floor_tokens_per_s": n_cores * hash_bytes_per_s / hashed_per_token,
        "loopback_gb_s": loopback / 1e9,
        "transfer_floor_tokens_per_s": loopback / collected_bytes_per_token if collected_bytes_per_token else 0.0,
    }
    if hash_streams_ms:
        out.update(mandatory_floor(hash_streams_ms, wire["recv_cpu_s_per_byte"], tokens_per_step,
                                   collected_bytes_per_token, n_cores))
        out["mandatory_vs_hashing_floor"] = out["mandatory_floor_tokens_per_s"] / out["hashing_floor_tokens_per_s"]
    return out


def mandatory_floor(hash_streams_ms: float, recv_cpu_s_per_byte: float, tokens_per_step: int,
                    collected_bytes_per_token: float, n_cores: int) -> dict[str, float]:
    """The rate (tokens/s) if ``n_cores`` did nothing but what every finalize of a step
    must: hash the verifier's three streams (``hash_streams_ms``: thread CPU ms a step,
    bare buffers, no checks) and receive the gathered bytes over loopback (CPU of both
    ends); no orchestration, no copies, no Python."""
    transfer_s = collected_bytes_per_token * tokens_per_step * recv_cpu_s_per_byte
    total_s = hash_streams_ms / 1e3 + transfer_s
    return {
        "mandatory_hash_cpu_ms_per_step": hash_streams_ms,
        "mandatory_transfer_cpu_ms_per_step": transfer_s * 1e3,
        "mandatory_floor_tokens_per_s": n_cores * tokens_per_step / total_s if total_s > 0 else 0.0,
    }


def _sig(x: float) -> float:
    """``x`` to 3 significant digits."""
    return float(f"{x:.3g}")


def cpu_floor(runs: Sequence[SustainedRun], n_cores: int) -> dict[str, object]:
    """CPU ms per step of each process (medians over ``runs``) and the rate every core
    busy with them would sustain (tokens/s)."""
    keys = sorted({k for r in runs for k in r["cpu_ms_per_step"]})
    per = {k: statistics.median(r["cpu_ms_per_step"].get(k, 0.0) for r in runs) for k in keys}
    total_s = sum(per.values()) / 1e3
    tokens_per_step = runs[0]["tokens"] / max(runs[0]["steps"], 1)
    return {"cpu_ms_per_step": {k: round(v, 1) for k, v in per.items()},
            "cpu_floor_tokens_per_s": n_cores * tokens_per_step / total_s if total_s > 0 else 0.0}


def in_flight_figures(runs: Sequence[SustainedRun], floor: Mapping[str, float], target: float | None) -> dict[str, object]:
    """Medians over ``runs`` and the median rate over each floor (``vs_hashing_floor``:
    the target's figure, ``target`` the fraction asked for)."""
    rate = statistics.median(r["tokens_per_s"] for r in runs)
    out: dict[str, object] = {
        "in_flight": runs[0]["in_flight"],
        "steps": runs[0]["steps"],
        "runs": len(runs),
        "tokens_per_step": runs[0]["tokens"] // max(runs[0]["steps"], 1),
        "tokens_per_s_runs": [round(r["tokens_per_s"]) for r in runs],
        "tokens_per_s_median": round(rate),
        "wall_s_runs": [round(r["wall_s"], 4) for r in runs],
        "step_wall_ms_median": round(statistics.median(r["step_wall_ms_median"] for r in runs), 1),
        "collect_ms_median": round(statistics.median(r["collect_ms_median"] for r in runs), 1),
        "collected_bytes_per_token": round(runs[0]["collected_bytes_per_token"], 2),
        **{k: _sig(v) if isinstance(v, float) else v for k, v in floor.items()},
    }
    cpu = cpu_floor(runs, int(floor.get("cores", 1)))
    out["cpu_ms_per_step"] = cpu["cpu_ms_per_step"]
    out["cpu_floor_tokens_per_s"] = _sig(float(cpu["cpu_floor_tokens_per_s"]))
    hashing, transfer = floor["hashing_floor_tokens_per_s"], floor["transfer_floor_tokens_per_s"]
    out["vs_hashing_floor"] = _sig(rate / hashing) if hashing else 0.0
    out["vs_transfer_floor"] = _sig(rate / transfer) if transfer else 0.0
    out["vs_cpu_floor"] = _sig(rate / out["cpu_floor_tokens_per_s"]) if out["cpu_floor_tokens_per_s"] else 0.0
    mandatory = floor.get("mandatory_floor_tokens_per_s")
    if mandatory:
        out["vs_mandatory_floor"] = _sig(rate / mandatory)
    if target is not None:
        out["target_vs_hashing_floor"] = target
        if mandatory:  # the target asks for more than the mandatory work alone allows here
            out["target_out_of_reach"] = floor["mandatory_vs_hashing_floor"] < target
    return out
