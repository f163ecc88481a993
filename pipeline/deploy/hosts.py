"""Hosts on this machine: a ``dask scheduler`` process and groups of ``dask worker``
processes started from Dask's own command line, each group (a "host") bound to its own
loopback address (127.0.0.2, 127.0.0.3, ...) with its own local directory.

Nothing is shared between hosts but the scheduler. Each process runs in a session of its
own (a Ctrl-C in the terminal reaches only the controlling process, which closes the
hosts in order) and writes its log under its host's directory. :meth:`LocalHosts.kill_host`
SIGKILLs every process of a host (a host lost); :meth:`LocalHosts.add_host` starts a new
one. Startup waits until every worker is registered; a failure raises
:class:`~tasks.errors.HostStartFailed` naming the host, its log and the fix.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from tasks.errors import HostStartFailed

from ..actors import workers_now

from .commands import HostSpec, scheduler_command, worker_commands
from .settings import HostSettings

if TYPE_CHECKING:
    from distributed import Client

POLL_S = 0.1  # how often startup looks at the scheduler and the processes (s)
STOP_WAIT_S = 10.0  # how long a stop waits for SIGKILLed worker processes to exit (s)


@dataclass
class Host:
    """A started host: its spec, its processes (one per command line) and their logs."""

    spec: HostSpec
    processes: list[subprocess.Popen] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    killed: bool = False

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return self.spec.address

    def pids(self) -> list[int]:
        """Every process of the host now: its command lines' and their children (nannies' workers)."""
        import psutil

        out = []
        for p in self.processes:
            try:
                proc = psutil.Process(p.pid)
                out += [proc.pid, *(c.pid for c in proc.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
        return out


class LocalHosts:
    """A scheduler and hosts of workers on this machine (module docstring).

    ``directory``: where the scheduler file, the hosts' directories and the logs go
    (default: a new temporary directory, removed by :meth:`close`). ``env``: extra
    environment variables for every process (``DASK_...`` config). ``progress``: called
    with one line per step (the CLI prints it on stderr). Knobs: ``hosts.*``, read once.
    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, directory: str | None = None, *, settings: HostSettings | None = None,
                 env: Mapping[str, str] | None = None, progress: Callable[[str], None] | None = None) -> None:
        self.settings = settings or HostSettings.from_config()
        self._own_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="token-capture-hosts-")
        os.makedirs(self.directory, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.progress = progress or (lambda line: None)
        self.hosts: dict[str, Host] = {}
        self.address: str | None = None
        self.scheduler: subprocess.Popen | None = None
        self._scheduler_log = os.path.join(self.directory, "scheduler.log")
        self._client: Client | None = None
        self._next = 0  # index of the next host (names host1, host2, ...; addresses first + index)

    def __enter__(self) -> LocalHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the scheduler ----------------------------------------------------------------

    def start(self, port: int | None = None, dashboard_address: str | None = None) -> str:
        """Start the scheduler (``hosts.scheduler-port`` / ``cluster.dashboard-address``
        unless given) and wait until it answers; returns its address."""
        s = self.settings
        port = s.scheduler_port if port is None else int(port)
        scheduler_file = os.path.join(self.directory, "scheduler.json")
        argv = scheduler_command(s.scheduler_host, port, dashboard_address or s.dashboard_address, scheduler_file)
        self.progress(f"scheduler: starting on {s.scheduler_host}:{port} (log {self._scheduler_log})")
        self.scheduler = self._spawn(argv, self._scheduler_log)
        deadline = time.monotonic() + s.start_timeout_s
        while not self._read_address(scheduler_file):
            code = self.scheduler.poll()
            if code is not None:
                raise HostStartFailed(self._scheduler_failure(code, port))
            if time.monotonic() > deadline:
                raise HostStartFailed(
                    f"the scheduler did not answer within {s.start_timeout_s:g} s (log {self._scheduler_log}); "
                    "raise token-capture.hosts.start-timeout-s or read the log")
            time.sleep(POLL_S)
        self.progress(f"scheduler: {self.address}")
        return str(self.address)

    def _read_address(self, scheduler_file: str) -> bool:
        import json

        try:
            with open(scheduler_file) as f:
                self.address = json.load(f)["address"]
        except (OSError, ValueError, KeyError):
            return False
        return True

    def _scheduler_failure(self, code: int, port: int) -> str:
        text = _read(self._scheduler_log)
        host = self.settings.scheduler_host
        if "Address already in use" in text:
            return (f"the scheduler could not listen on {host}:{port}: the port is in use (log {self._scheduler_log}); "
                    "stop what holds it, or pass another --port (0 picks a free one)")
        return f"the scheduler exited with code {code} before answering: {_last_error(text)} (log {self._scheduler_log})"

    def client(self) -> Client:
        """This object's own client of the scheduler (made on first use)."""
        if self._client is None:
            from distributed import Client

            if self.address is None:
                raise HostStartFailed("no scheduler: call start() first")
            self._client = Client(self.address, timeout=self.settings.start_timeout_s, set_as_default=False)
        return self._client

    # ---- hosts ------------------------------------------------------------------------

    def spec(self, roles: Sequence[str], workers: int | None = None, *, name: str | None = None,
             extra_args: Sequence[str] = ()) -> HostSpec:
        """The next host's spec: its name (``host<k>``), address, own directory, roles."""
        s = self.settings
        index = self._next
        self._next += 1
        name = name or f"host{index + 1}"
        directory = os.path.join(self.directory, name)
        os.makedirs(directory, exist_ok=True)
        return HostSpec(name=name, address=s.host_address(index), roles=tuple(roles),
                        workers=s.workers_per_host if workers is None else int(workers), threads=s.threads_per_worker,
                        nanny=s.nanny, local_directory=directory, finalize_slots=s.finalize_slots,
                        death_timeout_s=s.start_timeout_s, extra_args=tuple(extra_args))

    def add_host(self, roles: Sequence[str], workers: int | None = None, *, name: str | None = None,
                 extra_args: Sequence[str] = ()) -> Host:
        """Start one host of ``roles`` and wait until every worker of it is registered."""
        return self.add_hosts([self.spec(roles, workers, name=name, extra_args=extra_args)])[0]

    def add_hosts(self, specs: Iterable[HostSpec]) -> list[Host]:
        """Start every host of ``specs`` at once, then wait until all their workers are
        registered (:class:`HostStartFailed` naming the first host that failed; the
        failed hosts' processes are killed)."""
        if self.address is None:
            raise HostStartFailed("no scheduler: call start() first")
        started = []
        for spec in specs:
            host = Host(spec)
            self.hosts[spec.name] = host
            for i, argv in enumerate(worker_commands(spec, self.address)):
                log = os.path.join(spec.local_directory, f"worker-{i}.log" if not spec.nanny else "workers.log")
                host.logs.append(log)
                host.processes.append(self._spawn(argv, log))
            self.progress(f"{spec.name}: starting {spec.workers} worker(s) on {spec.address} ({', '.join(spec.roles)})")
            started.append(host)
        try:
            self._wait_registered(started)
        except BaseException:
            for host in started:
                stop_processes(host.processes, 0.0)
            raise
        for host in started:
            self.progress(f"{host.name}: {host.spec.workers}/{host.spec.workers} workers registered on {host.address}")
        return started

    def _wait_registered(self, hosts: list[Host]) -> None:
        """Until every worker name of ``hosts`` is registered at its host's address."""
        deadline = time.monotonic() + self.settings.start_timeout_s
        client = self.client()
        while True:
            registered = self.registered(client)
            missing = {h.name: [n for n in h.spec.worker_names if not registered.get(n, "").startswith(f"tcp://{h.address}:")
                                and not registered.get(n, "").startswith(f"tls://{h.address}:")] for h in hosts}
            if not any(missing.values()):
                return
            for host in hosts:
                for proc, log in zip(host.processes, host.logs):
                    code = proc.poll()
                    if code is not None and missing[host.name]:
                        raise HostStartFailed(
                            f"{host.name} ({host.address}): a worker process exited with code {code} before "
                            f"{', '.join(missing[host.name])} registered: {_last_error(_read(log))} (log {log}); "
                            "fix what the log says and start the host again")
            if time.monotonic() > deadline:
                name, names = next((n, m) for n, m in missing.items() if m)
                raise HostStartFailed(
                    f"{name} ({self.hosts[name].address}): worker(s) {', '.join(names)} did not register within "
                    f"{self.settings.start_timeout_s:g} s (logs {', '.join(self.hosts[name].logs)}); read the logs, "
                    "or raise token-capture.hosts.start-timeout-s on a slow machine")
            time.sleep(POLL_S)

    @staticmethod
    def registered(client: Client) -> dict[str, str]:
        """Worker name -> address, of every worker registered now."""
        return {str(w.get("name")): a for a, w in workers_now(client).items()}

    def workers(self, host: str) -> list[str]:
        """The addresses of host ``host``'s workers registered now."""
        names = set(self.hosts[host].spec.worker_names)
        return sorted(a for n, a in self.registered(self.client()).items() if n in names)

    def role_workers(self, role: str) -> list[str]:
        """Addresses of the registered workers of live hosts with ``role``, sorted."""
        return sorted(a for h in self.hosts.values() if not h.killed and role in h.spec.roles for a in self.workers(h.name))

    def kill_host(self, name: str, *, wait: bool = True) -> list[int]:
        """SIGKILL every process of host ``name`` (a host lost: no goodbye to the
        scheduler); with ``wait``, until the scheduler has removed its workers. Returns
        the pids killed."""
        host = self.hosts[name]
        pids = host.pids()
        stop_processes(host.processes, 0.0)  # SIGKILL, a child outside the group too; until all exited
        host.killed = True
        self.progress(f"{name}: killed ({len(pids)} process(es), SIGKILL)")
        if wait:
            names = set(host.spec.worker_names)
            deadline = time.monotonic() + self.settings.start_timeout_s
            while names & set(self.registered(self.client())) and time.monotonic() < deadline:
                time.sleep(POLL_S)
        return pids

    # ---- processes --------------------------------------------------------------------

    def _spawn(self, argv: list[str], log: str) -> subprocess.Popen:
        with open(log, "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=self.env, cwd=self.directory, start_new_session=True)

    def _stop(self, processes: list[subprocess.Popen], graceful: bool = True) -> None:
        """:func:`stop_processes` with ``hosts.stop-timeout-s`` (not ``graceful``: SIGKILL at once)."""
        stop_processes(processes, self.settings.stop_timeout_s if graceful else 0.0)

    def close(self, graceful: bool = True) -> None:
        """Stop every host (workers first), then the scheduler; remove a temporary
        directory. Not ``graceful``: SIGKILL every process at once (nothing to keep)."""
        if self._client is not None:
            self._client.close()
            self._client = None
        live = [h for h in self.hosts.values() if not h.killed]
        if live:
            self.progress(f"stopping {len(live)} host(s)")
        self._stop([p for h in live for p in h.processes], graceful)
        for h in live:
            h.killed = True
        if self.scheduler is not None:
            self._stop([self.scheduler], graceful)
            self.scheduler = None
            self.progress("scheduler: stopped")
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)


def stop_processes(processes: Sequence[subprocess.Popen], graceful_s: float) -> None:
    """Stop ``processes`` (each the leader of its own session) and everything below them:
    SIGTERM to each group (a graceful close), SIGKILL to whatever is left after
    ``graceful_s`` seconds (0: at once); returns once every one of them has exited, a
    worker process that left its group included (killed on its own)."""
    descendants = _descendants(processes)  # a nanny's workers: gone only once they have exited
    for proc in processes:
        _killpg(proc, signal.SIGTERM if graceful_s > 0 else signal.SIGKILL)
    deadline = time.monotonic() + graceful_s
    for proc in processes:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _killpg(proc, signal.SIGKILL)  # the group: a nanny's workers too
        proc.wait()
    _kill_and_wait(descendants, STOP_WAIT_S)


def _descendants(processes: Iterable[subprocess.Popen]) -> list[psutil.Process]:
    """Every process below ``processes`` now (a nanny's worker processes)."""
    out: list[psutil.Process] = []
    for proc in processes:
        try:
            out += psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:  # already gone
            pass
    return out


def _kill_and_wait(processes: Iterable[psutil.Process], timeout_s: float) -> None:
    """SIGKILL each of ``processes`` still running (one that left its group), then wait
    up to ``timeout_s`` seconds until all have exited: killed is not yet gone. A zombie
    has exited (only its parent's reaping is left); psutil checks a pid is still the
    process recorded (never another one that reused it)."""
    live = []
    for p in processes:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                p.kill()
                live.append(p)
        except psutil.Error:  # gone
            pass
    deadline = time.monotonic() + timeout_s
    for p in live:
        while time.monotonic() < deadline:
            try:
                if p.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.Error:  # gone
                break
            time.sleep(0.01)


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``proc``'s process group (its own session: the process and its children)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _last_error(text: str) -> str:
    """The log's last line that names an error (else its last line), for a one-line message."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "Exception" in line]
    return (errors or lines or ["(empty log)"])[-1][:300]
