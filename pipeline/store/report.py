"""Store figures for the dashboard and ``/metrics``: one ``STORE`` event per unit.

Reading a unit's stats is one actor round trip per unit, so callers report at their own
cadence (the demo and the controller loop after each step) rather than per put.
"""
from __future__ import annotations

from typing import Any

from ..events import STORE, publish


def report_store(store: Any) -> list[dict[str, Any]]:
    """Publish each unit's rows, memory and spilled bytes; return the unit stats."""
    stats = store.stats()
    for s in stats:
        publish(
            STORE,
            {
                "unit": s["unit"],
                "worker": s.get("worker"),
                "rows": s["rows"],
                "memory_bytes": s["memory_bytes"],
                "spilled_bytes": s["spilled_bytes"],
            },
        )
    return stats
