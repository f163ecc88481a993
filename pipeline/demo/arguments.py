"""The demo's command line: its flags (:func:`add_arguments`) and the combinations
argparse cannot check one flag at a time (:func:`check_arguments`)."""
from __future__ import annotations

import argparse

from .. import config
from ..cli_args import host_port, non_negative_float, positive_float, positive_int, scheduler_address


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the demo's flags to ``p`` (defaults from ``token-capture.demo`` and ``cluster``)."""
    _add_cluster_arguments(p)
    _add_workload_arguments(p)
    _add_phase_arguments(p)
    _add_run_arguments(p)


def _add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Where the demo runs: an existing scheduler, or the embedded LocalCluster's knobs."""
    p.add_argument("--scheduler", metavar="ADDR", type=scheduler_address, help="attach to an existing scheduler (e.g. tcp://127.0.0.1:8786) instead of an embedded LocalCluster")
    p.add_argument("--connect-timeout", metavar="SECONDS", type=positive_float, default=None,
                   help=f"with --scheduler: how long to wait for it (and for a worker) to answer (default {config.get('cluster.connect-timeout-s'):g}, config cluster.connect-timeout-s)")
    p.add_argument("--dashboard-address", metavar="HOST:PORT", type=host_port, default=None,
                   help=f"embedded cluster: where the dashboard listens (default {config.get('cluster.dashboard-address')}; port 0 picks a free one)")
    p.add_argument("--n-workers", type=positive_int, default=None,
                   help=f"embedded cluster: workers at start, and the adaptive minimum (default {config.get('cluster.n-workers')})")


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The shape of the steps: how many, how big, how many in flight."""
    p.add_argument("--steps", type=positive_int, default=config.get("demo.steps"), help="training steps to finalize (default %(default)s)")
    p.add_argument("--groups", type=positive_int, default=config.get("demo.groups"), help="GRPO groups per step (default %(default)s)")
    p.add_argument("--rollouts", type=positive_int, default=config.get("demo.rollouts-per-group"), help="rollouts per group (default %(default)s)")
    p.add_argument("--turns", type=positive_int, default=config.get("demo.turns"), help="model calls per rollout (default %(default)s)")
    p.add_argument("--tokens-per-turn", type=positive_int, default=config.get("demo.tokens-per-turn"), help="generated tokens per call (default %(default)s)")
    p.add_argument("--in-flight", type=positive_int, default=config.get("demo.steps-in-flight"), help="finalization steps kept in flight (default %(default)s)")


def _add_phase_arguments(p: argparse.ArgumentParser) -> None:
    """Which of the later phases run (resume, tamper, scale) and the scale phase's shape."""
    p.add_argument("--no-resume", action="store_true", help="skip the cut -> checkpoint -> kill -> restore -> resume -> finalize phase")
    p.add_argument("--tamper", action=argparse.BooleanOptionalAction, default=config.get("demo.tamper"),
                   help="also finalize a group of rollouts tampered on purpose, each rejected with its reason (default %(default)s, config demo.tamper)")
    p.add_argument("--scale-demo", action=argparse.BooleanOptionalAction, default=config.get("demo.scale-phase"),
                   help="embedded cluster: a verify-heavy burst of min(--steps, --scale-steps) steps, then idle, printing the adaptive "
                        "policy's scale-up/down decisions; skipped with --scheduler or below 2 steps (default %(default)s, config demo.scale-phase)")
    p.add_argument("--scale-steps", type=positive_int, default=config.get("demo.scale-steps"), help="steps in the scale phase's burst (default %(default)s)")
    p.add_argument("--scale-tokens", metavar="N", type=positive_int, default=config.get("demo.scale-tokens-per-call"),
                   help="tokens per call of the scale phase's long rollouts (default %(default)s)")
    p.add_argument("--scale-calls", metavar="N", type=positive_int, default=config.get("demo.scale-calls"),
                   help="model calls per rollout in the scale phase: long agentic chains, whose per-call checks make verification the heavy side (default %(default)s)")


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    """After the run (--keep-alive) and stderr progress (--quiet)."""
    p.add_argument("--keep-alive", action="store_true", help="after the run, keep the cluster and dashboard up and keep finalizing steps (Ctrl-C to stop)")
    p.add_argument("--keep-alive-interval", metavar="SECONDS", type=non_negative_float, default=2.0, help="seconds between steps with --keep-alive (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations argparse cannot see one flag at a time (``p.error``: exit 2)."""
    if args.scheduler:
        embedded_only = [f for f, v in (("--dashboard-address", args.dashboard_address), ("--n-workers", args.n_workers)) if v is not None]
        if embedded_only:
            what = " and ".join(embedded_only)
            p.error(f"{what} {'configure' if len(embedded_only) > 1 else 'configures'} the embedded cluster; drop {'them' if len(embedded_only) > 1 else 'it'} when attaching with --scheduler")
    elif args.connect_timeout is not None:
        p.error("--connect-timeout applies to --scheduler only; pass --scheduler ADDR too, or drop it")
