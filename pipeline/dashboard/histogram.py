"""A fixed-bucket histogram with Prometheus semantics, as the state keeps and serves them."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Histogram:
    """Fixed-bucket histogram with Prometheus semantics (a value lands in ``le >= value``).

    ``bounds`` are the buckets' upper bounds, in the unit of the values (seconds for the
    ``*_seconds`` histograms, calls for ``calls_per_rollout``). ``counts[i]`` counts values
    in ``(bounds[i-1], bounds[i]]``; the last slot is +Inf. ``total`` is the sum of the
    values, ``n`` their number.
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.bounds = tuple(sorted(float(b) for b in self.bounds))
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        """Count one ``value`` (in the unit of the bounds)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def add_counts(self, bounds: Sequence[float], counts: Sequence[int], total: float) -> None:
        """Add another histogram's per-bucket ``counts`` over ``bounds`` (plus +Inf) and its
        sum. Each bucket lands in ours whose ``le`` is >= its own upper bound: exact when
        the bounds match (both sides read ``metrics.buckets-seconds``), an upper estimate
        otherwise."""
        for i, n in enumerate(counts):
            slot = bisect_left(self.bounds, bounds[i]) if i < len(bounds) else len(self.bounds)
            self.counts[slot] += n
            self.n += n
        self.total += total

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, cumulative count), ...]`` ending with ``("+Inf", n)``."""
        out: list[tuple[str, int]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            out.append((_le(bound), running))
        out.append(("+Inf", self.n))
        return out


def _le(bound: float) -> str:
    """A bucket bound as its ``le`` label (``1`` for 1.0, ``0.25`` otherwise)."""
    return str(int(bound)) if float(bound).is_integer() else repr(bound)
