"""``python -m pipeline bench chaos``'s pure parts: the fault schedule and the verdict.

The soak itself (minutes, a cluster of hosts) is its own CI step
(``python -m pipeline bench chaos --short --json``, .ci/run); here, in milliseconds: a
schedule kills a worker every 30-60 s (scaled in short mode), the controller once, stalls
a host once and cuts a host once, with no kill near the stall or the cut and nothing in
the tail; a report with a lost row,
a differing tensor, an unfinished step or a controller that died by itself fails, names
what failed, exits 1 and carries no throughput ratio; a clean one has the ratio.
"""
from __future__ import annotations

import pytest

from pipeline.bench import chaos
from pipeline.bench.chaos_report import digests_differing, exit_status, report, run_figures
from pipeline.bench.chaos_schedule import (
    KILL_CONTROLLER,
    KILL_FINALIZE,
    KILL_STORAGE,
    PARTITION,
    STALL,
    ScheduleSettings,
    fault_schedule,
    kill_times,
)
from pipeline.cli import build_parser

FULL = ScheduleSettings(duration_s=210.0)
SHORT = ScheduleSettings(duration_s=75.0, scale=0.4, partition_s=8.0, gap_s=4.0, tail_s=14.0, stall_s=6.0)


@pytest.mark.parametrize("settings", [FULL, SHORT], ids=["full", "short"])
def test_a_schedule_kills_a_worker_every_interval_the_controller_once_and_stalls_and_cuts_a_host_once(settings):
    import random

    lo, hi = settings.kill_interval_s()
    for seed in range(30):
        times = kill_times(settings, random.Random(seed))
        gaps = [b - a for a, b in zip([0.0, *times], times)]
        assert times and all(lo - 0.01 <= g <= hi + 0.01 for g in gaps), (seed, gaps)
        faults = fault_schedule(settings, seed)
        assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)
        assert [f.kind for f in faults].count(KILL_CONTROLLER) == 1
        [cut] = [f for f in faults if f.kind == PARTITION]
        assert cut.duration_s == settings.partition_s
        kills = [f for f in faults if f.kind in (KILL_STORAGE, KILL_FINALIZE)]
        assert kills and {f.at_s for f in kills} <= set(times)
        kinds = [f.kind for f in kills]
        assert len(kills) < 2 or {KILL_STORAGE, KILL_FINALIZE} <= set(kinds), kinds  # both kinds
        assert abs(kinds.count(KILL_STORAGE) - kinds.count(KILL_FINALIZE)) <= 1
        [stall] = [f for f in faults if f.kind == STALL]
        end = settings.duration_s - settings.tail_s
        assert stall.duration_s == settings.stall_s and stall.at_s + stall.duration_s <= end / 3
        assert stall.at_s + stall.duration_s + settings.gap_s < cut.at_s - settings.gap_s  # never both at once
        for window in (cut, stall):  # no kill near a stall or a cut
            assert not [f for f in kills if window.at_s - settings.gap_s <= f.at_s <= window.at_s + window.duration_s + settings.gap_s]
        assert all(0 < f.at_s and f.at_s + f.duration_s <= end for f in faults), faults


def test_a_seed_gives_one_schedule_and_a_run_too_short_is_refused():
    assert fault_schedule(FULL, 3) == fault_schedule(FULL, 3) != fault_schedule(FULL, 4)
    assert {f.kind for s in range(10) for f in fault_schedule(FULL, s)} == {KILL_STORAGE, KILL_FINALIZE, KILL_CONTROLLER, PARTITION, STALL}
    with pytest.raises(ValueError, match="too short"):
        fault_schedule(ScheduleSettings(duration_s=50.0), 0)
    with pytest.raises(ValueError, match="too short"):  # room for the partition, not for the stall before a third
        fault_schedule(ScheduleSettings(duration_s=100.0), 0)


