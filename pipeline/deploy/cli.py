"""``python -m pipeline cluster``: a scheduler and hosts of workers on this machine.

Starts ``dask scheduler`` with the pipeline's preload and ``--hosts`` hosts of
``--workers-per-host`` ``dask worker`` processes, host k on loopback address
127.0.0.(k+1) with its own directory: the first hosts generation, the last
``--storage-hosts`` storage, every one finalize slots. Waits until every worker has
registered and the attach check passes, prints ``scheduler: ADDRESS`` on stdout and runs
until Ctrl-C (or SIGTERM), then stops the hosts and the scheduler. Progress on stderr.

    python -m pipeline cluster --hosts 4 --workers-per-host 2
    python -m pipeline demo --scheduler tcp://127.0.0.1:8786     # in another terminal
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from .roles import check_roles


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli_args import host_port, non_negative_int, positive_float, positive_int

    p.add_argument("--hosts", type=positive_int, default=4, help="hosts to start (default 4)")
    p.add_argument("--workers-per-host", type=positive_int, default=None, help="worker processes per host (default hosts.workers-per-host)")
    p.add_argument("--storage-hosts", type=non_negative_int, default=None,
                   help="how many of the hosts (the last ones) have the storage role, the others generation (default: half)")
    p.add_argument("--port", type=non_negative_int, default=None, help="scheduler port (default hosts.scheduler-port; 0: a free one)")
    p.add_argument("--dashboard-address", type=host_port, default=None, help="scheduler dashboard (default cluster.dashboard-address)")
    p.add_argument("--directory", default=None, help="where logs and the hosts' directories go (default: a temporary directory, removed at exit)")
    p.add_argument("--no-nanny", action="store_true", help="start each worker as its own `dask worker --no-nanny` process")
    p.add_argument("--start-timeout", type=positive_float, default=None, help="seconds to wait for every worker to register (default hosts.start-timeout-s)")
    p.add_argument("--print-commands", action="store_true", help="print each process's command line on stderr")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that do not fit together before anything starts (exit code 2)."""
    storage = storage_hosts(args)
    if storage > args.hosts:
        p.error(f"argument --storage-hosts: must be at most --hosts ({args.hosts}), got {storage}")


def storage_hosts(args: argparse.Namespace) -> int:
    """``--storage-hosts``, or half the hosts (one host: it has every role)."""
    return args.hosts // 2 if args.storage_hosts is None else int(args.storage_hosts)


def host_roles(hosts: int, storage: int) -> list[tuple[str, ...]]:
    """Each host's roles: generation on the first ``hosts - storage``, storage on the
    others, finalize on all; a single host has all three."""
    if hosts == 1:
        return [check_roles(["generation", "storage", "finalize"])]
    return [check_roles([("storage" if k >= hosts - storage else "generation"), "finalize"]) for k in range(hosts)]


def main(args: argparse.Namespace) -> int:
    """Start, print the scheduler's address, wait for Ctrl-C or SIGTERM, stop; exit 0."""
    import dask

    from .check import require_configured
    from .commands import display_command, worker_commands
    from .hosts import LocalHosts
    from .settings import HostSettings

    overrides: dict[str, object] = {}
    if args.workers_per_host is not None:
        overrides["token-capture.hosts.workers-per-host"] = args.workers_per_host
    if args.no_nanny:
        overrides["token-capture.hosts.nanny"] = False
    if args.start_timeout is not None:
        overrides["token-capture.hosts.start-timeout-s"] = args.start_timeout
    with dask.config.set(overrides):
        settings = HostSettings.from_config()

    def note(line: str) -> None:
        if not args.quiet:
            print(f"[cluster] {line}", file=sys.stderr, flush=True)

    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    # Started in the background by a non-interactive shell, SIGINT arrives ignored: Ctrl-C
    # (kill -INT) must stop it all the same.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with LocalHosts(args.directory, settings=settings, progress=note) as hosts:
            address = hosts.start(args.port, args.dashboard_address)
            specs = [hosts.spec(roles) for roles in host_roles(args.hosts, storage_hosts(args))]
            if args.print_commands:
                for spec in specs:
                    for argv in worker_commands(spec, address):
                        note(f"{spec.name}: {display_command(argv)}")
            hosts.add_hosts(specs)
            require_configured(hosts.client())
            print(f"scheduler: {address}", flush=True)
            link = hosts.client().dashboard_link
            note(f"ready: {len(specs)} host(s) x {settings.workers_per_host} worker(s); dashboard {link}; Ctrl-C stops")
            try:
                stop.wait()
            except KeyboardInterrupt:
                note("stopping (Ctrl-C or SIGTERM)")
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    note("stopped")
    return 0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    """SIGTERM stops like Ctrl-C."""
    raise KeyboardInterrupt
