"""The steps phase: generate, stage and finalize ``--steps`` training steps, several in
flight; and ``--keep-alive``, one more step at a time until Ctrl-C."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from ..capture import submit_generation
from ..store.report import report_store
from . import reporter
from .context import DemoRun, Row
from .finishing import FinishWatch, report_step, wait_step, wall_s
from .interrupt import as_finished, stop_requested, wait_for_stop

if TYPE_CHECKING:
    from tasks.receipts import Receipt
    from tasks.toy.rollouts import RolloutSpec

    from ..finalize.controller import StepHandle
    from ..progress import Progress


def generate(run: DemoRun, groups: Sequence[Sequence[RolloutSpec]], label: str, progress: Progress | None) -> list[list[Receipt]]:
    """One generation task per group; receipts in group order, advancing ``progress`` as
    each group's receipts arrive."""
    futures = submit_generation(run.client, run.store, groups)
    index = {f.key: i for i, f in enumerate(futures)}
    receipts: list[list[Receipt]] = [[] for _ in futures]
    try:
        for fut in as_finished(futures):
            i = index[fut.key]
            receipts[i] = fut.result()
            if progress is not None:
                progress.advance(1, f"{label}: {groups[i][0].group_id} staged")
    except BaseException:
        run.client.cancel(futures)
        raise
    return receipts


def run_steps(run: DemoRun, steps: Iterable[int], progress: Progress | None = None) -> list[Row]:
    """Generate, stage and finalize ``steps``, keeping ``args.in_flight`` steps in flight;
    their summary rows.

    Step ids are ``<run-id>-step-<n>``.
    """
    from tasks.toy.rollouts import make_step_specs

    args, finalizer = run.args, run.steps_finalizer
    steps = list(steps)
    pending: list[FinishWatch] = []
    done: list[Row] = []
    for i, s in enumerate(steps):
        step_id = f"{run.run_id}-step-{s}"
        groups = make_step_specs(f"s{s}", args.groups, args.rollouts, turns=args.turns,
                                 tokens_per_turn=args.tokens_per_turn, **run.settings.spec_sizes())
        receipts = generate(run, groups, step_id, progress)
        submitted_s = wall_s()
        handle = finalizer.submit_step({g[0].group_id: r for g, r in zip(groups, receipts)}, step_id=step_id)
        pending.append(FinishWatch(handle, submitted_s))
        while len(pending) >= args.in_flight or (pending and i == len(steps) - 1):
            done.append(_collect(run, pending, progress))
    return done


def _collect(run: DemoRun, pending: list[FinishWatch], progress: Progress | None) -> Row:
    """Wait for the oldest of ``pending`` (removed from it), print it and publish the
    store's figures; its row. Ctrl-C cancels every pending step."""
    watch = pending.pop(0)
    handles: list[StepHandle] = [watch.handle, *(w.handle for w in pending)]
    wait_step(watch.handle, cancel=handles)
    step = watch.handle.result()
    row = report_step(run, step, watch.finalize_s(step))
    report_store(run.store)
    if progress is not None:
        progress.advance(0, f"{step.step_id} finalized")
    return row


def keep_alive(run: DemoRun) -> None:
    """Keep finalizing a step every ``--keep-alive-interval`` seconds until Ctrl-C, so the
    page's split timing, queue depth and scaling decisions keep moving."""
    interval_s = run.args.keep_alive_interval
    run.report.line(reporter.keep_alive_line(interval_s))
    s = run.args.steps
    try:
        while not stop_requested():
            run_steps(run, [s])
            s += 1
            wait_for_stop(interval_s)
    except KeyboardInterrupt:
        pass
    run.report.line(reporter.stopped_line())


def steps_phase(run: DemoRun, progress: Progress | None) -> list[Row]:
    """The phase as the runner calls it: steps ``0 .. --steps - 1``."""
    return run_steps(run, range(run.args.steps), progress)
