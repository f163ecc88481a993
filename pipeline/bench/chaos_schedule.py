"""The chaos soak's fault schedule (pure: no Dask): when to kill which worker, when to kill
the controller, when to stall a host or cut it off and for how long.

Kills of a storage or finalize worker (half each, in random order) come every 30-60 s
(times ``scale``: the short mode's 0.4 gives 12-24 s); the controller is killed once, between two kills near the
first third of the run; one host is stalled once (its processes stopped, then continued:
alive and silent, as in a long pause or a swap storm) for ``stall_s`` seconds near the
first sixth, ending before the first third; one storage host is cut off once, between two
kills near the second third, for ``partition_s`` seconds. No kill falls within ``gap_s``
of a stall or a cut. Nothing starts in the last ``tail_s`` of the run, so the last
fault's work settles before the run ends. Seconds count from the start of the faulty
run; a seed gives one schedule.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass

KILL_STORAGE = "kill-storage"
KILL_FINALIZE = "kill-finalize"
KILL_CONTROLLER = "kill-controller"
PARTITION = "partition"
STALL = "stall"
KINDS = (KILL_STORAGE, KILL_FINALIZE, KILL_CONTROLLER, PARTITION, STALL)
KILL_EVERY_S = (30.0, 60.0)  # seconds between two worker kills, before scaling


@dataclass(frozen=True)
class Fault:
    """One fault: ``kind`` (:data:`KINDS`) at ``at_s`` seconds into the faulty run,
    lasting ``duration_s`` (a partition or a stall; 0 for a kill)."""

    at_s: float
    kind: str
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ScheduleSettings:
    """A run's length and pace (s): ``duration_s`` of faulty run, intervals times ``scale``,
    a cut of ``partition_s`` and a stall of ``stall_s``, kills kept ``gap_s`` away from
    them, nothing in the last ``tail_s``."""

    duration_s: float
    scale: float = 1.0
    partition_s: float = 20.0
    gap_s: float = 10.0
    tail_s: float = 30.0
    stall_s: float = 15.0

    def kill_interval_s(self) -> tuple[float, float]:
        return KILL_EVERY_S[0] * self.scale, KILL_EVERY_S[1] * self.scale


def kill_times(settings: ScheduleSettings, rng: random.Random) -> list[float]:
    """Worker kill times: gaps drawn uniformly from the scaled interval, until the tail."""
    lo, hi = settings.kill_interval_s()
    end = settings.duration_s - settings.tail_s
    times, t = [], rng.uniform(lo, hi)
    while t < end:
        times.append(round(t, 2))
        t += rng.uniform(lo, hi)
    return times


def _between(times: list[float], near: float, lo: float, end: float) -> float:
    """The midpoint of the two consecutive points of ``[lo] + times + [end]`` around ``near``."""
    points = [lo, *times, end]
    k = min(range(len(points) - 1), key=lambda i: abs((points[i] + points[i + 1]) / 2 - near))
    return round((points[k] + points[k + 1]) / 2, 2)


def fault_schedule(settings: ScheduleSettings, seed: int) -> list[Fault]:
    """The faults of one run, by time: worker kills (storage or finalize at random), one
    controller kill, one stall, one partition (module docstring). Raises ``ValueError``
    when the run is too short to hold the stall and the partition before its tail."""
    end = settings.duration_s - settings.tail_s
    if end / 3 < settings.stall_s + 2 * settings.gap_s or end <= settings.partition_s + 2 * settings.gap_s:
        need = max(3 * (settings.stall_s + 2 * settings.gap_s), settings.partition_s + 2 * settings.gap_s)
        raise ValueError(f"a chaos run of {settings.duration_s:g} s is too short: it needs more than "
                         f"{need + settings.tail_s:g} s (stall, partition, gaps, tail)")
    rng = random.Random(seed)
    kills = kill_times(settings, rng)
    controller = _between(kills, end / 3, 0.0, end)
    cut_mid = _between(kills, 2 * end / 3, 0.0, end)
    cut_at = round(min(max(cut_mid - settings.partition_s / 2, settings.gap_s), end - settings.partition_s), 2)
    stall_mid = _between(kills, end / 6, 0.0, end)
    stall_at = round(min(max(stall_mid - settings.stall_s / 2, settings.gap_s), end / 3 - settings.stall_s - settings.gap_s), 2)
    windows = [(at - settings.gap_s, at + length + settings.gap_s)
               for at, length in ((cut_at, settings.partition_s), (stall_at, settings.stall_s))]
    kept = [t for t in kills if not any(lo <= t <= hi for lo, hi in windows)]
    first = rng.randrange(2)
    kinds = [(KILL_STORAGE, KILL_FINALIZE)[(first + k) % 2] for k in range(len(kept))]
    rng.shuffle(kinds)  # random order, both kinds as soon as there are two kills
    faults = [Fault(t, kind) for t, kind in zip(kept, kinds)]
    faults.append(Fault(controller, KILL_CONTROLLER))
    faults.append(Fault(stall_at, STALL, settings.stall_s))
    faults.append(Fault(cut_at, PARTITION, settings.partition_s))
    return sorted(faults, key=lambda f: (f.at_s, f.kind))
