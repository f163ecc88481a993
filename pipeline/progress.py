"""A tiny progress line on stderr for long CLI work (benchmarks, demo).

stdout stays clean for ``--json`` output; progress goes to stderr, overwritten in place
on a terminal and one line per update otherwise (CI logs).
"""
from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("staging", total=n, unit="rows") as p: p.advance(k, "note")``.

    ``advance(0, note)`` updates the note without counting (a phase that has started);
    updates closer together than ``min_interval_s`` are skipped, except the last.
    """

    def __init__(self, label: str, total: int | None = None, *, quiet: bool = False, min_interval_s: float = 0.5, unit: str = ""):
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.quiet = quiet
        self._tty = sys.stderr.isatty()
        self._min_interval_s = min_interval_s
        self._last = 0.0
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Progress":
        self._emit(force=True)
        return self

    def __exit__(self, *exc) -> None:
        self._emit(force=True, final=True)

    def advance(self, n: int = 1, note: str = "", *, force: bool = False) -> None:
        """Count ``n`` more done; ``force`` shows the line even if the last was recent."""
        self.done += n
        self._emit(note=note, force=force)

    def note(self, text: str) -> None:
        if not self.quiet:
            print(f"[{self.label}] {text}", file=sys.stderr, flush=True)

    def _emit(self, *, force: bool = False, final: bool = False, note: str = "") -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        if not force and now - self._last < self._min_interval_s:
            return
        self._last = now
        frac = f"{self.done}/{self.total}" if self.total else f"{self.done}"
        if self.unit:
            frac = f"{frac} {self.unit}"
        line = f"[{self.label}] {frac} {now - self._t0:6.1f}s {note}".rstrip()
        if self._tty and not final:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            print(("\r" if self._tty else "") + line, file=sys.stderr, flush=True)
