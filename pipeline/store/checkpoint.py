"""Atomic checkpoints of a staging store (controller side): save, verify, restore.

A checkpoint directory holds ``MANIFEST.json`` (written last: temp, fsync, rename) and
one generation ``gen-<id>/`` of packed batch files (:mod:`~pipeline.store.batch_file`,
one per chunk of about ``chunk_bytes`` of a unit's partition). The manifest records each
file's SHA-256 and size in bytes, and, when ``store.checkpoint-key`` names a key file,
an HMAC-SHA256 of its whole body. Its file names must be ``<generation>/<plain name>``
resolving inside the directory. Restore is all-or-nothing: every file is hashed, decoded
and validated before the first row is loaded, and a restore that fails while loading
removes the rows it added. While a save runs, it is open on every unit
(``begin_checkpoint`` before any write, ``end_checkpoint`` in ``finally``): concurrent
deletes are deferred, so the checkpoint loses no row to them.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import shutil
import stat
import time
import uuid
from typing import TYPE_CHECKING, Any

from tasks.errors import CheckpointCorrupt, CheckpointError, CheckpointReplayed, RestoreIncomplete
from tasks.packed import PackedBatch

from .. import config
from . import batch_file, sequence
from .batch_file import DATA_SUFFIX, FORMAT_VERSION, decode_batch, fsync_dir
from .deadline import settle_all
from .location_lock import location_lock
from .protocol import PARTITION_RE, check_key, field_problem
from .regular_file import read_regular_bounded

if TYPE_CHECKING:  # pragma: no cover
    from .client import StagingStore

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "dask-token-capture/store-checkpoint"
KEY_CONFIG = "store.checkpoint-key"
MANIFEST_MAX_CONFIG = "store.checkpoint-manifest-max-bytes"
STORE_NAME_CONFIG = "capture-client.store-name"
HMAC_FIELD = "manifest_hmac_sha256"
_DIGEST_FIELDS = ("manifest_sha256", HMAC_FIELD)
_HMAC_TAG = b"dask-token-capture/store-checkpoint-manifest/v1\n"
_MIN_KEY_BYTES = 32
_GENERATION_RE = re.compile(r"^gen-[A-Za-z0-9_-]{1,200}$")
_DATA_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,250}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_FROM_CONFIG: Any = object()


# ---- manifest: digest, optional HMAC, entry checks ------------------------------------


def _canonical(manifest: dict, drop: tuple[str, ...]) -> bytes:
    body = {k: v for k, v in manifest.items() if k not in drop}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _manifest_digest(manifest: dict) -> str:
    """Unkeyed SHA-256 of everything but itself (the HMAC included): catches accidents."""
    return hashlib.sha256(_canonical(manifest, ("manifest_sha256",))).hexdigest()


def _manifest_hmac(manifest: dict, key: bytes) -> str:
    """HMAC-SHA256 under ``key`` of everything but the two digests."""
    return hmac.new(key, _HMAC_TAG + _canonical(manifest, _DIGEST_FIELDS), hashlib.sha256).hexdigest()


def manifest_key() -> bytes | None:
    """The manifest HMAC key of ``token-capture.store.checkpoint-key``, or ``None``.

    The setting is the PATH of a key file (never the key itself, so the secret stays out
    of dask config, environment variables and logs); the file holds the key as hex
    digits, at least 64 (32 bytes), surrounding whitespace ignored. Only the process that
    saves or restores (the controller) reads it. A setting that cannot be used raises
    :class:`CheckpointError` naming it.
    """
    value = config.get(KEY_CONFIG)
    if value is None:
        return None
    where = f"token-capture.{KEY_CONFIG}"
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise CheckpointError(f"{where} must be null or the path of a key file, got {value!r}")
    path = os.path.expanduser(str(value))
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: cannot read key file {path!r}: {e}") from None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise CheckpointError(f"{where}: key file {path!r} must hold the key as hex digits") from None
    if len(key) < _MIN_KEY_BYTES:
        raise CheckpointError(
            f"{where}: key file {path!r} holds a {len(key)}-byte key; at least {_MIN_KEY_BYTES} bytes "
            f"({2 * _MIN_KEY_BYTES} hex digits) are required"
        )
    return key


def write_manifest(path: str, manifest: dict, key: bytes | None = _FROM_CONFIG) -> None:
    """Write ``path/MANIFEST.json`` atomically (temp, fsync, rename, fsync dir), signed
    with ``key`` (default: :func:`manifest_key`) when there is one."""
    if key is _FROM_CONFIG:
        key = manifest_key()
    manifest = {k: v for k, v in manifest.items() if k not in _DIGEST_FIELDS}
    if key is not None:
        manifest[HMAC_FIELD] = _manifest_hmac(manifest, key)
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    # Through the module (not an imported name): one patch point for every atomic write.
    batch_file.write_atomic(os.path.join(path, MANIFEST), [data])
    fsync_dir(path)


def read_manifest(path: str, key: bytes | None = _FROM_CONFIG, allow_older: bool = False) -> dict:
    """The manifest of the checkpoint at ``path``: self-digest checked; with a ``key``
    (default: :func:`manifest_key`) its signature is required and checked, and so is its
    sequence (:func:`check_sequence`: an older signed checkpoint than one already saved or
    restored for its store name raises :class:`CheckpointReplayed`, unless
    ``allow_older``); every file entry checked (names resolve inside ``path``).

    ``MANIFEST.json`` must be a regular file (a symlink to one is followed; a FIFO,
    device or directory is refused unopened) of at most
    ``token-capture.store.checkpoint-manifest-max-bytes`` bytes, read without blocking
    and never past that bound. Raises :class:`CheckpointCorrupt`."""
    if key is _FROM_CONFIG:
        key = manifest_key()
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"no checkpoint at {path!r}: {MANIFEST} is missing")
    manifest = _load_manifest_json(mpath)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointCorrupt(f"{mpath}: not a store checkpoint manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: checkpoint version {manifest.get('version')}, expected {FORMAT_VERSION}")
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise CheckpointCorrupt(f"{mpath}: manifest digest mismatch (edited or damaged)")
    if key is not None:
        given = manifest.get(HMAC_FIELD)
        if given is None:
            raise CheckpointCorrupt(
                f"{mpath}: manifest is unsigned, but token-capture.{KEY_CONFIG} is set: only a manifest "
                f"signed with that key is restored"
            )
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), _manifest_hmac(manifest, key).encode()):
            raise CheckpointCorrupt(
                f"{mpath}: manifest is signed, but its signature does not match the key of "
                f"token-capture.{KEY_CONFIG} (signed with another key, or edited)"
            )
    _check_sequence_fields(mpath, manifest)
    if key is not None and not allow_older:
        check_sequence(manifest, where=mpath)
    _check_entries(path, mpath, manifest)
    return manifest


def _load_manifest_json(mpath: str) -> Any:
    """The parsed JSON of the manifest file ``mpath``, read safely (see :func:`read_manifest`)."""
    knob = f"token-capture.{MANIFEST_MAX_CONFIG}"
    data = read_regular_bounded(mpath, config.get_bytes(MANIFEST_MAX_CONFIG), knob, CheckpointCorrupt)
    try:
        return json.loads(data)
    except ValueError as e:
        raise CheckpointCorrupt(f"{mpath}: unreadable manifest: {e}") from None


# ---- manifest: checkpoint sequence (replay of an older signed save) ------------------


def _check_sequence_fields(mpath: str, manifest: dict) -> None:
    """``store`` and ``sequence``, when present, must be a name and an int >= 0."""
    store = manifest.get("store", "")
    if not isinstance(store, str):
        raise CheckpointCorrupt(f"{mpath}: store {store!r} is not a store name")
    if not sequence.is_sequence(manifest.get("sequence", 0)):
        raise CheckpointCorrupt(f"{mpath}: sequence {manifest.get('sequence')!r} is not an integer >= 0")


def _store_name(store: Any = None) -> str:
    """The name a store's checkpoints are sequenced under: its ``name`` attribute if it
    has one, else the name it is published as (``capture-client.store-name``)."""
    name = getattr(store, "name", None)
    return str(name) if isinstance(name, str) and name else str(config.get(STORE_NAME_CONFIG))


def _manifest_sequence(manifest: dict) -> tuple[str, int]:
    """(store name, sequence) of a manifest; one from before sequences counts as 0 of
    the configured store name."""
    return manifest.get("store") or _store_name(), int(manifest.get("sequence", 0))


def _record_file() -> str | None:
    """The sequence record next to the key file of ``store.checkpoint-key``, or ``None``."""
    value = config.get(KEY_CONFIG)
    return None if value is None else sequence.record_path(str(value))


def check_sequence(manifest: dict, *, where: str = "checkpoint") -> None:
    """Refuse a replayed signed checkpoint: raise :class:`CheckpointReplayed` if
    ``manifest``'s sequence is below the highest recorded for its store name (saved or
    restored by this controller, see :mod:`~pipeline.store.sequence`).

    Only with ``store.checkpoint-key`` set (no key, no record, nothing to check):
    unsigned checkpoints cannot be defended against replay, since anyone can rewrite one."""
    record = _record_file()
    if record is None:
        return
    name, seq = _manifest_sequence(manifest)
    highest = sequence.recorded(record, name)
    if seq < highest:
        raise CheckpointReplayed(
            f"{where}: checkpoint sequence {seq} of store {name!r} is older than sequence {highest}, "
            f"already saved or restored (recorded in {record!r}): an older signed checkpoint was put back. "
            "Restore the newest checkpoint, or pass allow_older=True to restore this older one on purpose",
            checkpoint=seq, recorded=highest,
        )


def note_restored(manifest: dict) -> None:
    """Record that ``manifest``'s checkpoint was restored: its store name's recorded
    sequence is raised to the manifest's (never lowered), so older signed checkpoints are
    refused from now on. Nothing to do without ``store.checkpoint-key``."""
    record = _record_file()
    if record is not None:
        name, seq = _manifest_sequence(manifest)
        sequence.raise_to(record, name, seq)


def _check_entries(root: str, mpath: str, manifest: dict) -> None:
    generation = manifest.get("generation")
    if not isinstance(generation, str) or not _GENERATION_RE.match(generation):
        raise CheckpointCorrupt(f"{mpath}: generation {generation!r} is not a plain gen-<id> name")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise CheckpointCorrupt(f"{mpath}: files must be a list")
    seen: set[str] = set()
    for i, entry in enumerate(files):
        what = f"{mpath}: files[{i}] {entry.get('file') if isinstance(entry, dict) else entry!r}"
        problem = _entry_problem(entry, generation)
        if problem is None:
            if entry["file"] in seen:
                problem = "named twice"
            seen.add(entry["file"])
        if problem is None:
            try:
                resolve_entry(root, entry, generation)
            except CheckpointCorrupt as e:
                problem = str(e)
        if problem is not None:
            raise CheckpointCorrupt(f"{what}: {problem}")


def _int_field(entry: dict, name: str) -> bool:
    v = entry.get(name)
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry_problem(entry: Any, generation: str) -> str | None:
    """Why a manifest file entry is unusable (its shape and its name), or ``None``."""
    if not isinstance(entry, dict):
        return f"entry must be an object, got {type(entry).__name__}"
    name = entry.get("file")
    if not isinstance(name, str):
        return f"file name must be a str, got {type(name).__name__}"
    if os.path.isabs(name) or name.startswith(("/", "\\")) or "\\" in name or "\x00" in name:
        return "file name must be relative to the checkpoint directory (absolute paths are refused)"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "file name must not contain '..', '.' or empty path components"
    if len(parts) != 2 or parts[0] != generation:
        return f"file name must be {generation}/<name> (a plain name in the manifest's generation)"
    if not _DATA_NAME_RE.match(parts[1]) or not parts[1].endswith(DATA_SUFFIX):
        return f"file name {parts[1]!r} is not a plain *{DATA_SUFFIX} name"
    partition = entry.get("partition")
    if not isinstance(partition, str) or not PARTITION_RE.match(partition):
        return f"partition {partition!r} is not a partition name"
    if not (_int_field(entry, "rows") and _int_field(entry, "bytes")):
        return f"rows and bytes must be non-negative integers, got {entry.get('rows')!r} / {entry.get('bytes')!r}"
    if not isinstance(entry.get("sha256"), str) or not _SHA_RE.match(entry["sha256"]):
        return f"sha256 {entry.get('sha256')!r} is not 64 lowercase hex digits"
    return None


def resolve_entry(root: str, entry: dict, generation: str) -> str:
    """The real path of ``entry``'s file, which must lie inside the checkpoint directory
    ``root`` once every symlink is resolved; else :class:`CheckpointCorrupt`."""
    problem = _entry_problem(entry, generation)
    if problem is not None:
        raise CheckpointCorrupt(f"{entry.get('file') if isinstance(entry, dict) else entry!r}: {problem}")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, entry["file"]))
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointCorrupt(f"{entry['file']}: resolves to {real!r}, outside the checkpoint directory {real_root!r}")
    return real


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


def _read_checked(root: str, entry: dict, generation: str) -> PackedBatch:
    """Read one data file, check size and SHA-256 on the bytes read, decode, validate."""
    path = resolve_entry(root, entry, generation)
    try:
        buf = _read_regular(path)
    except CheckpointCorrupt:
        raise
    except OSError as e:
        raise CheckpointCorrupt(f"{entry['file']}: unreadable: {e}") from None
    sha = hashlib.sha256(buf).hexdigest()
    if len(buf) != entry["bytes"] or sha != entry["sha256"]:
        raise CheckpointCorrupt(
            f"{entry['file']}: sha256 {sha} / {len(buf)} bytes, manifest says {entry['sha256']} / {entry['bytes']} bytes"
        )
    try:
        batch = decode_batch(buf)
    except CheckpointCorrupt as e:
        raise CheckpointCorrupt(f"{entry['file']}: {e}") from None
    problem = _batch_problem(entry, batch)
    if problem is not None:
        raise CheckpointCorrupt(f"{entry['file']}: {problem}")
    return batch


def verify_file(root: str, entry: dict, generation: str) -> dict:
    """Validate-only pass over one file: ``{"problem": why or None, "keys": [...]}``.

    Size, SHA-256, decode and row/key/field checks, exactly as :func:`load_file` does;
    only the keys travel back (the rows are dropped here)."""
    try:
        batch = _read_checked(root, entry, generation)
    except CheckpointCorrupt as e:
        return {"problem": str(e), "keys": []}
    return {"problem": None, "keys": list(batch.keys)}


def load_file(root: str, entry: dict, generation: str) -> PackedBatch:
    """Read one data file again and re-check it (SHA-256 on the bytes read, decode, rows)."""
    return _read_checked(root, entry, generation)


def restore_file(store: "StagingStore", root: str, entry: dict, generation: str, claim: str) -> dict:
    """Load one file into ``store`` (rows placed by ``unit_for_key``), its new rows
    provisional under ``claim``: ``{"ok": [keys], "failed": {key: (reason, detail)}}``."""
    result = store.put_claimed(load_file(root, entry, generation), claim, partition=entry["partition"])
    return {"ok": list(result.ok), "failed": dict(result.failed)}


# ---- orchestration (controller side) ------------------------------------------------


def save(store: "StagingStore", path: str, chunk_bytes: int) -> dict:
    """Checkpoint every unit of ``store`` into ``path``; returns the manifest (signed when
    ``store.checkpoint-key`` is set).

    Saves to one ``path`` run one at a time: each holds ``<path>/.lock``
    (:func:`~pipeline.store.location_lock.location_lock`) from before it creates its
    generation until it has removed the others, waiting for it at most
    ``store.checkpoint-lock-timeout-s`` seconds (then :class:`CheckpointError`). The
    manifest names the store (``store``) and its ``sequence`` (:func:`_write_sequenced`).
    """
    path = os.path.abspath(path)
    key = manifest_key()  # a bad key setting fails before anything is written
    os.makedirs(path, exist_ok=True)
    with location_lock(path):
        return _save_locked(store, path, chunk_bytes, key)


def _save_locked(store: "StagingStore", path: str, chunk_bytes: int, key: bytes | None) -> dict:
    """:func:`save` with the location's lock held: write a generation, then the manifest."""
    generation = f"gen-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    gen_dir = os.path.join(path, generation)
    os.makedirs(gen_dir)
    token = f"{generation}@{path}"
    try:
        # Open on EVERY unit before any unit writes: from here on no delete removes a row
        # this checkpoint may still write, whichever process issues it.
        opened = settle_all([unit.begin_checkpoint(token) for unit in store.units])
        errors = [o for o in opened if isinstance(o, Exception)]
        if not errors:
            # Wait for every unit before deciding: a failed unit must not leave others writing.
            # A replicated store holds every key twice: each unit writes only its primary keys.
            primary_of = len(store.units) if getattr(store, "replica", None) is not None else None
            outcomes = settle_all([unit.checkpoint_write(gen_dir, int(chunk_bytes), primary_of) for unit in store.units])
            errors = [o for o in outcomes if isinstance(o, Exception)]
    finally:
        # Closing applies the deletes deferred meanwhile (a lost unit has nothing to close).
        closed = settle_all([unit.end_checkpoint(token) for unit in store.units])
    if not errors:
        # A unit whose lease ran out applied deletes the checkpoint was holding back: what
        # it wrote may miss rows deleted since, so the checkpoint does not count.
        expired = [c["unit"] for c in closed if isinstance(c, dict) and c.get("expired")]
        if expired:
            errors = [CheckpointError(
                f"the checkpoint outlived store.checkpoint-lease-s on unit(s) {expired}, which applied the "
                "deletes it deferred; raise store.checkpoint-lease-s and save again"
            )]
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
        "store": _store_name(store),
    }
    _write_sequenced(path, manifest, key)
    # Only now is the new checkpoint current: drop older and half-written generations
    # (never one a concurrent save is writing: saves to one location hold its lock).
    for name in os.listdir(path):
        if name.startswith("gen-") and name != generation:
            shutil.rmtree(os.path.join(path, name), ignore_errors=True)
    return manifest


