"""``bench store``'s elastic block: the store growing and shrinking while it is used.

An embedded LocalCluster of its own (worker processes on 127.0.0.1, scheduler preload
``pipeline.dashboard.preload``: the store host), whose 2 workers carry
``{"finalize": 1, "storage": 1}``; the template of every worker it adds carries the same
resources, so ``cluster.scale(3)`` adds a storage worker and the host gives it a unit.

1. **Throughput during a rebalance vs without** (``replicas_1``, ``replicas_2``): a hosted
   store of 2 units, pre-filled with ``--elastic-fill-mb`` MB of rows, and ONE loop that
   puts ``--elastic-rows-per-call`` new rows, gets as many rows already put (every row
   read back compared bit for bit with what was put) and deletes its oldest batch beyond
   ``--elastic-live-mb`` (the store stays at a steady size). Each of
   ``--elastic-alternations`` rounds measures ``--elastic-seconds`` of that loop with 2
   units and nothing moving (``baseline``), then the loop while a third storage worker
   joins and its unit is filled (``during_add``: from the worker's join to the host's
   change record), then while that worker is retired and its unit drained first
   (``during_drain``; not part of the ratio). Rows/s are rows over the time spent in
   that op's calls (put or get) within the window; figures are medians over the rounds;
   ``put_rows_per_s_during_vs_without`` / ``get_...``: the medians' ratio (target
   ``TARGET_RATIO``).
2. **Seconds to rebalance** (``rebalance``): a store of 2 units filled with ``--elastic-gb``
   GB of rows, then a third storage worker; the host's change record (``seconds``: fence,
   copy, switch, drop), the wall time from the worker's join until the record is listed,
   the rows moved (``copies_moved_fraction``: about 1/3), the move's GB/s and raw loopback
   TCP's on this machine next to it; then every row read back bit for bit, and the unit
   drained again (``drain_seconds``).

Any refused key, failed call, row read back not bit-exact or change that never completes
is a failure: ``ok`` false, ``failures`` names it, no ratio is reported, exit status 1.
The store host runs in the scheduler, which a LocalCluster keeps in this process: the
keys a change moves pass through the same process (and GIL) as the loop's calls.

    python -m pipeline bench store --json --elastic
    python -m pipeline.bench.store_elastic --json --elastic-gb 1
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Mapping, Sequence

import numpy as np

from tasks.packed import PackedBatch

from . import loopback
from .common import compare_rows, main, notes
from .store_rows import template_batch, with_keys

if TYPE_CHECKING:
    from distributed import Client, LocalCluster

    from ..store.protocol import PlacedStoreLike

TARGET_RATIO = 0.5  # rows/s while a unit is added vs without, put and get
DEFAULT_ON = False  # about 2 minutes at default sizes: run with --elastic
RESOURCES = {"finalize": 1, "storage": 1}  # every worker of the block's cluster, added ones too
STORE_NAME = "bench-store-elastic"
TEMPLATES = 4  # distinct row contents, cycled over batches: a row read from the wrong key differs
FILL_ROWS_PER_CALL = 256  # rows per put while filling the store for the rebalance timing
CHANGE_TIMEOUT_S = 600.0  # a change not listed by then is a failure
MAX_MESSAGES = 8  # failure messages kept per part (the count is kept too)


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

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ElasticSizes:
        return cls(
            args.elastic_tokens, getattr(args, "layers", 4), getattr(args, "top_k", 2), not getattr(args, "no_routes", False),
            args.elastic_rows_per_call, int(args.elastic_fill_mb * 1e6), int(args.elastic_live_mb * 1e6),
            float(args.elastic_seconds), args.elastic_alternations, tuple(args.elastic_replicas),
            int(args.elastic_gb * 1e9), bool(getattr(args, "quiet", False)),
        )


class Failures:
    """Failure messages of one part: the first MAX_MESSAGES, and how many there were."""

    def __init__(self, where: str) -> None:
        self.where, self.count, self.messages = where, 0, []
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        with self._lock:
            self.count += 1
            if len(self.messages) < MAX_MESSAGES:
                self.messages.append(f"{self.where}: {text}")

    def report(self) -> list[str]:
        more = self.count - len(self.messages)
        return self.messages + ([f"{self.where}: {more} more failure(s)"] if more > 0 else [])


# ---- rows ------------------------------------------------------------------------------


class Rows:
    """The rows the block moves: ``TEMPLATES`` distinct contents of ``n`` rows each;
    batch ``j`` under ``prefix`` is template ``j % TEMPLATES`` keyed ``{prefix}{j}-{i}/c0``."""

    def __init__(self, sizes: ElasticSizes, n: int) -> None:
        self.templates = [template_batch(n, sizes.tokens, layers=sizes.layers, top_k=sizes.top_k, routes=sizes.routes, seed=s)
                          for s in range(TEMPLATES)]
        self.n = n
        self.row_bytes = self.templates[0].nbytes / n  # bytes per row, payload and offsets

    def batch(self, prefix: str, j: int) -> PackedBatch:
        return with_keys(self.templates[j % TEMPLATES], f"{prefix}{j}-", 0, self.n)

    def batches_for(self, nbytes: int) -> int:
        """Batches of ``n`` rows that hold about ``nbytes`` (at least one)."""
        return max(1, round(nbytes / (self.row_bytes * self.n)))


def read_back_problems(want: PackedBatch, got: PackedBatch) -> list[str]:
    """Every row of ``want`` against ``got``, bit for bit: whole buffers first (the rows of
    one put come back packed alike), row by row only when those differ."""
    if list(got.keys) != list(want.keys):
        return [f"read back {len(got.keys)} keys {list(got.keys)[:2]}.., expected {len(want.keys)} {list(want.keys)[:2]}.."]
    for name, w in want.fields.items():
        g = got.fields.get(name)
        same = g is not None and w.values.dtype == g.values.dtype and np.array_equal(w.values, g.values) \
            and np.array_equal(w.offsets - w.offsets[0], g.offsets - g.offsets[0]) \
            and (w.present is None) == (g.present is None) and (w.present is None or np.array_equal(w.present, g.present))
        if not same:
            return compare_rows(want, got)
    return []


def fill(store: PlacedStoreLike, rows: Rows, prefix: str, batches: int, failures: Failures) -> None:
    """Put ``batches`` batches under ``prefix``; refused keys go to ``failures``."""
    for j in range(batches):
        res = store.put_many(rows.batch(prefix, j))
        if res.failed:
            failures.add(_refused("fill put", res.failed))


def _refused(what: str, failed: Mapping[str, tuple[str, str]]) -> str:
    key, why = next(iter(failed.items()))
    return f"{what}: {len(failed)} key(s) failed, e.g. {key}: {why}"


# ---- the loop ----------------------------------------------------------------------------


@dataclass
class Call:
    """One timed call of the loop: ``op`` (put, get, delete), start and end (perf_counter s), rows."""

    op: str
    t0: float
    t1: float
    rows: int


class Loop(threading.Thread):
    """Puts new batches, gets batches already put (checked bit for bit), deletes its
    oldest beyond ``live`` batches; every call timed (:class:`Call`). ``prefilled``:
    batches under ``f`` readable from the start."""

    def __init__(self, store: PlacedStoreLike, rows: Rows, prefilled: int, live: int, failures: Failures) -> None:
        super().__init__(name="bench-elastic-loop", daemon=True)
        self.store, self.rows, self.prefilled, self.live, self.failures = store, rows, prefilled, live, failures
        self.calls: list[Call] = []
        self.read_back_rows = 0
        self.rounds = 0
        self.stop = threading.Event()
        self._rng = np.random.default_rng(11)
        self._kept: list[int] = []  # the loop's batches, oldest first

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.round()
            except Exception as e:  # noqa: BLE001 - a failed call is reported, the loop goes on
                self.failures.add(f"loop call raised {type(e).__name__}: {e}")

    def _timed(self, op: str, rows: int, call):
        t0 = time.perf_counter()
        out = call()
        self.calls.append(Call(op, t0, time.perf_counter(), rows))
        return out

    def round(self) -> None:
        j, self.rounds = self.rounds, self.rounds + 1
        batch = self.rows.batch("L", j)
        res = self._timed("put", len(batch), lambda: self.store.put_many(batch))
        if res.failed:
            self.failures.add(_refused(f"put of batch L{j}", res.failed))
        else:
            self._kept.append(j)
        self.get_one()
        if len(self._kept) > self.live:
            old = self._kept.pop(0)
            keys = self.rows.batch("L", old).keys
            res = self._timed("delete", len(keys), lambda: self.store.delete(keys))
            if res.failed:
                self.failures.add(_refused(f"delete of batch L{old}", res.failed))

    def get_one(self) -> None:
        """One get of a random batch already put (pre-filled or the loop's), compared."""
        pick = int(self._rng.integers(self.prefilled + len(self._kept)))
        prefix, j = ("f", pick) if pick < self.prefilled else ("L", self._kept[pick - self.prefilled])
        want = self.rows.batch(prefix, j)
        got = self._timed("get", len(want), lambda: self.store.get_many(want.keys))
        if got.failed:
            self.failures.add(_refused(f"get of batch {prefix}{j}", got.failed))
        for problem in read_back_problems(want, got.batch)[:2]:
            self.failures.add(f"get of batch {prefix}{j}: {problem}")
        self.read_back_rows += len(got.batch)

    def all_kept(self) -> list[tuple[str, int]]:
        """Every batch that should be readable now (pre-filled and the loop's kept ones)."""
        return [("f", j) for j in range(self.prefilled)] + [("L", j) for j in self._kept]


def window_rates(calls: Sequence[Call], lo: float, hi: float) -> dict[str, float]:
    """Rows/s of the put and the get calls that started in ``[lo, hi)`` (rows over the
    seconds spent in those calls), their counts, and the window's length (s)."""
    out: dict[str, float] = {"seconds": round(hi - lo, 3)}
    for op in ("put", "get"):
        mine = [c for c in calls if c.op == op and lo <= c.t0 < hi]
        spent = sum(c.t1 - c.t0 for c in mine)
        out[f"{op}_rows_per_s"] = round(sum(c.rows for c in mine) / spent, 1) if spent > 0 else 0.0
        out[f"{op}_calls"] = len(mine)
    return out


# ---- the cluster -------------------------------------------------------------------------


class ElasticCluster:
    """The block's LocalCluster and a client of it: storage workers added and retired."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        self.cluster, self.client = cluster, client
        self.base = len(self.workers())

    def workers(self) -> set[str]:
        return set(self.client.scheduler_info(n_workers=-1)["workers"])

    def add_storage_worker(self, timeout_s: float = 120.0) -> tuple[str, float]:
        """Scale to one more worker (carrying the storage resource); its address and the
        moment it was seen joined (perf_counter s, polled every 10 ms)."""
        before = self.workers()
        self.cluster.scale(len(self.cluster.worker_spec) + 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            new = self.workers() - before
            if new:
                return new.pop(), time.perf_counter()
            time.sleep(0.01)
        raise TimeoutError(f"no worker joined within {timeout_s:.0f} s of cluster.scale")

    def retire(self, address: str, timeout_s: float = 120.0) -> None:
        """``client.retire_workers`` (the store host drains the worker's units first), then
        the cluster's spec shrinks to match; returns once the worker's process is gone.
        (``cluster.scale`` alone would not drain: SpecCluster asks the scheduler to retire
        the worker by its name, and the host drains by address.)"""
        self.client.retire_workers([address], close_workers=True)
        self.cluster.scale(len(self.cluster.worker_spec) - 1)
        deadline = time.monotonic() + timeout_s
        while address in self.workers() or len(self.cluster.workers) > len(self.cluster.worker_spec):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {address} still running {timeout_s:.0f} s after retire_workers")
            time.sleep(0.05)

    def changes(self) -> list[dict]:
        from ..store.hosted import hosted_stores

        return next((s["changes"] for s in hosted_stores(self.client) if s["name"] == STORE_NAME), [])

    def next_change(self, seen: int, timeout_s: float = CHANGE_TIMEOUT_S) -> tuple[dict, float]:
        """The change record after the first ``seen`` and when it was listed (perf_counter s;
        polled every 20 ms)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            changes = self.changes()
            if len(changes) > seen:
                return changes[seen], time.perf_counter()
            time.sleep(0.02)
        raise TimeoutError(f"the store host listed no new change within {timeout_s:.0f} s")


@contextlib.contextmanager
def elastic_cluster(n_workers: int = 2) -> Iterator[ElasticCluster]:
    """A loopback LocalCluster of ``n_workers`` single-threaded worker processes carrying
    ``RESOURCES``, the store host preloaded (:func:`pipeline.cluster.local_cluster`)."""
    from distributed import Client

    from ..cluster import local_cluster

    with local_cluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0",
                       resources=dict(RESOURCES)) as cluster, Client(cluster) as client:
        client.wait_for_workers(n_workers)
        yield ElasticCluster(cluster, client)


@contextlib.contextmanager
def hosted_store(ec: ElasticCluster, replicas: int) -> Iterator[PlacedStoreLike]:
    """A hosted store of 2 units with ``replicas`` copies per key (memory-resident: 4 GiB
    per unit before spilling), closed on exit."""
    import dask

    from ..store.hosted import close_hosted, start_hosted

    with dask.config.set({"token-capture.store.replicas": replicas}):
        store = start_hosted(ec.client, STORE_NAME, n_units=2, memory_limit="4GiB")
    try:
        yield store
    finally:
        close_hosted(ec.client, STORE_NAME)


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
    record, listed = ec.next_change(seen)
    windows["during_add"].append((joined, listed))
    changes.append(record)
    t0 = time.perf_counter()
    ec.retire(address)
    windows["during_drain"].append((t0, time.perf_counter()))
    changes.extend(ec.changes()[seen + 1:])
    return record


def _summary(calls: Sequence[Call], bounds: Sequence[tuple[float, float]]) -> dict[str, float | list[float]]:
    """Medians over the windows of :func:`window_rates`, and every window's figures."""
    per = [window_rates(calls, lo, hi) for lo, hi in bounds]
    out: dict[str, float | list[float]] = {}
    for key in ("put_rows_per_s", "get_rows_per_s"):
        out[key] = round(statistics.median(w[key] for w in per), 1) if per else 0.0
        out[f"{key}_runs"] = [w[key] for w in per]
    for key in ("seconds", "put_calls", "get_calls"):
        out[f"{key}_runs"] = [w[key] for w in per]
    return out


def throughput(ec: ElasticCluster, sizes: ElasticSizes, replicas: int, rows: Rows, failures: Failures) -> dict:
    """Part 1 for one replicas count (module docstring): figures of each window kind,
    the ratios and their target, the changes' records, the rows read back."""
    say = notes(f"store elastic r{replicas}", sizes.quiet)
    windows: dict[str, list[tuple[float, float]]] = {"baseline": [], "during_add": [], "during_drain": []}
    changes: list[dict] = []
    with hosted_store(ec, replicas) as store:
        prefilled = rows.batches_for(sizes.fill_bytes)
        fill(store, rows, "f", prefilled, failures)
        loop = Loop(store, rows, prefilled, rows.batches_for(sizes.live_bytes), failures)
        loop.start()
        try:
            for k in range(sizes.alternations):
                added = _round(ec, sizes, windows, changes)
                say(f"round {k + 1}/{sizes.alternations}: the add moved {added['rows_moved']} rows in {added['seconds']:.2f} s")
        except Exception as e:  # noqa: BLE001 - reported, then fails the command
            failures.add(f"{type(e).__name__}: {e}")
        finally:
            loop.stop.set()
            loop.join()
        final = _read_all(store, rows, loop.all_kept(), failures)
    out: dict = {"replicas": replicas, "prefilled_rows": prefilled * rows.n, "loop_rounds": loop.rounds,
                 "rows_read_back_in_loop": loop.read_back_rows, "rows_read_back_after": final}
    out |= {kind: _summary(loop.calls, bounds) for kind, bounds in windows.items()}
    base, during = out["baseline"], out["during_add"]
    for op in ("put", "get"):
        if base[f"{op}_rows_per_s"] > 0:
            out[f"{op}_rows_per_s_during_vs_without"] = round(during[f"{op}_rows_per_s"] / base[f"{op}_rows_per_s"], 3)
    out["target_ratio"] = TARGET_RATIO
    if "put_rows_per_s_during_vs_without" in out and "get_rows_per_s_during_vs_without" in out:
        out["meets_target"] = min(out["put_rows_per_s_during_vs_without"], out["get_rows_per_s_during_vs_without"]) >= TARGET_RATIO
    out["changes"] = changes
    return out


def _read_all(store: PlacedStoreLike, rows: Rows, batches: Sequence[tuple[str, int]], failures: Failures) -> int:
    """Every batch of ``batches`` read back and compared bit for bit; rows read back."""
    n = 0
    for prefix, j in batches:
        want = rows.batch(prefix, j)
        got = store.get_many(want.keys)
        if got.failed:
            failures.add(_refused(f"read-back of batch {prefix}{j}", got.failed))
        for problem in read_back_problems(want, got.batch)[:2]:
            failures.add(f"read-back of batch {prefix}{j}: {problem}")
        n += len(got.batch)
    return n


# ---- part 2: seconds to rebalance --------------------------------------------------------


def rebalance(ec: ElasticCluster, sizes: ElasticSizes, failures: Failures) -> dict:
    """Part 2 (module docstring): fill 2 units with ``sizes.rebalance_bytes``, add a third,
    time the change; read everything back; drain it again."""
    say = notes("store elastic rebalance", sizes.quiet)
    rows = Rows(sizes, FILL_ROWS_PER_CALL)
    batches = rows.batches_for(sizes.rebalance_bytes)
    n_rows = batches * rows.n
    out: dict = {"rows": n_rows, "bytes": int(n_rows * rows.row_bytes), "replicas": 1, "copies": n_rows}
    with hosted_store(ec, 1) as store:
        t0 = time.perf_counter()
        fill(store, rows, "R", batches, failures)
        out["fill_s"] = round(time.perf_counter() - t0, 2)
        say(f"filled {out['bytes'] / 1e9:.2f} GB in {out['fill_s']} s; adding a unit")
        try:
            seen = len(ec.changes())
            address, joined = ec.add_storage_worker()
            record, listed = ec.next_change(seen)
            out |= _move_figures(record, listed - joined, rows.row_bytes, n_rows)
            say(f"moved {record['rows_moved']} rows in {record['seconds']:.2f} s")
            out["rows_read_back"] = _read_all(store, rows, [("R", j) for j in range(batches)], failures)
            ec.retire(address)
            drained = ec.changes()[seen + 1:]
            out["drain_seconds"] = round(drained[-1]["seconds"], 3) if drained else None
        except Exception as e:  # noqa: BLE001 - reported, then fails the command
            failures.add(f"{type(e).__name__}: {e}")
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
    }


