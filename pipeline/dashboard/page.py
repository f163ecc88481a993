"""The token-capture page of the Dask dashboard (Bokeh, live).

Served by the scheduler's own dashboard at ``/<dashboard.page>`` (default
``/token-capture``) and listed in its top menu. The page is a view: it reads
:meth:`~pipeline.dashboard.state.TokenCaptureState.snapshot` of the state found through
the lookup function given to :func:`register_page`, and redraws only when the state
changed.

Layout (readable at 1400 and 1920 px): a live header of totals (:mod:`.header`), then a
two-column grid of charts (each at least ``CHART_HEIGHT`` px tall, toolbar above as on
Dask's own pages, legends above the plot area, categorical names on the y axis of
unit/worker charts) and full-width tables whose columns are sized to their content
(:mod:`.widgets`). Every chart and table shows a "no data yet" note until it has data.
Bar charts show the newest ``MAX_BARS`` entries; step bars are labelled by step number
under their run id (the full id is in the hover). Each chart group is built and redrawn
by its panel builder (:mod:`.panels`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING

from .header import PAGE_TEMPLATE, TILES, PageHeader, summary, summary_of  # noqa: F401  (summary, summary_of: re-exported)
from .labels import short_worker, shorten, step_factor  # noqa: F401  (re-exported)
from .panels import CutPanels, FinalizePanels, Panel, QueuePanels, RestorePanels, ScalingPanels, StorePanels, TrainerPanels
from .settings import PageSettings
from .widgets import PanelKit, section

if TYPE_CHECKING:
    from bokeh.document import Document
    from bokeh.models.layouts import Column
    from bokeh.server.tornado import BokehTornado
    from distributed import Scheduler

    from .state import TokenCaptureState

StateLookup = Callable[["Scheduler"], "TokenCaptureState | None"]
"""Finds the state kept on a scheduler (``None`` when the aggregator is not installed)."""

DocFunction = Callable[["Scheduler", Mapping[str, object], "Document"], None]
"""Builds one browser session's document (distributed's ``(scheduler, extra, doc)`` convention)."""

logger = logging.getLogger(__name__)


def page_path() -> str:
    """The page's path on the dashboard, without slashes (``dashboard.page``, read now)."""
    return PageSettings.from_config().path


class TokenCapturePage:
    """The Bokeh models of one browser session, and how they are refreshed from the state.

    ``heading`` and the panel builders (``finalize_panels``, ``queue_panels``,
    ``scaling_panels``, ``cut_panels``, ``restore_panels``, ``store_panels``,
    ``trainer_panels``) own the
    models; ``root`` lays them out. ``header`` / ``summary`` / ``header_js`` (the header's
    models) and ``rejections`` / ``rejection_table`` are kept here as shortcuts.
    """

    def __init__(self, scheduler: Scheduler, state_for: StateLookup) -> None:
        self.scheduler = scheduler
        self.state_for = state_for
        self._version = -1
        self.kit = PanelKit()
        self.notes = self.kit.notes  # panel -> its "no data yet" note (a Label or a Div)
        self.heading = PageHeader()
        self.header, self.summary, self.header_js = self.heading.div, self.heading.summary, self.heading.js
        self.finalize_panels = FinalizePanels(self.kit)
        self.queue_panels = QueuePanels(self.kit)
        self.scaling_panels = ScalingPanels(self.kit)
        self.cut_panels = CutPanels(self.kit)
        self.restore_panels = RestorePanels(self.kit)
        self.store_panels = StorePanels(self.kit)
        self.trainer_panels = TrainerPanels(self.kit)
        self.rejections = self.finalize_panels.rejections
        self.rejection_table = self.finalize_panels.rejection_table
        # redrawn in this order on every change of the state
        self.panels: tuple[Panel, ...] = (
            self.finalize_panels, self.queue_panels, self.store_panels,
            self.scaling_panels, self.cut_panels, self.restore_panels, self.trainer_panels,
        )
        self.root = self._layout()

    def _layout(self) -> Column:
        """The header, then each section's rule, its charts in rows of two and its tables."""
        from bokeh.layouts import column, row

        fin, queue, scale = self.finalize_panels, self.queue_panels, self.scaling_panels
        cut, restore, store = self.cut_panels, self.restore_panels, self.store_panels
        grid = dict(sizing_mode="stretch_width")
        return column(
            self.header,
            section("Finalization"),
            row(fin.fig_split, fin.fig_outcome, **grid),
            fin.rejections_block,
            section("Queue and scaling"),
            row(queue.fig_depth, queue.fig_wait, **grid),
            row(queue.fig_calls, scale.fig_scale, **grid),
            scale.decisions_block,
            section("Checkpoint cuts and restores"),
            row(cut.fig_cut, restore.fig_restore, **grid),
            cut.cuts_block,
            restore.restores_block,
            section("Staging store"),
            row(store.fig_store, fin.fig_cross_host, **grid),  # the store's fill; the rows crossing hosts per step
            store.units_block,
            section("Trainer: staleness and mismatch"),
            row(self.trainer_panels.fig_staleness, self.trainer_panels.fig_mismatch, **grid),
            **grid,
        )

    def update(self) -> None:
        """Refresh every source from the state (whole columns; skipped when unchanged)."""
        agg = self.state_for(self.scheduler)
        if agg is None:
            self.heading.show_not_installed()
            return
        agg.sample_workers(len(self.scheduler.workers))  # the worker line keeps moving even without events
        self.scaling_panels.update_workers(agg.worker_counts)
        if agg.version == self._version:
            return
        self._version = agg.version
        snap = agg.snapshot()
        self.heading.update(snap)
        for panel in self.panels:
            panel.update(snap)