def test_short_mode_scales_the_run_down():
    args = build_parser().parse_args(["bench", "chaos", "--short", "--json"])
    settings, fault_free_s = chaos.plan(args)
    assert settings.scale < 1 and settings.duration_s + fault_free_s <= 100 and settings.partition_s < 20
    assert settings.stall_s < 10  # shorter than the soak's worker TTL: the stalled host resumes
    args = build_parser().parse_args(["bench", "chaos", "--json"])
    settings, fault_free_s = chaos.plan(args)
    assert settings.scale == 1 and settings.partition_s == 20 and settings.duration_s + fault_free_s <= 300
    assert settings.stall_s > 10  # longer than the soak's worker TTL: the stalled host may be removed, then replaced


def record(sid: str, *, rows_lost: int = 0, mismatched: dict | None = None, digest: str = "d", incarnation: int = 1) -> dict:
    return {"step": sid, "index": int(sid[1:]), "incarnation": incarnation, "attempts": 1, "resubmitted": incarnation > 1, "t": float(sid[1:]), "rollouts": 8,
            "acknowledged": 8, "rows": 16, "tokens": 400, "rows_lost": rows_lost, "mismatched": mismatched or {},
            "digests": {f"{sid}-r0": digest}}


def figures(records: list[dict], saved: list[str] | None = None, problems: list[str] | None = None, lost_keys: int = 0) -> dict:
    delivered = {r["step"]: r for r in records}
    return run_figures(delivered, {s: int(s[1:]) for s in (saved or list(delivered))}, 10.0, {"lost_keys": lost_keys}, problems)


def test_a_clean_pair_of_runs_reports_its_throughput_ratio_and_exits_0():
    base = figures([record("s1"), record("s2")])
    faulty = figures([record("s1"), record("s2", incarnation=2)])
    result = report(base, faulty, [], [{"kind": KILL_CONTROLLER}], {"mode": "short"})
    assert result["ok"] and exit_status(result) == 0 and result["failures"] == []
    assert result["throughput_ratio"] == 1.0 and result["steps_finalized"] == 2 and result["rows_acknowledged"] == 32
    assert result["chaos"]["resubmitted_steps"] == 1 and result["rows_lost"] == 0


@pytest.mark.parametrize("what", ["lost", "oracle", "fault-free", "unfinished", "given-up", "controller", "lost-key", "nothing"])
def test_a_failed_run_names_what_failed_exits_1_and_has_no_ratio(what):
    base = figures([record("s1"), record("s2")])
    records = [record("s1"), record("s2")]
    saved, problems, lost_keys, differing = None, None, 0, []
    if what == "lost":
        records[1] = record("s2", rows_lost=2)
    elif what == "oracle":
        records[1] = record("s2", mismatched={"s2-r0": ["input_ids"]})
    elif what == "fault-free":
        records[1] = record("s2", digest="other")
        differing = digests_differing({r["step"]: r for r in base_records()}, {r["step"]: r for r in records})
    elif what == "unfinished":
        saved = ["s1", "s2", "s3"]
    elif what == "given-up":
        records.append({"step": "s3", "index": 3, "failed": "TimeoutError: ", "t": 0.0})
    elif what == "controller":
        problems = ["controller 1 exited by itself with code 1"]
    elif what == "lost-key":
        lost_keys = 1
    elif what == "nothing":
        records = []
    result = report(base, figures(records, saved, problems, lost_keys), differing, [], {})
    assert not result["ok"] and exit_status(result) == 1 and "throughput_ratio" not in result
    expected = {"lost": "2 acknowledged row(s) lost", "oracle": "differ from the oracle", "fault-free": "differ from the fault-free run",
                "unfinished": "never finished: ['s3']", "given-up": "failed every attempt: ['s3']",
                "controller": "exited by itself", "lost-key": "1 lost key", "nothing": "no step was finalized"}[what]
    assert any(expected in line for line in result["failures"]), result["failures"]


def base_records() -> list[dict]:
    return [record("s1"), record("s2")]


