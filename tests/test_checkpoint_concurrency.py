"""Saves to one checkpoint location run one at a time (``<path>/.lock``), waiting for the
lock at most ``store.checkpoint-lock-timeout-s``: concurrent saves never delete each
other's generation nor cross their manifests."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import dask
import pytest

from pipeline.store import checkpoint as ck
from pipeline.store.location_lock import LOCK_NAME, location_lock
from tasks.errors import CheckpointError
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(300)

TIMEOUT_SETTING = "token-capture.store.checkpoint-lock-timeout-s"
SAVES_PER_THREAD = 6
MEET_WINDOW_S = 0.3  # how long a manifest write waits for the other save to arrive (not asserted on)


class OverlapProbe:
    """Wraps ``write_manifest``: counts calls that begin while another is still running.

    Each call waits (up to ``window_s`` seconds) for another call to begin, so two saves
    that are NOT kept apart meet there every time; saves kept apart never do."""

    def __init__(self, real: Callable[..., Any], window_s: float):
        self.real, self.window_s = real, window_s
        self.cond = threading.Condition()
        self.active = self.entries = self.overlaps = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.cond:
            self.active += 1
            self.entries += 1
            if self.active > 1:
                self.overlaps += 1
            self.cond.notify_all()
            mine = self.entries
            self.cond.wait_for(lambda: self.entries > mine, timeout=self.window_s)
        try:
            return self.real(*args, **kwargs)
        finally:
            with self.cond:
                self.active -= 1


def save_repeatedly(store: Any, path: str, n: int, errors: list) -> threading.Thread:
    def run() -> None:
        for _ in range(n):
            try:
                store.checkpoint(path, chunk_bytes=4096)
            except Exception as e:  # noqa: BLE001 - the test asserts there are none
                errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def assert_consistent(path: Path) -> dict:
    """The manifest's generation is the only one, and every file it names exists."""
    manifest = ck.read_manifest(str(path))
    generations = sorted(p.name for p in path.iterdir() if p.name.startswith("gen-"))
    assert generations == [manifest["generation"]]
    missing = [e["file"] for e in manifest["files"] if not (path / e["file"]).is_file()]
    assert not missing, missing
    return manifest


def test_concurrent_saves_to_one_location_never_overlap(store_factory, tmp_path, monkeypatch):
    store = store_factory(n_units=2)
    rows = make_rows(6, calls=2, tokens=64)
    assert not store.put_many(pack_rows(rows)).failed
    path = tmp_path / "ckpt"
    probe = OverlapProbe(ck.write_manifest, MEET_WINDOW_S)
    monkeypatch.setattr(ck, "write_manifest", probe)

    errors: list = []
    threads = [save_repeatedly(store, str(path), SAVES_PER_THREAD, errors) for _ in range(2)]
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a save never finished"

    assert not errors, errors[:2]
    assert probe.entries == 2 * SAVES_PER_THREAD
    assert probe.overlaps == 0, f"{probe.overlaps} manifest write(s) ran while another save's did"
    manifest = assert_consistent(path)
    assert manifest["rows"] == len(rows)
    out = store_factory(n_units=1).restore(str(path))
    assert out["rows"] == len(rows) and not out["failed"]


def test_save_waits_for_the_lock_at_most_the_timeout(store_factory, tmp_path):
    store = store_factory(n_units=1)
    assert not store.put_many(pack_rows(make_rows(2, calls=1, tokens=16))).failed
    path = tmp_path / "ckpt"
    path.mkdir()
    with dask.config.set({TIMEOUT_SETTING: 0.2}), location_lock(str(path)):  # another save holds it
        with pytest.raises(CheckpointError, match=f"checkpoint location '{path}'.*{TIMEOUT_SETTING}"):
            store.checkpoint(str(path))
        assert not [p for p in os.listdir(path) if p.startswith("gen-")], "nothing is written without the lock"
    manifest = store.checkpoint(str(path))  # released: the next save goes ahead
    assert manifest["rows"] == 2
    assert (path / LOCK_NAME).is_file()
    assert_consistent(path)


def test_lock_is_exclusive_across_file_descriptions(tmp_path):
    # Two holders in one process (two threads' opens) exclude each other, as two processes do.
    with location_lock(str(tmp_path), timeout_s=0):
        with pytest.raises(CheckpointError, match="still held by another save"):
            with location_lock(str(tmp_path), timeout_s=0):
                pass
    with location_lock(str(tmp_path), timeout_s=0):  # released on exit
        pass
