"""Bounded waits for an exclusive (or shared) ``fcntl.flock`` on a lock file.

:func:`location_lock` locks a checkpoint location, ``<path>/.lock``: every save to that
directory holds it exclusively from before it creates its generation directory until it
has removed the older generations, so two saves never interleave (one removing the
other's half-written generation, or their manifests crossing). :func:`file_lock` is the
same for any lock file (the checkpoint sequence record uses it).

An ``flock`` belongs to an open file description: two threads of one process exclude
each other exactly as two processes do, and the kernel drops the lock when its holder
exits, so a crashed save never leaves a location locked. The lock file stays behind
(empty, harmless). Local file systems only: over NFS ``flock`` may be emulated or absent.
Waiting is bounded by ``token-capture.store.checkpoint-lock-timeout-s`` (seconds); on
time-out :class:`~tasks.errors.CheckpointError` names the lock and that knob.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from contextlib import contextmanager
from typing import Iterator

from tasks.errors import CheckpointError

from .. import config

LOCK_NAME = ".lock"
TIMEOUT_CONFIG = "store.checkpoint-lock-timeout-s"
_FIRST_POLL_S = 0.005
_MAX_POLL_S = 0.2


def lock_timeout_s() -> float:
    """``token-capture.store.checkpoint-lock-timeout-s`` in seconds (>= 0), read now."""
    value = config.get(TIMEOUT_CONFIG)
    try:
        timeout_s = float(value)
    except (TypeError, ValueError):
        timeout_s = -1.0
    if not timeout_s >= 0:  # also refuses NaN
        raise CheckpointError(f"token-capture.{TIMEOUT_CONFIG} must be a number of seconds >= 0, got {value!r}")
    return timeout_s


def _open_lock_file(lock_path: str) -> int:
    """An fd of the regular lock file at ``lock_path``, created if missing (a symlink,
    FIFO or directory there is refused, never followed or waited on)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as e:
        raise CheckpointError(f"cannot open lock file {lock_path!r}: {e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"lock file {lock_path!r} is not a regular file; remove it")
    return fd


def _acquire(fd: int, lock_path: str, timeout_s: float, shared: bool, what: str) -> None:
    """Take the flock on ``fd``, polling (never blocking) for at most ``timeout_s`` seconds."""
    op = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    pause = _FIRST_POLL_S
    while True:
        try:
            fcntl.flock(fd, op)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"{what}: cannot lock {lock_path!r}: {e}") from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise CheckpointError(
                f"{what}: lock {lock_path!r} is still held by another save after {timeout_s:g} s; wait for "
                f"that save to finish, or raise token-capture.{TIMEOUT_CONFIG}"
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, _MAX_POLL_S)


@contextmanager
def file_lock(lock_path: str, timeout_s: float | None = None, *, shared: bool = False, what: str = "") -> Iterator[None]:
    """Hold an flock on ``lock_path`` (exclusive, or ``shared``) for the ``with`` block.

    Waits at most ``timeout_s`` seconds (default: :func:`lock_timeout_s`), then raises
    :class:`CheckpointError` naming ``what``, the lock file and the knob. Closing the
    file releases the lock, also when the block raises."""
    timeout_s = lock_timeout_s() if timeout_s is None else float(timeout_s)
    fd = _open_lock_file(lock_path)
    try:
        _acquire(fd, lock_path, timeout_s, shared, what or f"lock file {lock_path!r}")
        yield
    finally:
        os.close(fd)


def location_lock(path: str, timeout_s: float | None = None, *, shared: bool = False):
    """:func:`file_lock` on ``<path>/.lock`` of the checkpoint directory ``path`` (which
    must exist): saves take it exclusively; a reader may take it ``shared``."""
    return file_lock(os.path.join(path, LOCK_NAME), timeout_s, shared=shared, what=f"checkpoint location {path!r}")
