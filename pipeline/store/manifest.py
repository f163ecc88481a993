"""A store checkpoint's manifest: its digest, optional HMAC signature, sequence, and the
rules its file entries follow.

``MANIFEST.json`` names one generation ``gen-<id>/`` of packed batch files with each
file's digest and size in bytes. The file digests are BLAKE3 or SHA-256 (the
``capture.digest`` setting at save time): the manifest says which in ``file_digest``
(absent: SHA-256, every checkpoint from before BLAKE3) and each entry keeps its hex
digest under the algorithm's name. Its unkeyed SHA-256 catches accidents; with
``store.checkpoint-key`` (the PATH of a key file) it is also signed (HMAC-SHA256), and a
signed manifest carries a ``sequence`` per store name that a restore checks against the
highest one this controller saved or restored (a replayed older save is refused). Its
file names must be ``<generation>/<plain name>`` (resolving inside the checkpoint
directory, for a local one); the manifest itself is read bounded (a local one as a
regular file, never blocking). A location is a path or an fsspec URL
(:mod:`~pipeline.store.location`): a local manifest is replaced by temp+fsync+rename, a
remote one by one whole-object put.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from typing import Final, Union

from tasks.digests import ALGORITHMS, SHA256
from tasks.errors import CheckpointCorrupt, CheckpointError, CheckpointReplayed, ManifestReplaced

from .. import config
from . import sequence
from .batch_file import DATA_SUFFIX, FORMAT_VERSION
from .checkpoint_losses import LOST_FIELD, lost_problem
from .location import Location, parse
from .location_probe import explain
from .protocol import PARTITION_RE


MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "dask-token-capture/store-checkpoint"
KEY_CONFIG = "store.checkpoint-key"
MANIFEST_MAX_CONFIG = "store.checkpoint-manifest-max-bytes"
STORE_NAME_CONFIG = "capture-client.store-name"
HMAC_FIELD = "manifest_hmac_sha256"
FILE_DIGEST_FIELD = "file_digest"  # the data files' digest algorithm; absent: sha256
_DIGEST_FIELDS = ("manifest_sha256", HMAC_FIELD)
_HMAC_TAG = b"dask-token-capture/store-checkpoint-manifest/v1\n"
_MIN_KEY_BYTES = 32
_GENERATION_RE = re.compile(r"^gen-[A-Za-z0-9_-]{1,200}$")
_DATA_NAME_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,250}$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_FROM_CONFIG: Final = object()  # "the key from config" (a default no caller passes)
_ANY: Final = object()  # "replace whatever manifest is there" (write_manifest's default)
Where = Union[str, "os.PathLike[str]", Location]  # a checkpoint location: a path, a URL or a parsed one


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


def write_manifest(path: Where, manifest: dict, key: bytes | None = _FROM_CONFIG, replacing: object = _ANY) -> None:
    """Write ``MANIFEST.json`` at location ``path`` whole (local: temp, fsync, rename, fsync
    dir; remote: one put), signed with ``key`` (default: :func:`manifest_key`) when there is one.
    ``replacing``: the entity tag of the manifest this one may replace (None: only where
    there is none), checked by the put where the location is conditional: another writer's
    manifest since raises :class:`ManifestReplaced`."""
    if key is _FROM_CONFIG:
        key = manifest_key()
    manifest = {k: v for k, v in manifest.items() if k not in _DIGEST_FIELDS}
    if key is not None:
        manifest[HMAC_FIELD] = _manifest_hmac(manifest, key)
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    loc = parse(path)
    if replacing is _ANY:
        loc.write(MANIFEST, [data])
    elif not loc.replace(MANIFEST, data, replacing):  # type: ignore[arg-type]
        raise ManifestReplaced(f"{loc.url}: another save wrote the manifest since this save took its lease")
    loc.sync()


def read_manifest(path: Where, key: bytes | None = _FROM_CONFIG, allow_older: bool = False) -> dict:
    """The manifest of the checkpoint at location ``path``: self-digest checked; with a ``key``
    (default: :func:`manifest_key`) its signature is required and checked, and so is its
    sequence (:func:`check_sequence`: an older signed checkpoint than one already saved or
    restored for its store name raises :class:`CheckpointReplayed`, unless
    ``allow_older``); every file entry checked (names resolve inside ``path``), and the lost keys when present.

    ``MANIFEST.json`` must be a regular file or object (locally a symlink to one is
    followed; a FIFO, device or directory is refused unopened) of at most
    ``token-capture.store.checkpoint-manifest-max-bytes`` bytes, read without blocking
    and never past that bound. Raises :class:`CheckpointCorrupt`."""
    if key is _FROM_CONFIG:
        key = manifest_key()
    loc = parse(path)
    mpath = loc.path(MANIFEST) if loc.local else f"{loc.url}/{MANIFEST}"
    try:
        present = loc.exists(MANIFEST)
    except Exception as e:  # a URL's backend errors (credentials, endpoint): one line with the fix
        raise CheckpointError(explain(loc, e)) from None
    if not present:
        raise CheckpointError(f"no checkpoint at {loc.url!r}: {MANIFEST} is missing")
    manifest = _load_manifest_json(loc, mpath)
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
    _check_entries(loc, mpath, manifest)
    if LOST_FIELD in manifest and (why := lost_problem(manifest[LOST_FIELD])) is not None:
        raise CheckpointCorrupt(f"{mpath}: {why}")
    return manifest


def _load_manifest_json(loc: Location, mpath: str) -> object:
    """The parsed JSON of the manifest ``mpath`` at ``loc``, read safely (see :func:`read_manifest`)."""
    knob = f"token-capture.{MANIFEST_MAX_CONFIG}"
    data = loc.read(MANIFEST, config.get_bytes(MANIFEST_MAX_CONFIG), knob, CheckpointCorrupt)
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


def _store_name(store: object = None) -> str:
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


def _check_entries(loc: Location, mpath: str, manifest: dict) -> None:
    generation = manifest.get("generation")
    if not isinstance(generation, str) or not _GENERATION_RE.match(generation):
        raise CheckpointCorrupt(f"{mpath}: generation {generation!r} is not a plain gen-<id> name")
    algorithm = manifest.get(FILE_DIGEST_FIELD, SHA256)
    if algorithm not in ALGORITHMS:
        raise CheckpointCorrupt(f"{mpath}: file_digest {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise CheckpointCorrupt(f"{mpath}: files must be a list")
    seen: set[str] = set()
    for i, entry in enumerate(files):
        what = f"{mpath}: files[{i}] {entry.get('file') if isinstance(entry, dict) else entry!r}"
        problem = _entry_problem(entry, generation)
        if problem is None and (named := entry_digest(entry)[0]) != algorithm:
            problem = f"digest {named}, the manifest's file_digest is {algorithm}"
        if problem is None:
            if entry["file"] in seen:
                problem = "named twice"
            seen.add(entry["file"])
        if problem is None and loc.local:  # remote names are checked above: plain, inside the generation
            try:
                _resolved(loc.root, entry)
            except CheckpointCorrupt as e:
                problem = str(e)
        if problem is not None:
            raise CheckpointCorrupt(f"{what}: {problem}")


def _int_field(entry: dict, name: str) -> bool:
    v = entry.get(name)
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _entry_problem(entry: object, generation: str) -> str | None:
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
    named = [a for a in ALGORITHMS if a in entry]
    if len(named) != 1:
        return f"needs one file digest ({' or '.join(ALGORITHMS)}), got {named or 'none'}"
    value = entry[named[0]]
    if not isinstance(value, str) or not _SHA_RE.match(value):
        return f"{named[0]} {value!r} is not 64 lowercase hex digits"
    return None


def entry_digest(entry: dict) -> tuple[str, str]:
    """``(algorithm, hex digest)`` of a checked file entry (its one digest field)."""
    algorithm = next(a for a in ALGORITHMS if a in entry)
    return algorithm, entry[algorithm]


def resolve_entry(root: str, entry: dict, generation: str) -> str:
    """The real path of ``entry``'s file, which must lie inside the checkpoint directory
    ``root`` once every symlink is resolved; else :class:`CheckpointCorrupt`."""
    problem = _entry_problem(entry, generation)
    if problem is not None:
        raise CheckpointCorrupt(f"{entry.get('file') if isinstance(entry, dict) else entry!r}: {problem}")
    return _resolved(root, entry)


def _resolved(root: str, entry: dict) -> str:
    """:func:`resolve_entry` of an entry whose shape and name were checked."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, entry["file"]))
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointCorrupt(f"{entry['file']}: resolves to {real!r}, outside the checkpoint directory {real_root!r}")
    return real