def test_the_chaos_benchmark_is_on_the_command_line():
    args = build_parser().parse_args(["bench", "chaos", "--short", "--json", "--seed", "2", "--in-flight", "4"])
    assert args.short and args.json and args.seed == 2 and args.in_flight == 4


@pytest.mark.parametrize("flag, value, what", [
    ("--in-flight", "9", "an integer from 1 to 8"), ("--in-flight", "0", "an integer from 1 to 8"),
    ("--groups", "0", "a positive integer"), ("--duration", "-5", "a positive number"),
    ("--seed", "-1", "a non-negative integer"), ("--partition-s", "nan", "a positive number"),
])
def test_a_bad_flag_is_one_usage_line_before_anything_starts(capsys, flag, value, what):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "chaos", flag, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and f"argument {flag}: must be {what}" in err, err


def test_the_controller_book_reads_a_steps_receipts_from_disk_once(tmp_path):
    """A saved step's receipts are kept in memory for its submits and its verdict; a new
    controller reads a predecessor's step from its file once; delivered steps are dropped."""
    import numpy as np

    from pipeline.bench.chaos_controller import Book, step_id
    from rollout_factory import make_group

    receipts = {"g0": [b.receipt for b in make_group(np.random.default_rng(0), "g0", 2, rollout_prefix="bk")]}
    book = Book(str(tmp_path))
    book.save(0, receipts)
    sid, path = step_id(0), tmp_path / "steps" / f"{step_id(0)}.pkl"
    assert book.saved() == {sid: 0}
    successor = Book(str(tmp_path))  # a new controller: the step is on disk only
    read = successor.receipts(sid)
    assert [r.rollout_id for r in read["g0"]] == [r.rollout_id for r in receipts["g0"]]
    path.unlink()  # every later read is served from memory
    assert book.receipts(sid) is receipts and successor.receipts(sid) is read
    successor.deliver({"step": sid, "index": 0})
    with pytest.raises(FileNotFoundError):  # delivered: forgotten, never submitted again
        successor.receipts(sid)


def test_a_replacement_controller_clears_the_rows_of_delivered_steps_not_seen_cleared(tmp_path):
    """A controller killed between a step's delivery and its clear's end leaves rows only
    its replacement can clear: the keys go with the delivered record, the clear's end to
    ``cleared.jsonl``; a failed step (no keys) is owed nothing."""
    from pipeline.bench.chaos_controller import Book, owed_clears

    book = Book(str(tmp_path))
    book.deliver({"step": "s00000", "index": 0, "clear_keys": ["r0/c0", "r0/c1"]})
    book.deliver({"step": "s00001", "index": 1, "clear_keys": ["r1/c0"]})
    book.deliver({"step": "s00002", "index": 2, "failed": "TimeoutError: "})
    book.mark_cleared("s00000")
    successor = Book(str(tmp_path))
    assert successor.cleared() == {"s00000"}
    assert owed_clears(successor.delivered(), successor.cleared()) == {"s00001": ["r1/c0"]}


