"""The page's building blocks, drawn as Dask's own pages draw them.

Charts (toolbar above, legend above the plot area), tables whose columns are sized to
their content, section rules, and the "no data yet" note every chart and table carries
until it has data (a model named ``tc-empty-<key>``). :class:`PanelKit` is what the panel
builders of one page share. Sizes are px.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .style import BAR_PX, CELL_PAD_PX, CHAR_PX, CHART_HEIGHT, GRAY, MAX_CHART_HEIGHT, NO_DATA, ROW_PX

if TYPE_CHECKING:
    from bokeh.models.annotations.labels import Label
    from bokeh.models.formatters import DatetimeTickFormatter
    from bokeh.models.layouts import Column
    from bokeh.models.ranges import FactorRange
    from bokeh.models.renderers.glyph_renderer import GlyphRenderer
    from bokeh.models.sources import ColumnDataSource
    from bokeh.models.widgets.markups import Div
    from bokeh.models.widgets.tables import DataTable
    from bokeh.plotting import figure as Figure

ColumnSpec = tuple[str, str, "str | None"]
"""A table column: ``(field, title, number format)``; no format: the cell is text."""


def bar_height(n: int, extra: int = 110) -> int:
    """Height of a horizontal bar chart with ``n`` categories (px)."""
    return max(CHART_HEIGHT, min(MAX_CHART_HEIGHT, extra + BAR_PX * n))


def table_height(n: int, most: int = 12) -> int:
    """Height of a table showing ``n`` rows (at most ``most``, then it scrolls) (px)."""
    return ROW_PX * (1 + max(1, min(n, most))) + 4


def cell_text(value: object, fmt: str | None) -> str:
    """``value`` as a table cell shows it (numbers with the NumberFormatter's format)."""
    if fmt and isinstance(value, (int, float)):
        if fmt.endswith(" b"):
            return "1023.9 MiB"  # numbro's byte format: at most this long
        return f"{value:,.{fmt.count('0') - 2 if '.' in fmt else 0}f}"
    return str(value)


def text_px(text: str) -> int:
    """Width a table cell needs to show ``text`` uncut (px)."""
    return int(len(text) * CHAR_PX) + CELL_PAD_PX


class PanelKit:
    """What the panel builders of one page share: ``notes``, each panel's "no data yet"
    note by panel key (a chart's Label, a table's Div), and the time axes' clock format."""

    def __init__(self) -> None:
        self.notes: dict[str, Label | Div] = {}
        self._clock: DatetimeTickFormatter | None = None

    def figure(self, key: str, title: str, note: str = NO_DATA, **axes: FactorRange | str) -> Figure:
        """A chart named ``tc-fig-<key>`` as Dask's pages draw them (toolbar above), with its
        "no data yet" note; ``axes`` (``x_range``, ``y_range``, ``x_axis_type``) go to Bokeh."""
        from bokeh.models import Label, Node, Title
        from bokeh.plotting import figure

        # A Title model, not a string Bokeh converts on assignment: the conversion once
        # left a str in fig.title under the test suite's load (AttributeError on styling).
        fig = figure(title=Title(text=title, text_font_size="13px"), height=CHART_HEIGHT, min_height=CHART_HEIGHT, sizing_mode="stretch_width",
                     tools="pan,wheel_zoom,box_zoom,reset,save", toolbar_location="above",
                     min_border_left=50, min_border_right=20, name=f"tc-fig-{key}", **axes)
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

    def titled(self, title: str, key: str, table: DataTable, note: str = NO_DATA) -> Column:
        """A table under its title and "no data yet" note (``tc-empty-<key>``)."""
        from bokeh.layouts import column, row
        from bokeh.models import Div

        head = Div(text=f"<b>{title}</b>", styles={"font-size": "13px", "margin": "6px 0 2px 0"})
        empty = Div(text=f"<i>{note}</i>", styles={"color": GRAY, "font-size": "13px", "margin": "6px 0 2px 12px"},
                    name=f"tc-empty-{key}")
        self.notes[key] = empty
        return column(row(head, empty), table, sizing_mode="stretch_width")

    def time_axis(self, fig: Figure) -> None:
        """Wall-clock tick labels on ``fig``'s x axis (one formatter shared by the page)."""
        if self._clock is None:
            from bokeh.models import DatetimeTickFormatter

            self._clock = DatetimeTickFormatter(
                microseconds="%H:%M:%S.%3N", milliseconds="%H:%M:%S.%3N", seconds="%H:%M:%S",
                minsec="%H:%M:%S", minutes="%H:%M", hourmin="%H:%M", hours="%H:%M")
        fig.xaxis.formatter = self._clock
        fig.xaxis.ticker.desired_num_ticks = 5

    def show(self, key: str, has_data: bool) -> None:
        """Hide panel ``key``'s note once it has data (show it again when it has none)."""
        note = self.notes[key]
        if note.visible == has_data:
            note.visible = not has_data


def legend(fig: Figure, labels: list[str], renderers: list[GlyphRenderer]) -> None:
    """A horizontal legend above the plot area (never over the data)."""
    from bokeh.models import Legend, LegendItem

    items = [LegendItem(label=label, renderers=[r]) for label, r in zip(labels, renderers)]
    fig.add_layout(Legend(items=items, orientation="horizontal", location="top_left", border_line_alpha=0, padding=2,
                          margin=0, spacing=12, label_text_font_size="11px", glyph_height=12, glyph_width=16,
                          background_fill_alpha=0), "above")


def table(source: ColumnDataSource, columns: list[ColumnSpec]) -> DataTable:
    """A table named ``tc-table-<source>`` whose columns are sized to their content (see :func:`fit`)."""
    from bokeh.models import DataTable, NumberFormatter, StringFormatter, TableColumn

    cols = [TableColumn(field=f, title=t, width=text_px(t),
                        formatter=NumberFormatter(format=fmt, text_align="right") if fmt else StringFormatter())
            for f, t, fmt in columns]
    # "force_fit" grows the content widths to the table's width. (Bokeh's own content
    # autosizing, "fit_columns"/"fit_viewport", fails in bokeh 3.9's SlickGrid.)
    return DataTable(source=source, columns=cols, autosize_mode="force_fit", sizing_mode="stretch_width",
                     height=table_height(0), row_height=ROW_PX, index_position=None,
                     name=f"tc-table-{source.name.removeprefix('tc-')}")


def fit(table: DataTable, rows: int, most: int = 12) -> None:
    """Size ``table``'s columns to their content and its height to ``rows`` rows."""
    data = table.source.data
    for col in table.columns:
        fmt = getattr(col.formatter, "format", None)
        width = max([text_px(col.title)] + [text_px(cell_text(v, fmt)) for v in data.get(col.field, [])])
        if col.width != width:
            col.width = width
    height = table_height(rows, most)
    if table.height != height:
        table.height = height


def section(title: str) -> Div:
    """A section's title, ruled across the page."""
    from bokeh.models import Div

    return Div(text=title, sizing_mode="stretch_width",
               styles={"font-size": "15px", "font-weight": "bold", "margin": "12px 0 0 0",
                       "border-bottom": "1px solid #ddd", "padding-bottom": "2px"})
