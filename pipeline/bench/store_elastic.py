"""``bench store``'s elastic block: rows/s while the store grows vs while it does not, and
the seconds a rebalance takes, on a cluster of its own (:mod:`.store_elastic_cluster`: 2
storage workers; ``hosts``, the default, runs the scheduler and its store host in a process
of their own and each storage worker as a CLI host, as deployed), a hosted store of 2 units:

1. ``replicas_1``/``replicas_2``: one put+get loop (:mod:`.store_elastic_loop`) measured for
   ``--elastic-seconds`` with nothing moving (``baseline``), while a third storage worker
   joins and its unit is filled (``during_add``: join to change record, the worker's start-up
   included; ``during_move``: the change's own interval, what TARGET_RATIO judges), and while
   it is retired, drained first (``during_drain``), ``--elastic-alternations`` times; medians.
2. ``rebalance``: 2 units holding ``--elastic-gb`` GB, a third added: the change's seconds,
   phases, rows and bytes moved (about 1/3 of the copies), GB/s next to loopback TCP's.

Any refused key, failed call, row read back not bit-exact or change that never completes:
``ok`` false, ``failures`` names it, no ratio, exit status 1.

    python -m pipeline bench store --json --elastic
    python -m pipeline.bench.store_elastic --json --elastic-gb 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import loopback
from .common import main, notes
from .profile_args import profile_from_args
from .limits import CHUNK as LIMITS_CHUNK
from .store_elastic_cluster import KINDS, ElasticCluster, elastic_cluster, hosted_store
from .store_elastic_loop import Call, Failures, Loop, Rows, fill, read_all, window_rates

if TYPE_CHECKING:
    from ..store.protocol import PlacedStoreLike

TARGET_RATIO = 0.5  # rows/s while a unit is added vs without, put and get
DEFAULT_ON = False  # about 2 minutes at default sizes: run with --elastic
FILL_ROWS_PER_CALL = 256  # rows per put while filling the store for the rebalance timing


def replica_counts(text: str) -> tuple[int, ...]:
    """``--elastic-replicas``: comma-separated copies per key, each 1 or 2 (``"1,2"``)."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items or any(t not in ("1", "2") for t in items):
        raise argparse.ArgumentTypeError(f"must be 1, 2 or 1,2 (copies per key), got {text!r}")
    return tuple(dict.fromkeys(int(t) for t in items))


def add_flags(p: argparse.ArgumentParser, switch: bool = True) -> None:
    """The block's sizes and, with ``switch``, ``--elastic/--no-elastic`` (default DEFAULT_ON)."""
    from ..cli_args import positive_float, positive_int

    if switch:
        p.add_argument("--elastic", action=argparse.BooleanOptionalAction, default=DEFAULT_ON,
                       help=f"also run the elastic block: rows/s while a storage unit is added vs without, seconds to rebalance --elastic-gb (default {'on' if DEFAULT_ON else 'off'}; a cluster of its own, skipped with --scheduler)")
    p.add_argument("--elastic-gb", type=positive_float, default=1.0, help="elastic: GB of rows on 2 units before a third is added and timed (default 1.0)")
    p.add_argument("--elastic-fill-mb", type=positive_float, default=256.0, help="elastic: MB of rows pre-filled before the throughput rounds (default 256)")
    p.add_argument("--elastic-live-mb", type=positive_float, default=64.0, help="elastic: MB of its own rows the loop keeps, deleting older ones (default 64)")
    p.add_argument("--elastic-seconds", type=positive_float, default=2.0, help="elastic: seconds of each baseline window (default 2)")
    p.add_argument("--elastic-alternations", type=positive_int, default=3, help="elastic: baseline/add rounds per replicas count; medians reported (default 3)")
    p.add_argument("--elastic-rows-per-call", type=positive_int, default=64, help="elastic: rows per put and per get of the loop (default 64)")
    p.add_argument("--elastic-tokens", type=positive_int, default=1024, help="elastic: tokens per row (default 1024)")
    p.add_argument("--elastic-cluster", choices=KINDS, default="hosts", help="elastic: hosts (default: a dask scheduler process of its own and dask worker CLI processes, one loopback host per storage worker, as deployed) or local (a LocalCluster: its scheduler, and so the store host moving keys, shares the loop's process)")
    p.add_argument("--elastic-replicas", type=replica_counts, default=(1, 2), help="elastic: copies per key of the throughput stores, 1, 2 or 1,2 (default 1,2)")


