"""The token-capture page of the Dask dashboard (Bokeh, live).

Served by the scheduler's own dashboard at ``/<dashboard.page>`` (default
``/token-capture``) and listed in its top menu. The page is a view: it reads
:meth:`~pipeline.dashboard.state.TokenCaptureState.snapshot` of the state found through
the lookup function given to :func:`register_page`, and redraws only when the state
changed.

Layout (readable at 1400 and 1920 px): a live header of totals, then a two-column grid
of charts (each at least ``CHART_HEIGHT`` px tall, toolbar above as on Dask's own pages,
legends above the plot area, categorical names on the y axis of unit/worker charts) and
full-width tables whose columns are sized to their content. Every chart and table shows
a "no data yet" note until it has data. Bar charts show the newest ``MAX_BARS`` entries;
step bars are labelled by step number under their run id (the full id is in the hover).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from .. import config
from .state import TokenCaptureState

StateLookup = Callable[[Any], TokenCaptureState | None]
"""Finds the state kept on a scheduler (``None`` when the aggregator is not installed)."""

logger = logging.getLogger(__name__)

# bokeh.palettes.Category10[10] (the palette of Bokeh's and Dask's categorical charts),
# spelled out so importing this module does not need bokeh.
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GRAY, OLIVE, CYAN = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
LIGHT_PURPLE = "#c5b0d5"  # Category20's companion of PURPLE
ACTION_COLORS = {"up": GREEN, "down": RED, "hold": GRAY}
ACTION_MARKERS = {"up": "triangle", "down": "inverted_triangle", "hold": "circle"}

_SPLIT = ("fetch_ms", "verify_ms", "assemble_ms")
_SPLIT_COLORS = (BLUE, RED, GREEN)

CHART_HEIGHT = 260  # px, every chart at least this tall
BAR_PX = 24  # px per category on horizontal bar charts (they grow with their categories)
MAX_CHART_HEIGHT = 640
MAX_BARS = 30  # newest steps / cut reports / units drawn as bars (tables keep every row)
ROW_PX = 25  # DataTable row height
NO_DATA = "no data yet"
LABEL_CHARS = 24  # longest categorical tick label (the full name is in the hover)

_TEMPLATE = """{% extends "base.html" %}
{% block extra_resources %}
<style>
  #token-capture-summary { font-family: Helvetica, Arial, sans-serif; margin: 8px 16px 0 16px; }
  #token-capture-summary h2 { margin: 4px 0 6px 0; font-size: 22px; }
  #token-capture-summary .tc-tiles { display: flex; flex-wrap: wrap; gap: 8px; }
  #token-capture-summary .tc-tile { border: 1px solid #ddd; border-radius: 4px; padding: 4px 10px; min-width: 96px; }
  #token-capture-summary .tc-tile b { display: block; font-size: 20px; }
  #token-capture-summary .tc-tile span { color: #555; font-size: 12px; }
</style>
{% endblock %}
{% block content %}
<div id="token-capture-summary">
  <h2>Token capture</h2>
  <div class="tc-tiles">
  {% for key, label in tc_tiles %}
    <div class="tc-tile"><b id="tc-{{ key }}">{{ tc[key] }}</b><span>{{ label }}</span></div>
  {% endfor %}
  </div>
</div>
{{ plot_div }}
{{ plot_script }}
{% endblock %}
"""

TILES = (
    ("rollouts", "rollouts finalized"),
    ("accepted", "accepted"),
    ("rejected", "rejected"),
    ("groups", "groups"),
    ("steps", "steps collected"),
    ("cuts", "cut reports"),
    ("gets", "restore gets"),
    ("decisions", "scaling decisions"),
)
"""The header's totals, ``(summary key, label)``; each is ``<b id="tc-<key>">``."""

# Writes the summary source's values into the header's ``tc-<key>`` elements (the header
# is in the page template, outside Bokeh's roots): on load and on every change.
_HEADER_JS = """
const data = source.data;
for (const key of Object.keys(data)) {
  const el = document.getElementById('tc-' + key);
  if (el != null && data[key].length > 0) { el.textContent = String(data[key][0]); }
}
"""


def page_path() -> str:
    """The page's path on the dashboard, without slashes (``dashboard.page``)."""
    return str(config.get("dashboard.page")).strip("/")


