"""Every line the demo prints: one formatting function per kind of line, and the
:class:`Reporter` that writes them (stdout unless told otherwise, flushed line by line).

The phases compute their figures and hand them here; nothing else in the demo prints.
Progress on stderr is :class:`pipeline.progress.Progress`'s, not this module's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence, TextIO

if TYPE_CHECKING:
    from ..driver import CutStats, RecoveryStats
    from ..finalize.controller import StepResult

# A scaling decision as the scheduler's aggregator records it (JSON: action, current,
# target, reason, reason_code, t, ...).
Decision = Mapping[str, Any]


class Reporter:
    """Writes the demo's lines to ``out``, each flushed at once."""

    def __init__(self, out: TextIO) -> None:
        """Print to ``out``."""
        self.out = out

    def line(self, text: str) -> None:
        """Print one line."""
        print(text, file=self.out, flush=True)

    def lines(self, texts: Iterable[str]) -> None:
        """Print each of ``texts``, in order."""
        for text in texts:
            self.line(text)


def reasons(counts: Mapping[str, int]) -> str:
    """`` (a=1, b=2)`` for non-empty ``counts``, else the empty string."""
    return f" ({', '.join(f'{k}={v}' for k, v in counts.items())})" if counts else ""


# ---- the run ------------------------------------------------------------------------------


def run_line(run_id: str) -> str:
    """The first line: the run id and the shape of its step ids."""
    return f"run: {run_id} (step ids {run_id}-step-N)"


def dashboard_line(url: str | None) -> str:
    """Where the dashboard page is (``None`` when the scheduler serves none)."""
    return f"dashboard: {url}"


def step_line(step: StepResult, finalize_s: float, rate: float, note: str = "") -> str:
    """One line per finalized step: accepted / rejected by reason, the fetch vs verify
    split and ``rate``, the step's training tokens over ``finalize_s``."""
    m = step.metrics
    rejected = ", ".join(f"{k}={v}" for k, v in m["rejected"].items()) or "none"
    return (
        f"{step.step_id}: {m['accepted']}/{m['rollouts']} rollouts accepted (rejected: {rejected}){f' ({note})' if note else ''}; "
        f"fetch {m['fetch_ms']:.1f} ms vs verify {m['verify_ms']:.1f} ms (assemble {m['assemble_ms']:.1f} ms, "
        f"{m['fetch_calls']} fetch calls); {m['tokens']} training tokens in accepted rows / "
        f"{finalize_s:.2f} s from submit to last group assembled = {rate:.0f} tokens/s"
    )


def keep_alive_line(interval_s: float) -> str:
    """The line that starts ``--keep-alive``."""
    return f"keeping the cluster up and finalizing a step every {interval_s:g} s; Ctrl-C to stop"


def stopped_line() -> str:
    """The line that ends ``--keep-alive``."""
    return "stopped"


def summary_line(summary: Mapping[str, Any]) -> str:
    """The totals line (``summary`` after :func:`pipeline.demo.runner.add_totals`)."""
    steps = summary["steps"]
    scale, resume, tampered = summary.get("scale"), summary.get("resume"), summary.get("tampered")
    parts = f"{sum(s['rollouts'] for s in steps)} in {len(steps)} steps"
    if scale:
        parts += f" + {scale['rollouts']} in the scale phase"
    if resume:
        parts += f" + {resume['rollouts']} in the resume step"
    demo_note = ""
    if tampered:
        rejected = ", ".join(f"{k}={v}" for k, v in sorted(tampered["rejected"].items())) or "none"
        demo_note = (f" (demo: {tampered['rollouts']} rollouts tampered on purpose; rejected: {rejected}; "
                     f"{tampered['as_expected']}/{tampered['rollouts']} with the expected reason)")
    phases = "generation + finalization" + (" + resume" if resume else "") + (" + scale phase" if scale else "")
    return (
        f"summary: {summary['rollouts']} rollouts finalized ({parts}), {summary['accepted']} accepted{demo_note}, {summary['calls']} calls; "
        f"{summary['tokens']} training tokens in accepted rows / {summary['wall_s']:.1f} s run wall time ({phases}) = {summary['tokens_per_s']:.0f} tokens/s; "
        f"store: {summary['rows_staged']} rows, {summary['bytes_staged']} bytes staged in {summary['units']} units, "
        f"{summary['spilled_bytes']} bytes spilled"
    )


# ---- the tampered group ---------------------------------------------------------------------


def tamper_note(n: int, as_expected: int) -> str:
    """The note on the tampered step's line."""
    return f"demo: {n} rollouts tampered on purpose; {as_expected}/{n} rejected with the expected reason"


def tamper_verdict_line(rollout_id: str, status: str, detail: str, want: str, how: str) -> str:
    """One tampered rollout: its verdict, against ``want`` (the reason its tampering
    must produce; ``how`` says what was tampered), with the verifier's ``detail``."""
    verdict = f"rejected {status}" if status != "ok" else "ACCEPTED"
    check = "as expected" if status == want else f"EXPECTED {want}: the verifier did not catch it as it should"
    return f"  {rollout_id}: {verdict} ({check}) <- {how}{': ' + detail if detail and status == want else ''}"


# ---- the resume phase ---------------------------------------------------------------------


