"""Short category labels for the page's axes (the full names stay in the hovers), free of Bokeh."""
from __future__ import annotations

import re

LABEL_CHARS = 24  # longest categorical tick label (characters)

Factor = tuple[str, str]
"""A two-level categorical factor ``(group, label)`` (Bokeh draws the group under the labels)."""


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


def step_factor(step_id: str) -> Factor:
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


def unique_factors(factors: list[Factor]) -> list[Factor]:
    """Factors made unique (a repeated one gets ``#k``): Bokeh needs distinct factors."""
    seen: dict[Factor, int] = {}
    out = []
    for f in factors:
        k = seen.get(f, 0)
        seen[f] = k + 1
        out.append(f if k == 0 else (f[0], f"{f[1]}#{k}"))
    return out
