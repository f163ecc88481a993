"""``python -m pipeline cluster`` and :class:`pipeline.deploy.LocalHosts` on their own:
the command starts a scheduler and hosts of ``dask worker`` processes (nannies, the
deployment form), each on its own loopback address, prints the scheduler's address and
stops every process on Ctrl-C. Startup failures are one line naming the scheduler or the
host and the fix: a port in use, a worker that exits before registering, one that does
not register in time, an address outside loopback.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys

import psutil
import pytest
from distributed import Client

from pipeline.actors import workers_now
from pipeline.deploy import LocalHosts, check_cluster
from pipeline.deploy.cli import host_roles
from pipeline.deploy.settings import HostSettings
from tasks.errors import ClusterMisconfigured, HostStartFailed

from multi_host import host_address

pytestmark = pytest.mark.timeout(180)


def cluster_command(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline", "cluster", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_cluster_command_prints_the_address_and_stops_every_process_on_ctrl_c(tmp_path):
    proc = cluster_command("--hosts", "2", "--workers-per-host", "1", "--port", "0", "--dashboard-address", "127.0.0.1:0",
                           "--directory", str(tmp_path), "--print-commands")
    try:
        line = proc.stdout.readline()
        assert line.startswith("scheduler: tcp://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")
        address = line.split()[1]
        pids = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        with Client(address, timeout=30) as client:
            workers = workers_now(client).values()
            got = {w["name"]: (w["host"], tuple(sorted(w["resources"]))) for w in workers}
            assert got == {"host1": (host_address(1), ("finalize", "generation")), "host2": (host_address(2), ("finalize", "storage"))}
            assert check_cluster(client).ok
        assert (tmp_path / "host1" / "workers.log").exists() and (tmp_path / "host2" / "workers.log").exists()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = err.splitlines()
    # The command lines a deployment would run, then progress; no traceback.
    assert any("host1: dask worker tcp://" in ln and f"--host {host_address(1)}" in ln and "--preload pipeline.deploy.worker_preload" in ln
               and "--resources generation=1,finalize=2" in ln for ln in lines), err
    assert "[cluster] stopped" in lines[-1] and "Traceback" not in err, err
    assert not alive(pids), "processes outlived the cluster command"


# The refusals run through pipeline.cli.main in the test's process (the same code path as
# ``python -m pipeline cluster``, without another interpreter's imports); the command's
# own process is the Ctrl-C test's above.


def cluster_in_process(capsys, *args: str, settings: dict | None = None) -> tuple[int, str]:
    """``python -m pipeline cluster ARGS`` run in this process: (exit status, stderr)."""
    import dask

    from pipeline.cli import main as cli_main

    with dask.config.set(settings or {}):
        code = cli_main(["cluster", *args])
    return code, capsys.readouterr().err


def test_a_port_in_use_is_one_line_naming_the_scheduler_and_the_fix(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        code, err = cluster_in_process(capsys, "--hosts", "1", "--port", str(port), "--dashboard-address", "127.0.0.1:0")
    assert code == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the scheduler could not listen on 127.0.0.1:{port}: the port is in use") and "--port" in last, err


def test_an_address_outside_loopback_is_refused_before_anything_starts(capsys):
    code, err = cluster_in_process(capsys, "--hosts", "1", settings={"token-capture.hosts.first-address": "10.1.2.3"})
    assert code == 1 and err.strip().splitlines() == [
        "error: token-capture.hosts.first-address '10.1.2.3' is not a loopback host address; local hosts bind only "
        "127.0.0.1-127.255.255.254 (set token-capture.hosts.first-address to e.g. 127.0.0.2)"], err
    settings = HostSettings.from_config()
    with pytest.raises(ClusterMisconfigured, match="host 16777215's address '128.0.0.0' is not a loopback"):
        dataclasses.replace(settings, first_address="127.0.0.2").host_address(256 ** 3 - 2)


def test_roles_per_host():
    assert host_roles(1, 0) == [("generation", "storage", "finalize")]
    assert host_roles(4, 2) == [("generation", "finalize")] * 2 + [("storage", "finalize")] * 2


@pytest.fixture(scope="module")
def scheduler():
    import dask

    with dask.config.set({"token-capture.hosts.nanny": False}), LocalHosts() as hosts:
        hosts.start(port=0, dashboard_address="127.0.0.1:0")
        yield hosts


def test_a_worker_that_exits_before_registering_names_its_host_and_log(scheduler):
    with pytest.raises(HostStartFailed) as e:
        scheduler.add_host(["finalize"], 1, name="broken", extra_args=["--preload", "no_such_module_for_this_test"])
    message = str(e.value)
    assert message.startswith(f"broken ({host_address(1)}): a worker process exited with code 1 before broken registered: "
                              "ModuleNotFoundError: No module named 'no_such_module_for_this_test'"), message
    assert os.path.join(scheduler.directory, "broken", "worker-0.log") in message and "start the host again" in message
    assert not alive(p.pid for p in scheduler.hosts["broken"].processes)


def test_a_worker_that_does_not_register_in_time_names_its_host_and_the_fix(scheduler):
    scheduler.settings = dataclasses.replace(scheduler.settings, start_timeout_s=0.2)  # a worker takes seconds to start
    with pytest.raises(HostStartFailed, match=r"slow \(127\.0\.\d+\.\d+\): worker\(s\) slow did not register within 0.2 s "
                       r"\(logs .*\); read the logs, or raise token-capture.hosts.start-timeout-s"):
        scheduler.add_host(["finalize"], 1, name="slow")
    assert not alive(p.pid for p in scheduler.hosts["slow"].processes), "a failed host's processes are killed"


def test_killing_a_nanny_host_kills_every_process_of_it(scheduler):
    scheduler.settings = dataclasses.replace(scheduler.settings, nanny=True, start_timeout_s=60.0)
    host = scheduler.add_host(["finalize"], 2, name="nannied")
    assert len(scheduler.workers("nannied")) == 2
    pids = host.pids()
    assert len(pids) >= 3, pids  # the `dask worker` process (two nannies) and its two worker processes
    killed = scheduler.kill_host("nannied")
    assert set(pids) <= set(killed) and not alive(pids)
    assert not scheduler.workers("nannied"), "the scheduler still lists the killed host's workers"
