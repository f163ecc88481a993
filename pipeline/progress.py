"""A tiny progress line on stderr for long CLI work (benchmarks, demo).

stdout stays clean for ``--json`` output; progress goes to stderr, overwritten in place
on a terminal and one line per update otherwise (CI logs).
"""
from __future__ import annotations

import sys
import time


class Progress:
    """``with Progress("staging", total=n) as p: p.advance(k)``."""

    def __init__(self, label: str, total: int | None = None, *, quiet: bool = False, min_interval_s: float = 0.5):
        self.label = label
        self.total = total
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

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        self._emit(note=note)

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
        line = f"[{self.label}] {frac} {now - self._t0:6.1f}s {note}".rstrip()
        if self._tty and not final:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        else:
            print(("\r" if self._tty else "") + line, file=sys.stderr, flush=True)
