"""Restore panels: each batcher worker's latest report, its request latency p50 / p99 (ms)
as bars and its counters (requests, gets, keys, keys per get, failures) in the table."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..labels import short_worker, unique_factors
from ..style import LIGHT_PURPLE, PURPLE
from ..widgets import PanelKit, bar_height, fit, legend, table

if TYPE_CHECKING:
    from ..snapshot import StateSnapshot

RESTORE_FIGURES = ("requests", "gets", "keys", "keys_per_get", "p50_ms", "p99_ms", "failures")


class RestorePanels:
    """``tc-fig-restore`` and the restore batchers table (source ``tc-restore``)."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool

        self.kit = kit
        self.restore = ColumnDataSource(dict(
            worker=[], label=[], requests=[], gets=[], keys=[], keys_per_get=[], p50_ms=[], p99_ms=[], failures=[]),
            name="tc-restore")
        self.fig_restore = kit.figure("restore", "Restore latency per batcher worker (ms): p50 / p99", y_range=FactorRange())
        p99 = self.fig_restore.hbar(y="label", right="p99_ms", height=0.7, source=self.restore, color=LIGHT_PURPLE)
        p50 = self.fig_restore.hbar(y="label", right="p50_ms", height=0.4, source=self.restore, color=PURPLE)
        legend(self.fig_restore, ["p50", "p99"], [p50, p99])
        self.fig_restore.add_tools(HoverTool(tooltips=[
            ("worker", "@worker"), ("requests", "@requests"), ("gets", "@gets"), ("keys/get", "@keys_per_get{0.0}"),
            ("p50", "@p50_ms{0.0} ms"), ("p99", "@p99_ms{0.0} ms"), ("failures", "@failures")]))
        self.fig_restore.xaxis.axis_label = "ms"
        self.fig_restore.x_range.start = 0
        self.fig_restore.ygrid.visible = False
        self.restore_table = table(self.restore, [
            ("worker", "batcher worker", None), ("requests", "requests", "0,0"), ("gets", "gets", "0,0"),
            ("keys", "keys", "0,0"), ("keys_per_get", "keys / get", "0,0.0"), ("p50_ms", "p50 ms", "0,0.0"),
            ("p99_ms", "p99 ms", "0,0.0"), ("failures", "failures", "0,0")])
        self.restores_block = kit.titled("Restore batchers (latest report per worker)", "restores", self.restore_table)

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the restore chart and table from ``snap``."""
        restores = list(snap["restore_latest"].values())
        workers = [r["worker"] or "?" for r in restores]
        labels = [f for _, f in unique_factors([("", short_worker(w)) for w in workers])]
        self.fig_restore.y_range.factors = labels[::-1]
        self.fig_restore.height = bar_height(len(restores))
        self.restore.data = dict(
            worker=workers, label=labels,
            **{k: [r[k] for r in restores] for k in RESTORE_FIGURES},
        )
        fit(self.restore_table, len(restores))
        self.kit.show("restore", bool(restores))
        self.kit.show("restores", bool(restores))