def test_a_step_with_acknowledged_rows_unread_just_then_is_finalized_again_not_counted(tmp_path, monkeypatch):
    """Rows the store could not read when the step ran (both copies' units unreachable at
    that moment) were kept, not lost: the controller finalizes the step again, with the
    same receipts, instead of recording those rollouts as lost and differing."""
    from collections import deque
    from types import SimpleNamespace

    from pipeline.bench import chaos_controller as cc
    from pipeline.finalize.kept_rows import UNREAD_METRIC
    from pipeline.finalize.step_result import StepResult

    monkeypatch.setattr(cc, "UNREAD_RETRY_S", 0.0)
    receipts = {"g0": [SimpleNamespace(rollout_id="r0", poisoned=False, calls=[1, 2], to_dict=lambda: {}),
                       SimpleNamespace(rollout_id="r1", poisoned=False, calls=[1, 2], to_dict=lambda: {})]}
    group = SimpleNamespace(rollout_ids=["r0", "r1"], status=["ok", "missing_staging_row"],
                            metrics={UNREAD_METRIC: ["r1"]})
    step = StepResult("s00000-i1-a1", {"g0": group}, {})
    submitted = []
    ctl = object.__new__(cc.Controller)
    ctl.book, ctl.incarnation, ctl.in_flight, ctl.clears = cc.Book(str(tmp_path)), 1, deque(), []
    ctl.book._receipts["s00000"] = receipts
    ctl.cfg = SimpleNamespace(step_timeout_s=5.0, store="x")
    ctl.client = None
    ctl.fin = SimpleNamespace(store="handle", submit_step=lambda rs, step_id: submitted.append((rs, step_id)) or "h2")
    ctl.collect("s00000", 0, SimpleNamespace(result=lambda timeout: step), 1)
    assert submitted == [(receipts, "s00000-i1-a2")] and list(ctl.in_flight) == [("s00000", 0, "h2", 2)]
    assert ctl.book.delivered() == {}  # nothing recorded: no verdict, no clear
    assert step.retryable == ["r1"]
    read = SimpleNamespace(rollout_ids=["r0", "r1"], status=["ok", "ok"], metrics={})
    assert ctl.unread("s00000", StepResult("s00000-i1-a2", {"g0": read}, {})) == []  # read this time: delivered as usual


def test_a_failed_step_goes_in_again_under_its_own_id_or_a_new_one_if_not_seen_failed(tmp_path):
    """A step whose result raised is cancelled and resubmitted (same step id: the failed
    handle leaves the Finalizer); one the Finalizer does not see failed goes in under a
    new id, as before."""
    from collections import deque
    from types import SimpleNamespace

    from pipeline.bench import chaos_controller as cc
    from tasks.errors import FinalizeError

    submitted, cancelled = [], []
    ctl = object.__new__(cc.Controller)
    ctl.book, ctl.incarnation, ctl.in_flight, ctl.clears = cc.Book(str(tmp_path)), 1, deque(), []
    ctl.book._receipts["s00000"] = {"g0": []}
    ctl.cfg = SimpleNamespace(step_timeout_s=5.0, store="x")
    ctl.say = lambda text: None
    ctl.fin = SimpleNamespace(store="handle", submit_step=lambda rs, step_id: submitted.append(step_id) or "new-id")

    def raising(timeout):
        raise OSError("the store was unreachable")

    failed = SimpleNamespace(result=raising, cancel=lambda: cancelled.append(1), resubmit=lambda: "same-id")
    ctl.collect("s00000", 0, failed, 1)
    assert cancelled == [1] and submitted == [] and list(ctl.in_flight) == [("s00000", 0, "same-id", 2)]

    def refused():
        raise FinalizeError("step 's00000-i1-a2' has not failed")

    ctl.in_flight.clear()
    ctl.collect("s00000", 0, SimpleNamespace(result=raising, cancel=lambda: None, resubmit=refused), 2)
    assert submitted == ["s00000-i1-a3"] and list(ctl.in_flight) == [("s00000", 0, "new-id", 3)]


@pytest.mark.parametrize("flags", [["--short", "--stall-s", "30"], ["--duration", "50"]])
def test_a_schedule_the_run_cannot_hold_is_one_usage_line_before_anything_starts(capsys, flags):
    from pipeline.cli import main as cli_main

    code = cli_main(["bench", "chaos", "--json", "--quiet", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: a chaos run of"), err
    assert "--duration" in err[0] and "Traceback" not in err[0]


def test_a_run_reports_its_longest_wait_between_two_deliveries():
    # What a stall or a partition held every step for shows as the longest gap.
    records = [record(f"s{i}") for i in range(1, 6)]
    for r, t in zip(records, [10.0, 10.5, 11.0, 19.0, 19.2]):
        r["t"] = t
    got = figures(records)
    assert got["longest_delivery_gap_s"] == 8.0 and got["longest_gap_after_first_s"] == 1.0
    assert figures(records[:1])["longest_delivery_gap_s"] == 0.0