def _previous_sequence(path: str, key: bytes | None) -> int:
    """The sequence of the checkpoint now at ``path`` (0: none, one from before
    sequences, or one that does not verify under ``key``)."""
    try:
        return int(read_manifest(path, key, allow_older=True).get("sequence", 0))
    except CheckpointError:
        return 0


def _write_sequenced(path: str, manifest: dict, key: bytes | None) -> None:
    """Set ``manifest["sequence"]`` and write the manifest (:func:`write_manifest`).

    Signed (``key``): one more than the highest of the sequence recorded for its store
    name and the checkpoint now at ``path``, allocated, written and recorded under the
    sequence record's lock. Unsigned: one more than the checkpoint now at ``path``; an
    unsigned checkpoint cannot be defended against replay (anyone can rewrite it), so no
    record is kept and none is checked; the sequence is informational only."""
    previous = _previous_sequence(path, key)
    record = _record_file() if key is not None else None
    if record is None:
        manifest["sequence"] = previous + 1
        write_manifest(path, manifest, key)
        return
    with sequence.updating(record) as stores:
        name = manifest["store"]
        manifest["sequence"] = max(stores.get(name, 0), previous) + 1
        write_manifest(path, manifest, key)
        stores[name] = manifest["sequence"]


def _settle_tasks(futures: list) -> list:
    """Every task future's result, or its exception (all awaited, none raised)."""
    from distributed import wait

    wait(futures)
    return [f.exception() if f.status == "error" else f.result() for f in futures]


