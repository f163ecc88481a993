"""The token-capture page of the Dask dashboard (Bokeh, live).

Served by the scheduler's own dashboard at ``/<dashboard.page>`` (default
``/token-capture``) and listed in its top menu. The page is a view: it reads a
:class:`~pipeline.dashboard.state.TokenCaptureState`, found through the lookup function
given to :func:`register_page`, and redraws only when the state changed.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from .. import config
from .state import TokenCaptureState

StateLookup = Callable[[Any], TokenCaptureState | None]
"""Finds the state kept on a scheduler (``None`` when the aggregator is not installed)."""

logger = logging.getLogger(__name__)

_SPLIT = ("fetch_ms", "verify_ms", "assemble_ms")
_SPLIT_COLORS = ("#1f77b4", "#d62728", "#2ca02c")

_TEMPLATE = """{% extends "base.html" %}
{% block content %}
<div id="token-capture-summary" style="font-family: sans-serif; margin: 8px 16px;">
  <h2 style="margin: 4px 0;">Token capture</h2>
  <span>Finalized rollouts: <b id="tc-rollouts">{{ tc.rollouts }}</b></span> &middot;
  <span>accepted: <b id="tc-accepted">{{ tc.accepted }}</b></span> &middot;
  <span>rejected: <b id="tc-rejected">{{ tc.rejected }}</b></span> &middot;
  <span>groups: <b id="tc-groups">{{ tc.groups }}</b></span> &middot;
  <span>cuts: <b id="tc-cuts">{{ tc.cuts }}</b></span> &middot;
  <span>restore gets: <b id="tc-gets">{{ tc.gets }}</b></span> &middot;
  <span>scaling decisions: <b id="tc-decisions">{{ tc.decisions }}</b></span>
  <span style="color: #888;">(as served; the plots below update live)</span>
</div>
{{ plot_div }}
{{ plot_script }}
{% endblock %}
"""


def page_path() -> str:
    """The page's path on the dashboard, without slashes (``dashboard.page``)."""
    return str(config.get("dashboard.page")).strip("/")


def summary(agg: TokenCaptureState | None) -> dict[str, int]:
    """Headline counts shown in the page header (all counts)."""
    if agg is None:
        return dict(rollouts=0, accepted=0, rejected=0, groups=0, cuts=0, gets=0, decisions=0)
    return dict(
        rollouts=int(agg.totals["rollouts"]),
        accepted=int(agg.totals["accepted"]),
        rejected=int(agg.totals["rejected"]),
        groups=int(agg.totals["groups"]),
        cuts=int(agg.cut_totals["cuts"]),
        gets=int(agg.restore_totals["gets"]),
        decisions=len(agg.decisions),
    )