def summary_of(snap: Mapping[str, Any] | None) -> dict[str, int]:
    """Headline counts of a :meth:`TokenCaptureState.snapshot` (all counts, all totals)."""
    if snap is None:
        return {key: 0 for key, _ in TILES}
    totals = snap["totals"]
    return dict(
        rollouts=int(totals.get("rollouts", 0)),
        accepted=int(totals.get("accepted", 0)),
        rejected=int(totals.get("rejected", 0)),
        groups=int(totals.get("groups", 0)),
        steps=int(totals.get("steps", 0)),
        cuts=int(snap["cut_totals"].get("cuts", 0)),
        gets=int(snap["restore_totals"].get("gets", 0)),
        decisions=int(sum(snap["decision_counts"].values())),
    )


def summary(agg: TokenCaptureState | None) -> dict[str, int]:
    """Headline counts shown in the page header (all counts)."""
    return summary_of(agg.snapshot() if agg is not None else None)


# ---------------------------------------------------------------- short labels
def shorten(text: str, chars: int = LABEL_CHARS) -> str:
    """``text`` cut to ``chars`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= chars else text[: chars - 1] + "\u2026"


def short_worker(address: str) -> str:
    """A worker address without its scheme (``tcp://127.0.0.1:40401`` -> ``127.0.0.1:40401``)."""
    return shorten(re.sub(r"^[a-z]+://", "", address or "?"))


_RUN_STEP = re.compile(r"^(?P<run>[0-9a-f]{4,16})-step-(?P<n>\d+)$")
_RUN_PHASE = re.compile(r"^(?P<run>[0-9a-f]{4,16})-(?P<phase>[a-z]+)(?:-(?P<n>\d+))?$")
_BARE_STEP = re.compile(r"^step-(?P<n>\d+)$")
_PHASE_SHORT = {"resume": "resume", "tampered": "tamper", "scale": "sc"}


def step_factor(step_id: str) -> tuple[str, str]:
    """``(group, label)`` of a step on the x axis: ``<run>-step-<n>`` is ``("run <run>",
    "<n>")``, a demo phase ``<run>-resume`` / ``<run>-tampered`` / ``<run>-scale-<n>`` is
    ``("run <run>", "resume")`` / ``"tamper"`` / ``"sc<n>"``, ``step-<n>`` is ``("",
    "<n>")``; any other id is kept (shortened) with no group."""
    m = _RUN_STEP.match(step_id)
    if m:
        return f"run {m['run']}", m["n"]
    m = _RUN_PHASE.match(step_id)
    if m:
        label = _PHASE_SHORT.get(m["phase"], shorten(m["phase"], 6)) + (m["n"] or "")
        return f"run {m['run']}", label
    m = _BARE_STEP.match(step_id)
    if m:
        return "", m["n"]
    return "", shorten(step_id, 12)


def _unique(factors: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Factors made unique (a repeated one gets ``#k``): Bokeh needs distinct factors."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for f in factors:
        k = seen.get(f, 0)
        seen[f] = k + 1
        out.append(f if k == 0 else (f[0], f"{f[1]}#{k}"))
    return out


def _bar_height(n: int, extra: int = 110) -> int:
    """Height of a horizontal bar chart with ``n`` categories (px)."""
    return max(CHART_HEIGHT, min(MAX_CHART_HEIGHT, extra + BAR_PX * n))


def _table_height(n: int, most: int = 12) -> int:
    """Height of a table showing ``n`` rows (at most ``most``, then it scrolls) (px)."""
    return ROW_PX * (1 + max(1, min(n, most))) + 4


CHAR_PX = 7.6  # average width of a table character (13px Helvetica/Arial, digits are wider)
CELL_PAD_PX = 20  # a cell's padding and border


def _cell_text(value: Any, fmt: str | None) -> str:
    """``value`` as a table cell shows it (numbers with the NumberFormatter's format)."""
    if fmt and isinstance(value, (int, float)):
        if fmt.endswith(" b"):
            return "1023.9 MiB"  # numbro's byte format: at most this long
        return f"{value:,.{fmt.count('0') - 2 if '.' in fmt else 0}f}"
    return str(value)


def _text_px(text: str) -> int:
    """Width a table cell needs to show ``text`` uncut (px)."""
    return int(len(text) * CHAR_PX) + CELL_PAD_PX


class TokenCapturePage:
    """The Bokeh models of one browser session, and how they are refreshed from the state."""

    def __init__(self, scheduler: Any, state_for: StateLookup) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import (
            ColumnDataSource,
            CustomJS,
            DatetimeTickFormatter,
            Div,
            FactorRange,
            HoverTool,
            NumeralTickFormatter,
        )

        self.scheduler = scheduler
        self.state_for = state_for
        self._version = -1
        self._column, self._row = column, row
        self.notes: dict[str, Any] = {}  # panel -> its "no data yet" note (a Label or a Div)

        self.header = Div(text="", sizing_mode="stretch_width", name="tc-header",
                          styles={"font-size": "13px", "color": "#333", "margin": "2px 16px"})
        # the template's totals, kept live by _HEADER_JS from this source
        self.summary = ColumnDataSource({key: [0] for key, _ in TILES}, name="tc-summary")
        self.header_js = CustomJS(args=dict(source=self.summary), code=_HEADER_JS)
        self.summary.js_on_change("data", self.header_js)
        # (also makes the source part of the document: it is reachable from a root)
        self.header.js_on_change("text", self.header_js)

        # ---- finalize: split timing per step (stacked bars)
        self.split = ColumnDataSource(dict(
            x=[], step=[], fetch_ms=[], verify_ms=[], assemble_ms=[], groups=[], rollouts=[], wall_ms=[], state=[]),
            name="tc-split")
        self.fig_split = self._figure("split", "Finalize time per step (ms): fetch / verify / assemble",
                                      x_range=FactorRange(group_padding=0.5))
        bars = self.fig_split.vbar_stack(list(_SPLIT), x="x", width=0.8, source=self.split, color=list(_SPLIT_COLORS))
        self._legend(self.fig_split, ["fetch", "verify", "assemble"], bars)
        self.fig_split.add_tools(HoverTool(tooltips=[
            ("step", "@step"), ("fetch", "@fetch_ms{0.0} ms"), ("verify", "@verify_ms{0.0} ms"),
            ("assemble", "@assemble_ms{0.0} ms"), ("groups", "@groups"), ("rollouts", "@rollouts"),
            ("wall", "@wall_ms{0.0} ms"), ("state", "@state")]))
        self.fig_split.xaxis.axis_label = "step"
        self.fig_split.xgrid.visible = False
        self.fig_split.y_range.start = 0

        # ---- outcomes: accepted and each rejection reason
        self.outcome = ColumnDataSource(dict(outcome=[], count=[], color=[]), name="tc-outcome")
        self.fig_outcome = self._figure("outcome", "Rollouts: accepted / rejected by reason", y_range=FactorRange())
        self.fig_outcome.hbar(y="outcome", right="count", height=0.7, color="color", source=self.outcome)
        self.fig_outcome.add_tools(HoverTool(tooltips=[("outcome", "@outcome"), ("rollouts", "@count")]))
        self.fig_outcome.xaxis.axis_label = "rollouts"
        self.fig_outcome.x_range.start = 0
        self.fig_outcome.ygrid.visible = False

        self.rejections = ColumnDataSource(dict(reason=[], count=[], detail=[]), name="tc-rejections")
        self.rejection_table = self._table(self.rejections, [
            ("reason", "rejection reason", None), ("count", "rollouts", "0,0"), ("detail", "last detail", None)])

        # ---- queue depth and wait over time, calls per rollout (one point per group)
        self.depth = ColumnDataSource(dict(t=[], queue_depth=[]), name="tc-depth")
        self.queue = ColumnDataSource(dict(t=[], queue_wait_ms=[], calls_per_rollout=[], group=[], step=[]), name="tc-queue")
        self.fig_depth = self._figure("depth", "Queue depth (groups in flight)", x_axis_type="datetime")
        self.fig_depth.step("t", "queue_depth", source=self.depth, mode="after", line_width=2, color=BLUE)
        self.fig_depth.yaxis.axis_label = "groups"
        self.fig_wait = self._figure("wait", "Queue wait per group (ms)", x_axis_type="datetime")
        self.fig_wait.line("t", "queue_wait_ms", source=self.queue, alpha=0.4, color=ORANGE)
        self.fig_wait.scatter("t", "queue_wait_ms", source=self.queue, size=5, color=ORANGE)
        self.fig_wait.yaxis.axis_label = "ms"
        self.fig_calls = self._figure("calls", "Calls per rollout (mean per group)", x_axis_type="datetime")
        self.fig_calls.scatter("t", "calls_per_rollout", source=self.queue, size=5, color=PURPLE)
        self.fig_calls.yaxis.axis_label = "calls"
        for fig, fmt in ((self.fig_wait, "0.0"), (self.fig_calls, "0.0")):
            fig.add_tools(HoverTool(tooltips=[("group", "@group"), ("step", "@step"),
                                              ("wait", "@queue_wait_ms{0.0} ms"), ("calls/rollout", "@calls_per_rollout{0.0}")]))
        for fig in (self.fig_depth, self.fig_wait, self.fig_calls):
            fig.y_range.start = 0

        # ---- store: memory vs spilled per unit (stacked, one row per unit)
        self.store = ColumnDataSource(
            dict(label=[], unit=[], memory_bytes=[], spilled_bytes=[], rows=[], lost_keys=[], worker=[]), name="tc-store"
        )
        self.fig_store = self._figure("store", "Store bytes per unit: memory / spilled", y_range=FactorRange())
        bars = self.fig_store.hbar_stack(["memory_bytes", "spilled_bytes"], y="label", height=0.7, source=self.store,
                                         color=[CYAN, GRAY])
        self._legend(self.fig_store, ["memory", "spilled"], bars)
        self.fig_store.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.fig_store.x_range.start = 0
        self.fig_store.ygrid.visible = False
        self.fig_store.add_tools(HoverTool(tooltips=[
            ("unit", "@unit"), ("worker", "@worker"), ("rows", "@rows"), ("lost keys", "@lost_keys"),
            ("memory", "@memory_bytes{0.0 b}"), ("spilled", "@spilled_bytes{0.0 b}")]))

        self.store_table = self._table(self.store, [
            ("unit", "unit", None), ("worker", "worker", None), ("rows", "rows", "0,0"),
            ("lost_keys", "lost keys", "0,0"),
            ("memory_bytes", "memory", "0.0 b"), ("spilled_bytes", "spilled", "0.0 b")])

        # ---- scaling: workers over time and the decisions with their reasons
        self.workers = ColumnDataSource(dict(t=[], workers=[]), name="tc-workers")
        self.decisions = ColumnDataSource(dict(
            t=[], when=[], action=[], current=[], target=[], reason=[], y=[], color=[], marker=[]), name="tc-decisions")
        self.fig_scale = self._figure("scale", "Workers and scaling decisions", x_axis_type="datetime",
                                      note="no scaling decisions yet")
        line = self.fig_scale.step("t", "workers", source=self.workers, mode="after", line_width=2, color=BLUE)
        marks = self.fig_scale.scatter("t", "y", source=self.decisions, size=10, color="color", marker="marker")
        self._legend(self.fig_scale, ["workers", "decision (target): up / down / hold"], [line, marks])
        self.fig_scale.add_tools(HoverTool(renderers=[marks], tooltips=[
            ("time", "@when"), ("action", "@action"), ("workers", "@current \u2192 @target"), ("reason", "@reason")]))
        self.fig_scale.yaxis.axis_label = "workers"
        self.fig_scale.y_range.start = 0
        self.fig_scale.yaxis.ticker.min_interval = 1
        self.fig_depth.yaxis.ticker.min_interval = 1
        self.decision_table = self._table(self.decisions, [
            ("when", "time", None), ("action", "action", None), ("current", "workers", "0,0"),
            ("target", "target", "0,0"), ("reason", "reason", None)])

        # ---- cuts: wall time per worker report (grouped by checkpoint), details in the table
        self.cut = ColumnDataSource(dict(
            i=[], checkpoint_id=[], worker=[], calls=[], rows=[], puts=[], wall_ms=[], durable=[], failures=[]),
            name="tc-cut")
        self.fig_cut = self._figure("cut", "Cut wall time per checkpoint and worker (ms)", y_range=FactorRange(group_padding=0.6))
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
        self.cut_table = self._table(self.cut, [
            ("checkpoint_id", "checkpoint", None), ("worker", "worker", None), ("calls", "calls", "0,0"),
            ("rows", "rows", "0,0"), ("puts", "puts", "0,0"), ("wall_ms", "wall ms", "0,0.0"),
            ("durable", "durable", "0,0"), ("failures", "failures by reason", None)])

        # ---- restore: latest report per batcher worker
        self.restore = ColumnDataSource(dict(
            worker=[], label=[], requests=[], gets=[], keys=[], keys_per_get=[], p50_ms=[], p99_ms=[], failures=[]),
            name="tc-restore")
        self.fig_restore = self._figure("restore", "Restore latency per batcher worker (ms): p50 / p99", y_range=FactorRange())
        p99 = self.fig_restore.hbar(y="label", right="p99_ms", height=0.7, source=self.restore, color=LIGHT_PURPLE)
        p50 = self.fig_restore.hbar(y="label", right="p50_ms", height=0.4, source=self.restore, color=PURPLE)
        self._legend(self.fig_restore, ["p50", "p99"], [p50, p99])
        self.fig_restore.add_tools(HoverTool(tooltips=[
            ("worker", "@worker"), ("requests", "@requests"), ("gets", "@gets"), ("keys/get", "@keys_per_get{0.0}"),
            ("p50", "@p50_ms{0.0} ms"), ("p99", "@p99_ms{0.0} ms"), ("failures", "@failures")]))
        self.fig_restore.xaxis.axis_label = "ms"
        self.fig_restore.x_range.start = 0
        self.fig_restore.ygrid.visible = False
        self.restore_table = self._table(self.restore, [
            ("worker", "batcher worker", None), ("requests", "requests", "0,0"), ("gets", "gets", "0,0"),
            ("keys", "keys", "0,0"), ("keys_per_get", "keys / get", "0,0.0"), ("p50_ms", "p50 ms", "0,0.0"),
            ("p99_ms", "p99 ms", "0,0.0"), ("failures", "failures", "0,0")])

        clock = DatetimeTickFormatter(
            microseconds="%H:%M:%S.%3N", milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S",
            minsec="%H:%M:%S", minutes="%H:%M", hourmin="%H:%M", hours="%H:%M")
        for fig in (self.fig_depth, self.fig_wait, self.fig_calls, self.fig_scale):
            fig.xaxis.formatter = clock
            fig.xaxis.ticker.desired_num_ticks = 5

        grid = dict(sizing_mode="stretch_width")
        self.root = column(
            self.header,
            self._section("Finalization"),
            row(self.fig_split, self.fig_outcome, **grid),
            self._titled("Rejections by reason (the latest detail of each)", "rejections", self.rejection_table,
                         note="no rejections yet"),
            self._section("Queue and scaling"),
            row(self.fig_depth, self.fig_wait, **grid),
            row(self.fig_calls, self.fig_scale, **grid),
            self._titled("Scaling decisions (newest first)", "decisions", self.decision_table),
            self._section("Checkpoint cuts and restores"),
            row(self.fig_cut, self.fig_restore, **grid),
            self._titled("Cut reports (one per generation worker and checkpoint)", "cuts", self.cut_table),
            self._titled("Restore batchers (latest report per worker)", "restores", self.restore_table),
            self._section("Staging store"),
            row(self.fig_store, self._titled("Storage units (latest report per unit)", "units", self.store_table), **grid),
            **grid,
        )

    # ---------------------------------------------------------------- building blocks
    def _figure(self, key: str, title: str, note: str = NO_DATA, **kwargs: Any) -> Any:
        """A chart as Dask's pages draw them (toolbar above), with its "no data yet" note."""
        from bokeh.models import Label, Node
        from bokeh.plotting import figure

        fig = figure(title=title, height=CHART_HEIGHT, min_height=CHART_HEIGHT, sizing_mode="stretch_width",
                     tools="pan,wheel_zoom,box_zoom,reset,save", toolbar_location="above",
                     min_border_left=50, min_border_right=20, name=f"tc-fig-{key}", **kwargs)
        fig.title.text_font_size = "13px"
        fig.axis.major_label_text_font_size = "11px"
        fig.axis.axis_label_text_font_size = "11px"
        fig.axis.axis_label_text_font_style = "normal"
        fig.toolbar.autohide = True
        center = Node(target="frame", symbol="center")
        label = Label(x=center, y=center, anchor="center", text=note, text_color=GRAY,
                      text_font_style="italic", text_font_size="14px", name=f"tc-empty-{key}")
        fig.add_layout(label)
        self.notes[key] = label
        return fig

    @staticmethod
    def _legend(fig: Any, labels: list[str], renderers: list[Any]) -> None:
        """A horizontal legend above the plot area (never over the data)."""
        from bokeh.models import Legend, LegendItem

        legend = Legend(items=[LegendItem(label=l, renderers=[r]) for l, r in zip(labels, renderers)],
                        orientation="horizontal", location="top_left", border_line_alpha=0, padding=2, margin=0,
                        spacing=12, label_text_font_size="11px", glyph_height=12, glyph_width=16,
                        background_fill_alpha=0)
        fig.add_layout(legend, "above")

    @staticmethod
    def _table(source: Any, columns: list[tuple[str, str, str | None]]) -> Any:
        """A table whose columns are sized to their content (see :meth:`_fit`)."""
        from bokeh.models import DataTable, NumberFormatter, StringFormatter, TableColumn

        cols = [TableColumn(field=f, title=t, width=_text_px(t),
                            formatter=NumberFormatter(format=fmt, text_align="right") if fmt else StringFormatter())
                for f, t, fmt in columns]
        # "force_fit" grows the content widths to the table's width. (Bokeh's own content
        # autosizing, "fit_columns"/"fit_viewport", fails in bokeh 3.9's SlickGrid.)
        return DataTable(source=source, columns=cols, autosize_mode="force_fit", sizing_mode="stretch_width",
                         height=_table_height(0), row_height=ROW_PX, index_position=None,
                         name=f"tc-table-{source.name.removeprefix('tc-')}")

    @staticmethod
    def _fit(table: Any, rows: int, most: int = 12) -> None:
        """Size ``table``'s columns to their content and its height to ``rows`` rows."""
        data = table.source.data
        for col in table.columns:
            fmt = getattr(col.formatter, "format", None)
            width = max([_text_px(col.title)] + [_text_px(_cell_text(v, fmt)) for v in data.get(col.field, [])])
            if col.width != width:
                col.width = width
        height = _table_height(rows, most)
        if table.height != height:
            table.height = height

    def _titled(self, title: str, key: str, table: Any, note: str = NO_DATA) -> Any:
        """A table under its title and "no data yet" note."""
        from bokeh.models import Div

        head = Div(text=f"<b>{title}</b>", styles={"font-size": "13px", "margin": "6px 0 2px 0"})
        empty = Div(text=f"<i>{note}</i>", styles={"color": GRAY, "font-size": "13px", "margin": "6px 0 2px 12px"},
                    name=f"tc-empty-{key}")
        self.notes[key] = empty
        return self._column(self._row(head, empty), table, sizing_mode="stretch_width")

    @staticmethod
    def _section(title: str) -> Any:
        from bokeh.models import Div

        return Div(text=title, sizing_mode="stretch_width",
                   styles={"font-size": "15px", "font-weight": "bold", "margin": "12px 0 0 0",
                           "border-bottom": "1px solid #ddd", "padding-bottom": "2px"})

    def _show(self, key: str, has_data: bool) -> None:
        note = self.notes[key]
        if note.visible == has_data:
            note.visible = not has_data

    # ---------------------------------------------------------------- refresh
    def update(self) -> None:
        """Refresh every source from the state (whole columns; skipped when unchanged)."""
        agg = self.state_for(self.scheduler)
        if agg is None:
            self.header.text = "<i>token-capture aggregator not installed on this scheduler</i>"
            return
        agg.sample_workers(len(self.scheduler.workers))  # the worker line keeps moving even without events
        self.workers.data = dict(
            t=[t * 1000 for t, _ in agg.worker_counts], workers=[n for _, n in agg.worker_counts])
        if agg.version == self._version:
            return
        self._version = agg.version
        snap = agg.snapshot()
        self._update_header(snap)
        self._update_finalize(snap)
        self._update_queue(snap)
        self._update_store(snap)
        self._update_scaling(snap)
        self._update_cuts(snap)
        self._update_restores(snap)

    def _update_header(self, snap: Mapping[str, Any]) -> None:
        s = summary_of(snap)
        self.summary.data = {key: [s[key]] for key, _ in TILES}
        malformed = sum(snap["malformed"].values())
        last = f" (last: {snap['last_error'][:120]})" if malformed and snap["last_error"] else ""
        self.header.text = (
            f"<b>{s['rollouts']}</b> rollouts finalized in {s['groups']} groups, {s['steps']} steps collected "
            f"(<b>{s['accepted']}</b> accepted, {s['rejected']} rejected); queue depth {snap['queue_depth']:g}; "
            f"{s['cuts']} cut reports; {s['gets']} restore gets; {malformed} malformed events dropped{last}; "
            f"updated {time.strftime('%H:%M:%S')}"
        )

    def _update_finalize(self, snap: Mapping[str, Any]) -> None:
        steps = snap["steps"][-MAX_BARS:]
        factors = _unique([step_factor(st["step_id"]) for st in steps])
        self.fig_split.x_range.factors = factors
        shown = len(steps)
        total = len(snap["steps"])
        self.fig_split.xaxis.axis_label = "step" if shown == total else f"step (newest {shown} of {total})"
        self.split.data = dict(
            x=factors,
            step=[st["step_id"] for st in steps],
            **{k: [st[k] for st in steps] for k in _SPLIT},
            groups=[st["groups"] for st in steps],
            rollouts=[st["rollouts"] for st in steps],
            wall_ms=[st["wall_ms"] for st in steps],
            state=[f"collected ({st['dominant']}-bound)" if st["final"] else "running" for st in steps],
        )
        self._show("split", bool(steps))

        rejected = sorted(snap["rejected"].items(), key=lambda kv: (-kv[1], kv[0]))
        outcomes = [("accepted", snap["totals"].get("accepted", 0), GREEN)] + [(r, n, RED) for r, n in rejected]
        if not snap["totals"].get("rollouts"):
            outcomes = []
        self.fig_outcome.y_range.factors = [o for o, _, _ in outcomes][::-1]
        self.fig_outcome.height = _bar_height(len(outcomes))
        self.outcome.data = dict(
            outcome=[o for o, _, _ in outcomes], count=[n for _, n, _ in outcomes], color=[c for _, _, c in outcomes])
        self._show("outcome", bool(outcomes))
        details = snap["rejected_details"]
        self.rejections.data = dict(
            reason=[r for r, _ in rejected], count=[n for _, n in rejected], detail=[details.get(r, "") for r, _ in rejected])
        self._fit(self.rejection_table, len(rejected))
        self._show("rejections", bool(rejected))

    def _update_queue(self, snap: Mapping[str, Any]) -> None:
        self.depth.data = dict(t=[t * 1000 for t, _ in snap["depths"]], queue_depth=[d for _, d in snap["depths"]])
        groups = snap["groups"]
        self.queue.data = dict(
            t=[g["t"] * 1000 for g in groups],
            queue_wait_ms=[g["queue_wait_ms"] for g in groups],
            calls_per_rollout=[g["calls_per_rollout"] for g in groups],
            group=[g.get("group_id") or "" for g in groups],
            step=[g.get("step_id") or "" for g in groups],
        )
        self._show("depth", bool(snap["depths"]))
        self._show("wait", bool(groups))
        self._show("calls", any(g["calls_per_rollout"] for g in groups))

    def _update_store(self, snap: Mapping[str, Any]) -> None:
        units = sorted(snap["store_units"].values(), key=lambda u: (len(u["unit"]), u["unit"]))[:MAX_BARS]
        labels = [f"unit {shorten(u['unit'], 8)} \u00b7 {short_worker(u['worker'])}" if u["worker"]
                  else f"unit {shorten(u['unit'], 8)}" for u in units]
        self.fig_store.y_range.factors = labels[::-1]  # unit 0 on top
        self.fig_store.height = _bar_height(len(units))
        self.store.data = dict(
            label=labels, unit=[u["unit"] for u in units], worker=[u["worker"] for u in units],
            **{k: [u[k] for u in units] for k in ("memory_bytes", "spilled_bytes", "rows", "lost_keys")},
        )
        self._fit(self.store_table, len(units))
        self._show("store", bool(units))
        self._show("units", bool(units))

    def _update_scaling(self, snap: Mapping[str, Any]) -> None:
        decisions = snap["decisions"][::-1]  # newest first (the table); the chart is by time
        self.decisions.data = dict(
            t=[d["t"] * 1000 for d in decisions],
            when=[time.strftime("%H:%M:%S", time.localtime(d["t"])) for d in decisions],
            action=[d["action"] for d in decisions],
            current=[int(d["current"]) for d in decisions],
            target=[int(d["target"]) for d in decisions],
            reason=[d["reason"] for d in decisions],
            y=[d["target"] for d in decisions],
            color=[ACTION_COLORS[d["action"]] for d in decisions],
            marker=[ACTION_MARKERS[d["action"]] for d in decisions],
        )
        self._fit(self.decision_table, len(decisions), most=8)
        self._show("scale", bool(decisions))
        self._show("decisions", bool(decisions))

    def _update_cuts(self, snap: Mapping[str, Any]) -> None:
        cuts = snap["cuts"]
        shown = cuts[-MAX_BARS:]
        factors = _unique([(shorten(c["checkpoint_id"] or "?", 16), short_worker(c["worker"])) for c in shown])
        self.fig_cut.y_range.factors = factors[::-1]  # oldest on top, as in the table
        self.fig_cut.height = _bar_height(len(shown) + len({f[0] for f in factors}))
        columns = lambda rows: dict(  # noqa: E731
            checkpoint_id=[c["checkpoint_id"] for c in rows],
            worker=[c["worker"] for c in rows],
            **{k: [c[k] for c in rows] for k in ("calls", "rows", "puts", "wall_ms", "durable")},
            failures=[", ".join(f"{r}: {n}" for r, n in c["failures"].items()) or "-" for c in rows],
        )
        self.cut.data = dict(i=list(range(len(cuts))), **columns(cuts))
        self.cut_bars.data = dict(y=factors, **columns(shown))
        self._fit(self.cut_table, len(cuts))
        self._show("cut", bool(cuts))
        self._show("cuts", bool(cuts))

    def _update_restores(self, snap: Mapping[str, Any]) -> None:
        restores = list(snap["restore_latest"].values())
        workers = [r["worker"] or "?" for r in restores]
        labels = [f for _, f in _unique([("", short_worker(w)) for w in workers])]
        self.fig_restore.y_range.factors = labels[::-1]
        self.fig_restore.height = _bar_height(len(restores))
        self.restore.data = dict(
            worker=workers, label=labels,
            **{k: [r[k] for r in restores] for k in ("requests", "gets", "keys", "keys_per_get", "p50_ms", "p99_ms", "failures")},
        )
        self._fit(self.restore_table, len(restores))
        self._show("restore", bool(restores))
        self._show("restores", bool(restores))


def token_capture_doc(scheduler: Any, extra: dict[str, Any], doc: Any, *, state_for: StateLookup) -> None:
    """Bokeh application function (distributed's ``(scheduler, extra, doc)`` convention).

    ``state_for`` is bound by :func:`register_page`.
    """
    from bokeh.themes import Theme  # noqa: F401  (bokeh is present whenever the dashboard is)
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = TokenCapturePage(scheduler, state_for)
    page.update()
    doc.title = "Dask: Token capture"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, int(config.get("dashboard.update-ms")))
    # the header is rendered with the figures the page was built from (a plain HTTP fetch
    # shows them), then kept live from the same summary source as the rest of the page
    doc.js_on_event("document_ready", page.header_js)
    doc.template = env.from_string(_TEMPLATE)
    doc.template_variables.update(extra)
    doc.template_variables["tc"] = {key: values[0] for key, values in page.summary.data.items()}
    doc.template_variables["tc_tiles"] = TILES
    doc.theme = BOKEH_THEME


def _bokeh_apps(scheduler: Any) -> list[Any]:
    from bokeh.server.tornado import BokehTornado

    app = getattr(scheduler, "http_application", None)
    return [a for a in getattr(app, "applications", []) if isinstance(a, BokehTornado)]


def register_page(
    scheduler: Any, state_for: StateLookup, doc_function: Callable[..., None] | None = None
) -> bool:
    """Serve the page on ``scheduler``'s dashboard and add it to the menu.

    ``state_for(scheduler)`` finds the state the page shows; ``doc_function`` (default
    :func:`token_capture_doc` bound to ``state_for``) builds each browser's document.
    Returns True if the page is served (now or already), False if the scheduler has no
    Bokeh dashboard (``dashboard=False`` or bokeh missing). Idempotent.
    """
    apps = _bokeh_apps(scheduler)
    if not apps:
        return False
    path = "/" + page_path()
    if any(path in a.app_paths for a in apps):
        return True
    if doc_function is None:
        doc_function = partial(token_capture_doc, state_for=state_for)
    # Mounted the way distributed mounts its own Bokeh pages (see the design notes).
    from tornado.ioloop import IOLoop

    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables

    main = apps[0]
    variables = template_variables(scheduler)  # memoized per scheduler: the menu all pages render
    if page_path() not in variables["pages"]:
        variables["pages"].append(page_path())
    bokeh_app = BokehApplication({path: doc_function}, scheduler, prefix=main.prefix, template_variables=variables)
    scheduler.http_application.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())
    bokeh_app.start()
    logger.info("token-capture dashboard page at %s", path)
    return True