# ---- the block ---------------------------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    """Both parts on a cluster of the block's own; ``ok``, ``failures``, no ratio on failure."""
    sizes = ElasticSizes.from_args(args)
    say = notes("store elastic", sizes.quiet)
    t0 = time.perf_counter()
    parts: list[Failures] = []
    rows = Rows(sizes, sizes.rows_per_call)
    out: dict = {"tokens_per_row": sizes.tokens, "row_bytes": int(rows.row_bytes), "rows_per_call": sizes.rows_per_call,
                 "window_s": sizes.window_s, "alternations": sizes.alternations}
    with elastic_cluster() as ec:
        for r in sizes.replicas:
            parts.append(Failures(f"replicas={r}"))
            out[f"replicas_{r}"] = throughput(ec, sizes, r, rows, parts[-1])
            say(f"replicas={r}: " + ", ".join(f"{k} {out[f'replicas_{r}'].get(k)}" for k in ("put_rows_per_s_during_vs_without", "get_rows_per_s_during_vs_without")))
        parts.append(Failures("rebalance"))
        out["rebalance"] = rebalance(ec, sizes, parts[-1])
    wire = loopback.measure(16 << 20, 8)  # the same machine's raw TCP, right after
    move = out["rebalance"]
    move["loopback_send_gb_per_s"] = round(wire["send_bytes_per_s"] / 1e9, 3)
    if move.get("move_gb_per_s"):
        move["move_vs_loopback_ratio"] = round(move["move_gb_per_s"] / move["loopback_send_gb_per_s"], 3)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["failures"] = [m for p in parts for m in p.report()]
    out["ok"] = not out["failures"]
    if not out["ok"]:
        drop_ratios(out)
    return out


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
