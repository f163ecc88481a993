"""One error hierarchy: bad input is a ``ValueError``, a closed or lost store is not, and
checkpoint failures are ``OSError``s; every public error class is defined once, in
``tasks/errors.py``."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.store import StagingStore
from tasks import errors
from tasks.errors import (
    CheckpointCorrupt,
    CheckpointError,
    InvalidInput,
    InvalidStoreRequest,
    StoreUnavailable,
    TokenCaptureError,
)
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

ROOT = Path(__file__).resolve().parents[1]


def test_bases_say_what_went_wrong():
    assert issubclass(InvalidInput, ValueError)
    assert issubclass(InvalidStoreRequest, ValueError)
    assert not issubclass(StoreUnavailable, ValueError)
    assert issubclass(CheckpointError, OSError) and issubclass(CheckpointCorrupt, CheckpointError)
    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert issubclass(obj, TokenCaptureError), name


def test_error_classes_are_defined_only_in_tasks_errors():
    # Private exceptions used as control flow inside one module (a leading underscore) and
    # the fault-injection double are the only other exception classes.
    defined = {}
    for path in sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]):
        if path == ROOT / "tasks" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if any(b.endswith(("Error", "Exception", "Corrupt")) for b in bases):
                defined[node.name] = str(path.relative_to(ROOT))
    defined.pop("InjectedStoreError", None)
    assert not defined, f"error classes outside tasks/errors.py: {defined}"



@pytest.fixture
def client(inprocess_client):
    return inprocess_client


def test_closed_store_is_not_swallowed_by_except_valueerror(client, tmp_path):
    store = StagingStore.start(client, n_units=1, spill_directory=str(tmp_path / "spill"))
    store.close()
    with pytest.raises(StoreUnavailable):
        try:
            store.get_many(["r/c"])
        except ValueError:  # a caller's bad-input handler must not catch a closed store
            pytest.fail("a closed store was reported as bad input")


def test_bad_store_request_is_a_valueerror(client, tmp_path):
    store = StagingStore.start(client, n_units=1, spill_directory=str(tmp_path / "spill"))
    try:
        with pytest.raises(ValueError, match="partition"):
            store.get_many(["r/c"], partition="no-such-partition")
        with pytest.raises(InvalidStoreRequest, match="PackedBatch"):
            store.put_many({"not": "a batch"})
    finally:
        store.close()


def test_corrupt_checkpoint_is_an_oserror(client, tmp_path):
    store = StagingStore.start(client, n_units=1, spill_directory=str(tmp_path / "spill"))
    try:
        assert not store.put_many(pack_rows(make_rows(2))).failed
        store.checkpoint(str(tmp_path / "ckpt"))
    finally:
        store.close()
    manifest = tmp_path / "ckpt" / "MANIFEST.json"
    manifest.write_text(manifest.read_text().replace('"', "'", 1))
    with pytest.raises(OSError):
        StagingStore.from_checkpoint(client, str(tmp_path / "ckpt"), n_units=1, spill_directory=str(tmp_path / "s2"))
