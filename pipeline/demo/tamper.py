"""The tamper phase: one group of rollouts tampered with on purpose, one per kind of
:data:`tasks.toy.tamper.TAMPER_KINDS`, finalized as step ``<run-id>-tampered``; each must
be rejected with the reason its tampering names."""
from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import TYPE_CHECKING, Sequence

from . import reporter
from .context import DemoRun, DemoSettings, Row
from .finishing import FinishWatch, report_step, wait_step, wall_s
from .interrupt import as_finished

if TYPE_CHECKING:
    from tasks.finalize.assemble import FinalizedGroup
    from tasks.receipts import Receipt
    from tasks.toy.rollouts import RolloutSpec

    from ..progress import Progress
    from ..store.protocol import StoreLike

TAMPER_GROUP = "tampered"


def generate_tampered_and_stage(store: StoreLike, specs: Sequence[RolloutSpec], other_group: str) -> list[Receipt]:
    """Task body: generate ``specs`` (ids ``tampered-<reason>-<i>``) with the toy policy,
    tamper with each as its id says (:mod:`tasks.toy.tamper`), stage what the tamperer
    left and return the tampered receipts."""
    from tasks.toy.rollouts import generate_rollouts
    from tasks.toy.tamper import tamper, tamper_kind

    from ..capture import policy_from_config, stage_rollouts

    done = []
    for ro in generate_rollouts(policy_from_config(), specs):
        t = tamper(tamper_kind(ro.spec.rollout_id), ro.rows, ro.receipt, other_group=other_group)
        done.append(SimpleNamespace(rows=t.rows, receipt=t.receipt))
    return stage_rollouts(store, done)


def tamper_specs(args: argparse.Namespace | SimpleNamespace, settings: DemoSettings | None = None) -> list[RolloutSpec]:
    """One rollout per tamper kind, group ``tampered``, shaped like the demo's others
    (``args.turns`` calls of ``args.tokens_per_turn`` tokens)."""
    from tasks.toy.environment import synthetic_prompt
    from tasks.toy.rollouts import RolloutSpec
    from tasks.toy.tamper import TAMPER_KINDS, tampered_rollout_id

    s = settings or DemoSettings.from_config()
    prompt = synthetic_prompt(s.seed, TAMPER_GROUP, s.prompt_tokens, s.vocab_size)
    return [
        RolloutSpec(tampered_rollout_id(kind), TAMPER_GROUP, prompt, args.turns, args.tokens_per_turn, s.tool_tokens)
        for kind in TAMPER_KINDS
    ]


def tamper_step(run: DemoRun, progress: Progress | None = None) -> Row:
    """Finalize step ``<run-id>-tampered``. Prints the step and, per rollout, its verdict
    against the reason its tampering must produce; the step's row, with ``verdicts``
    (rollout id -> status) and ``as_expected`` (how many got their expected reason)."""
    from tasks.toy.tamper import TAMPER_KINDS, tamper_kind

    step_id = f"{run.run_id}-tampered"
    receipts = _stage(run, tamper_specs(run.args, run.settings))
    if progress is not None:
        progress.advance(1, f"{step_id}: {TAMPER_GROUP} staged")
    handle = run.steps_finalizer.submit_step({TAMPER_GROUP: receipts}, step_id=step_id)
    watch = FinishWatch(handle, wall_s())
    wait_step(handle)
    step = handle.result()
    verdicts = _verdicts(step.groups[TAMPER_GROUP])
    expected = {rid: tamper_kind(rid) for rid in verdicts}
    as_expected = [rid for rid, (st, _d) in verdicts.items() if st == expected[rid]]
    row = report_step(run, step, watch.finalize_s(step), note=reporter.tamper_note(len(verdicts), len(as_expected)))
    run.report.lines(
        reporter.tamper_verdict_line(rid, st, det, expected[rid], TAMPER_KINDS.get(expected[rid], "?"))
        for rid, (st, det) in verdicts.items()
    )
    row.update(
        verdicts={rid: st for rid, (st, _d) in verdicts.items()},
        as_expected=len(as_expected),
    )
    return row


def _stage(run: DemoRun, specs: list[RolloutSpec]) -> list[Receipt]:
    """Generate, tamper with and stage ``specs`` in one task; the tampered receipts."""
    fut = run.client.submit(generate_tampered_and_stage, run.store, specs, "s0p0", pure=False)
    try:
        return next(iter(as_finished([fut]))).result()
    except BaseException:
        run.client.cancel([fut])
        raise


def _verdicts(g: FinalizedGroup) -> dict[str, tuple[str, str]]:
    """Rollout id -> (status, detail) of the finalized tampered group."""
    return {rid: (st, det) for rid, st, det in zip(g.rollout_ids, g.status, g.details or [""] * len(g.status))}


def tamper_phase(run: DemoRun, progress: Progress | None) -> Row:
    """The phase as the runner calls it."""
    return tamper_step(run, progress)
