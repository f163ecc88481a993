"""The scale phase: a verify-heavy burst, then idle; the adaptive policy should scale up,
then down, and its decisions (read from the scheduler's aggregator) are printed.

``--scale-steps`` steps (ids ``<run-id>-scale-<k>``) of ``--groups`` x ``--rollouts``
long synthetic dense rollouts (``--scale-calls`` calls of ``--scale-tokens`` tokens): all
staged first, then all submitted back to back, so the queue rises while verification
dominates the finalize split. Then the phase waits (bounded) for an ``up`` decision, and
idles (bounded: ``scaling.idle-s`` plus a few adaptive intervals) for a ``down``; none
within its bound is said plainly, not an error. While the first burst is in flight the
store's own fill is shown against a demo threshold (half of it, until the burst is
collected), so the storage side of the policy decides too (:func:`_storage_moment`).
Embedded cluster only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable


from ..store.report import report_store
from . import reporter
from .context import DemoRun, Row
from .finishing import FinishWatch, report_step, wait_step, wall_s
from .interrupt import as_finished, check_interrupt, wait_for_stop
from .reporter import Decision

if TYPE_CHECKING:
    from distributed import Client

    from tasks.receipts import Receipt

    from ..progress import Progress
    from ..store.protocol import StoreLike


def stage_synthetic(store: StoreLike, group_id: str, rollout_ids: list[str], calls: int, tokens_per_call: int,
                    prompt_tokens: int, tool_tokens: int, vocab_size: int, seed: int) -> list[Receipt]:
    """Task body of the scale phase: long rollouts of a dense model (no routed experts),
    their tokens and logprobs drawn at random (seeded per rollout), captured call by call
    through the :class:`~tasks.gate.CaptureGate` and staged in one put. Cheap to make, so
    the finalizer's verification, not generation, is what the burst loads."""
    import zlib
    from types import SimpleNamespace

    import numpy as np

    from tasks.gate import CaptureGate
    from tasks.toy.rollouts import call_id, parent_call_id, toy_reward

    from ..capture import stage_rollouts

    made = []
    for rid in rollout_ids:
        rng = np.random.default_rng([seed, zlib.crc32(rid.encode())])
        gate = CaptureGate(rid, vocab_size=vocab_size, num_experts=None, group_id=group_id)
        rows, generated = [], []
        for c in range(calls):
            n_ctx = prompt_tokens if c == 0 else tool_tokens
            ids = rng.integers(0, vocab_size, size=n_ctx + tokens_per_call, dtype=np.int64)
            mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(tokens_per_call, np.float32)])
            lps = np.zeros(n_ctx + tokens_per_call, np.float32)
            lps[n_ctx:] = -rng.exponential(1.0, size=tokens_per_call).astype(np.float32)
            rows.append(gate.stage_call(call_id(c), parent_call_id(c), ids, mask, lps))
            generated.append(ids[n_ctx:])
        made.append(SimpleNamespace(rows=rows, receipt=gate.receipt(toy_reward(np.concatenate(generated)))))
    return stage_rollouts(store, made)


def scaling_since(decisions: Iterable[Decision], since: float) -> list[Decision]:
    """The scheduler's recorded scaling decisions (``token_capture_state()["decisions"]``)
    made at or after ``since`` (scheduler wall-clock seconds), oldest first."""
    return [d for d in decisions if float(d.get("t", 0.0)) >= since]


def kind_of(d: Decision) -> str:
    """Which side of the policy made ``d``: ``finalize`` (also when unnamed) or ``storage``."""
    return str(d.get("kind") or "finalize")


def _decisions(client: Client, since: float) -> list[Decision]:
    """The aggregator's decisions since ``since`` (none when no aggregator answers)."""
    try:
        state = client.sync(client.scheduler.token_capture_state)
    except Exception:  # no aggregator answered: nothing recorded
        return []
    return scaling_since(state.get("decisions", []) if isinstance(state, dict) else [], since)


def _last_event_age_s(client: Client) -> float:
    """Seconds since the scheduler's last finalize event (infinite when it cannot say)."""
    try:
        sig = client.sync(client.scheduler.token_capture_signal, window_s=None)
        return float(sig["last_event_age_s"])
    except Exception:
        return float("inf")


@dataclass(frozen=True)
class _Plan:
    """The phase's shape and its waiting bounds (seconds), fixed when the phase starts."""

    n_steps: int  # steps per burst
    bursts: int  # bursts tried at most until an up decision
    interval_s: float  # the adaptive policy's decision interval
    wait_count: int  # intervals the policy waits before scaling down
    idle_s: float  # scaling.idle-s
    since: float  # decisions before this (wall clock) are not the phase's

    @property
    def up_bound_s(self) -> float:
        """How long to wait for an up: a fresh signal, until the pool has idled idle-s."""
        return self.idle_s + 2 * self.interval_s

    @property
    def down_bound_s(self) -> float:
        """How long to idle for a down."""
        return self.idle_s + (self.wait_count + 2) * self.interval_s


