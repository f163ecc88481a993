"""Ctrl-C for the demo: the first one only sets a flag, the demo stops from ordinary code.

The demo checks the flag between waits (every 0.5 s at most) and stops from ordinary
code: futures cancelled, store closed, cluster closed, one "interrupted" line
(:func:`pipeline.cli_args.run_command`). A KeyboardInterrupt raised inside a blocking
Dask call instead leaves asyncio/tornado tracebacks behind. A second Ctrl-C interrupts
at once.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from distributed import Client, Future

_STOP = threading.Event()


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    """SIGINT handler: the first sets the stop flag, a second raises at once."""
    if _STOP.is_set():
        raise KeyboardInterrupt
    _STOP.set()


@contextlib.contextmanager
def ctrl_c() -> Iterator[None]:
    """Clear the stop flag and, on the main thread, route SIGINT to it for the block."""
    _STOP.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_requested() -> bool:
    """Whether Ctrl-C was pressed (the stop flag is set)."""
    return _STOP.is_set()


def wait_for_stop(seconds: float) -> bool:
    """Sleep ``seconds``, waking early on Ctrl-C; whether the stop flag is set."""
    return _STOP.wait(seconds)


def check_interrupt() -> None:
    """Raise KeyboardInterrupt, from ordinary code, once Ctrl-C was pressed."""
    if _STOP.is_set():
        raise KeyboardInterrupt


def as_finished(futures: Sequence[Future]) -> Iterator[Future]:
    """``futures`` as each finishes (any order), checking for Ctrl-C twice a second."""
    from distributed import wait

    pending = set(futures)
    while pending:
        check_interrupt()
        try:
            done, pending = wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
        except TimeoutError:
            continue
        yield from done


def silence_teardown(client: Client, embedded: bool) -> None:
    """After Ctrl-C: the cut-short tasks' complaints while the cluster closes (cancelled
    executions, actor calls into closing pools, busy workers killed) are expected, not
    news. Silenced here, and on the workers when the cluster is ours."""
    def quiet() -> None:
        """No more log records in this process, nor closed-loop client finalizers."""
        logging.disable(logging.CRITICAL)
        drop_closed_loop_finalizers()

    quiet()
    if embedded:
        with contextlib.suppress(Exception):
            client.run(quiet, wait=True)


def drop_closed_loop_finalizers() -> None:
    """From now on this process does not print a Dask client's finalizer failing because
    its event loop closed first (``Client.__del__``: ``RuntimeError: IOLoop is closed``, a
    client collected during the teardown Ctrl-C started); any other unraisable exception
    still goes to the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "IOLoop is closed":
            return
        previous(unraisable)

    sys.unraisablehook = hook
