"""A checkpoint's data files. Saving: each unit writes its partitions as packed batch
files straight to the checkpoint's generation (a local directory or an fsspec URL,
:mod:`~pipeline.store.location`). Restoring, one Dask task per file: read (locally as a
regular file inside the directory, remotely bounded by the manifest's size), size and
digest recomputed on the bytes read (never trusted) with the algorithm the entry names
(``blake3`` or ``sha256``), decoded, rows/keys/fields checked; then put into the store
under the restore's claim. A save hashes with the algorithm it is given (the controller
reads ``capture.digest`` once per save)."""
from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence, TypeVar

from tasks.digests import DEFAULT_ALGORITHM, file_hash
from tasks.errors import CheckpointCorrupt
from tasks.keys import primary_units
from tasks.packed import PackedBatch

from . import batch_file
from .batch_file import decode_batch
from .checkpoint_losses import unit_lost_entries
from .location import Location, local
from .manifest import _entry_problem, entry_digest, resolve_entry
from .protocol import check_key, field_problem
from .registry import FieldRegistry
from .row_packing import pack_stored_rows

if TYPE_CHECKING:  # pragma: no cover
    from .held_rows import HeldRows
    from .losses import LossBook
    from .protocol import StoreLike

T = TypeVar("T")


def _read_regular(path: str) -> bytearray:
    """The bytes of the regular file at ``path`` (a symlink swapped in after resolution,
    a FIFO or a device is refused, not followed or read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointCorrupt(f"{path}: not a regular file")
        buf = bytearray(st.st_size)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            got = fh.readinto(buf)  # buffered: reads until full or end of file
        return buf if got == len(buf) else buf[:got]
    finally:
        os.close(fd)


# ---- per-file work (runs in Dask tasks on workers) ----------------------------------


def _batch_problem(entry: dict, batch: PackedBatch) -> str | None:
    """Why a decoded file cannot be loaded as is (rows, keys, field layout), or ``None``."""
    if len(batch) != entry["rows"]:
        return f"{len(batch)} rows, manifest says {entry['rows']}"
    seen: set = set()
    for key in batch.keys:
        why = check_key(key)
        if why is not None:
            return f"key {key!r}: {why}"
        if key in seen:
            return f"key {key!r} appears twice"
        seen.add(key)
    for name, f in batch.fields.items():
        why = field_problem(name, f, len(batch))
        if why is not None:
            return why
    return None


def _read_data(root: "str | Location", entry: dict, generation: str) -> bytes | bytearray:
    """The bytes of one data file: a local one as a regular file resolving inside the
    directory; a remote one at most the manifest's size (a larger object refused unread)."""
    loc = root if isinstance(root, Location) else local(root)
    if not loc.local:
        problem = _entry_problem(entry, generation)  # a plain name in the generation, as the manifest said
        if problem is not None:
            raise CheckpointCorrupt(f"{entry.get('file') if isinstance(entry, dict) else entry!r}: {problem}")
        return loc.read(entry["file"], entry["bytes"], None, CheckpointCorrupt)
    path = resolve_entry(loc.root, entry, generation)
    try:
        return _read_regular(path)
    except CheckpointCorrupt:
        raise
    except OSError as e:
        raise CheckpointCorrupt(f"{entry['file']}: unreadable: {e}") from None


def _read_checked(root: "str | Location", entry: dict, generation: str) -> PackedBatch:
    """Read one data file, check size and digest on the bytes read, decode, validate."""
    buf = _read_data(root, entry, generation)
    algorithm, want = entry_digest(entry)
    h = file_hash(algorithm)
    h.update(buf)
    got = h.hexdigest()
    if len(buf) != entry["bytes"] or got != want:
        raise CheckpointCorrupt(
            f"{entry['file']}: {algorithm} {got} / {len(buf)} bytes, manifest says {want} / {entry['bytes']} bytes"
        )
    try:
        batch = decode_batch(buf)
    except CheckpointCorrupt as e:
        raise CheckpointCorrupt(f"{entry['file']}: {e}") from None
    problem = _batch_problem(entry, batch)
    if problem is not None:
        raise CheckpointCorrupt(f"{entry['file']}: {problem}")
    return batch


def verify_file(root: "str | Location", entry: dict, generation: str) -> dict:
    """Validate-only pass over one file: ``{"problem": why or None, "keys": [...]}``.

    Size, digest, decode and row/key/field checks, exactly as :func:`load_file` does;
    only the keys travel back (the rows are dropped here)."""
    try:
        batch = _read_checked(root, entry, generation)
    except CheckpointCorrupt as e:
        return {"problem": str(e), "keys": []}
    return {"problem": None, "keys": list(batch.keys)}


