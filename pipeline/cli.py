"""``python -m pipeline``: the demo, a local multi-host cluster and the side-by-side benchmarks."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from types import ModuleType
from typing import Sequence

BENCHMARKS = {
    "store": "put/get throughput, one row per call vs 256 rows per call",
    "finalize": "per-rollout fetch + per-token verify vs the one-union-fetch graph",
    "cut": "checkpoint cut writes, one put per call vs batched puts",
    "restore": "restore reads, per-request gets vs the coalescing PrefixReadBatcher",
    "capture": "capture-client staging (gate + batched puts) vs a direct put_many of pre-packed rows",
    "soak": "200+ steps in flight: store bytes/rows, scheduler tasks and RSS stay flat (exit 1 if not)",
    "limits": "this machine's physical limits: loopback TCP, memcpy, first touch of fresh memory, SHA-256 per core",
    "scale": "finalize step costs (tasks, messages, store calls, CPU, bytes across hosts) at 1/2/4 hosts and 1x-16x work",
    "chaos": "steps flowing while workers, the controller and the network fail, beside a fault-free run (exit 1 on a loss)",
}


def _command(sub: argparse._SubParsersAction, name: str, module: ModuleType, help_text: str) -> None:
    """Subcommand ``name`` from ``module``: its docstring, ``add_arguments``, ``main`` and
    ``check_arguments``."""
    p = sub.add_parser(name, help=help_text, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(func=module.main, check=lambda args, p=p: module.check_arguments(p, args))


def build_parser() -> argparse.ArgumentParser:
    from .cli_args import ArgumentParser

    parser = ArgumentParser(
        prog="python -m pipeline",
        description="dask-token-capture: verifiable token capture for RL post-training on Dask.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from . import demo
    from .deploy import cli as cluster_cli

    _command(sub, "demo", demo, "run the whole loop on an embedded LocalCluster (or --scheduler ADDR)")
    _command(sub, "cluster", cluster_cli,
             "a dask scheduler and hosts of dask workers on this machine, each host on its own loopback address")

    bench = sub.add_parser("bench", help="side-by-side benchmarks (one run, ratios)", description="Side-by-side benchmarks; --json prints one JSON object on stdout, progress goes to stderr.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        try:
            module = importlib.import_module(f"pipeline.bench.{name}")
        except ImportError as e:  # a benchmark whose module is missing is listed, not run
            p = bench_sub.add_parser(name, help=f"{help_text} (unavailable: {e})")
            p.set_defaults(func=lambda args, e=e: sys.exit(f"benchmark unavailable: {e}"))
            continue
        p = bench_sub.add_parser(
            name, help=help_text, description=(module.__doc__ or help_text), formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(p)
        if not any("--json" in a.option_strings for a in p._actions):
            p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        p.set_defaults(func=lambda args, module=module: _run_bench(module, args))
    return parser


def _run_bench(module, args: argparse.Namespace) -> int:
    result = module.run(args)
    if args.json:
        print(json.dumps(result, sort_keys=False))
    else:
        print(json.dumps(result, indent=2))
    # A benchmark with pass/fail targets (soak) says its exit status; the others exit 0.
    status = getattr(module, "exit_status", None)
    return int(status(result)) if status is not None else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run, and turn expected failures into one line on stderr.

    Bad flags: argparse's usage line, exit 2 (before any cluster starts). An expected
    problem of the environment (:func:`pipeline.cli_args.run_command`): ``error: <problem>;
    <fix>``, exit 1 (2 for a malformed address). Ctrl-C: ``interrupted``, exit 130. Any
    other exception is a bug and keeps its traceback.
    """
    from .cli_args import run_command

    args = build_parser().parse_args(argv)
    check = getattr(args, "check", None)
    if check is not None:
        check(args)
    return run_command(args.func, args)
