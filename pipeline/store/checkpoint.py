"""Atomic checkpoints of a staging store (controller side): save, verify, restore.

A checkpoint directory holds ``MANIFEST.json`` (written last: temp, fsync, rename) and
one generation ``gen-<id>/`` of packed batch files (:mod:`~pipeline.store.batch_file`,
one per chunk of about ``chunk_bytes`` of a unit's partition). The manifest records each
file's SHA-256 and size in bytes; restore recomputes them all before loading anything,
then places rows by ``unit_for_key`` on the restoring store. While a save runs, it is
open on every unit (``begin_checkpoint`` before any write, ``end_checkpoint`` in
``finally``): concurrent deletes are deferred, so the checkpoint loses no row to them.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from typing import TYPE_CHECKING

from tasks.errors import CheckpointCorrupt, CheckpointError
from tasks.packed import PackedBatch

from . import batch_file
from .batch_file import FORMAT_VERSION, decode_batch, file_sha256, fsync_dir

if TYPE_CHECKING:  # pragma: no cover
    from .client import StagingStore

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "dask-token-capture/store-checkpoint"


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``path/MANIFEST.json`` atomically (temp, fsync, rename, fsync dir)."""
    manifest = dict(manifest, manifest_sha256=_manifest_digest(manifest))
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    # Through the module (not an imported name): one patch point for every atomic write.
    batch_file.write_atomic(os.path.join(path, MANIFEST), [data])
    fsync_dir(path)


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path``, self-digest checked."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"no checkpoint at {path!r}: {MANIFEST} is missing")
    try:
        with open(mpath, "rb") as fh:
            manifest = json.loads(fh.read())
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{mpath}: unreadable manifest: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorrupt(f"{mpath}: not a store checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: checkpoint version {manifest.get('version')}, expected {FORMAT_VERSION}")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointCorrupt(f"{mpath}: manifest digest mismatch (edited or damaged)")
    return manifest


# ---- per-file work (runs in Dask tasks on workers) ----------------------------------


def verify_file(root: str, entry: dict) -> str | None:
    """``None`` if the file of ``entry`` has its recorded SHA-256 and size, else why not."""
    path = os.path.join(root, entry["file"])
    try:
        sha, size = file_sha256(path)
    except OSError as e:
        return f"{entry['file']}: unreadable: {e}"
    if size != entry["bytes"] or sha != entry["sha256"]:
        return f"{entry['file']}: sha256 {sha} / {size} bytes, manifest says {entry['sha256']} / {entry['bytes']} bytes"
    return None


def load_file(root: str, entry: dict) -> PackedBatch:
    """Read one data file, check its SHA-256 on the bytes read, decode it."""
    path = os.path.join(root, entry["file"])
    with open(path, "rb") as fh:
        buf = bytearray(os.fstat(fh.fileno()).st_size)
        fh.readinto(buf)
    if hashlib.sha256(buf).hexdigest() != entry["sha256"]:
        raise CheckpointCorrupt(f"{entry['file']}: sha256 changed since verification")
    batch = decode_batch(buf)
    if len(batch) != entry["rows"]:
        raise CheckpointCorrupt(f"{entry['file']}: {len(batch)} rows, manifest says {entry['rows']}")
    return batch


def restore_file(store: "StagingStore", root: str, entry: dict) -> dict:
    """Load one file into ``store`` (rows placed by ``unit_for_key``); a StoreResult as dict."""
    result = store.put_many(load_file(root, entry), partition=entry["partition"])
    return {"ok": len(result.ok), "failed": result.failed}


# ---- orchestration (controller side) ------------------------------------------------


def _settle_all(futures: list) -> list:
    """Every actor future's result, or its exception (all awaited, none raised)."""
    out = []
    for fut in futures:
        try:
            out.append(fut.result())
        except Exception as e:  # noqa: BLE001 - the caller decides what a failure means
            out.append(e)
    return out


def save(store: "StagingStore", path: str, chunk_bytes: int) -> dict:
    """Checkpoint every unit of ``store`` into ``path``; returns the manifest."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    generation = f"gen-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    gen_dir = os.path.join(path, generation)
    os.makedirs(gen_dir)
    token = f"{generation}@{path}"
    try:
        # Open on EVERY unit before any unit writes: from here on no delete removes a row
        # this checkpoint may still write, whichever process issues it.
        opened = _settle_all([unit.begin_checkpoint(token) for unit in store.units])
        errors = [o for o in opened if isinstance(o, Exception)]
        if not errors:
            # Wait for every unit before deciding: a failed unit must not leave others writing.
            outcomes = _settle_all([unit.checkpoint_write(gen_dir, int(chunk_bytes)) for unit in store.units])
            errors = [o for o in outcomes if isinstance(o, Exception)]
    finally:
        # Closing applies the deletes deferred meanwhile (a lost unit has nothing to close).
        _settle_all([unit.end_checkpoint(token) for unit in store.units])
    if errors:
        shutil.rmtree(gen_dir, ignore_errors=True)  # best effort; a crash leaves it for the next save
        raise CheckpointError(f"checkpoint to {path!r} failed; previous checkpoint kept: {errors[0]!r}") from errors[0]
    files = [dict(e, file=f"{generation}/{e['file']}") for entries in outcomes for e in entries]
    fsync_dir(gen_dir)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": FORMAT_VERSION,
        "generation": generation,
        "created_unix_s": time.time(),
        "n_units": len(store.units),
        "rows": sum(f["rows"] for f in files),
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
    }
    write_manifest(path, manifest)
    # Only now is the new checkpoint current: drop older and half-written generations.
    for name in os.listdir(path):
        if name.startswith("gen-") and name != generation:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    return manifest


def restore(store: "StagingStore", path: str, client=None) -> dict:
    """Verify the checkpoint at ``path`` and load it into ``store``.

    Raises :class:`CheckpointCorrupt` (naming every bad file) before loading anything if a
    digest fails. Returns ``{"rows": restored, "failed": {key: (reason, detail)}, "files": n}``.
    """
    from distributed import get_client

    path = os.path.abspath(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    client = client or get_client()
    problems = [p for p in client.gather(client.map(verify_file, [path] * len(files), files, pure=False)) if p]
    if problems:
        raise CheckpointCorrupt(f"checkpoint {path!r} refused: " + "; ".join(problems))
    results = client.gather(client.map(restore_file, [store] * len(files), [path] * len(files), files, pure=False))
    failed: dict = {}
    for r in results:
        failed.update(r["failed"])
    return {"rows": sum(r["ok"] for r in results), "failed": failed, "files": len(files), "generation": manifest["generation"]}
