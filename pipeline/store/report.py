"""Store figures for the dashboard and ``/metrics``: one ``STORE`` event per unit, now.

Storage units publish these figures by themselves every ``store.report-interval-s``
seconds (``pipeline.store.unit.StoreReporter``), so nothing needs to call this for the
page or ``/metrics`` to show the store. :func:`report_store` adds one report at once (the
demo calls it after each step, so the figures match the step just finalized); it costs
one actor round trip per unit.
"""
from __future__ import annotations

from typing import Any

from ..events import STORE, publish


def report_store(store: Any) -> list[dict[str, Any]]:
    """Publish each unit's ``STORE`` event now (as the unit builds it); return the unit stats."""
    stats = store.stats()
    for s in stats:
        publish(STORE, s["event"])
    return stats