@dataclass(frozen=True)
class ElasticSizes:
    """The block's sizes (from the flags; bytes, seconds, rows)."""

    tokens: int
    layers: int
    top_k: int
    routes: bool
    rows_per_call: int
    fill_bytes: int
    live_bytes: int
    window_s: float
    alternations: int
    replicas: tuple[int, ...]
    rebalance_bytes: int
    quiet: bool
    cluster: str = "hosts"  # the cluster's kind (store_elastic_cluster.KINDS)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ElasticSizes:
        prof = profile_from_args(args)  # --profile, with --layers / --top-k as overrides
        return cls(
            args.elastic_tokens, prof.layers, prof.top_k, not getattr(args, "no_routes", False),
            args.elastic_rows_per_call, int(args.elastic_fill_mb * 1e6), int(args.elastic_live_mb * 1e6),
            float(args.elastic_seconds), args.elastic_alternations, tuple(args.elastic_replicas),
            int(args.elastic_gb * 1e9), bool(getattr(args, "quiet", False)), getattr(args, "elastic_cluster", "hosts"),
        )


def _rows(sizes: ElasticSizes, n: int) -> Rows:
    """Batches of ``n`` rows shaped as ``sizes`` says (tokens, routed-experts L and K)."""
    return Rows(n, sizes.tokens, sizes.layers, sizes.top_k, sizes.routes)


# ---- part 1: throughput during a rebalance vs without ------------------------------------


def _round(ec: ElasticCluster, sizes: ElasticSizes, windows: dict[str, list[tuple[float, float]]],
           changes: list[dict]) -> dict:
    """One baseline window, one add, one drain (the loop runs throughout); the windows'
    bounds go to ``windows``, the host's change records to ``changes``; the add's record."""
    t0 = time.perf_counter()
    time.sleep(sizes.window_s)
    windows["baseline"].append((t0, time.perf_counter()))
    seen = len(ec.changes())
    address, joined = ec.add_storage_worker()
    try:
        record, listed = ec.next_change(seen)
        windows["during_add"].append((joined, listed))
        windows["during_move"].append(move_window(record))
        changes.append(record)
    finally:  # back to 2 units whatever happened
        t0 = time.perf_counter()
        ec.retire(address)
        windows["during_drain"].append((t0, time.perf_counter()))
    changes.extend(ec.changes()[seen + 1:])
    return record


def move_window(record: Mapping[str, object]) -> tuple[float, float]:
    """The change's own interval (its first fence to its end), from the record's wall-clock
    seconds to this process's ``perf_counter`` (the loop's calls' clock; the store host
    runs on the same machine)."""
    offset = time.time() - time.perf_counter()
    return float(record["started_at"]) - offset, float(record["ended_at"]) - offset  # type: ignore[arg-type]


def _summary(calls: Sequence[Call], bounds: Sequence[tuple[float, float]]) -> dict[str, float | list[float]]:
    """Medians over the windows of :func:`window_rates`, and every window's figures."""
    per = [window_rates(calls, lo, hi) for lo, hi in bounds]
    out: dict[str, float | list[float]] = {}
    for key in ("put_rows_per_s", "get_rows_per_s"):
        out[key] = round(statistics.median(w[key] for w in per), 1) if per else 0.0
        out[f"{key}_runs"] = [w[key] for w in per]
    for key in ("seconds", "put_calls", "get_calls", "put_slowest_s", "get_slowest_s"):
        out[f"{key}_runs"] = [w[key] for w in per]
    return out


