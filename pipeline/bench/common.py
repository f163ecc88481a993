"""What every ``python -m pipeline bench ...`` shares: cluster flags, the cluster itself,
progress notes on stderr, the stand-alone entry point (``python -m pipeline.bench.X``) and
the bit-exact check of rows read back."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from tasks.packed import PackedBatch

if TYPE_CHECKING:
    from distributed import Client


def add_cluster_arguments(p: argparse.ArgumentParser, n_workers: int | None = None) -> None:
    """``--scheduler``, ``--connect-timeout`` and ``--quiet``, the flags every benchmark
    takes; with ``n_workers`` (the default worker count) also ``--n-workers`` for the
    embedded cluster. A flag the benchmark already defines is left as it is."""
    from ..cli_args import positive_float, positive_int, scheduler_address

    have = set(p._option_string_actions)
    if "--scheduler" not in have:
        p.add_argument("--scheduler", metavar="ADDR", type=scheduler_address, default=None,
                       help="use an existing cluster (e.g. tcp://127.0.0.1:8786) instead of an embedded LocalCluster")
    if "--connect-timeout" not in have:
        p.add_argument("--connect-timeout", metavar="SECONDS", type=positive_float, default=None,
                       help="with --scheduler: how long to wait for it to answer (default: config cluster.connect-timeout-s)")
    if n_workers is not None and "--n-workers" not in have:
        p.add_argument("--n-workers", type=positive_int, default=n_workers,
                       help=f"embedded LocalCluster workers, one thread each (default {n_workers}; ignored with --scheduler)")
    if "--quiet" not in have:
        p.add_argument("--quiet", action="store_true", help="no progress on stderr")


@contextlib.contextmanager
def bench_client(args: argparse.Namespace, n_workers: int = 2) -> Iterator["Client"]:
    """A client on ``args.scheduler`` (waiting at most ``args.connect_timeout`` seconds for
    it), or on a fresh loopback LocalCluster of ``args.n_workers`` (else ``n_workers``)
    single-threaded worker processes (closed on exit)."""
    from distributed import Client

    from ..cluster import attach, local_cluster

    if getattr(args, "scheduler", None):
        with attach(args.scheduler, getattr(args, "connect_timeout", None)) as client:
            yield client
        return
    n_workers = getattr(args, "n_workers", None) or n_workers
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
    from ..cli_args import ArgumentParser, run_command

    name = module.__spec__.name if getattr(module, "__spec__", None) else module.__name__
    p = ArgumentParser(prog=f"python -m {name}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    if "--json" not in p._option_string_actions:
        p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)

    def go(args: argparse.Namespace) -> int:
        result = module.run(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=2))
        return int(module.exit_status(result)) if hasattr(module, "exit_status") else 0

    return run_command(go, args)


def refused(what: str, failed: Any) -> str:
    """One failure line for keys a store call refused (``{key: (reason, detail)}``)."""
    key, why = next(iter(failed.items()))
    return f"{what}: {len(failed)} key(s) failed, e.g. {key}: {why}"


def compare_rows(want: PackedBatch, got: PackedBatch, fields: Any = None, what: str = "") -> list[str]:
    """Bit-exact check of rows read back: row ``i`` of ``got`` against row ``i`` of ``want``
    (same key, and for every field of ``want``, or ``fields``: same presence, dtype and
    values by ``np.array_equal``). Returns one problem per differing row and field."""
    problems: list[str] = []
    if list(got.keys[: len(want)]) != list(want.keys):
        return [f"{what}read back keys {list(got.keys)[:3]}.., expected {list(want.keys)[:3]}.."]
    names = list(fields) if fields is not None else list(want.fields)
    for i, key in enumerate(want.keys):
        for name in names:
            w = want.fields[name].row(i) if name in want.fields else None
            g = got.fields[name].row(i) if name in got.fields else None
            if (w is None) != (g is None):
                problems.append(f"{what}{key}: field {name} {'missing' if g is None else 'unexpected'} in what was read back")
            elif w is not None and (w.dtype != g.dtype or w.shape != g.shape or not np.array_equal(w, g)):
                problems.append(f"{what}{key}: field {name} read back differs from what was written")
    return problems
