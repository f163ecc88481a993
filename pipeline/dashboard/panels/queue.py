"""Queue panels: queue depth over time (groups in flight), queue wait per group (ms) and
calls per rollout (mean per group), one point per group event."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..style import BLUE, ORANGE, PURPLE
from ..widgets import PanelKit

if TYPE_CHECKING:
    from ..snapshot import StateSnapshot


class QueuePanels:
    """``tc-fig-depth`` (source ``tc-depth``), ``tc-fig-wait`` and ``tc-fig-calls`` (source ``tc-queue``)."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource, HoverTool

        self.kit = kit
        self.depth = ColumnDataSource(dict(t=[], queue_depth=[]), name="tc-depth")
        self.queue = ColumnDataSource(dict(t=[], queue_wait_ms=[], calls_per_rollout=[], group=[], step=[]), name="tc-queue")
        self.fig_depth = kit.figure("depth", "Queue depth (groups in flight)", x_axis_type="datetime")
        self.fig_depth.step("t", "queue_depth", source=self.depth, mode="after", line_width=2, color=BLUE)
        self.fig_depth.yaxis.axis_label = "groups"
        self.fig_depth.yaxis.ticker.min_interval = 1
        self.fig_wait = kit.figure("wait", "Queue wait per group (ms)", x_axis_type="datetime")
        self.fig_wait.line("t", "queue_wait_ms", source=self.queue, alpha=0.4, color=ORANGE)
        self.fig_wait.scatter("t", "queue_wait_ms", source=self.queue, size=5, color=ORANGE)
        self.fig_wait.yaxis.axis_label = "ms"
        self.fig_calls = kit.figure("calls", "Calls per rollout (mean per group)", x_axis_type="datetime")
        self.fig_calls.scatter("t", "calls_per_rollout", source=self.queue, size=5, color=PURPLE)
        self.fig_calls.yaxis.axis_label = "calls"
        for fig in (self.fig_wait, self.fig_calls):
            fig.add_tools(HoverTool(tooltips=[("group", "@group"), ("step", "@step"),
                                              ("wait", "@queue_wait_ms{0.0} ms"), ("calls/rollout", "@calls_per_rollout{0.0}")]))
        for fig in (self.fig_depth, self.fig_wait, self.fig_calls):
            fig.y_range.start = 0
            kit.time_axis(fig)

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the queue panels from ``snap`` (times in ms since the epoch, as Bokeh's)."""
        self.depth.data = dict(t=[t * 1000 for t, _ in snap["depths"]], queue_depth=[d for _, d in snap["depths"]])
        groups = snap["groups"]
        self.queue.data = dict(
            t=[g["t"] * 1000 for g in groups],
            queue_wait_ms=[g["queue_wait_ms"] for g in groups],
            calls_per_rollout=[g["calls_per_rollout"] for g in groups],
            group=[g.get("group_id") or "" for g in groups],
            step=[g.get("step_id") or "" for g in groups],
        )
        self.kit.show("depth", bool(snap["depths"]))
        self.kit.show("wait", bool(groups))
        self.kit.show("calls", any(g["calls_per_rollout"] for g in groups))
