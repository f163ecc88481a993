"""Trainer-side panels: staleness by rollout length (rollouts kept and dropped ``stale`` per
token-length bucket, bars; their mean weight-version lag, dots on the right axis), so a
bias toward short rollouts shows; and the mismatch monitor per report (mean and max
|delta logprob| and k3 in nats on the left axis; the fraction of tokens outside each
ratio bound and the route agreement, fractions on the right axis)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..style import BLUE, BROWN, CYAN, GREEN, OLIVE, ORANGE, PINK, PURPLE, RED
from ..widgets import PanelKit, legend

if TYPE_CHECKING:
    from bokeh.models.sources import ColumnDataSource
    from bokeh.plotting import figure as Figure

    from ..snapshot import StateSnapshot

EPS_COLORS = (PURPLE, PINK, BROWN, OLIVE, CYAN)


def _right_axis(fig: Figure, name: str, label: str, end: float = 1.0) -> None:
    """A second y range ``name``, ``[0, end]``, drawn as the right axis."""
    from bokeh.models import LinearAxis, Range1d

    fig.extra_y_ranges = {name: Range1d(0, end)}
    fig.add_layout(LinearAxis(y_range_name=name, axis_label=label, axis_label_text_font_size="11px",
                              axis_label_text_font_style="normal", major_label_text_font_size="11px"), "right")


def _staleness_chart(kit: PanelKit) -> tuple[ColumnDataSource, Figure]:
    """``tc-staleness``: per length bucket, rollouts kept / dropped stale and the mean lag,
    over the steps the state keeps (the last ``dashboard.history``)."""
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool

    source = ColumnDataSource(dict(bucket=[], kept=[], stale=[], rollouts=[], mean_lag=[]), name="tc-staleness")
    fig = kit.figure("staleness", "Staleness by rollout length (tokens), recent steps: kept / dropped stale (bars), mean lag (dots)",
                     x_range=FactorRange(), note="no staleness figures yet")
    bars = fig.vbar_stack(["kept", "stale"], x="bucket", width=0.7, source=source, color=[GREEN, RED])
    _right_axis(fig, "lag", "mean lag (weight versions)")
    dots = fig.scatter(x="bucket", y="mean_lag", size=10, source=source, color=BLUE, y_range_name="lag")
    legend(fig, ["kept", "dropped stale", "mean lag (right)"], [*bars, dots])
    fig.add_tools(HoverTool(tooltips=[("length", "@bucket"), ("rollouts", "@rollouts"), ("dropped stale", "@stale"),
                                      ("mean lag", "@mean_lag{0.00} versions")]))
    fig.xaxis.axis_label = "rollout length (tokens)"
    fig.yaxis[0].axis_label = "rollouts"
    fig.xgrid.visible = False
    fig.y_range.start = 0
    return source, fig


MISMATCH_LINES = (("mean_abs_delta", "mean |Δ logprob|", BLUE), ("max_abs_delta", "max |Δ logprob|", ORANGE),
                  ("k3_mean", "k3 KL", RED))


def _mismatch_chart(kit: PanelKit) -> tuple[ColumnDataSource, ColumnDataSource, Figure]:
    """``tc-mismatch`` (per report: nats and route agreement) and ``tc-mismatch-frac``
    (one line per eps: the fraction of tokens whose ratio is outside 1 +- eps)."""
    from bokeh.models import ColumnDataSource, HoverTool

    source = ColumnDataSource(dict(seq=[], step=[], weight_version=[], tokens=[], mean_abs_delta=[], max_abs_delta=[],
                                   k3_mean=[], route_agreement=[]), name="tc-mismatch")
    fracs = ColumnDataSource(dict(xs=[], ys=[], eps=[], color=[]), name="tc-mismatch-frac")
    fig = kit.figure("mismatch", "Trainer vs sampler per report: |Δ logprob|, k3 (nats, left); outside 1±eps, routes agree (right)",
                     note="no mismatch reports yet")
    lines = [fig.line("seq", key, source=source, color=color, line_width=2) for key, _, color in MISMATCH_LINES]
    marks = fig.scatter("seq", "mean_abs_delta", source=source, size=6, color=BLUE)
    _right_axis(fig, "frac", "fraction", end=1.0)
    route = fig.line("seq", "route_agreement", source=source, color=GREEN, line_width=2, line_dash="dashed", y_range_name="frac")
    outside = fig.multi_line("xs", "ys", source=fracs, color="color", line_width=2, line_dash="dotted", y_range_name="frac")
    legend(fig, [label for _, label, _ in MISMATCH_LINES] + ["routes agree", "outside 1±eps"], lines + [route, outside])
    fig.add_tools(HoverTool(renderers=[marks], tooltips=[
        ("step", "@step"), ("trainer version", "@weight_version"), ("tokens", "@tokens"),
        ("mean |Δ|", "@mean_abs_delta{0.0000}"), ("max |Δ|", "@max_abs_delta{0.000}"), ("k3", "@k3_mean{0.000000}"),
        ("routes agree", "@route_agreement{0.000}")]))
    fig.xaxis.axis_label = "mismatch report (step)"
    fig.yaxis[0].axis_label = "nats"
    fig.y_range.start = 0
    return source, fracs, fig


class TrainerPanels:
    """``tc-fig-staleness`` and ``tc-fig-mismatch``."""

    def __init__(self, kit: PanelKit) -> None:
        self.kit = kit
        self.staleness, self.fig_staleness = _staleness_chart(kit)
        self.mismatch, self.mismatch_frac, self.fig_mismatch = _mismatch_chart(kit)

    def update(self, snap: StateSnapshot) -> None:
        """Redraw both charts from ``snap``."""
        buckets = snap["staleness"]["recent_buckets"]
        self.fig_staleness.x_range.factors = [b["bucket"] for b in buckets]
        self.staleness.data = dict(
            bucket=[b["bucket"] for b in buckets], kept=[b["rollouts"] - b["stale"] for b in buckets],
            stale=[b["stale"] for b in buckets], rollouts=[b["rollouts"] for b in buckets],
            mean_lag=[b["mean_lag"] for b in buckets])
        self.fig_staleness.extra_y_ranges["lag"].end = max([1.0] + [1.15 * b["mean_lag"] for b in buckets])
        self.kit.show("staleness", any(b["rollouts"] for b in buckets))
        self._update_mismatch(snap["mismatch"]["events"])

    def _update_mismatch(self, events: list[dict]) -> None:
        nan = float("nan")  # a report without routes: a gap in the route line
        self.mismatch.data = dict(
            seq=[e["seq"] for e in events], step=[e.get("step_id", "") for e in events],
            weight_version=[e.get("weight_version", 0) for e in events], tokens=[e.get("tokens", 0) for e in events],
            **{key: [e.get(key, 0.0) for e in events] for key, _, _ in MISMATCH_LINES},
            route_agreement=[nan if e.get("route_agreement") is None else e["route_agreement"] for e in events])
        eps = sorted({k for e in events for k in e.get("frac_outside", {})}, key=float)
        self.mismatch_frac.data = dict(
            xs=[[e["seq"] for e in events if k in e.get("frac_outside", {})] for k in eps],
            ys=[[e["frac_outside"][k] for e in events if k in e.get("frac_outside", {})] for k in eps],
            eps=eps, color=[EPS_COLORS[i % len(EPS_COLORS)] for i in range(len(eps))])
        self.kit.show("mismatch", bool(events))
