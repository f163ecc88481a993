"""The elastic block's load (:mod:`.store_elastic`): its rows (distinct contents cycled
over batches), the bit-exact check of rows read back, and the put+get loop whose every
call is timed, so rates can be taken over any window afterwards."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from tasks.packed import PackedBatch

from .common import compare_rows, refused
from .store_rows import template_batch, with_keys

if TYPE_CHECKING:
    from ..store.protocol import PlacedStoreLike

TEMPLATES = 4  # distinct row contents, cycled over batches: a row read from the wrong key differs
MAX_MESSAGES = 4  # failure messages kept per part and kind (the count is kept too)
T = TypeVar("T")


class Failures:
    """Failure messages of one part, thread-safe: per kind (the message up to " of " or
    ":", e.g. "get", "read-back", "put"), the first MAX_MESSAGES and how many there were."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.messages: dict[str, list[str]] = {}
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, text: str) -> None:
        kind = text.split(":", 1)[0].split(" of ", 1)[0]
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            kept = self.messages.setdefault(kind, [])
            if len(kept) < MAX_MESSAGES:
                kept.append(f"{self.where}: {text}")

    def report(self) -> list[str]:
        """Every kind's messages, then ``N more <kind> failure(s)`` past MAX_MESSAGES."""
        with self._lock:
            out: list[str] = []
            for kind, kept in self.messages.items():
                out += kept
                if self.counts[kind] > len(kept):
                    out.append(f"{self.where}: {self.counts[kind] - len(kept)} more {kind} failure(s)")
            return out


# ---- rows ------------------------------------------------------------------------------


class Rows:
    """The rows the block moves: ``TEMPLATES`` distinct contents of ``n`` rows each;
    batch ``j`` under ``prefix`` is template ``j % TEMPLATES`` keyed ``{prefix}{j}-{i}/c0``."""

    def __init__(self, n: int, tokens: int, layers: int, top_k: int, routes: bool) -> None:
        self.templates = [template_batch(n, tokens, layers=layers, top_k=top_k, routes=routes, seed=s) for s in range(TEMPLATES)]
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
            failures.add(refused("fill put", res.failed))


def read_all(store: PlacedStoreLike, rows: Rows, batches: Sequence[tuple[str, int]], failures: Failures) -> int:
    """Every batch of ``batches`` read back and compared bit for bit; rows read back."""
    n = 0
    for prefix, j in batches:
        want = rows.batch(prefix, j)
        got = store.get_many(want.keys)
        if got.failed:
            failures.add(refused(f"read-back of batch {prefix}{j}", got.failed))
        for problem in read_back_problems(want, got.batch)[:2]:
            failures.add(f"read-back of batch {prefix}{j}: {problem}")
        n += len(got.batch)
    return n


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
                self.stop.wait(0.05)

    def _timed(self, op: str, rows: int, call: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        out = call()
        self.calls.append(Call(op, t0, time.perf_counter(), rows))
        return out

    def round(self) -> None:
        j, self.rounds = self.rounds, self.rounds + 1
        batch = self.rows.batch("L", j)
        res = self._timed("put", len(batch), lambda: self.store.put_many(batch))
        if res.failed:
            self.failures.add(refused(f"put of batch L{j}", res.failed))
        else:
            self._kept.append(j)
        self.get_one()
        if len(self._kept) > self.live:
            old = self._kept.pop(0)
            keys = self.rows.batch("L", old).keys
            res = self._timed("delete", len(keys), lambda: self.store.delete(keys))
            if res.failed:
                self.failures.add(refused(f"delete of batch L{old}", res.failed))

    def get_one(self) -> None:
        """One get of a random batch already put (pre-filled or the loop's), compared."""
        pick = int(self._rng.integers(self.prefilled + len(self._kept)))
        prefix, j = ("f", pick) if pick < self.prefilled else ("L", self._kept[pick - self.prefilled])
        want = self.rows.batch(prefix, j)
        got = self._timed("get", len(want), lambda: self.store.get_many(want.keys))
        if got.failed:
            self.failures.add(refused(f"get of batch {prefix}{j}", got.failed))
        for problem in read_back_problems(want, got.batch)[:2]:
            self.failures.add(f"get of batch {prefix}{j}: {problem}")
        self.read_back_rows += len(got.batch)

    def all_kept(self) -> list[tuple[str, int]]:
        """Every batch that should be readable now (pre-filled and the loop's kept ones)."""
        return [("f", j) for j in range(self.prefilled)] + [("L", j) for j in self._kept]


def window_rates(calls: Sequence[Call], lo: float, hi: float) -> dict[str, float]:
    """Rows/s of the put and the get calls that ran during ``[lo, hi)`` (started before
    its end and ended after its start: a call a change slowed counts; rows over the
    seconds spent in those calls), their counts, the slowest call's seconds, and the
    window's length (s)."""
    out: dict[str, float] = {"seconds": round(hi - lo, 3)}
    for op in ("put", "get"):
        mine = [c for c in calls if c.op == op and c.t0 < hi and c.t1 > lo]
        spent = sum(c.t1 - c.t0 for c in mine)
        out[f"{op}_rows_per_s"] = round(sum(c.rows for c in mine) / spent, 1) if spent > 0 else 0.0
        out[f"{op}_calls"] = len(mine)
        out[f"{op}_slowest_s"] = round(max((c.t1 - c.t0 for c in mine), default=0.0), 3)
    return out
