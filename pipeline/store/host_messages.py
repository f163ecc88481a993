"""The store host's messages: what a start request carries and what a listing says
(plain values: they cross the wire). Shared by :mod:`.host` and :mod:`.hosted`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from tasks.errors import InvalidStoreRequest


class HostedStoreInfo(TypedDict):
    """What ``token_capture_store_list`` says about one hosted store."""

    name: str
    units: int
    workers: list[str]
    replicas: int
    version: int
    started_s: float  # wall clock, s
    repaired: list[dict]  # one record per re-replicated unit (the repairer's)
    changes: list[dict]  # one record per unit added or drained (the rebalancer's)
    interrupted: dict | None  # the unfinished move (kind, unit, version, error) the host resumes, or None
    waiting: dict[str, str]  # a change refused StoreBusy and retried ("add on <worker>") -> why it waits
    unit_rows: dict[str, int]  # unit id -> its last known row count (its STORE report, or the last change)
    lost_rows: int  # rows lost with units whose worker died (replicas=1: one copy), as last known
    lost_units: list[dict]  # one record per such unit: unit, worker, rows, known (a count was known), noticed_s


@dataclass(frozen=True)
class StartRequest:
    """A store to start: the requester's own settings, so the store behaves as if the
    requester had started it (the scheduler's config decides only the repair cadence)."""

    name: str
    n_units: int
    replicas: int
    memory_limit: int  # bytes per unit held in memory before spilling
    capacity: int  # bytes per unit, memory and disk
    spill_directory: str | None
    workers: tuple[str, ...] | None
    store_settings: dict[str, int | bool] = field(default_factory=dict)  # StoreSettings fields

    @classmethod
    def from_message(cls, msg: dict) -> StartRequest:
        """Checked: a malformed request is refused with the field it got wrong."""
        name = msg.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidStoreRequest(f"a hosted store needs a non-empty name, got {name!r}")
        ints = {}
        for key in ("n_units", "replicas", "memory_limit", "capacity"):
            value = msg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidStoreRequest(f"hosted store {name!r}: {key} must be a positive int, got {value!r}")
            ints[key] = value
        workers = msg.get("workers")
        if workers is not None and (not isinstance(workers, (list, tuple)) or not all(isinstance(w, str) for w in workers)):
            raise InvalidStoreRequest(f"hosted store {name!r}: workers must be a list of addresses, got {workers!r}")
        spill = msg.get("spill_directory")
        settings = msg.get("store_settings") or {}
        return cls(name, ints["n_units"], ints["replicas"], ints["memory_limit"], ints["capacity"],
                   None if spill is None else str(spill), None if workers is None else tuple(workers), dict(settings))