def cut_line(rollouts: int, actors: int, rounds: int, cut: CutStats) -> str:
    """The cut: where it happened and what it wrote."""
    return (
        f"resume: {rollouts} rollouts on {actors} generation actors; cut after round {rounds}: "
        f"{cut.calls} in-flight calls, {cut.rows} rows in {cut.puts} puts, {cut.durable} durable / "
        f"{sum(cut.failed.values())} failed{reasons(cut.failed)}, {cut.wall_ms:.1f} ms"
    )


def checkpoint_line(manifest: Mapping[str, Any], killed: int, restored_rows: int) -> str:
    """The checkpoint, the crash and the restore into a fresh store."""
    return (
        f"checkpoint: {manifest['rows']} rows ({manifest['bytes']} bytes); crash: {killed} generation actors killed; "
        f"a fresh store restored {restored_rows} rows from the checkpoint"
    )


def restore_line(rec: RecoveryStats) -> str:
    """How the in-flight calls came back: resumed from their prefixes or regenerated."""
    return (
        f"restore: {rec.resumed} calls resumed from their prefixes ({rec.resumed_tokens} tokens kept), "
        f"{sum(rec.regenerated.values())} regenerated{reasons(rec.regenerated)}; {rec.restore_requests} prefix reads in "
        f"{rec.gets} gets, {rec.keys_per_get:.1f} keys/get; {rec.wall_ms:.0f} ms"
    )


def resume_finalize_lines(metrics: Mapping[str, Any], matched: int, rollouts: int,
                          mismatches: Mapping[str, Sequence[str]]) -> list[str]:
    """The resumed step finalized, compared with the uninterrupted run (the first five
    mismatching rollouts named with their fields)."""
    head = (f"finalize: {metrics['accepted']}/{metrics['rollouts']} accepted; "
            f"{matched}/{rollouts} rollouts matched the uninterrupted run")
    return [head, *(f"  mismatch {rid}: {', '.join(fields)}" for rid, fields in list(mismatches.items())[:5])]


# ---- the scale phase ----------------------------------------------------------------------


def describe_decision(d: Decision) -> str:
    """``up 2 -> 3 (verify-bound: ...)``: one decision for people."""
    return f"{d['action']} {int(d['current'])} -> {int(d['target'])} ({d.get('reason') or d.get('reason_code', '?')})"


def scale_skipped_attached_line() -> str:
    """The scale phase does not scale a cluster it did not start."""
    return "scaling: phase skipped: attached with --scheduler, this demo does not scale that cluster"


def scale_skipped_short_line(steps: int, scale_steps: int) -> str:
    """The scale phase needs a burst of 2 steps or more."""
    why = "--steps 1 runs only the quick story" if steps <= 1 else f"{scale_steps} step cannot make the queue rise"
    return f"scaling: phase skipped ({why}; the verify-heavy burst needs --steps 2 or more and --scale-steps 2 or more)"


def scale_share_line(share: float, deployment_share: float) -> str:
    """The verify share the demo's own cluster uses during the phase, and the default."""
    return (f"scaling: verify counts as dominant above {share:.0%} of finalize time during this phase (demo setting; "
            f"deployment default {deployment_share:.0%})")


def scale_outcome_lines(decisions: Sequence[Decision], up: bool, down: bool, bursts: int,
                        up_bound_s: float, down_bound_s: float) -> list[str]:
    """The first six up/down decisions, and plainly when no up (or no down) came in time."""
    out = []
    shown = [d for d in decisions if d["action"] in ("up", "down")][:6]
    if shown:
        out.append(f"scaling: {'; '.join(describe_decision(d) for d in shown)}")
    if not up:
        last = decisions[-1] if decisions else None
        why = f"; its last decision: {last['action']} ({last.get('reason', '')})" if last else "; it recorded no decision"
        out.append(f"scaling: the policy did not scale up within {up_bound_s:g} s of {bursts} burst(s) (not an error: verify "
                   f"did not dominate while the queue rose){why}")
    elif not down:
        out.append(f"scaling: no scale-down decision within {down_bound_s:g} s of idling")
    return out


def scale_store_line(threshold: float, deployment_fill: float, used_bytes: float, capacity_bytes: float, units: int) -> str:
    """The storage threshold the demo's own cluster uses during the first burst, and the default."""
    from dask.utils import format_bytes

    return (f"scaling: the burst's rows fill the store to {used_bytes / capacity_bytes:.4%} "
            f"({format_bytes(int(used_bytes))} of {format_bytes(int(capacity_bytes))} in {units} units); while the burst is in flight "
            f"the store counts as full above {threshold:.4%} (demo setting; deployment default store.scale-up-fill {deployment_fill:.0%})")


def scale_store_empty_line() -> str:
    """The store held nothing to decide on (no storage decision to show)."""
    return "scaling: the store holds no bytes of the burst (or reports no capacity): no storage decision to show"


def scale_storage_line(decisions: Sequence[Decision]) -> str:
    """The phase's storage decisions (the first four changes), or plainly that none came."""
    if not decisions:
        return "scaling: the policy recorded no storage decision during the phase"
    return f"scaling (storage): {'; '.join(describe_decision(d) for d in decisions[:4])}"