def token_capture_doc(
    scheduler: Scheduler, extra: Mapping[str, object], doc: Document, *,
    state_for: StateLookup, settings: PageSettings | None = None,
) -> None:
    """Bokeh application function (distributed's ``(scheduler, extra, doc)`` convention).

    ``state_for`` and ``settings`` (default: read from the config now) are bound by
    :func:`register_page`; the page refreshes every ``settings.update_ms`` ms.
    """
    from bokeh.themes import Theme  # noqa: F401  (bokeh is present whenever the dashboard is)
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    settings = settings if settings is not None else PageSettings.from_config()
    page = TokenCapturePage(scheduler, state_for)
    page.update()
    doc.title = "Dask: Token capture"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, settings.update_ms)
    # the header is rendered with the figures the page was built from (a plain HTTP fetch
    # shows them), then kept live from the same summary source as the rest of the page
    doc.js_on_event("document_ready", page.header_js)
    doc.template = env.from_string(PAGE_TEMPLATE)
    doc.template_variables.update(extra)
    doc.template_variables["tc"] = {key: values[0] for key, values in page.summary.data.items()}
    doc.template_variables["tc_tiles"] = TILES
    doc.theme = BOKEH_THEME


def _bokeh_apps(scheduler: Scheduler) -> list[BokehTornado]:
    from bokeh.server.tornado import BokehTornado

    app = getattr(scheduler, "http_application", None)
    return [a for a in getattr(app, "applications", []) if isinstance(a, BokehTornado)]


def register_page(
    scheduler: Scheduler, state_for: StateLookup, doc_function: DocFunction | None = None,
    settings: PageSettings | None = None,
) -> bool:
    """Serve the page on ``scheduler``'s dashboard and add it to the menu.

    ``state_for(scheduler)`` finds the state the page shows; ``doc_function`` (default
    :func:`token_capture_doc` bound to ``state_for`` and ``settings``) builds each
    browser's document; ``settings`` (default: read from the config now, once) give the
    page's path and refresh period. Returns True if the page is served (now or already),
    False if the scheduler has no Bokeh dashboard (``dashboard=False`` or bokeh missing).
    Idempotent.
    """
    apps = _bokeh_apps(scheduler)
    if not apps:
        return False
    settings = settings if settings is not None else PageSettings.from_config()
    path = "/" + settings.path
    if any(path in a.app_paths for a in apps):
        return True
    if doc_function is None:
        doc_function = partial(token_capture_doc, state_for=state_for, settings=settings)
    # Mounted the way distributed mounts its own Bokeh pages (see the design notes).
    from tornado.ioloop import IOLoop

    from distributed.dashboard.core import BokehApplication
    from distributed.dashboard.scheduler import template_variables

    main = apps[0]
    variables = template_variables(scheduler)  # memoized per scheduler: the menu all pages render
    if settings.path not in variables["pages"]:
        variables["pages"].append(settings.path)
    bokeh_app = BokehApplication({path: doc_function}, scheduler, prefix=main.prefix, template_variables=variables)
    scheduler.http_application.add_application(bokeh_app)
    bokeh_app.initialize(IOLoop.current())
    bokeh_app.start()
    logger.info("token-capture dashboard page at %s", path)
    return True
