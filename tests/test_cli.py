"""The command line as a new user meets it.

Every run is ``python -m pipeline ...`` in a subprocess. Bad flags fail in argparse before
any cluster starts: one line on stderr naming the flag, exit code 2, nothing on stdout.
Problems of the environment (no scheduler, no ``finalize`` slots) are one line
``error: <problem>; <fix>`` and exit code 1. Ctrl-C is ``interrupted`` and 130.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from distributed import Client

from pipeline.cluster import local_cluster

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--groups", "1", "--rollouts", "2", "--turns", "2", "--tokens-per-turn", "8", "--quiet"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["DASK_TOKEN_CAPTURE__CLUSTER__DASHBOARD_ADDRESS"] = "127.0.0.1:0"
    return env


def cli(*argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def in_process(capsys: pytest.CaptureFixture[str], *argv: str) -> subprocess.CompletedProcess:
    """The same command run by ``pipeline.cli.main`` in this process (for refusals that
    come before anything starts: the interpreter's start-up is most of a subprocess's
    cost); its exit status and output, shaped like :func:`cli`'s."""
    from pipeline import cli as pipeline_cli

    capsys.readouterr()
    try:
        code = pipeline_cli.main(list(argv))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out.out, out.err)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def assert_one_line(proc: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    err = lines(proc.stderr)
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert len(err) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in err[0], err[0]
    return err[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- bad flags: argparse, exit 2, before any cluster starts -----------------------------


@pytest.mark.parametrize(
    "argv, flag, expected",
    [
        (["demo", "--groups", "0"], "--groups", "positive integer"),  # was FinalizeError after start
        (["demo", "--rollouts", "-3"], "--rollouts", "positive integer"),  # was InvalidCall
        (["demo", "--in-flight", "0"], "--in-flight", "positive integer"),  # was IndexError
        (["demo", "--steps", "-1"], "--steps", "positive integer"),  # was accepted: "[demo] 0/-1"
        (["demo", "--turns", "three"], "--turns", "positive integer"),
        (["demo", "--keep-alive-interval", "-1"], "--keep-alive-interval", "non-negative number"),  # was after the run
        (["demo", "--scheduler", "tcp://127.0.0.1:8786", "--connect-timeout", "0"], "--connect-timeout", "positive number"),
        (["demo", "--dashboard-address", "8787"], "--dashboard-address", "HOST:PORT"),
        (["demo", "--n-workers", "0"], "--n-workers", "positive integer"),
        (["bench", "store", "--batch-size", "-5"], "--batch-size", "positive integer"),  # was ZeroDivisionError
        (["bench", "store", "--unit-memory-limit", "lots"], "--unit-memory-limit", "byte size"),
        (["bench", "finalize", "--seed", "-1"], "--seed", "non-negative integer"),
        (["bench", "cut", "--tokens", "1024,x"], "--tokens", "comma-separated positive integers"),
        (["bench", "restore", "--scenarios", "bogus"], "--scenarios", "mass_resume"),
        (["bench", "restore", "--repeats", "0"], "--repeats", "positive integer"),
    ],
)
def test_a_bad_value_is_one_usage_line(argv, flag, expected, capsys):
    # The first case as a real process (exit status, nothing else on stderr), the rest in
    # this process through the same entry point.
    proc = cli(*argv) if argv == ["demo", "--groups", "0"] else in_process(capsys, *argv)
    line = assert_one_line(proc, 2, flag, expected, "--help")
    assert line.startswith("python -m pipeline"), line
    assert proc.stdout == ""  # the demo prints its run id first: it never started


def test_embedded_cluster_flags_are_refused_with_scheduler(capsys):
    proc = in_process(capsys, "demo", "--scheduler", "tcp://127.0.0.1:8786", "--n-workers", "2", "--dashboard-address", "127.0.0.1:0")
    assert_one_line(proc, 2, "--dashboard-address and --n-workers", "--scheduler")
    assert proc.stdout == ""


@pytest.mark.parametrize("address", ["foo", "tcp://127.0.0.1:99999", "nosuchscheme://127.0.0.1:8786"])
def test_a_malformed_scheduler_address_is_one_line(address, capsys):
    proc = cli("demo", "--scheduler", address) if address == "foo" else in_process(capsys, "demo", "--scheduler", address)
    assert_one_line(proc, 2, "--scheduler", "tcp://127.0.0.1:8786")
    proc = in_process(capsys, "bench", "store", "--scheduler", address)
    assert_one_line(proc, 2, "--scheduler")


# ---- the environment: one line "error: <problem>; <fix>", exit 1 ------------------------


@pytest.mark.parametrize("command", [["demo"], ["bench", "store"]])
def test_a_scheduler_that_is_down_is_one_line(command, capsys):
    # The demo as a real process (exit status, nothing else on stderr), the bench in this one.
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = [*command, "--scheduler", address, "--connect-timeout", "2", "--quiet"]
    proc = cli(*argv) if command == ["demo"] else in_process(capsys, *argv)
    line = assert_one_line(proc, 1, "error: ", address, "dask scheduler", "--connect-timeout")
    assert "within 2 s" in line


def test_workers_without_finalize_slots_name_the_dask_worker_fix():
    with local_cluster(resources={}, n_workers=1, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster:
        address = cluster.scheduler_address
        proc = cli("demo", "--scheduler", address, "--steps", "1", *SMALL)
    line = assert_one_line(proc, 1, "error: ", "'finalize' resource", f"dask worker {address}", '--resources "finalize=2"')
    assert line.startswith("error: "), line


# ---- runs that work --------------------------------------------------------------------


def test_embedded_cluster_flags_work():
    proc = cli("demo", "--dashboard-address", "127.0.0.1:0", "--n-workers", "1", "--steps", "1", "--no-resume", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = re.search(r"^run: ([0-9a-f]+)", proc.stdout, re.M).group(1)
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/token-capture$", proc.stdout, re.M), proc.stdout
    assert re.search(rf"^{run_id}-step-0: 2/2 rollouts accepted", proc.stdout, re.M), proc.stdout
    assert "summary: 2 rollouts finalized (2 in 1 steps), 2 accepted" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def shared_cluster():
    with local_cluster(n_workers=1, threads_per_worker=2, processes=True, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        yield cluster.scheduler_address, client


def test_two_runs_on_one_cluster_have_their_own_step_ids_and_the_summary_counts_the_resume(shared_cluster):
    # The second run also goes through the resume phase: its summary counts those rollouts.
    address, client = shared_cluster
    ids, outs = [], []
    for resume in ([], ["--no-resume"]):
        proc = cli("demo", "--scheduler", address, "--steps", "2", "--in-flight", "1", *resume, *SMALL)
        assert proc.returncode == 0, proc.stderr[-3000:]
        run_id = re.search(r"^run: ([0-9a-f]+)", proc.stdout, re.M).group(1)
        steps = [f"{run_id}-step-0", f"{run_id}-step-1"]
        assert re.findall(r"^(\S+): 2/2 rollouts accepted", proc.stdout, re.M)[:2] == steps, proc.stdout
        ids.append(run_id)
        outs.append(proc.stdout)
    assert ids[0] != ids[1]
    finalized = {s["step_id"] for s in client.sync(client.scheduler.token_capture_state)["steps"]}
    assert {f"{r}-step-{n}" for r in ids for n in (0, 1)} <= finalized, finalized
    out = outs[0]  # the run with the resume phase
    # 2 steps x 1 group x 2 rollouts, then the resume phase's step of 1 x 2.
    assert "summary: 6 rollouts finalized (4 in 2 steps + 2 in the resume step), 6 accepted" in out, out
    assert "summary: 4 rollouts finalized" in outs[1], outs[1]
    # Throughput says what it divides.
    assert re.search(r"training tokens in accepted rows / [0-9.]+ s from submit to last group assembled", out), out
    assert re.search(r"training tokens in accepted rows / [0-9.]+ s run wall time", out), out


def test_ctrl_c_during_generation_exits_cleanly():
    # The whole process group gets SIGINT, as from a terminal: worker processes included.
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "demo", "--n-workers", "1", "--steps", "1000", "--groups", "4", "--tokens-per-turn", "64"],
        cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    err = []
    try:
        for line in proc.stderr:  # "[demo] 0/4000 groups" is printed once generation starts
            err.append(line)
            if line.startswith("[demo]"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(err) + rest
    assert code == 130, text
    assert lines(text)[-1] == "interrupted", text
    for noise in ("Traceback", "CancelledError", "Task exception was never retrieved", "ERROR", "WARNING"):
        assert noise not in text, text


def test_after_ctrl_c_a_closed_loop_client_finalizer_is_not_printed_but_other_ones_are():
    # A Dask client collected after its event loop closed fails in Client.__del__ with
    # "IOLoop is closed" (a CI run saw it in the Ctrl-C test's output); after Ctrl-C the
    # demo drops exactly that, and any other failing finalizer is still printed.
    code = textwrap.dedent("""
        from pipeline.demo.interrupt import drop_closed_loop_finalizers

        class Finalized:
            def __init__(self, error):
                self.error = error

            def __del__(self):
                raise self.error

        drop_closed_loop_finalizers()
        Finalized(RuntimeError("IOLoop is closed"))
        Finalized(ValueError("a real bug"))
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "IOLoop is closed" not in proc.stderr
    assert "ValueError: a real bug" in proc.stderr