class TokenCapturePage:
    """The Bokeh models of one browser session, and how they are refreshed from the state."""

    def __init__(self, scheduler: Any, state_for: StateLookup) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import (
            ColumnDataSource,
            DataTable,
            Div,
            FactorRange,
            HoverTool,
            DatetimeTickFormatter,
            NumberFormatter,
            NumeralTickFormatter,
            TableColumn,
        )
        from bokeh.plotting import figure

        self.scheduler = scheduler
        self.state_for = state_for
        self._version = -1
        w = dict(sizing_mode="stretch_width", height=230, tools="pan,wheel_zoom,box_zoom,reset,save")

        self.header = Div(text="", sizing_mode="stretch_width", name="tc-header")

        # split timing per step (stacked)
        self.split = ColumnDataSource(dict(
            step=[], fetch_ms=[], verify_ms=[], assemble_ms=[], groups=[], rollouts=[], wall_ms=[], state=[]),
            name="tc-split")
        self.fig_split = figure(title="Finalize time per step: fetch / verify / assemble (ms)", x_range=FactorRange(), **w)
        self.fig_split.vbar_stack(
            list(_SPLIT), x="step", width=0.8, source=self.split, color=list(_SPLIT_COLORS),
            legend_label=["fetch", "verify", "assemble"],
        )
        self.fig_split.add_tools(HoverTool(tooltips=[
            ("step", "@step"), ("fetch", "@fetch_ms{0.0} ms"), ("verify", "@verify_ms{0.0} ms"),
            ("assemble", "@assemble_ms{0.0} ms"), ("groups", "@groups"), ("rollouts", "@rollouts"),
            ("wall", "@wall_ms{0.0} ms"), ("state", "@state")]))
        self.fig_split.legend.location = "top_left"
        self.fig_split.xaxis.major_label_orientation = 0.8

        # queue depth and wait over time (one point per finalized group)
        self.depth = ColumnDataSource(dict(t=[], queue_depth=[]), name="tc-depth")
        self.queue = ColumnDataSource(dict(t=[], queue_wait_ms=[], calls_per_rollout=[]), name="tc-queue")
        self.fig_depth = figure(title="Queue depth (groups in flight)", x_axis_type="datetime", **w)
        self.fig_depth.step("t", "queue_depth", source=self.depth, mode="after", line_width=2)
        self.fig_wait = figure(title="Queue wait per group (ms)", x_axis_type="datetime", **w)
        self.fig_wait.scatter("t", "queue_wait_ms", source=self.queue, size=5)
        self.fig_wait.line("t", "queue_wait_ms", source=self.queue, alpha=0.5)
        self.fig_calls = figure(title="Calls per rollout (per group)", x_axis_type="datetime", **w)
        self.fig_calls.scatter("t", "calls_per_rollout", source=self.queue, size=5, color="#9467bd")

        # outcomes: accepted and each rejection reason
        self.outcome = ColumnDataSource(dict(outcome=[], count=[], color=[]), name="tc-outcome")
        self.fig_outcome = figure(title="Rollouts accepted / rejected by reason", y_range=FactorRange(), **w)
        self.fig_outcome.hbar(y="outcome", right="count", height=0.7, color="color", source=self.outcome)
        self.fig_outcome.add_tools(HoverTool(tooltips=[("outcome", "@outcome"), ("rollouts", "@count")]))
        # rejections: count and the latest detail per reason
        self.rejections = ColumnDataSource(dict(reason=[], count=[], detail=[]), name="tc-rejections")

        # cuts: wall time per cut report, details in the table
        self.cut = ColumnDataSource(dict(
            i=[], label=[], checkpoint_id=[], worker=[], calls=[], rows=[], puts=[], wall_ms=[], durable=[], failures=[]),
            name="tc-cut")
        self.fig_cut = figure(title="Cut wall time per worker report (ms)", x_range=FactorRange(), **w)
        self.fig_cut.xaxis.major_label_orientation = 0.8
        self.fig_cut.vbar(x="label", top="wall_ms", width=0.8, source=self.cut, color="#ff7f0e")
        self.fig_cut.add_tools(HoverTool(tooltips=[
            ("checkpoint", "@checkpoint_id"), ("worker", "@worker"), ("rows", "@rows"), ("puts", "@puts"),
            ("wall", "@wall_ms{0.0} ms"), ("durable", "@durable"), ("failures", "@failures")]))
        num = NumberFormatter(format="0,0")
        ms = NumberFormatter(format="0,0.0")
        self.rejection_table = DataTable(source=self.rejections, height=160, sizing_mode="stretch_width", index_position=None, columns=[
            TableColumn(field="reason", title="rejection reason"), TableColumn(field="count", title="rollouts", formatter=num),
            TableColumn(field="detail", title="last detail", width=600),
        ])
        self.cut_table = DataTable(source=self.cut, height=200, sizing_mode="stretch_width", index_position=None, columns=[
            TableColumn(field="checkpoint_id", title="checkpoint"), TableColumn(field="worker", title="worker"),
            TableColumn(field="calls", title="calls", formatter=num), TableColumn(field="rows", title="rows", formatter=num),
            TableColumn(field="puts", title="puts", formatter=num), TableColumn(field="wall_ms", title="wall ms", formatter=ms),
            TableColumn(field="durable", title="durable", formatter=num), TableColumn(field="failures", title="failures by reason"),
        ])

        # restore: latest report per batcher worker
        self.restore = ColumnDataSource(dict(
            worker=[], requests=[], gets=[], keys=[], keys_per_get=[], p50_ms=[], p99_ms=[], failures=[]), name="tc-restore")
        self.fig_restore = figure(title="Restore latency per batcher: p50 / p99 (ms)", x_range=FactorRange(), **w)
        self.fig_restore.vbar(x="worker", top="p99_ms", width=0.8, source=self.restore, color="#c5b0d5", legend_label="p99")
        self.fig_restore.vbar(x="worker", top="p50_ms", width=0.5, source=self.restore, color="#9467bd", legend_label="p50")
        self.fig_restore.add_tools(HoverTool(tooltips=[
            ("worker", "@worker"), ("gets", "@gets"), ("keys/get", "@keys_per_get{0.0}"),
            ("p50", "@p50_ms{0.0} ms"), ("p99", "@p99_ms{0.0} ms"), ("failures", "@failures")]))
        self.restore_table = DataTable(source=self.restore, height=160, sizing_mode="stretch_width", index_position=None, columns=[
            TableColumn(field="worker", title="batcher worker"), TableColumn(field="requests", title="requests", formatter=num),
            TableColumn(field="gets", title="gets", formatter=num), TableColumn(field="keys", title="keys", formatter=num),
            TableColumn(field="keys_per_get", title="keys / get", formatter=ms),
            TableColumn(field="p50_ms", title="p50 ms", formatter=ms), TableColumn(field="p99_ms", title="p99 ms", formatter=ms),
            TableColumn(field="failures", title="failures", formatter=num),
        ])

        # store: memory vs spilled per unit (stacked)
        self.store = ColumnDataSource(dict(unit=[], memory_bytes=[], spilled_bytes=[], rows=[], worker=[]), name="tc-store")
        self.fig_store = figure(title="Store bytes per unit: memory / spilled", y_range=FactorRange(), **w)
        self.fig_store.hbar_stack(
            ["memory_bytes", "spilled_bytes"], y="unit", height=0.7, source=self.store,
            color=["#17becf", "#7f7f7f"], legend_label=["memory", "spilled"],
        )
        self.fig_store.xaxis.formatter = NumeralTickFormatter(format="0.0 b")
        self.fig_store.add_tools(HoverTool(tooltips=[
            ("unit", "@unit"), ("worker", "@worker"), ("rows", "@rows"),
            ("memory", "@memory_bytes{0.0 b}"), ("spilled", "@spilled_bytes{0.0 b}")]))

        # scaling: workers over time and the decisions with their reasons
        self.workers = ColumnDataSource(dict(t=[], workers=[]), name="tc-workers")
        self.decisions = ColumnDataSource(dict(t=[], when=[], action=[], current=[], target=[], reason=[], y=[], color=[]), name="tc-decisions")
        self.fig_scale = figure(title="Workers and scaling decisions", x_axis_type="datetime", **w)
        self.fig_scale.step("t", "workers", source=self.workers, mode="after", line_width=2)
        self.fig_scale.scatter("t", "y", source=self.decisions, size=9, color="color", marker="triangle")
        self.fig_scale.add_tools(HoverTool(tooltips=[
            ("action", "@action"), ("workers", "@current -> @target"), ("reason", "@reason")]))
        self.decision_table = DataTable(source=self.decisions, height=230, sizing_mode="stretch_width", index_position=None, columns=[
            TableColumn(field="when", title="time"), TableColumn(field="action", title="action"),
            TableColumn(field="current", title="workers"), TableColumn(field="target", title="target"),
            TableColumn(field="reason", title="reason", width=600),
        ])

        clock = DatetimeTickFormatter(
            microseconds="%H:%M:%S.%3N", milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S",
            minsec="%H:%M:%S", minutes="%H:%M", hourmin="%H:%M", hours="%H:%M")
        for fig in (self.fig_depth, self.fig_wait, self.fig_calls, self.fig_scale):
            fig.xaxis.formatter = clock

        self.root = column(
            self.header,
            row(self.fig_split, self.fig_outcome, sizing_mode="stretch_width"),
            row(self.rejection_table, sizing_mode="stretch_width"),
            row(self.fig_depth, self.fig_wait, self.fig_calls, sizing_mode="stretch_width"),
            row(self.fig_scale, self.decision_table, sizing_mode="stretch_width"),
            row(self.fig_cut, self.fig_restore, self.fig_store, sizing_mode="stretch_width"),
            row(self.cut_table, self.restore_table, sizing_mode="stretch_width"),
            sizing_mode="stretch_width",
        )

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
        s = summary(agg)
        self.header.text = (
            f"<b>{s['rollouts']}</b> rollouts finalized in {s['groups']} groups, "
            f"{int(agg.totals['steps'])} steps collected "
            f"(<b>{s['accepted']}</b> accepted, {s['rejected']} rejected); queue depth "
            f"{agg.queue_depth:g}; {s['cuts']} cut reports; {s['gets']} restore gets; "
            f"{len(agg.malformed) and sum(agg.malformed.values())} malformed events dropped"
        )

        steps = list(agg.steps.values())
        self.fig_split.x_range.factors = [st["step_id"] for st in steps]
        self.split.data = dict(
            step=[st["step_id"] for st in steps],
            **{k: [st[k] for st in steps] for k in _SPLIT},
            groups=[st["groups"] for st in steps],
            rollouts=[st["rollouts"] for st in steps],
            wall_ms=[st["wall_ms"] for st in steps],
            state=[f"collected ({st['dominant']}-bound)" if st["final"] else "running" for st in steps],
        )
        self.depth.data = dict(t=[t * 1000 for t, _ in agg.depths], queue_depth=[d for _, d in agg.depths])

        groups = list(agg.groups)
        self.queue.data = dict(
            t=[g["t"] * 1000 for g in groups],
            queue_wait_ms=[g["queue_wait_ms"] for g in groups],
            calls_per_rollout=[g["calls_per_rollout"] for g in groups],
        )

        outcomes = [("accepted", agg.totals["accepted"], "#2ca02c")] + [
            (reason, n, "#d62728") for reason, n in agg.rejected.most_common()
        ]
        self.fig_outcome.y_range.factors = [o for o, _, _ in outcomes][::-1]
        self.outcome.data = dict(
            outcome=[o for o, _, _ in outcomes], count=[n for _, n, _ in outcomes], color=[c for _, _, c in outcomes])
        rejections = agg.rejected.most_common()
        self.rejections.data = dict(
            reason=[r for r, _ in rejections], count=[n for _, n in rejections],
            detail=[agg.rejected_details.get(r, "") for r, _ in rejections])

        cuts = list(agg.cuts)
        labels = [f"{i}: {c['checkpoint_id']}/{c['worker']}" for i, c in enumerate(cuts)]
        self.fig_cut.x_range.factors = labels
        self.cut.data = dict(
            i=list(range(len(cuts))),
            label=labels,
            checkpoint_id=[c["checkpoint_id"] for c in cuts],
            worker=[c["worker"] for c in cuts],
            **{k: [c[k] for c in cuts] for k in ("calls", "rows", "puts", "wall_ms", "durable")},
            failures=[", ".join(f"{r}: {n}" for r, n in c["failures"].items()) or "-" for c in cuts],
        )

        restores = list(agg.restore_latest.values())
        self.fig_restore.x_range.factors = [r["worker"] or "?" for r in restores]
        self.restore.data = dict(
            worker=[r["worker"] or "?" for r in restores],
            **{k: [r[k] for r in restores] for k in ("requests", "gets", "keys", "keys_per_get", "p50_ms", "p99_ms", "failures")},
        )

        units = list(agg.store_units.values())
        self.fig_store.y_range.factors = [u["unit"] for u in units]
        self.store.data = dict(
            unit=[u["unit"] for u in units], worker=[u["worker"] for u in units],
            **{k: [u[k] for u in units] for k in ("memory_bytes", "spilled_bytes", "rows")},
        )

        decisions = list(agg.decisions)
        colors = {"up": "#2ca02c", "down": "#d62728", "hold": "#7f7f7f"}
        self.decisions.data = dict(
            t=[d["t"] * 1000 for d in decisions],
            when=[time.strftime("%H:%M:%S", time.localtime(d["t"])) for d in decisions],
            action=[d["action"] for d in decisions],
            current=[int(d["current"]) for d in decisions],
            target=[int(d["target"]) for d in decisions],
            reason=[d["reason"] for d in decisions],
            y=[d["target"] for d in decisions],
            color=[colors[d["action"]] for d in decisions],
        )


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
    doc.template = env.from_string(_TEMPLATE)
    doc.template_variables.update(extra)
    doc.template_variables["tc"] = summary(state_for(scheduler))
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
