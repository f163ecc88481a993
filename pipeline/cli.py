"""``python -m pipeline``: the demo and the side-by-side benchmarks."""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

BENCHMARKS = {
    "store": "put/get throughput, one row per call vs 256 rows per call",
    "finalize": "per-rollout fetch + per-token verify vs the one-union-fetch graph",
    "cut": "checkpoint cut writes, one put per call vs batched puts",
    "restore": "restore reads, per-request gets vs the coalescing PrefixReadBatcher",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline",
        description="dask-token-capture: verifiable token capture for RL post-training on Dask.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from . import demo

    demo_parser = sub.add_parser(
        "demo",
        help="run the whole loop on an embedded LocalCluster (or --scheduler ADDR)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(func=demo.main)

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
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)
