"""What the step-finalizing phases share: waiting for a submitted step (Ctrl-C aware),
timing it from submit to its last group assembled, and its row in the summary."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Sequence

from . import reporter
from .context import DemoRun, Row
from .interrupt import as_finished

if TYPE_CHECKING:
    from distributed import Future

    from ..finalize.controller import StepHandle, StepResult

_ROW_KEYS = ("step_id", "rollouts", "accepted", "rejected", "fetch_ms", "verify_ms", "assemble_ms", "tokens",
             "tokens_per_s", "fetch_calls", "calls_per_rollout")


def wall_s() -> float:
    """Wall-clock seconds, on the clock of the finalize events (:mod:`pipeline.finalize.timing`)."""
    from ..finalize import timing

    return timing.wall_s()


class FinishWatch:
    """Records (:func:`wall_s`) when a submitted step's last task on the cluster is done
    (its verify tasks': the groups are assembled when the step is collected)."""

    def __init__(self, handle: StepHandle, submitted_s: float) -> None:
        """Watch ``handle``'s futures, submitted at ``submitted_s`` (:func:`wall_s`)."""
        self.handle = handle
        self.submitted_s = submitted_s
        self.n = 0
        self.last_s = 0.0
        self._lock = threading.Lock()
        for f in handle.futures:
            f.add_done_callback(self._one)

    def _one(self, _fut: Future) -> None:
        """Done callback of one future: count it, note when."""
        with self._lock:
            self.n += 1
            self.last_s = max(self.last_s, wall_s())

    def finalize_s(self, step: StepResult) -> float:
        """Seconds from submit to the last task done, plus the step's collection (gathering
        and assembling its groups: ``collect_ms``, all of it once every task is done); the
        step's own wall time if no callback ran."""
        if not self.n:
            return step.metrics["wall_ms"] / 1e3
        return max(0.0, self.last_s - self.submitted_s) + float(step.metrics.get("collect_ms", 0.0)) / 1e3


def wait_step(handle: StepHandle, cancel: Sequence[StepHandle] | None = None) -> None:
    """Wait for every task of ``handle``; on Ctrl-C cancel ``cancel`` (default: ``handle``
    alone) and re-raise."""
    try:
        for _ in as_finished(handle.futures):
            pass
    except KeyboardInterrupt:
        for h in (handle,) if cancel is None else cancel:
            h.cancel()
        raise


def report_step(run: DemoRun, step: StepResult, finalize_s: float | None = None, note: str = "") -> Row:
    """Print the step's line; its summary row. Throughput: the training tokens of the
    step's accepted rows (``metrics["tokens"]``) over ``finalize_s``, the seconds from
    submitting the step's graph to its groups assembled (the demo's generation of the
    next step overlaps it)."""
    m = step.metrics
    finalize_s = m["wall_ms"] / 1e3 if finalize_s is None else finalize_s
    rate = m["tokens"] / finalize_s if finalize_s > 0 else 0.0
    run.report.line(reporter.step_line(step, finalize_s, rate, note))
    row = {k: m[k] for k in _ROW_KEYS}
    row.update(finalize_s=finalize_s, finalize_tokens_per_s=rate)
    return row
