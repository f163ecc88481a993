"""What every ``python -m pipeline bench ...`` shares: cluster flags, the cluster itself,
progress notes on stderr, and the stand-alone entry point (``python -m pipeline.bench.X``)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

if TYPE_CHECKING:
    from distributed import Client


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """``--scheduler`` and ``--quiet``, the flags every benchmark takes."""
    p.add_argument("--scheduler", default=None, help="use an existing cluster instead of an embedded LocalCluster")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


@contextlib.contextmanager
def bench_client(args: argparse.Namespace, n_workers: int = 2) -> Iterator["Client"]:
    """A client on ``args.scheduler``, or on a fresh loopback LocalCluster of
    ``n_workers`` single-threaded worker processes (closed on exit)."""
    from distributed import Client

    from ..cluster import local_cluster

    if args.scheduler:
        with Client(args.scheduler) as client:
            yield client
        return
    with local_cluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        yield client


def notes(name: str, quiet: bool) -> Callable[[str], None]:
    """A ``say(text)`` that prints ``[bench NAME  12.3s] text`` on stderr unless quiet."""
    t0 = time.perf_counter()

    def say(text: str) -> None:
        if not quiet:
            print(f"[bench {name} {time.perf_counter() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    return say


def main(module: ModuleType, argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry point of a benchmark module (same flags as the CLI)."""
    p = argparse.ArgumentParser(prog=f"python -m {module.__name__}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    result = module.run(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0
