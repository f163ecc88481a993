"""The resume phase: cut -> checkpoint -> kill/recreate -> restore -> resume -> finish ->
finalize, then compare with an uninterrupted run of the same seeds.

One step of ``--groups`` x ``--rollouts`` rollouts (ids ``rs-p*``, step id
``<run-id>-resume``) on :class:`~pipeline.driver.RolloutDriver`; compared with
:func:`tasks.toy.rollouts.generate_rollouts` (same seeds, never interrupted). Progress
(stderr, unless quiet) names each phase and round.
"""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from . import reporter
from .context import DemoRun, Row
from .interrupt import check_interrupt

if TYPE_CHECKING:
    from distributed import Client

    from tasks.toy.rollouts import RolloutSpec

    from ..driver import CutStats, DriverSnapshot, RecoveryStats, RolloutDriver
    from ..finalize.controller import StepResult
    from ..progress import Progress
    from ..store.client import StagingStore

# Phases shown on the progress line: rounds before the cut, cut, checkpoint, crash +
# restore, resume, finish, finalize, compare.
_PROGRESS_PHASES = 8


@dataclass
class _Resumed:
    """What the resumed half of the phase reports: the finalized step, the recovery's
    figures and how many rollouts matched the uninterrupted run."""

    step: StepResult
    rec: RecoveryStats
    matched: int


def resume_phase(client: Client, store: StagingStore, args: argparse.Namespace, out: TextIO) -> Row:
    """The phase on ``client`` and ``store`` for ``args`` (``groups``, ``rollouts``,
    ``turns``, ``tokens_per_turn``; ``run_id`` and ``quiet`` optional), printing to
    ``out``; its summary row."""
    return run_resume(DemoRun.build(client, store, None, args, out))


def run_resume(run: DemoRun, progress: Progress | None = None) -> Row:
    """The phase on ``run`` (``progress``: unused, the phase has its own line)."""
    from tasks.toy.rollouts import make_step_specs

    from ..driver import RolloutDriver
    from ..progress import Progress

    args = run.args
    groups = make_step_specs("rs-", args.groups, args.rollouts, turns=args.turns, tokens_per_turn=args.tokens_per_turn,
                             **run.settings.spec_sizes())
    specs = [s for g in groups for s in g]
    with Progress("resume", total=_PROGRESS_PHASES, unit="phases", quiet=run.quiet) as own:
        driver = RolloutDriver(run.client, run.store)
        driver.submit(groups)
        cut = _cut(run, driver, len(specs), own)
        fresh, snapshot = _checkpoint_crash_restore(run, driver, own)
        try:
            resumed = _resume_and_finalize(run, fresh, snapshot, specs, own)
        finally:
            fresh.close()
    return _row(resumed, cut)


def _cut(run: DemoRun, driver: RolloutDriver, n_rollouts: int, progress: Progress) -> CutStats:
    """Run the rounds before the cut, cut every in-flight call; print the cut."""
    from ..driver import cut_round

    args = run.args
    rounds = cut_round(args.turns, args.tokens_per_turn, driver.step_tokens)
    for r in range(rounds):
        progress.advance(0, f"generating: round {r + 1}/{rounds} before the cut")
        check_interrupt()
        driver.run_rounds(1)
    progress.advance(1, "cutting in-flight calls", force=True)
    cut = driver.cut("demo-ckpt")
    run.report.line(reporter.cut_line(n_rollouts, len(driver.actors), rounds, cut))
    return cut


def _checkpoint_crash_restore(run: DemoRun, driver: RolloutDriver, progress: Progress) -> tuple[StagingStore, DriverSnapshot]:
    """Checkpoint the store, do one more round (lost in the crash), kill the actors and
    restore the checkpoint into a fresh store; print it. The fresh store and the cut's
    snapshot."""
    from ..store.client import StagingStore

    progress.advance(1, "checkpointing the store", force=True)
    with tempfile.TemporaryDirectory(prefix="token-capture-demo-") as tmp:
        manifest = driver.checkpoint_store(tmp)
        snapshot = driver.snapshot
        progress.advance(1, "crash: killing the generation actors, restoring the store", force=True)
        driver.run_rounds(1)  # work after the checkpoint: lost in the crash, redone identically
        killed = driver.kill()
        fresh = StagingStore.start(run.client)
        loaded = fresh.restore(tmp, client=run.client)
    run.report.line(reporter.checkpoint_line(manifest, len(killed), loaded["rows"]))
    return fresh, snapshot


def _resume_and_finalize(run: DemoRun, fresh: StagingStore, snapshot: DriverSnapshot, specs: list[RolloutSpec],
                         progress: Progress) -> _Resumed:
    """Recover on new actors from ``snapshot``, finish the rollouts, finalize them on
    ``fresh`` and compare with an uninterrupted run; print each."""
    from tasks.toy.rollouts import generate_rollouts

    from ..capture import policy_from_config
    from ..driver import RolloutDriver
    from ..finalize.controller import Finalizer
    from ..testing.oracle import reference_mismatches

    args = run.args
    progress.advance(1, "resuming calls from their prefixes", force=True)
    resumed, rec = RolloutDriver.recover(run.client, fresh, snapshot)
    run.report.line(reporter.restore_line(rec))
    progress.advance(1, "finishing the rollouts", force=True)
    after, bound = 0, args.turns * -(-args.tokens_per_turn // resumed.step_tokens) + 1
    while resumed.active and after < bound and not check_interrupt() and resumed.run_rounds(1):
        after += 1
        progress.advance(0, f"finishing: round {after} after the restore, {resumed.active} rollouts running")
    receipts = resumed.finish()
    progress.advance(1, "finalizing", force=True)
    step = Finalizer(run.client, fresh).submit_step(receipts, step_id=f"{run.run_id}-resume").result()
    resumed.kill()
    progress.advance(1, "comparing with an uninterrupted run", force=True)
    bad = reference_mismatches(step.groups, generate_rollouts(policy_from_config(), specs))
    progress.advance(1, "done", force=True)
    matched = len(specs) - len(bad)
    run.report.lines(reporter.resume_finalize_lines(step.metrics, matched, len(specs), bad))
    return _Resumed(step=step, rec=rec, matched=matched)


def _row(resumed: _Resumed, cut: CutStats) -> Row:
    """The phase's summary row."""
    step, rec = resumed.step, resumed.rec
    m = step.metrics
    return {
        "step_id": step.step_id, "rollouts": m["rollouts"], "matched": resumed.matched, "cut_calls": cut.calls, "cut_rows": cut.rows,
        "cut_puts": cut.puts, "cut_durable": cut.durable, "cut_failed": dict(cut.failed),
        "resumed": rec.resumed, "regenerated": dict(rec.regenerated), "restore_gets": rec.gets,
        "restore_keys_per_get": rec.keys_per_get, "accepted": m["accepted"], "tokens": m["tokens"],
        "calls": int(round(m["calls_per_rollout"] * m["rollouts"])),
    }