def throughput(ec: ElasticCluster, sizes: ElasticSizes, replicas: int, rows: Rows, failures: Failures) -> dict:
    """Part 1 for one replicas count (module docstring): figures of each window kind,
    the ratios and their target, the changes' records, the rows read back."""
    say = notes(f"store elastic r{replicas}", sizes.quiet)
    windows: dict[str, list[tuple[float, float]]] = {"baseline": [], "during_add": [], "during_move": [], "during_drain": []}
    changes: list[dict] = []
    with hosted_store(ec, replicas) as store:
        prefilled = rows.batches_for(sizes.fill_bytes)
        fill(store, rows, "f", prefilled, failures)
        loop = Loop(store, rows, prefilled, rows.batches_for(sizes.live_bytes), failures)
        loop.start()
        time.sleep(sizes.window_s)  # warm-up, untimed: connections, pooled buffers
        try:
            for k in range(sizes.alternations):
                added = _round(ec, sizes, windows, changes)
                say(f"round {k + 1}/{sizes.alternations}: the add moved {added['rows_moved']} rows in {added['seconds']:.2f} s")
        except Exception as e:  # noqa: BLE001 - reported, then fails the command
            failures.add(f"{type(e).__name__}: {e}")
        finally:
            loop.stop.set()
            loop.join()
        say("loop stopped; reading every kept row back")
        final = read_all(store, rows, loop.all_kept(), failures)
        counters = _move_counters(store)
        say("read back; closing the store")
    out: dict = {"replicas": replicas, "prefilled_rows": prefilled * rows.n, "loop_rounds": loop.rounds,
                 "rows_read_back_in_loop": loop.read_back_rows, "rows_read_back_after": final, "unit_move_counters": counters}
    out |= {kind: _summary(loop.calls, bounds) for kind, bounds in windows.items()}
    base, during, move = out["baseline"], out["during_add"], out["during_move"]
    for op in ("put", "get"):
        if base[f"{op}_rows_per_s"] > 0:
            out[f"{op}_rows_per_s_during_vs_without"] = round(during[f"{op}_rows_per_s"] / base[f"{op}_rows_per_s"], 3)
            out[f"{op}_rows_per_s_during_move_vs_without"] = round(move[f"{op}_rows_per_s"] / base[f"{op}_rows_per_s"], 3)
    out["target_ratio"] = TARGET_RATIO
    if "put_rows_per_s_during_move_vs_without" in out and "get_rows_per_s_during_move_vs_without" in out:
        out["meets_target"] = min(out["put_rows_per_s_during_move_vs_without"], out["get_rows_per_s_during_move_vs_without"]) >= TARGET_RATIO
    out["changes"] = changes
    return out


def _move_counters(store: PlacedStoreLike) -> dict[str, int]:
    """The move counters of the store's units, summed (rows moved in and out, calls
    refused as moved and retried by the client, copies skipped for a tombstone); a
    drained unit's counters went with it."""
    from ..store.unit_moves import MOVE_COUNTERS

    store.refresh(store.version)  # the current table: the units a drain left
    stats = store.stats()
    return {name: sum(int(s.get(name, 0)) for s in stats) for name in MOVE_COUNTERS}


# ---- part 2: seconds to rebalance --------------------------------------------------------


def rebalance(ec: ElasticCluster, sizes: ElasticSizes, failures: Failures) -> dict:
    """Part 2 (module docstring): fill 2 units with ``sizes.rebalance_bytes``, add a third,
    time the change; read everything back; drain it again."""
    say = notes("store elastic rebalance", sizes.quiet)
    rows = _rows(sizes, FILL_ROWS_PER_CALL)
    batches = rows.batches_for(sizes.rebalance_bytes)
    n_rows = batches * rows.n
    out: dict = {"rows": n_rows, "bytes": int(n_rows * rows.row_bytes), "replicas": 1, "copies": n_rows}
    with hosted_store(ec, 1) as store:
        t0 = time.perf_counter()
        fill(store, rows, "R", batches, failures)
        out["fill_s"] = round(time.perf_counter() - t0, 2)
        say(f"filled {out['bytes'] / 1e9:.2f} GB in {out['fill_s']} s; adding a unit")
        seen = len(ec.changes())
        address, joined = ec.add_storage_worker()
        try:
            record, listed = ec.next_change(seen)
            out |= _move_figures(record, listed - joined, rows.row_bytes, n_rows)
            say(f"moved {record['rows_moved']} rows in {record['seconds']:.2f} s")
            out["rows_read_back"] = read_all(store, rows, [("R", j) for j in range(batches)], failures)
        finally:  # drained again: the cluster is back to 2 storage workers
            ec.retire(address)
        drained = ec.changes()[seen + 1:]
        out["drain_seconds"] = round(drained[-1]["seconds"], 3) if drained else None
    return out


