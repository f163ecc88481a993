"""Storage scaling: a pure decision on the store's fill, and how it joins the finalize one.

:func:`decide_storage` turns the aggregator's signal (the live units' used and capacity
bytes, their count, the largest unit's capacity) into a frozen :class:`StorageDecision`:
``up`` (one more storage worker) when the store is at or above ``store.scale-up-fill``,
``down`` (one storage worker fewer) when it would still be below ``store.scale-down-fill``
without its largest unit, else ``hold``. :func:`combine` folds it into the finalize
decision's worker target as a :class:`WorkerPlan`. Knobs: :class:`StorageScalingSettings`,
read once. Policy and its interplay with the store's control plane: docs/design.md, "Scaling".
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from dask.utils import format_bytes

from tasks.errors import InvalidInput

from .. import config

STORAGE_RESOURCE = "storage"
"""The worker resource that marks the storage role: a worker joining with it gets a unit."""

KIND = "storage"
"""The ``kind`` of a storage decision's ``SCALE`` event (the finalize pool's is ``finalize``)."""

REASON_CODES = (
    "storage-no-signal", "storage-fill-high", "storage-fill-low", "storage-at-floor",
    "storage-balanced", "storage-up-pending", "storage-at-maximum",
)
"""Every storage ``reason_code``; all start with ``storage-`` (they never collide with the
finalize pool's codes on the page or in ``/metrics``)."""


class InvalidScalingSettings(InvalidInput):
    """A storage scaling knob out of range (names the key and the value)."""


@dataclass(frozen=True)
class StorageScalingSettings:
    """The storage policy's knobs, read once by :meth:`from_config`.

    Fills are fractions of the store's capacity (used bytes / capacity bytes, 0..1).
    """

    scale_up_fill: float  # store.scale-up-fill: at or above, one more storage worker
    scale_down_fill: float  # store.scale-down-fill: below it without the largest unit, one fewer
    min_units: int  # store.min-units: never fewer units
    replicas: int  # store.replicas: never fewer units than copies of a key
    settle_s: float  # store.scale-settle-s: after an up (a drain), the next waits for the unit count to change, at most this long (s)
    storage_resource: bool  # scaling.ensure-storage-resource: a storage up's worker carries `storage: 1`

    def __post_init__(self) -> None:
        if not 0.0 < self.scale_up_fill <= 1.0:
            raise InvalidScalingSettings(f"store.scale-up-fill must be in (0, 1], got {self.scale_up_fill!r}")
        if not 0.0 <= self.scale_down_fill < self.scale_up_fill:
            raise InvalidScalingSettings(
                f"store.scale-down-fill must be in [0, store.scale-up-fill = {self.scale_up_fill!r}), "
                f"got {self.scale_down_fill!r}: a store just scaled down must not be full"
            )
        if self.min_units < 1:
            raise InvalidScalingSettings(f"store.min-units must be >= 1, got {self.min_units!r}")
        if self.replicas not in (1, 2):
            raise InvalidScalingSettings(f"store.replicas must be 1 or 2, got {self.replicas!r}")
        if self.settle_s < 0:
            raise InvalidScalingSettings(f"store.scale-settle-s must be >= 0, got {self.settle_s!r}")

    @property
    def floor(self) -> int:
        """The fewest units the policy keeps: ``min_units``, and at least ``replicas``."""
        return max(1, self.min_units, self.replicas)

    @classmethod
    def from_config(cls) -> StorageScalingSettings:
        """The current ``dask.config`` values."""
        return cls(
            scale_up_fill=float(config.get("store.scale-up-fill")),
            scale_down_fill=float(config.get("store.scale-down-fill")),
            min_units=int(config.get("store.min-units")),
            replicas=int(config.get("store.replicas")),
            settle_s=float(config.get("store.scale-settle-s")),
            storage_resource=bool(config.get("scaling.ensure-storage-resource")),
        )


@dataclass(frozen=True)
class StorageDecision:
    """One storage decision: ``action`` up/down/hold by one storage worker, a stable
    ``reason_code`` (:data:`REASON_CODES`), the ``reason`` with its figures, and the
    figures (bytes; ``units`` a count) over the live units it was made from."""

    action: str
    reason_code: str
    reason: str
    used_bytes: float = 0.0
    capacity_bytes: float = 0.0
    units: int = 0
    largest_bytes: float = 0.0  # the capacity of the largest unit

    @property
    def fill(self) -> float:
        """used / capacity (0 when the capacity is 0)."""
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes > 0 else 0.0

    def asked(self, current: int) -> int:
        """The worker count this decision asks for, from ``current`` workers."""
        return current + 1 if self.action == "up" else max(0, current - 1) if self.action == "down" else current

    def payload(self, current: int) -> dict[str, str | int | float]:
        """The ``SCALE`` event (schema in ``pipeline.events``): ``kind`` ``storage``,
        ``target`` what it asks for (workers), and the store's figures."""
        return {
            "kind": KIND, "action": self.action, "target": self.asked(current), "current": current,
            "reason_code": self.reason_code, "reason": self.reason, "store_used_bytes": self.used_bytes,
            "store_capacity_bytes": self.capacity_bytes, "store_units": self.units, "store_fill": self.fill,
        }


def percent(fraction: float) -> str:
    """``fraction`` as a percentage for people: whole percents, two digits below 1%."""
    return f"{fraction:.0%}" if fraction == 0 or fraction >= 0.01 else f"{fraction * 100:.2g}%"


def _filled(used: float, capacity: float, units: int) -> str:
    return f"store {percent(used / capacity)} full ({format_bytes(int(used))} of {format_bytes(int(capacity))} in {units} unit(s))"


def decide_storage(signal: Mapping[str, float], settings: StorageScalingSettings | None = None) -> StorageDecision:
    """The storage policy: a pure function of the aggregator's signal and its knobs.

    ``signal`` is :meth:`TokenCaptureAggregator.signal`'s dict (``store_used_bytes``,
    ``store_capacity_bytes``, ``store_units``, ``store_unit_capacity_max_bytes``, bytes and
    a count over the live units); ``settings`` default to :meth:`StorageScalingSettings.from_config`.
    """
    s = StorageScalingSettings.from_config() if settings is None else settings
    used = float(signal.get("store_used_bytes", 0.0))
    capacity = float(signal.get("store_capacity_bytes", 0.0))
    units = int(signal.get("store_units", 0))
    largest = float(signal.get("store_unit_capacity_max_bytes", 0.0))

    def made(action: str, code: str, why: str) -> StorageDecision:
        return StorageDecision(action, code, f"{code}: {why}", used, capacity, units, largest)

    if units <= 0:
        return made("hold", "storage-no-signal", "no storage unit reported recently")
    if capacity <= 0:
        return made("hold", "storage-no-signal", f"{units} unit(s) report no capacity")
    fill = used / capacity
    filled = _filled(used, capacity, units)
    if fill >= s.scale_up_fill:
        return made("up", "storage-fill-high", f"{filled}, at or above {percent(s.scale_up_fill)}: one more storage worker")
    rest = capacity - largest
    without = used / rest if rest > 0 else fill  # one unit (or one holding it all): its own fill
    if without < s.scale_down_fill:
        if units - 1 < s.floor:
            return made("hold", "storage-at-floor", f"{filled}; {units} unit(s) is the floor "
                        f"(store.min-units {s.min_units}, replicas {s.replicas})")
        return made("down", "storage-fill-low", (
            f"{filled}; without its largest unit ({format_bytes(int(largest))}) {percent(without)}, below "
            f"{percent(s.scale_down_fill)}: one storage worker fewer, retired only once its unit has drained "
            "(a unit's host is protected until then)"))
    return made("hold", "storage-balanced", f"{filled}; between {percent(s.scale_down_fill)} (without the largest unit) "
                f"and {percent(s.scale_up_fill)}")


def pending(decision: StorageDecision, units_at_up: int) -> StorageDecision:
    """``decision`` (an up) held while the last up's unit has not reported yet."""
    filled = _filled(decision.used_bytes, decision.capacity_bytes, decision.units)
    return replace(decision, action="hold", reason_code="storage-up-pending", reason=(
        f"storage-up-pending: {filled}; the storage worker added at {units_at_up} unit(s) has no unit "
        "reporting yet: no other one before it does (or store.scale-settle-s passed)"))


def at_maximum(decision: StorageDecision, maximum: float) -> StorageDecision:
    """``decision`` (an up) held at the cluster's maximum."""
    filled = _filled(decision.used_bytes, decision.capacity_bytes, decision.units)
    return replace(decision, action="hold", reason_code="storage-at-maximum", reason=(
        f"storage-at-maximum: {filled}, full, but the cluster is at its maximum {maximum:g} workers"))


@dataclass(frozen=True)
class WorkerPlan:
    """The worker target of one round, finalize and storage decisions combined:
    ``target`` (workers), ``storage`` (the storage decision as published),
    ``add_storage_worker`` (one new worker takes the storage role) and
    ``retire_storage_worker`` (the one fewer worker must be a drained storage worker)."""

    target: int
    storage: StorageDecision
    add_storage_worker: bool = False
    retire_storage_worker: bool = False


def combine(finalize_action: str, finalize_target: int, storage: StorageDecision, current: int,
            minimum: int, maximum: float, drained: bool = False) -> WorkerPlan:
    """Join the finalize decision (``finalize_action``, ``finalize_target`` workers) and
    ``storage`` for ``current`` workers within ``minimum``/``maximum``.

    A storage up raises the target by one worker above the finalize one (never below
    ``current``), unless at ``maximum``; a pending up keeps ``current``. A storage down
    lowers it by one only while the finalize side holds and ``drained`` (a storage-role
    worker hosts no unit any more): a unit's host is never retired by it.
    """
    if storage.action == "up":
        base = max(finalize_target, current)
        if base + 1 > maximum:
            return WorkerPlan(finalize_target, at_maximum(storage, maximum))
        return WorkerPlan(base + 1, storage, add_storage_worker=True)
    if storage.reason_code == "storage-up-pending":
        return WorkerPlan(max(finalize_target, current), storage)
    if storage.action == "down" and finalize_action == "hold" and drained and current - 1 >= minimum:
        return WorkerPlan(current - 1, storage, retire_storage_worker=True)
    return WorkerPlan(finalize_target, storage)


def storage_worker_spec(spec: object) -> dict | None:
    """A copy of a ``SpecCluster`` worker template (``new_spec``) whose worker advertises
    the storage role (``storage: 1``), or None when ``spec`` is no such template."""
    if not isinstance(spec, dict) or not isinstance(spec.get("options"), dict):
        return None
    resources = {**(spec["options"].get("resources") or {}), STORAGE_RESOURCE: 1.0}
    return {**spec, "options": {**spec["options"], "resources": resources}}
