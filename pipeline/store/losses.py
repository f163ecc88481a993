"""A unit's record of key NAMES (replicas=2): the keys it witnesses for two other units,
and the keys whose two copies were both lost.

Names only, no rows. A witnessed name says a key was staged on two other units; when
both die together the repairer turns the names into lost keys on their replacements. A
lost key reads ``lost_key`` and refuses puts until a delete forgets it (see
:mod:`pipeline.store.repair`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

from tasks.errors import InvalidStoreRequest
from tasks.keys import primary_units


def lost_detail(key: str, how: str) -> str:
    return f"{key!r} was staged, but both its copies were lost ({how}); delete it to forget the loss"


@dataclass
class LossBook:
    """Per partition: witnessed names, and lost keys with how they were lost."""

    witnessed: dict[str, dict[str, None]] = field(default_factory=dict)
    lost: dict[str, dict[str, str]] = field(default_factory=dict)

    def witness(self, partition: str, add: Iterable[str] = (), drop: Iterable[str] = ()) -> int:
        """Record ``add`` and forget ``drop``; how many names ``partition`` now holds."""
        names = self.witnessed.setdefault(partition, {})
        names.update(dict.fromkeys(k for k in add if isinstance(k, str)))
        for key in drop:
            names.pop(key, None)
        return len(names)

    def witnessed_of(self, partition: str, primary: int | None = None, units: int | Sequence[str] | None = None) -> list[str]:
        """The witnessed names of ``partition``: all of them, or (``primary`` given) those
        whose primary is unit ``primary`` of ``units`` (the table's unit ids, or a unit
        count: the default ids), ranked as the placement ranks them."""
        names = list(self.witnessed.get(partition, {}))
        if primary is None or not names:
            return names
        if units is None:
            raise InvalidStoreRequest("witnessed names by primary need the table's units (ids or count)")
        return [names[i] for i in np.flatnonzero(primary_units(names, units) == primary)]

    def mark(self, partition: str, keys: Iterable[str], how: str, held: dict[str, str]) -> int:
        """Record ``keys`` not in ``held`` (the unit's index) as lost; how many were new."""
        lost = self.lost.setdefault(partition, {})
        new = [k for k in keys if isinstance(k, str) and k not in held and k not in lost]
        lost.update(dict.fromkeys(new, str(how)))
        return len(new)

    def how(self, partition: str, key: object) -> str | None:
        """How ``key`` was lost, or None if it is not a lost key."""
        return self.lost.get(partition, {}).get(key) if isinstance(key, str) else None

    def forget(self, partition: str, key: object) -> bool:
        """Forget a lost key (a delete); True if it was one."""
        return isinstance(key, str) and self.lost.get(partition, {}).pop(key, None) is not None

    def lost_count(self) -> int:
        return sum(len(d) for d in self.lost.values())

    def witnessed_count(self) -> int:
        return sum(len(d) for d in self.witnessed.values())

    def clear(self) -> None:
        self.witnessed.clear()
        self.lost.clear()
