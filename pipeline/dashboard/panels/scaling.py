"""Scaling panels: the worker count over time with the adaptive policy's decisions on it
(marker at the target, in workers), and the decisions table (newest first). Each decision
is the finalize pool's or the store's (``kind``; storage markers are drawn hollow)."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..style import ACTION_COLORS, ACTION_MARKERS, BLUE
from ..widgets import PanelKit, fit, legend, table

if TYPE_CHECKING:
    from ..parsing import ScaleEvent
    from ..snapshot import StateSnapshot


def kind_of(decision: ScaleEvent) -> str:
    """Which side decided: ``finalize`` (also for events that name no kind) or ``storage``."""
    return str(decision.get("kind") or "finalize")


class ScalingPanels:
    """``tc-fig-scale`` (sources ``tc-workers`` and ``tc-decisions``) and the decisions table."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource, HoverTool

        self.kit = kit
        self.workers = ColumnDataSource(dict(t=[], workers=[]), name="tc-workers")
        self.decisions = ColumnDataSource(dict(
            t=[], when=[], kind=[], action=[], current=[], target=[], reason=[], y=[], color=[], fill=[], marker=[]),
            name="tc-decisions")
        self.fig_scale = kit.figure("scale", "Workers and scaling decisions", x_axis_type="datetime",
                                    note="no scaling decisions yet")
        line = self.fig_scale.step("t", "workers", source=self.workers, mode="after", line_width=2, color=BLUE)
        marks = self.fig_scale.scatter("t", "y", source=self.decisions, size=10, line_color="color", fill_color="fill",
                                       line_width=2, marker="marker")
        legend(self.fig_scale, ["workers", "decision (target): up / down / hold; hollow: storage"], [line, marks])
        self.fig_scale.add_tools(HoverTool(renderers=[marks], tooltips=[
            ("time", "@when"), ("decision", "@kind @action"), ("workers", "@current \u2192 @target"), ("reason", "@reason")]))
        self.fig_scale.yaxis.axis_label = "workers"
        self.fig_scale.y_range.start = 0
        self.fig_scale.yaxis.ticker.min_interval = 1
        kit.time_axis(self.fig_scale)
        self.decision_table = table(self.decisions, [
            ("when", "time", None), ("kind", "kind", None), ("action", "action", None), ("current", "workers", "0,0"),
            ("target", "target", "0,0"), ("reason", "reason", None)])
        self.decisions_block = kit.titled("Scaling decisions (newest first)", "decisions", self.decision_table)

    def update_workers(self, worker_counts: Sequence[tuple[float, int]]) -> None:
        """The worker line from the state's ``(t (s), workers)`` samples (redrawn on every refresh)."""
        self.workers.data = dict(t=[t * 1000 for t, _ in worker_counts], workers=[n for _, n in worker_counts])

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the decisions (chart by time, table newest first) from ``snap``."""
        decisions = snap["decisions"][::-1]  # newest first (the table); the chart is by time
        self.decisions.data = dict(
            t=[d["t"] * 1000 for d in decisions],
            when=[time.strftime("%H:%M:%S", time.localtime(d["t"])) for d in decisions],
            kind=[kind_of(d) for d in decisions],
            action=[d["action"] for d in decisions],
            current=[int(d["current"]) for d in decisions],
            target=[int(d["target"]) for d in decisions],
            reason=[d["reason"] for d in decisions],
            y=[d["target"] for d in decisions],
            color=[ACTION_COLORS[d["action"]] for d in decisions],
            fill=[ACTION_COLORS[d["action"]] if kind_of(d) == "finalize" else "white" for d in decisions],
            marker=[ACTION_MARKERS[d["action"]] for d in decisions],
        )
        fit(self.decision_table, len(decisions), most=8)
        self.kit.show("scale", bool(decisions))
        self.kit.show("decisions", bool(decisions))
