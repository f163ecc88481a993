"""A checkpoint's MANIFEST.json is opened as safely as its data files: only a regular file
(a symlink to one is followed), never a blocking open, never read past
``store.checkpoint-manifest-max-bytes``."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import dask
import pytest

from pipeline.store import checkpoint as ck
from pipeline.store import regular_file
from tasks.errors import CheckpointCorrupt
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(180)

LIMIT_SETTING = "token-capture.store.checkpoint-manifest-max-bytes"
ROOT = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 30.0  # only a guard: a regression that blocks fails the test instead of hanging the suite


def call_promptly(fn: Callable[[], Any], unblock: Callable[[], None] | None = None) -> Any:
    """``fn()`` run in a thread; its result, or the exception it raised. A call still
    running after the guard fails the test (``unblock`` then frees the thread)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        pytest.fail(f"{fn} was still blocked after {HANG_GUARD_S} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def open_writer_once(fifo: str) -> Callable[[], None]:
    """Frees a reader blocked opening ``fifo``: a writer opens it and closes it again."""

    def unblock() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    return unblock


def restore_refuses(store: Any, path: Path, words: str, unblock: Callable[[], None] | None = None) -> None:
    """Both ``read_manifest`` and ``restore`` raise CheckpointCorrupt naming ``words``."""
    for call in (lambda: ck.read_manifest(str(path)), lambda: store.restore(str(path))):
        with pytest.raises(CheckpointCorrupt, match=words):
            call_promptly(call, unblock)


@pytest.fixture
def store(store_factory):
    return store_factory(n_units=1)


def test_fifo_manifest_is_refused_without_blocking(store, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    os.mkfifo(path / ck.MANIFEST)
    restore_refuses(store, path, "a FIFO, not a regular file", open_writer_once(str(path / ck.MANIFEST)))


def test_symlink_to_a_fifo_is_refused_without_blocking(store, tmp_path):
    path = tmp_path / "ckpt"
    path.mkdir()
    fifo = tmp_path / "elsewhere.fifo"
    os.mkfifo(fifo)
    (path / ck.MANIFEST).symlink_to(fifo)
    restore_refuses(store, path, "a FIFO, not a regular file", open_writer_once(str(fifo)))


def test_directory_manifest_is_refused(store, tmp_path):
    path = tmp_path / "ckpt"
    (path / ck.MANIFEST).mkdir(parents=True)
    restore_refuses(store, path, "a directory, not a regular file")


_READ_DEV_ZERO = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))  # a regression dies here, not the host
from pipeline.store import checkpoint as ck
from tasks.errors import CheckpointCorrupt
try:
    ck.read_manifest(sys.argv[1])
except CheckpointCorrupt as e:
    print("REFUSED", e)
else:
    print("ACCEPTED")
"""


def test_symlink_to_dev_zero_is_refused_unread(tmp_path):
    # In a child process with an address-space limit and a time-out: a regression that
    # reads without end fails this test, it cannot exhaust the host's memory or hang.
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / ck.MANIFEST).symlink_to("/dev/zero")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _READ_DEV_ZERO, str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("REFUSED") and "a character device, not a regular file" in out.stdout, out.stdout


def saved(store: Any, tmp_path: Path) -> Path:
    assert not store.put_many(pack_rows(make_rows(3, calls=1, tokens=16))).failed
    path = tmp_path / "ckpt"
    store.checkpoint(str(path))
    return path


def test_oversized_manifest_is_refused_naming_the_limit_and_the_knob(store, tmp_path):
    path = saved(store, tmp_path)
    size = (path / ck.MANIFEST).stat().st_size
    with dask.config.set({LIMIT_SETTING: size - 1}):
        restore_refuses(store, path, f"{size} bytes, over the {size - 1}-byte limit of {LIMIT_SETTING}")
    with dask.config.set({LIMIT_SETTING: size}):  # exactly at the limit: accepted
        assert ck.read_manifest(str(path))["files"]


def test_manifest_that_grows_while_read_is_read_only_to_the_limit(tmp_path, monkeypatch):
    # The size checks passed while the file was small; it grew before the read: no more
    # than limit + 1 bytes are read, and it is refused.
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / ck.MANIFEST).write_bytes(b" " * (4 << 20))
    monkeypatch.setattr(regular_file, "_check", lambda *a, **k: None)
    asked: list[int] = []
    real = regular_file._read_at_most

    def counting(fd: int, n: int) -> bytes:
        data = real(fd, n)
        asked.append(len(data))
        return data

    monkeypatch.setattr(regular_file, "_read_at_most", counting)
    with dask.config.set({LIMIT_SETTING: "1KiB"}):
        with pytest.raises(CheckpointCorrupt, match=f"grew past the 1024-byte limit of {LIMIT_SETTING}"):
            call_promptly(lambda: ck.read_manifest(str(path)))
    assert asked == [1025]


def test_symlink_to_a_regular_manifest_is_followed(store, store_factory, tmp_path):
    path = saved(store, tmp_path)
    real = tmp_path / "kept-elsewhere.json"
    shutil.move(str(path / ck.MANIFEST), real)
    (path / ck.MANIFEST).symlink_to(real)
    out = call_promptly(lambda: store_factory(n_units=1).restore(str(path)))
    assert out["rows"] == 3 and not out["failed"]
