"""The examples run as a user would run them (subprocesses, small sizes)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # The CLI tools (dask, python) of the interpreter running the tests come first.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["DASK_TOKEN_CAPTURE__CLUSTER__DASHBOARD_ADDRESS"] = "127.0.0.1:0"
    return env


def _run(cmd: list[str], timeout: float = 240, **env_extra: str) -> str:
    env = _env()
    env.update(env_extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_controller_loop_finalizes_every_step():
    out = _run([sys.executable, str(EXAMPLES / "controller_loop.py"), "--steps", "3", "--groups", "2", "--rollouts", "2", "--turns", "2"])
    done = re.findall(r"step-(\d+): (\d+)/(\d+) accepted", out)
    assert [d[0] for d in done] == ["0", "1", "2"], out
    assert all(int(a) == int(n) == 4 for _, a, n in done), out
    # Several steps were in flight: the second was submitted before the first was collected.
    assert out.index("step 1: submitted") < out.index("step-0:"), out


def test_controller_loop_with_a_journal_acknowledges_each_step_after_training(tmp_path):
    journal = tmp_path / "journal"
    out = _run([sys.executable, str(EXAMPLES / "controller_loop.py"), "--steps", "3", "--groups", "2", "--rollouts", "2",
                "--turns", "2", "--journal", str(journal)])
    done = re.findall(r"step-\w+-(\d+): (\d+)/(\d+) accepted, .*, acknowledged", out)
    assert [d[0] for d in done] == ["0", "1", "2"], out
    assert os.listdir(journal) == []  # every step delivered and its rows cleared: nothing left to resume


@pytest.mark.slow
def test_multi_worker_cluster_from_the_command_line():
    out = _run(
        ["bash", str(EXAMPLES / "multi_worker_cluster.sh")],
        WORKERS="2",
        DEMO_ARGS="--steps 1 --groups 1 --rollouts 2 --turns 2 --quiet",
    )
    assert re.search(r"scheduler: tcp://127\.0\.0\.1:\d+", out), out
    m = re.search(r"step-0: (\d+)/(\d+) rollouts accepted", out)
    assert m and m.group(1) == m.group(2) == "2", out


def test_hf_moe_rollouts_prints_faithful_fidelity_figures():
    pytest.importorskip("transformers")
    # One embedded worker: generation, finalization and the fidelity check still run as
    # tasks in a worker process, but transformers is imported by two processes, not three
    # (the import is most of this example's time on 2 cores).
    one_worker = {"DASK_TOKEN_CAPTURE__CLUSTER__N_WORKERS": "1", "DASK_TOKEN_CAPTURE__CLUSTER__ADAPTIVE_MINIMUM": "1"}
    out = _run([sys.executable, str(EXAMPLES / "hf_moe_rollouts.py"), "--groups", "2", "--rollouts", "2", "--turns", "3",
                "--tokens-per-turn", "8"], **one_worker)
    assert re.search(r"step-0: 4/4 accepted", out), out
    assert re.search(r"route agreement: 100\.00% \(\d+/\d+ ", out), out
    max_diff = float(re.search(r"max \|dlogprob\|: (\S+) nats \(tolerance (\S+)\)", out).group(1))
    assert max_diff <= 1e-4, out
    assert re.search(r"tokens compared: 96 generated tokens in 4 rows", out), out
    assert "fidelity: OK" in out, out
