"""Finalization panels: the split timing per step (ms, stacked fetch / verify / assemble),
the bytes each step moved between hosts (measured bars, planned markers), the rollouts' outcomes (accepted and each rejection reason, in rollouts) and the
rejections table (rollouts and the latest detail per reason)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..labels import step_factor, unique_factors
from ..style import BLUE, GREEN, MAX_BARS, RED
from ..widgets import PanelKit, bar_height, fit, legend, table

if TYPE_CHECKING:
    from bokeh.models.sources import ColumnDataSource
    from bokeh.plotting import figure as Figure

    from ..snapshot import StateSnapshot

SPLIT = ("fetch_ms", "verify_ms", "assemble_ms")
SPLIT_COLORS = (BLUE, RED, GREEN)


def _split_chart(kit: PanelKit) -> tuple[ColumnDataSource, Figure]:
    """``tc-split``: one stacked bar per step (newest :data:`MAX_BARS`), step number under its run."""
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool

    source = ColumnDataSource(dict(
        x=[], step=[], fetch_ms=[], verify_ms=[], assemble_ms=[], groups=[], rollouts=[], wall_ms=[], state=[]),
        name="tc-split")
    fig = kit.figure("split", "Finalize time per step (ms): fetch / verify / assemble",
                     x_range=FactorRange(group_padding=0.5))
    bars = fig.vbar_stack(list(SPLIT), x="x", width=0.8, source=source, color=list(SPLIT_COLORS))
    legend(fig, ["fetch", "verify", "assemble"], bars)
    fig.add_tools(HoverTool(tooltips=[
        ("step", "@step"), ("fetch", "@fetch_ms{0.0} ms"), ("verify", "@verify_ms{0.0} ms"),
        ("assemble", "@assemble_ms{0.0} ms"), ("groups", "@groups"), ("rollouts", "@rollouts"),
        ("wall", "@wall_ms{0.0} ms"), ("state", "@state")]))
    fig.xaxis.axis_label = "step"
    fig.xgrid.visible = False
    fig.y_range.start = 0
    return source, fig


def _cross_host_chart(kit: PanelKit) -> tuple[ColumnDataSource, Figure]:
    """``tc-cross-host``: bytes each step's tasks moved between hosts (bars: measured on the
    scheduler; markers: what the step's layout planned), newest :data:`MAX_BARS` steps."""
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool

    source = ColumnDataSource(dict(x=[], step=[], measured=[], planned=[]), name="tc-cross-host")
    fig = kit.figure("cross-host", "Bytes crossing hosts per step: measured (bars) / planned (dots)",
                     x_range=FactorRange(group_padding=0.5))
    fig.vbar(x="x", top="measured", width=0.8, source=source, color=BLUE)
    fig.scatter(x="x", y="planned", size=8, source=source, color=RED)
    fig.add_tools(HoverTool(tooltips=[("step", "@step"), ("measured", "@measured{0,0} bytes"), ("planned", "@planned{0,0} bytes")]))
    fig.xaxis.axis_label = "step"
    fig.yaxis.axis_label = "bytes"
    fig.xgrid.visible = False
    fig.y_range.start = 0
    return source, fig


def _outcome_chart(kit: PanelKit) -> tuple[ColumnDataSource, Figure]:
    """``tc-outcome``: rollouts accepted, then rejected by reason (horizontal bars)."""
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool

    source = ColumnDataSource(dict(outcome=[], count=[], color=[]), name="tc-outcome")
    fig = kit.figure("outcome", "Rollouts: accepted / rejected by reason", y_range=FactorRange())
    fig.hbar(y="outcome", right="count", height=0.7, color="color", source=source)
    fig.add_tools(HoverTool(tooltips=[("outcome", "@outcome"), ("rollouts", "@count")]))
    fig.xaxis.axis_label = "rollouts"
    fig.x_range.start = 0
    fig.ygrid.visible = False
    return source, fig


class FinalizePanels:
    """The finalization section's charts and its rejections table (``tc-rejections``)."""

    def __init__(self, kit: PanelKit) -> None:
        from bokeh.models import ColumnDataSource

        self.kit = kit
        self.split, self.fig_split = _split_chart(kit)
        self.outcome, self.fig_outcome = _outcome_chart(kit)
        self.cross_host, self.fig_cross_host = _cross_host_chart(kit)
        self.rejections = ColumnDataSource(dict(reason=[], count=[], detail=[]), name="tc-rejections")
        self.rejection_table = table(self.rejections, [
            ("reason", "rejection reason", None), ("count", "rollouts", "0,0"), ("detail", "last detail", None)])
        self.rejections_block = kit.titled("Rejections by reason (the latest detail of each)", "rejections",
                                           self.rejection_table, note="no rejections yet")

    def update(self, snap: StateSnapshot) -> None:
        """Redraw the split, outcome and rejection panels from ``snap``."""
        self._update_split(snap)
        self._update_outcomes(snap)

    def _update_split(self, snap: StateSnapshot) -> None:
        steps = snap["steps"][-MAX_BARS:]
        factors = unique_factors([step_factor(st["step_id"]) for st in steps])
        self.fig_split.x_range.factors = factors
        shown = len(steps)
        total = len(snap["steps"])
        self.fig_split.xaxis.axis_label = "step" if shown == total else f"step (newest {shown} of {total})"
        self.split.data = dict(
            x=factors,
            step=[st["step_id"] for st in steps],
            **{k: [st[k] for st in steps] for k in SPLIT},
            groups=[st["groups"] for st in steps],
            rollouts=[st["rollouts"] for st in steps],
            wall_ms=[st["wall_ms"] for st in steps],
            state=[f"collected ({st['dominant']}-bound)" if st["final"] else "running" for st in steps],
        )
        self.kit.show("split", bool(steps))
        final = [st for st in steps if st["final"]]
        final_factors = unique_factors([step_factor(st["step_id"]) for st in final])
        self.fig_cross_host.x_range.factors = final_factors
        self.cross_host.data = dict(
            x=final_factors, step=[st["step_id"] for st in final],
            measured=[st["cross_host_bytes"] for st in final], planned=[st["cross_host_bytes_planned"] for st in final])
        self.kit.show("cross-host", bool(final))

    def _update_outcomes(self, snap: StateSnapshot) -> None:
        rejected = sorted(snap["rejected"].items(), key=lambda kv: (-kv[1], kv[0]))
        outcomes = [("accepted", snap["totals"].get("accepted", 0), GREEN)] + [(r, n, RED) for r, n in rejected]
        if not snap["totals"].get("rollouts"):
            outcomes = []
        self.fig_outcome.y_range.factors = [o for o, _, _ in outcomes][::-1]
        self.fig_outcome.height = bar_height(len(outcomes))
        self.outcome.data = dict(
            outcome=[o for o, _, _ in outcomes], count=[n for _, n, _ in outcomes], color=[c for _, _, c in outcomes])
        self.kit.show("outcome", bool(outcomes))
        details = snap["rejected_details"]
        self.rejections.data = dict(
            reason=[r for r, _ in rejected], count=[n for _, n in rejected], detail=[details.get(r, "") for r, _ in rejected])
        fit(self.rejection_table, len(rejected))
        self.kit.show("rejections", bool(rejected))
