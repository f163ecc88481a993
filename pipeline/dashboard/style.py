"""The page's look: its palette and its sizes (px), free of Bokeh."""
from __future__ import annotations

# bokeh.palettes.Category10[10] (the palette of Bokeh's and Dask's categorical charts),
# spelled out so importing this module does not need bokeh.
BLUE, ORANGE, GREEN, RED, PURPLE, BROWN, PINK, GRAY, OLIVE, CYAN = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
)
LIGHT_PURPLE = "#c5b0d5"  # Category20's companion of PURPLE
ACTION_COLORS = {"up": GREEN, "down": RED, "hold": GRAY}
ACTION_MARKERS = {"up": "triangle", "down": "inverted_triangle", "hold": "circle"}

CHART_HEIGHT = 260  # px, every chart at least this tall
BAR_PX = 24  # px per category on horizontal bar charts (they grow with their categories)
MAX_CHART_HEIGHT = 640  # px
MAX_BARS = 30  # newest steps / cut reports / units drawn as bars (tables keep every row)
ROW_PX = 25  # px, DataTable row height
CHAR_PX = 7.6  # px, average width of a table character (13px Helvetica/Arial, digits are wider)
CELL_PAD_PX = 20  # px, a cell's padding and border
NO_DATA = "no data yet"
