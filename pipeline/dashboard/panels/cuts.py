"""Checkpoint cut panels: cut wall time (ms) per worker report, grouped by checkpoint (the
newest :data:`~pipeline.dashboard.style.MAX_BARS`), and the table of every report."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..labels import short_worker, shorten, unique_factors
from ..style import MAX_BARS, ORANGE
from ..widgets import PanelKit, bar_height, fit, table

if TYPE_CHECKING:
    from ..parsing import CutEvent
    from ..snapshot import StateSnapshot

CUT_FIGURES = ("calls", "rows", "puts", "wall_ms", "durable")


def _cut_columns(rows: list[CutEvent]) -> dict[str, list[object]]:
    """The source columns of cut reports ``rows`` (failures as ``reason: n, ...`` or ``-``)."""
    return dict(
        checkpoint_id=[c["checkpoint_id"] for c in rows],
        worker=[c["worker"] for c in rows],
        **{k: [c[k] for c in rows] for k in CUT_FIGURES},
        failures=[", ".join(f"{r}: {n}" for r, n in c["failures"].items()) or "-" for c in rows],
    )


class CutPanels:
    """``tc-fig-cut`` (source ``tc-cut-bars``) and the cut reports table (source ``tc-cut``)."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource, FactorRange, HoverTool

        self.kit = kit
        self.cut = ColumnDataSource(dict(
            i=[], checkpoint_id=[], worker=[], calls=[], rows=[], puts=[], wall_ms=[], durable=[], failures=[]),
            name="tc-cut")
        self.fig_cut = kit.figure("cut", "Cut wall time per checkpoint and worker (ms)", y_range=FactorRange(group_padding=0.6))
        self.cut_bars = ColumnDataSource(dict(y=[], checkpoint_id=[], worker=[], calls=[], rows=[], puts=[],
                                              wall_ms=[], durable=[], failures=[]), name="tc-cut-bars")
        self.fig_cut.hbar(y="y", right="wall_ms", height=0.7, source=self.cut_bars, color=ORANGE)
        self.fig_cut.add_tools(HoverTool(tooltips=[
            ("checkpoint", "@checkpoint_id"), ("worker", "@worker"), ("calls", "@calls"), ("rows", "@rows"),
            ("puts", "@puts"), ("wall", "@wall_ms{0.0} ms"), ("durable", "@durable"), ("failures", "@failures")]))
        self.fig_cut.xaxis.axis_label = "ms"
        self.fig_cut.x_range.start = 0
        self.fig_cut.ygrid.visible = False
        self.fig_cut.yaxis.group_label_orientation = "horizontal"
        self.cut_table = table(self.cut, [
            ("checkpoint_id", "checkpoint", None), ("worker", "worker", None), ("calls", "calls", "0,0"),
            ("rows", "rows", "0,0"), ("puts", "puts", "0,0"), ("wall_ms", "wall ms", "0,0.0"),
            ("durable", "durable", "0,0"), ("failures", "failures by reason", None)])
        self.cuts_block = kit.titled("Cut reports (one per generation worker and checkpoint)", "cuts", self.cut_table)

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the cut chart (oldest on top, as in the table) and table from ``snap``."""
        cuts = snap["cuts"]
        shown = cuts[-MAX_BARS:]
        factors = unique_factors([(shorten(c["checkpoint_id"] or "?", 16), short_worker(c["worker"])) for c in shown])
        self.fig_cut.y_range.factors = factors[::-1]  # oldest on top, as in the table
        self.fig_cut.height = bar_height(len(shown) + len({f[0] for f in factors}))
        self.cut.data = dict(i=list(range(len(cuts))), **_cut_columns(cuts))
        self.cut_bars.data = dict(y=factors, **_cut_columns(shown))
        fit(self.cut_table, len(cuts))
        self.kit.show("cut", bool(cuts))
        self.kit.show("cuts", bool(cuts))
