"""Stopping a host's processes: nothing below them is left running when the stop returns."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil

from pipeline.deploy.hosts import stop_processes

# A stand-in for `dask worker --nanny`: the leader starts a worker in its own group (as a
# nanny's process does) and one that left the group (its own session), then waits.
LEADER = r"""
import os, subprocess, sys, time
child = "import time; time.sleep(600)"
subprocess.Popen([sys.executable, "-c", child])
subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
print("ready", flush=True)
time.sleep(600)
"""


def _running(procs: list[psutil.Process]) -> list[int]:
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def _kill(procs: list[psutil.Process]) -> None:
    """Cleanup whatever a failed test left running."""
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def _leader() -> tuple[subprocess.Popen, list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    children = psutil.Process(proc.pid).children(recursive=True)
    deadline = time.monotonic() + 30
    while len(children) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 2, children
    return proc, children


def test_a_stop_returns_once_every_process_below_the_leaders_has_exited():
    proc, children = _leader()
    try:
        stop_processes([proc], graceful_s=5.0)
        assert proc.poll() is not None
        # The worker in the group and the one that left it: both exited, none left running.
        assert _running(children) == []
    finally:
        _kill(children)


def test_a_forced_stop_kills_at_once_and_leaves_nothing_running():
    proc, children = _leader()
    try:
        stop_processes([proc], graceful_s=0.0)
        assert proc.returncode == -9  # SIGKILL: no graceful close asked for
        assert _running(children) == []
    finally:
        _kill(children)