def _rollback(store: "StagingStore", keys: dict[str, list[str]], claim: str) -> tuple[int, dict]:
    """Take back every copy of the checkpoint's ``keys`` (per partition) that this restore
    created and no other writer has put since (``claim``): ONE batched release per unit
    and partition. A row the store held before, or that another writer had acknowledged
    meanwhile, stays. Returns (rows removed, {key: (reason, detail)} of copies on units
    that could not be reached)."""
    removed, failed = 0, {}
    for partition, ks in keys.items():
        n, bad = store.release_claim(ks, claim, partition=partition)
        removed += n
        failed.update(bad)
    return removed, failed


def restore(store: "StagingStore", path: str, client=None, allow_older: bool = False) -> dict:
    """Verify the checkpoint at ``path`` and load it into ``store``, all or nothing.

    1. The manifest: digest, signature when ``store.checkpoint-key`` is set, and every
       file name (``<generation>/<plain name>``, resolving inside ``path``).
    2. A validate-only pass (Dask tasks, one per file): each file is read, its size and
       SHA-256 recomputed, decoded and checked (rows, keys, field layout); only its keys
       come back, so controller memory holds keys, never rows. Any problem raises
       :class:`CheckpointCorrupt` naming every bad file; nothing has been loaded.
    3. The load pass reads every file again (its SHA-256 re-checked on the bytes read)
       and puts its rows, each new row provisional under this restore's claim. If any
       key fails (``store_full``, ``key_conflict``, a lost unit ...) or a file fails its
       second read, every copy of a row this restore created is taken back (one batched
       release per unit and partition; with replicas=2 a key one copy of which failed
       keeps neither). Rows the store held before, or that another writer put meanwhile
       (acknowledged to it), are never removed or changed (write-once keys refuse an
       overwrite as ``key_conflict``). It then raises :class:`RestoreIncomplete` naming
       the failed keys and reasons, or the load error.

    Returns ``{"rows": restored, "failed": {}, "files": n, "generation": id}``.
    """
    from distributed import get_client

    path = os.path.abspath(path)
    manifest = read_manifest(path, allow_older=allow_older)
    files, generation = manifest["files"], manifest["generation"]
    if store.partitions is not None:
        unknown = sorted({e["partition"] for e in files} - set(store.partitions))
        if unknown:
            raise CheckpointError(f"checkpoint {path!r} holds partition(s) {unknown} this store lacks ({store.partitions})")
    client = client or get_client()
    n = len(files)
    checked = client.gather(client.map(verify_file, [path] * n, files, [generation] * n, pure=False))
    problems = [c["problem"] for c in checked if c["problem"]]
    if problems:
        raise CheckpointCorrupt(f"checkpoint {path!r} refused: " + "; ".join(problems))
    owner: dict[tuple[str, str], str] = {}
    for entry, c in zip(files, checked):
        for key in c["keys"]:
            other = owner.setdefault((entry["partition"], key), entry["file"])
            if other != entry["file"]:
                raise CheckpointCorrupt(f"checkpoint {path!r} refused: key {key!r} is in both {other} and {entry['file']}")
    # The rows this restore creates are provisional under its claim until it succeeds: a
    # rollback takes back exactly those, on every copy, and never a row another writer put.
    claim = f"restore-{uuid.uuid4().hex}"
    outcomes = _settle_tasks(
        client.map(restore_file, [store] * n, [path] * n, files, [generation] * n, [claim] * n, pure=False)
    )
    keys: dict[str, list[str]] = {}
    failed: dict = {}
    error: BaseException | None = None
    rows = 0
    for entry, c, out in zip(files, checked, outcomes):
        keys.setdefault(entry["partition"], []).extend(c["keys"])
        if isinstance(out, BaseException):
            error = error or out
            continue
        failed.update(out["failed"])
        rows += len(out["ok"])
    if error is None and not failed:
        store.settle_claim(claim)
        note_restored(manifest)  # a replay of anything older is refused from now on
        return {"rows": rows, "failed": {}, "files": n, "generation": generation}
    removed, rollback_failed = _rollback(store, keys, claim)
    if error is not None:
        note = f"restore of {path!r} failed while loading; the {removed} row(s) it had added were removed" + (
            f", {len(rollback_failed)} could not be: {_first(rollback_failed)}" if rollback_failed else ""
        )
        if isinstance(error, CheckpointError):  # CheckpointCorrupt stays CheckpointCorrupt
            raise type(error)(f"{note}: {error}") from error
        if hasattr(error, "add_note"):  # anything else (a closed store, a bug) keeps its type
            error.add_note(note)
        raise error
    raise RestoreIncomplete(failed, removed=removed, rollback_failed=rollback_failed, path=path)


def _first(failed: dict) -> str:
    key, (reason, detail) = next(iter(failed.items()))
    return f"{key!r}: {reason}: {detail}"