def load_file(root: "str | Location", entry: dict, generation: str) -> PackedBatch:
    """Read one data file again and re-check it (digest on the bytes read, decode, rows)."""
    return _read_checked(root, entry, generation)


def restore_file(store: "StoreLike", root: "str | Location", entry: dict, generation: str, claim: str) -> dict:
    """Load one file into ``store`` (rows placed by the store's placement), its new rows
    provisional under ``claim``: ``{"ok": [keys], "failed": {key: (reason, detail)}}``."""
    result = store.put_claimed(load_file(root, entry, generation), claim, partition=entry["partition"])
    return {"ok": list(result.ok), "failed": dict(result.failed)}


def primary_items(items: list[tuple[str, T]], units: int | Sequence[str], unit_index: int) -> list[tuple[str, T]]:
    """Those ``(key, value)`` of ``items`` whose key's primary is unit ``unit_index`` of
    ``units`` (the placement's unit ids, or a count: the default ids), ranked as the
    placement ranks them (vectorised): what a replicated store's unit checkpoints."""
    if not items:
        return []
    mine = (primary_units([k for k, _ in items], units) == unit_index).tolist()
    return [item for item, keep in zip(items, mine) if keep]


def write_partition_files(
    target: "str | Location", stem: str, partition: str, rows: Iterable[tuple[str, dict, int]], reg: FieldRegistry | None,
    chunk_bytes: int, digest: str = DEFAULT_ALGORITHM,
) -> list[dict]:
    """One unit's partition as packed batch files ``<stem>-<n>.tcb`` of about
    ``chunk_bytes`` (row weights, bytes) each, written to ``target`` (a generation: a
    local directory, every file atomic by temp, fsync, rename; or a remote one, every file
    one whole-object put). ``rows`` yields ``(key, row, weight)``. Returns one manifest
    entry per file, its hex digest under ``digest`` (the algorithm, ``"blake3"`` or
    ``"sha256"``)."""
    loc = target if isinstance(target, Location) else local(target)
    names = list(reg.specs) if reg else []
    entries: list[dict] = []
    keys: list[str] = []
    chunk: list[dict] = []
    size = 0

    def flush() -> None:
        batch = pack_stored_rows(keys, chunk, names, reg)
        name = f"{stem}-{len(entries):05d}{batch_file.DATA_SUFFIX}"
        hexdigest, nbytes = loc.write(name, batch_file.encode_batch(batch), digest)
        entries.append({"file": name, "partition": partition, "rows": len(batch), "bytes": nbytes, digest: hexdigest})

    for key, row, weight in rows:
        keys.append(key)
        chunk.append(row)
        size += weight
        if size >= chunk_bytes:
            flush()
            keys, chunk, size = [], [], 0
    if keys:
        flush()
    return entries


def write_unit_files(
    target: "str | Location", me: int, held: "HeldRows", registry: Mapping[str, FieldRegistry], chunk_bytes: int,
    primary_of_units: int | Sequence[str] | None = None, digest: str = DEFAULT_ALGORITHM,
    skip: Mapping[str, set[str]] | None = None, losses: "LossBook | None" = None,
) -> list[dict]:
    """A unit's checkpoint_write: every partition of ``held`` as files ``u<me>-<partition>-<n>.tcb``
    in ``target`` (:func:`write_partition_files`); with ``primary_of_units`` only the keys
    unit ``me`` is the primary of, never the keys of ``skip[partition]``; files hashed with
    ``digest``. Runs on the unit's actor thread: a consistent snapshot. With ``losses``
    (the unit's lost-key records) one more entry carries them, every one of them (the
    controller keeps each key once: :mod:`.checkpoint_losses`)."""
    entries: list[dict] = []
    for partition, index in held.index.items():
        left_out = (skip or {}).get(partition)
        items = [(k, s) for k, s in index.items() if k not in left_out] if left_out else list(index.items())
        if primary_of_units is not None:
            items = primary_items(items, primary_of_units, me)
        rows = ((key, held.rows.peek(slot), held.weights[slot]) for key, slot in items)
        entries.extend(write_partition_files(
            target, f"u{me:03d}-{partition}", partition, rows, registry.get(partition), chunk_bytes, digest
        ))
    return entries if losses is None else entries + unit_lost_entries(losses)