def scale_phase(run: DemoRun, progress: Progress | None = None) -> Row | None:
    """The phase (``progress``: unused, the phase has its own lines); its summary row, or
    None (one line said why) when attached with --scheduler or below 2 steps."""
    args, adaptive, s = run.args, run.adaptive, run.settings
    n_steps = args.scale_steps if args.steps > 1 else 0
    if adaptive is None:
        run.report.line(reporter.scale_skipped_attached_line())
        return None
    if n_steps < 2:
        run.report.line(reporter.scale_skipped_short_line(args.steps, n_steps))
        return None
    interval_s = float(getattr(adaptive, "interval", 1.0) or 1.0)
    wait_count = int(getattr(adaptive, "wait_count", 3) or 3)
    _clear_window(run)
    plan = _Plan(n_steps=n_steps, bursts=s.scale_bursts, interval_s=interval_s, wait_count=wait_count,
                 idle_s=s.idle_s, since=time.time())
    # On a small machine the toy store's fetch and verify cost about the same per byte, so the
    # split hovers around the deployment threshold; the demo lowers it for its own cluster,
    # and says so, so the mechanism shows on every run.
    run.report.line(reporter.scale_share_line(s.scale_verify_share, s.verify_dominant_share))
    previous = adaptive.with_settings(verify_dominant_share=s.scale_verify_share)
    try:
        return _run_bursts(run, plan)
    finally:
        adaptive.restore_settings(previous)


def _clear_window(run: DemoRun) -> None:
    """The policy reads the finalize split of the last window-s seconds: let the earlier
    (fetch-bound, short-rollout) steps leave it first, so it sees the burst alone."""
    from ..progress import Progress

    window_s = run.settings.window_s
    with Progress("scale", quiet=run.quiet) as progress:
        deadline = time.monotonic() + window_s
        while time.monotonic() < deadline and _last_event_age_s(run.client) < window_s:
            progress.advance(0, f"letting the {window_s:g} s scaling window clear of the earlier steps")
            check_interrupt()
            wait_for_stop(0.25)


def _wait_for_decision(client: Client, since: float, action: str, bound_s: float, progress: Progress, note: str) -> list[Decision]:
    """Poll the scheduler's decisions until one finalize ``action`` since ``since`` or
    ``bound_s`` passed (``action`` ``"storage"``: any storage decision made on the store's fill)."""
    deadline = time.monotonic() + bound_s
    while True:
        ds = _decisions(client, since)
        if any(_is(d, action) for d in ds) or time.monotonic() >= deadline:
            return ds
        progress.advance(0, note)
        check_interrupt()
        wait_for_stop(0.25)


def _is(d: Decision, action: str) -> bool:
    """``d`` is a finalize ``action``, or for ``"storage"`` a storage decision on a full store."""
    if action == "storage":
        return kind_of(d) == "storage" and d.get("reason_code") in ("storage-fill-high", "storage-at-maximum")
    return kind_of(d) == "finalize" and d["action"] == action


def _storage_moment(run: DemoRun, plan: _Plan, progress: Progress) -> Callable[[], None] | None:
    """With the first burst staged and in flight: publish the units' figures now, count
    the store as full above half of its current fill (a demo setting, said so) and wait
    (bounded) for the storage decision (the outcome lines print it). Returns what puts
    the deployment's threshold back (once the burst is collected: while its rows fill
    the store the worker added for it stays), or None when nothing was changed."""
    adaptive = run.adaptive
    since = time.time()
    stats = report_store(run.store)
    used, capacity = sum(float(u["used_bytes"]) for u in stats), sum(float(u["capacity"]) for u in stats)
    if adaptive is None or used <= 0 or capacity <= 0:
        run.report.line(reporter.scale_store_empty_line())
        return None
    fill = used / capacity
    run.report.line(reporter.scale_store_line(fill / 2, adaptive.storage_settings.scale_up_fill, used, capacity, len(stats)))
    previous = adaptive.with_storage_settings(scale_up_fill=fill / 2, scale_down_fill=0.0)
    try:
        _wait_for_decision(run.client, since, "storage", plan.up_bound_s, progress,
                           "waiting for the adaptive policy's storage decision")
    except BaseException:
        adaptive.restore_storage_settings(previous)
        raise
    return lambda: adaptive.restore_storage_settings(previous)


