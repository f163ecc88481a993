"""Staging store panels: bytes in memory / spilled per storage unit (stacked bars, one row
per unit, the first :data:`~pipeline.dashboard.style.MAX_BARS`) and the units table
(rows, lost keys, bytes), each unit's latest report."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..labels import short_worker, shorten
from ..style import CYAN, GRAY, MAX_BARS
from ..widgets import PanelKit, bar_height, fit, legend, table

if TYPE_CHECKING:
    from ..snapshot import StateSnapshot

STORE_FIGURES = ("memory_bytes", "spilled_bytes", "rows", "lost_keys")


class StorePanels:
    """``tc-fig-store`` and the storage units table (source ``tc-store``)."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool, NumeralTickFormatter

        self.kit = kit
        self.store = ColumnDataSource(
            dict(label=[], unit=[], memory_bytes=[], spilled_bytes=[], rows=[], lost_keys=[], worker=[]), name="tc-store"
        )
        self.fig_store = kit.figure("store", "Store bytes per unit: memory / spilled", y_range=FactorRange())
        bars = self.fig_store.hbar_stack(["memory_bytes", "spilled_bytes"], y="label", height=0.7, source=self.store,
                                         color=[CYAN, GRAY])
        legend(self.fig_store, ["memory", "spilled"], bars)
        self.fig_store.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.fig_store.x_range.start = 0
        self.fig_store.ygrid.visible = False
        self.fig_store.add_tools(HoverTool(tooltips=[
            ("unit", "@unit"), ("worker", "@worker"), ("rows", "@rows"), ("lost keys", "@lost_keys"),
            ("memory", "@memory_bytes{0.0 b}"), ("spilled", "@spilled_bytes{0.0 b}")]))
        self.store_table = table(self.store, [
            ("unit", "unit", None), ("worker", "worker", None), ("rows", "rows", "0,0"),
            ("lost_keys", "lost keys", "0,0"),
            ("memory_bytes", "memory", "0.0 b"), ("spilled_bytes", "spilled", "0.0 b")])
        self.units_block = kit.titled("Storage units (latest report per unit)", "units", self.store_table)

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the store chart (unit 0 on top) and table from ``snap``."""
        units = sorted(snap["store_units"].values(), key=lambda u: (len(u["unit"]), u["unit"]))[:MAX_BARS]
        labels = [f"unit {shorten(u['unit'], 8)} \u00b7 {short_worker(u['worker'])}" if u["worker"]
                  else f"unit {shorten(u['unit'], 8)}" for u in units]
        self.fig_store.y_range.factors = labels[::-1]  # unit 0 on top
        self.fig_store.height = bar_height(len(units))
        self.store.data = dict(
            label=labels, unit=[u["unit"] for u in units], worker=[u["worker"] for u in units],
            **{k: [u[k] for u in units] for k in STORE_FIGURES},
        )
        fit(self.store_table, len(units))
        self.kit.show("store", bool(units))
        self.kit.show("units", bool(units))
