"""Reusable argparse types: every numeric or structured flag is checked while the command
line is parsed, before any cluster starts, so a bad value ends in argparse's one-line
``error: argument --groups: must be a positive integer, got '0'`` and exit code 2.

    p.add_argument("--groups", type=positive_int, default=4)
    p.add_argument("--interval", type=non_negative_float, default=2.0)
    p.add_argument("--scheduler", type=scheduler_address)

Each type raises :class:`argparse.ArgumentTypeError` with a message that says what is
expected; argparse prefixes it with the flag's name. No Dask import at module level.

:func:`run_command` runs a parsed command the way ``python -m pipeline`` does: expected
problems (:data:`EXPECTED_ERRORS`) print ``error: <problem>; <fix>`` on stderr and return
their exit code, Ctrl-C prints ``interrupted`` and returns 130, anything else is a bug and
keeps its traceback.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Callable

from .scheduler_security import check_scheduler_security

__all__ = [
    "ArgumentParser",
    "positive_int",
    "non_negative_int",
    "positive_float",
    "non_negative_float",
    "int_between",
    "positive_int_list",
    "byte_size",
    "host_port",
    "scheduler_address",
    "check_scheduler_security",
    "run_command",
    "EXIT_USAGE",
    "EXIT_ENVIRONMENT",
    "EXIT_INTERRUPTED",
]

EXIT_ENVIRONMENT = 1  # the cluster is down, has no workers, lacks `finalize` slots, misconfigured workers, a host that did not start
EXIT_USAGE = 2  # argparse's own code for bad flags; also a malformed scheduler address
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are ONE line on stderr, exit code 2:
    ``PROG: error: argument --groups: must be a positive integer, got '0' (see PROG --help)``.
    Sub-parsers inherit the class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parse(text: str, kind: type, what: str) -> int | float:
    """``text`` as ``kind`` (int: ``_`` separators allowed; float: finite only)."""
    try:
        value = int(str(text).strip().replace("_", "")) if kind is int else float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _bounded(name: str, kind: type, what: str, ok: Callable[[float], bool], doc: str) -> Callable[[str], int | float]:
    """An argparse type: ``text`` parsed as ``kind`` and accepted when ``ok(value)``."""

    def parse(text: str) -> int | float:
        value = _parse(text, kind, what)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    parse.__name__ = parse.__qualname__ = name  # argparse names a type by it in some messages
    parse.__doc__ = doc
    return parse


positive_int = _bounded("positive_int", int, "a positive integer", lambda v: v >= 1, "An integer >= 1.")
non_negative_int = _bounded("non_negative_int", int, "a non-negative integer", lambda v: v >= 0, "An integer >= 0.")
positive_float = _bounded("positive_float", float, "a positive number", lambda v: v > 0, "A finite number > 0.")
non_negative_float = _bounded("non_negative_float", float, "a non-negative number", lambda v: v >= 0, "A finite number >= 0.")


def int_between(lo: int, hi: int) -> Callable[[str], int | float]:
    """An argparse type: an integer from ``lo`` to ``hi`` (both included)."""
    return _bounded(f"int_between_{lo}_{hi}", int, f"an integer from {lo} to {hi}", lambda v: lo <= v <= hi,
                    f"An integer {lo}-{hi}.")


def positive_int_list(text: str) -> str:
    """Comma-separated positive integers (``"1024,16384"``); returned normalized, as a
    comma-separated string."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}")
    try:
        return ",".join(str(positive_int(t)) for t in items)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive integers, got {text!r}") from None


def byte_size(text: str) -> str:
    """A positive byte count as Dask writes them (``256MiB``, ``2GB``, ``1048576``);
    returned as given (consumers parse it with ``dask.utils.parse_bytes``)."""
    from dask.utils import parse_bytes

    try:
        value = parse_bytes(str(text))
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"must be a byte size such as 256MiB or 2GB, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive byte size such as 256MiB, got {text!r}")
    return str(text)


_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:\s/\[\]]*):(?P<port>\d+)$")


def host_port(text: str) -> str:
    """``HOST:PORT`` or ``:PORT`` (port 0..65535; 0 picks a free one), e.g. ``127.0.0.1:8787``."""
    m = _HOST_PORT.match(str(text).strip())
    if not m or int(m.group("port")) > 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT such as 127.0.0.1:8787 (port 0 picks a free one), got {text!r}")
    return str(text).strip()


def scheduler_address(text: str) -> str:
    """A Dask scheduler address, ``[tcp|tls|...://]HOST:PORT`` with a port in 1..65535."""
    from distributed.comm.addressing import parse_address, parse_host_port
    from distributed.comm.registry import backends

    address = str(text).strip()
    fix = "expected a scheduler address such as tcp://127.0.0.1:8786"
    try:
        scheme, loc = parse_address(address)
        if scheme not in backends:
            raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(sorted(backends))}")
        if scheme in ("tcp", "tls", "ws", "wss"):
            _host, port = parse_host_port(loc)
            if not 0 < int(port) <= 65535:
                raise ValueError(f"port {port} out of range")
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{fix}, got {text!r} ({e})") from None
    return address


def expected_errors() -> dict[type, int]:
    """Exception class -> exit code of the problems a user fixes outside the code."""
    from tasks.errors import (ClusterMisconfigured, ClusterUnavailable, InvalidSchedulerAddress, MissingFinalizeResource,
                              UsageError)

    return {InvalidSchedulerAddress: EXIT_USAGE, UsageError: EXIT_USAGE, ClusterUnavailable: EXIT_ENVIRONMENT,
            MissingFinalizeResource: EXIT_ENVIRONMENT, ClusterMisconfigured: EXIT_ENVIRONMENT}


def run_command(func: Callable[[argparse.Namespace], int | None], args: argparse.Namespace) -> int:
    """``func(args)`` as an exit code; expected errors and Ctrl-C become one line on stderr.

    A ``--scheduler`` address the Dask security settings cannot reach
    (:func:`check_scheduler_security`) is refused first, before ``func`` runs.
    """
    codes = expected_errors()
    try:
        check_scheduler_security(getattr(args, "scheduler", None))
        return int(func(args) or 0)
    except KeyboardInterrupt:
        _quiet_shutdown()
        print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except tuple(codes) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return next(code for cls, code in codes.items() if isinstance(e, cls))


def _quiet_shutdown() -> None:
    """After Ctrl-C the cluster is already closed (context managers); what remains is
    asyncio's and distributed's complaints about the tasks the interrupt cut short
    ("Task exception was never retrieved", ``CancelledError``) while the process exits."""
    import logging

    for name in ("asyncio", "distributed", "tornado"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
