"""The packed batch file: one :class:`~tasks.packed.PackedBatch` as bytes on disk.

Format v1 (little-endian): ``b"TCPB"`` ``<H version>`` ``<I header_len>``, a msgpack
header ``{"keys": [...], "fields": [[name, dtype, trailing, n_values, has_present]]}``,
padding to 8 bytes, then per field: offsets (``<i8``), present (``bool``, if any),
values, each padded to 8 bytes. No pickle: a file is data, never code. Also atomic
writes (temp, fsync, rename) and SHA-256 of files; sizes are in bytes.
"""
from __future__ import annotations

from tasks.digests import SHA256, file_hash
import os
import struct

import msgpack
import numpy as np

from tasks.errors import CheckpointCorrupt
from tasks.packed import PackedBatch, PackedField

MAGIC = b"TCPB"
FORMAT_VERSION = 1
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
            if n_values < 0 or any(t < 0 for t in trailing):
                raise CheckpointCorrupt(f"field {name!r}: negative length {n_values} or trailing shape {trailing}")
            offsets = take(np.dtype("<i8"), n + 1, (n + 1,))
            present = take(np.dtype(bool), n, (n,)) if has_present else None
            dt = np.dtype(dtype)
            values = take(dt, n_values * int(np.prod(trailing, dtype=np.int64)), (n_values, *trailing))
            fields[name] = PackedField(values, offsets, present)
        if pos != len(buf):
            raise CheckpointCorrupt(f"packed batch file has {len(buf) - pos} bytes past its last field")
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


def write_atomic(path: str, buffers: list[bytes | memoryview], algorithm: str = SHA256) -> tuple[str, int]:
    """Write ``buffers`` to ``path`` via ``path.tmp`` + fsync + rename.

    Returns (hex digest of the bytes written under ``algorithm``, ``"sha256"`` or
    ``"blake3"``; size in bytes). The hash is computed over the very buffers written, in
    one pass (both release the GIL on large buffers).
    """
    tmp = f"{path}.tmp"
    h = file_hash(algorithm)
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
    return file_digest(path, SHA256)


def file_digest(path: str, algorithm: str) -> tuple[str, int]:
    """(hex digest under ``algorithm``, size in bytes) of a file, read in 8 MiB blocks."""
    h = file_hash(algorithm)
    size = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(8 << 20)
            if not block:
                break
            h.update(block)
            size += len(block)
    return h.hexdigest(), size
