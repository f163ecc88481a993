"""The page's header: totals tiles in the served HTML, kept live, and a line of totals.

The tiles (:data:`TILES`) are rendered into the page template on the server, so a plain
HTTP fetch shows them; :class:`PageHeader`'s ``tc-summary`` source then keeps them live
in the browser (:data:`HEADER_JS`), and its ``tc-header`` Div carries the line under them.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .snapshot import StateSnapshot
    from .state import TokenCaptureState

PAGE_TEMPLATE = """{% extends "base.html" %}
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
"""The page's Jinja template (distributed's ``base.html``): the header tiles, then the plots."""

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
HEADER_JS = """
const data = source.data;
for (const key of Object.keys(data)) {
  const el = document.getElementById('tc-' + key);
  if (el != null && data[key].length > 0) { el.textContent = String(data[key][0]); }
}
"""


def summary_of(snap: StateSnapshot | None) -> dict[str, int]:
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


class PageHeader:
    """The header's models: ``div`` (``tc-header``, the line of totals), ``summary``
    (``tc-summary``, the tiles' figures) and ``js`` (writes them into the tiles)."""

    def __init__(self) -> None:
        from bokeh.models import ColumnDataSource, CustomJS, Div

        self.div = Div(text="", sizing_mode="stretch_width", name="tc-header",
                       styles={"font-size": "13px", "color": "#333", "margin": "2px 16px"})
        # the template's totals, kept live by HEADER_JS from this source
        self.summary = ColumnDataSource({key: [0] for key, _ in TILES}, name="tc-summary")
        self.js = CustomJS(args=dict(source=self.summary), code=HEADER_JS)
        self.summary.js_on_change("data", self.js)
        # (also makes the source part of the document: it is reachable from a root)
        self.div.js_on_change("text", self.js)

    def show_not_installed(self) -> None:
        """Say that the scheduler has no aggregator (so nothing to show)."""
        self.div.text = "<i>token-capture aggregator not installed on this scheduler</i>"

    def update(self, snap: StateSnapshot) -> None:
        """The tiles' figures and the line of totals (queue depth in groups) from ``snap``."""
        s = summary_of(snap)
        self.summary.data = {key: [s[key]] for key, _ in TILES}
        malformed = sum(snap["malformed"].values())
        last = f" (last: {snap['last_error'][:120]})" if malformed and snap["last_error"] else ""
        self.div.text = (
            f"<b>{s['rollouts']}</b> rollouts finalized in {s['groups']} groups, {s['steps']} steps collected "
            f"(<b>{s['accepted']}</b> accepted, {s['rejected']} rejected); queue depth {snap['queue_depth']:g}; "
            f"{s['cuts']} cut reports; {s['gets']} restore gets; {malformed} malformed events dropped{last}; "
            f"updated {time.strftime('%H:%M:%S')}"
        )