def _run_bursts(run: DemoRun, plan: _Plan) -> Row:
    """The bursts until an up decision, then the idle wait for a down; print the outcome."""
    from ..progress import Progress

    rows: list[Row] = []
    up: list[Decision] = []
    down: list[Decision] = []
    ds: list[Decision] = []
    with Progress("scale", total=plan.bursts * plan.n_steps * run.args.groups, unit="groups", quiet=run.quiet) as progress:
        for b in range(plan.bursts):
            # the first burst in flight also shows the storage side of the policy
            rows += _burst(run, progress, b, plan.n_steps, (lambda: _storage_moment(run, plan, progress)) if b == 0 else None)
            ds = _wait_for_decision(run.client, plan.since, "up", plan.up_bound_s, progress,
                                    "waiting for the adaptive policy's scale-up decision")
            up = [d for d in ds if _is(d, "up")]
            if up:
                break
        if up:
            ds = _wait_for_decision(run.client, float(up[-1]["t"]), "down", plan.down_bound_s, progress,
                                    f"idle: waiting for the scale-down decision (after {plan.idle_s:g} s without finalize events)")
            ds = _decisions(run.client, plan.since)
            down = [d for d in ds if _is(d, "down") and float(d["t"]) >= float(up[0]["t"])]
    finalize_ds = [d for d in ds if kind_of(d) == "finalize"]
    storage_ds = [d for d in ds if kind_of(d) == "storage"]
    run.report.lines(reporter.scale_outcome_lines(finalize_ds, bool(up), bool(down), plan.bursts, plan.up_bound_s, plan.down_bound_s))
    run.report.line(reporter.scale_storage_line(storage_ds))
    return {
        "steps": rows,
        "decisions": ds,
        "storage_decisions": storage_ds,
        "storage_up": any(_is(d, "storage") and d["action"] == "up" for d in storage_ds),
        "up": bool(up),
        "down": bool(down),
        "rollouts": sum(r["rollouts"] for r in rows),
        "accepted": sum(r["accepted"] for r in rows),
        "tokens": sum(r["tokens"] for r in rows),
        "calls": int(round(sum(r["calls_per_rollout"] * r["rollouts"] for r in rows))),
    }


def _stage_burst(run: DemoRun, progress: Progress, steps: list[dict[str, list[str]]]) -> dict[tuple[int, str], list[Receipt]]:
    """Stage every group of ``steps`` (group id -> rollout ids, per step) as long
    synthetic rollouts, one task per group; receipts by (step index, group id)."""
    args = run.args
    sizes = run.settings.spec_sizes()
    futures = {
        (k, gid): run.client.submit(stage_synthetic, run.store, gid, rids, args.scale_calls, args.scale_tokens, **sizes, pure=False)
        for k, step in enumerate(steps) for gid, rids in step.items()
    }
    by_key = {f.key: kg for kg, f in futures.items()}
    receipts: dict[tuple[int, str], list[Receipt]] = {}
    try:
        for fut in as_finished(list(futures.values())):
            receipts[by_key[fut.key]] = fut.result()
            progress.advance(1, f"long rollouts of {by_key[fut.key][1]} staged")
    except BaseException:
        run.client.cancel(list(futures.values()))
        raise
    return receipts


def _burst(run: DemoRun, progress: Progress, b: int, n_steps: int,
           in_flight: Callable[[], Callable[[], None] | None] | None = None) -> list[Row]:
    """Stage ``n_steps`` steps of long rollouts, then submit all their graphs back to back
    (each finds the earlier ones queued), run ``in_flight`` while they are, collect them,
    then run what ``in_flight`` returned; the printed step rows."""
    args = run.args
    steps = [
        {gid: [f"{gid}-{i}" for i in range(args.rollouts)] for gid in (f"sc{b}x{k}p{g}" for g in range(args.groups))}
        for k in range(n_steps)
    ]
    receipts = _stage_burst(run, progress, steps)
    watches = []
    for k, step in enumerate(steps):
        h = run.steps_finalizer.submit_step({gid: receipts[(k, gid)] for gid in step}, step_id=f"{run.run_id}-scale-{b * n_steps + k}")
        watches.append(FinishWatch(h, wall_s()))
    rows = []
    done: Callable[[], None] | None = None
    try:
        done = in_flight() if in_flight is not None else None
        for w in watches:
            wait_step(w.handle, cancel=())
            step = w.handle.result()
            rows.append(report_step(run, step, w.finalize_s(step)))
            progress.advance(0, f"{step.step_id} finalized")
    except KeyboardInterrupt:
        for w in watches:
            w.handle.cancel()
        raise
    finally:
        if done is not None:
            done()
    return rows
