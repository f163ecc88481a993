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

import os
import shutil
import time
import uuid
from typing import TYPE_CHECKING

from tasks.errors import CheckpointCorrupt, CheckpointError, RestoreIncomplete

from . import sequence
from .batch_file import FORMAT_VERSION, fsync_dir
from .checkpoint_files import load_file, restore_file, verify_file  # noqa: F401 (tasks run them by this path too)
from .deadline import settle_all
from .location_lock import location_lock
from .manifest import (  # noqa: F401 (the checkpoint's public names, re-exported)
    HMAC_FIELD,
    MANIFEST,
    MANIFEST_FORMAT,
    _FROM_CONFIG,
    _manifest_digest,
    _record_file,
    _store_name,
    manifest_key,
    note_restored,
    read_manifest,
    resolve_entry,
    write_manifest,
)

if TYPE_CHECKING:  # pragma: no cover
    from .protocol import StoreLike


# ---- orchestration (controller side) ------------------------------------------------


def save(store: "StoreLike", path: str, chunk_bytes: int) -> dict:
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


def _save_locked(store: "StoreLike", path: str, chunk_bytes: int, key: bytes | None) -> dict:
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
            placement = store.placement
            primary_of = list(placement.unit_ids) if placement.replicas == 2 else None
            outcomes = settle_all([unit.checkpoint_write(gen_dir, int(chunk_bytes), primary_of, u) for u, unit in enumerate(store.units)])
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


def _rollback(store: "StoreLike", keys: dict[str, list[str]], claim: str) -> tuple[int, dict]:
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


def restore(store: "StoreLike", path: str, client=None, allow_older: bool = False) -> dict:
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