def _move_figures(record: Mapping[str, float], wall_s: float, row_bytes: float, copies: int) -> dict:
    """The change record's figures: seconds, rows and bytes moved, fraction, GB/s."""
    seconds = float(record["seconds"])
    moved = int(record["rows_moved"])
    return {
        "seconds": round(seconds, 3),
        "join_to_record_s": round(wall_s, 3),
        "rows_moved": moved,
        "copies_dropped": int(record["copies_dropped"]),
        "bytes_moved": int(moved * row_bytes),
        "copies_moved_fraction": round(moved / copies, 4) if copies else 0.0,
        "expected_fraction": round(1 / 3, 4),
        "move_gb_per_s": round(moved * row_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0,
        "phases_s": dict(record.get("phases_s", {})),  # type: ignore[call-overload]
    }


# ---- the block ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Both parts on a cluster of the block's own; ``ok``, ``failures``, no ratio on failure."""
    sizes = ElasticSizes.from_args(args)
    say = notes("store elastic", sizes.quiet)
    t0 = time.perf_counter()
    parts: list[Failures] = []
    rows = _rows(sizes, sizes.rows_per_call)
    out: dict = {"tokens_per_row": sizes.tokens, "row_bytes": int(rows.row_bytes), "rows_per_call": sizes.rows_per_call,
                 "window_s": sizes.window_s, "alternations": sizes.alternations, "cluster": sizes.cluster}
    try:
        with elastic_cluster(kind=sizes.cluster) as ec:
            for r in sizes.replicas:
                parts.append(Failures(f"replicas={r}"))
                out[f"replicas_{r}"] = _part(lambda: throughput(ec, sizes, r, rows, parts[-1]), parts[-1])
                say(f"replicas={r}: " + ", ".join(f"{k} {out[f'replicas_{r}'].get(k)}" for k in ("put_rows_per_s_during_move_vs_without", "get_rows_per_s_during_move_vs_without")))
            parts.append(Failures("rebalance"))
            out["rebalance"] = move = _part(lambda: rebalance(ec, sizes, parts[-1]), parts[-1])
    except Exception as e:  # noqa: BLE001 - the cluster itself: reported, then fails the command
        parts.append(Failures("cluster"))
        parts[-1].add(f"{type(e).__name__}: {e}")
    else:
        wire = loopback.measure(LIMITS_CHUNK, 8)  # ``bench limits``' loopback figure, right after
        move["loopback_send_gb_per_s"] = round(wire["send_bytes_per_s"] / 1e9, 3)
        if move.get("move_gb_per_s"):
            move["move_vs_loopback_ratio"] = round(move["move_gb_per_s"] / move["loopback_send_gb_per_s"], 3)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["failures"] = [m for p in parts for m in p.report()]
    out["ok"] = not out["failures"]
    if not out["ok"]:
        drop_ratios(out)
    return out


def _part(work: Callable[[], dict], failures: Failures) -> dict:
    """``work()``, or what it raised as a failure (and no figures)."""
    try:
        return work()
    except Exception as e:  # noqa: BLE001 - reported, then fails the command
        failures.add(f"{type(e).__name__}: {e}")
        return {}


def drop_ratios(block: dict) -> None:
    """No ratio or target verdict over a block with failures."""
    for part in block.values():
        if isinstance(part, dict):
            for key in [k for k in part if "ratio" in k or k == "meets_target"]:
                part.pop(key)


def block(args: argparse.Namespace, failures: list[str]) -> dict:
    """The block as ``bench store`` runs it: skipped with ``--scheduler`` (it adds and
    retires workers of a cluster of its own); its failures join ``failures``."""
    if getattr(args, "scheduler", None):
        return {"skipped": "the elastic block starts a cluster of its own; run it without --scheduler"}
    out = measure(args)
    failures.extend(f"elastic {f}" for f in out["failures"])
    return out


# ---- stand-alone -------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``python -m pipeline.bench.store_elastic`` (the block's, and ``--quiet``)."""
    add_flags(p, switch=False)
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def run(args: argparse.Namespace) -> dict:
    """The block alone; one JSON-able dict."""
    return {"benchmark": "store_elastic", **measure(args)}


def exit_status(result: Mapping[str, object]) -> int:
    """0 when nothing failed, else 1."""
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
