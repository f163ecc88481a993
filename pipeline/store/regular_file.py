"""Read a small file that must be a regular file, without blocking and with a size bound.

For files named by a path someone else may have replaced (a checkpoint manifest, the
checkpoint sequence record): a symlink is followed, but what it names must be a regular
file; a FIFO, device, socket or directory is refused before it is opened (and again on
the opened descriptor, in case it was swapped in between); the open never blocks
(``O_NONBLOCK``); and at most ``limit_bytes + 1`` bytes are read even if the file grows,
so a file over the limit is refused, never read whole.
"""
from __future__ import annotations

import os
import stat

from tasks.errors import CheckpointError

_READ_BLOCK = 1 << 20  # bytes per read call
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _limit(limit_bytes: int, knob: str | None) -> str:
    """The limit in words, with the knob that sets it and the fix."""
    if knob is None:
        return f"{limit_bytes}-byte limit"
    return f"{limit_bytes}-byte limit of {knob} (raise {knob} if this file is genuine)"


def _check(path: str, st: os.stat_result, limit_bytes: int, knob: str | None, error: type[CheckpointError]) -> None:
    """Refuse anything but a regular file of at most ``limit_bytes`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: is {_kind(st.st_mode)}, not a regular file; refused unread")
    if st.st_size > limit_bytes:
        raise error(f"{path}: {st.st_size} bytes, over the {_limit(limit_bytes, knob)}; refused unread")


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from ``fd`` (fewer only at end of file)."""
    chunks, got = [], 0
    while got < n:
        block = os.read(fd, min(n - got, _READ_BLOCK))
        if not block:
            break
        chunks.append(block)
        got += len(block)
    return b"".join(chunks)


def read_regular_bounded(
    path: str, limit_bytes: int, knob: str | None, error: type[CheckpointError] = CheckpointError
) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit_bytes`` bytes.

    ``knob`` (or ``None``) names the setting of the limit in messages. Raises ``error``
    for a file that is not a regular file (after following symlinks), is over the limit
    (also one that grew past it while read) or cannot be opened or read."""
    try:
        _check(path, os.stat(path), limit_bytes, knob, error)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except CheckpointError:  # an OSError too: pass it on as raised
        raise
    except OSError as e:
        raise error(f"{path}: unreadable: {e}") from None
    try:
        _check(path, os.fstat(fd), limit_bytes, knob, error)  # what was opened: it may differ
        data = _read_at_most(fd, limit_bytes + 1)
    except CheckpointError:
        raise
    except OSError as e:
        raise error(f"{path}: unreadable: {e}") from None
    finally:
        os.close(fd)
    if len(data) > limit_bytes:
        raise error(f"{path}: grew past the {_limit(limit_bytes, knob)} while read; refused")
    return data
