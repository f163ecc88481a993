"""Atomic checkpoints of a staging store: packed batch files plus a digest manifest.

Layout of a checkpoint directory ``path``::

    path/MANIFEST.json          the current checkpoint (written last, temp + fsync + rename)
    path/gen-<id>/u000-staging-00000.tcb   packed rows of one unit's partition (a chunk)

Saving writes a fresh ``gen-<id>/`` (every file: temp, fsync, rename), then the
manifest naming that generation and the SHA-256 and size of every file. Until the
manifest's rename, ``MANIFEST.json`` still names the previous generation, which is never
touched: a crash mid-save leaves the previous checkpoint intact and restorable. Older
generations are removed only after the new manifest is durable.

Restoring reads the manifest, recomputes every file's SHA-256 (digests are recomputed,
never trusted) and refuses the whole checkpoint with :class:`CheckpointCorrupt` naming
the bad file(s) before anything is loaded; each file is then hashed again as it is
decoded. Rows are placed by ``unit_for_key`` on the restoring store, so its unit count
may differ. Chunk size is a runtime knob and recorded nowhere that restore checks.

Data file format v1 (little-endian): ``b"TCPB"`` ``<H version>`` ``<I header_len>``
msgpack header ``{"keys": [...], "fields": [[name, dtype, trailing, n_values, has_present]]}``,
padding to 8 bytes, then per field: offsets (``<i8``), present (``bool``, if any),
values, each padded to 8 bytes. No pickle: a checkpoint is data, never code.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from typing import TYPE_CHECKING, Optional

import msgpack
import numpy as np

from tasks.errors import CheckpointCorrupt, CheckpointError
from tasks.packed import PackedBatch, PackedField

if TYPE_CHECKING:  # pragma: no cover
    from .client import StagingStore

MAGIC = b"TCPB"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "dask-token-capture/store-checkpoint"
DATA_SUFFIX = ".tcb"
_PRELUDE = struct.Struct("<4sHI")
_ALIGN = 8


# ---- packed batch <-> bytes ---------------------------------------------------------


def _pad(n: int) -> bytes:
    return b"\x00" * ((-n) % _ALIGN)


def encode_batch(batch: PackedBatch) -> list[bytes | memoryview]:
    """A packed batch as a list of buffers (format v1 above); no copy of the values."""
    meta = []
    body: list[bytes | memoryview] = []
    for name, f in batch.fields.items():
        values = np.ascontiguousarray(f.values)
        meta.append([name, values.dtype.str, list(values.shape[1:]), int(values.shape[0]), f.present is not None])
        parts = [np.ascontiguousarray(f.offsets, dtype="<i8")]
        if f.present is not None:
            parts.append(np.ascontiguousarray(f.present, dtype=bool))
        parts.append(values)
        for a in parts:
            if a.nbytes:
                body.append(memoryview(a).cast("B"))
            pad = _pad(a.nbytes)
            if pad:
                body.append(pad)
    header = msgpack.packb({"keys": list(batch.keys), "fields": meta})
    head = _PRELUDE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    return [head + _pad(len(head)), *body]


def decode_batch(buf: bytes | bytearray | memoryview) -> PackedBatch:
    """Inverse of :func:`encode_batch`; arrays view ``buf``. Raises :class:`CheckpointCorrupt`."""
    try:
        magic, version, hlen = _PRELUDE.unpack_from(buf, 0)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CheckpointCorrupt(f"not a v{FORMAT_VERSION} packed batch file (magic {magic!r}, version {version})")
        pos = _PRELUDE.size
        header = msgpack.unpackb(bytes(memoryview(buf)[pos : pos + hlen]))
        pos += hlen
        pos += (-pos) % _ALIGN
        keys = header["keys"]
        n = len(keys)
        fields = {}

        def take(dtype: np.dtype, count: int, shape: tuple) -> np.ndarray:
            nonlocal pos
            nbytes = dtype.itemsize * count
            if pos + nbytes > len(buf):
                raise CheckpointCorrupt("packed batch file is truncated")
            a = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).reshape(shape)
            pos += nbytes + (-nbytes) % _ALIGN
            return a

        for name, dtype, trailing, n_values, has_present in header["fields"]:
            offsets = take(np.dtype("<i8"), n + 1, (n + 1,))
            present = take(np.dtype(bool), n, (n,)) if has_present else None
            dt = np.dtype(dtype)
            values = take(dt, n_values * int(np.prod(trailing, dtype=np.int64)), (n_values, *trailing))
            fields[name] = PackedField(values, offsets, present)
        return PackedBatch(list(keys), fields)
    except CheckpointCorrupt:
        raise
    except Exception as e:
        raise CheckpointCorrupt(f"packed batch file does not parse: {e!r}") from None


# ---- atomic files -------------------------------------------------------------------


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, buffers: list[bytes | memoryview]) -> tuple[str, int]:
    """Write ``buffers`` to ``path`` via ``path.tmp`` + fsync + rename.

    Returns (sha256 hex of the bytes written, size in bytes). The hash is computed over
    the very buffers written, in one pass (hashlib releases the GIL on large buffers).
    """
    tmp = f"{path}.tmp"
    h = hashlib.sha256()
    size = 0
    with open(tmp, "wb") as fh:
        for b in buffers:
            h.update(b)
            fh.write(b)
            size += len(b) if isinstance(b, bytes) else b.nbytes
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return h.hexdigest(), size


def file_sha256(path: str) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(8 << 20)
            if not block:
                break
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``path/MANIFEST.json`` atomically (temp, fsync, rename, fsync dir)."""
    manifest = dict(manifest, manifest_sha256=_manifest_digest(manifest))
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    write_atomic(os.path.join(path, MANIFEST), [data])
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


def verify_file(root: str, entry: dict) -> Optional[str]:
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


def save(store: "StagingStore", path: str, chunk_bytes: int) -> dict:
    """Checkpoint every unit of ``store`` into ``path``; returns the manifest."""
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    generation = f"gen-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    gen_dir = os.path.join(path, generation)
    os.makedirs(gen_dir)
    futures = [unit.checkpoint_write(gen_dir, int(chunk_bytes)) for unit in store.units]
    # Wait for every unit before deciding: a failed unit must not leave others writing.
    outcomes = []
    for fut in futures:
        try:
            outcomes.append(fut.result())
        except Exception as e:  # noqa: BLE001 - re-raised below, after all units finished
            outcomes.append(e)
    errors = [o for o in outcomes if isinstance(o, Exception)]
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
