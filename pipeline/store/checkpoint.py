"""Atomic checkpoints of a staging store (controller side): save, verify, restore.

A checkpoint location (a local directory or any fsspec URL, :mod:`~pipeline.store.location`)
holds ``MANIFEST.json`` (written last, by the controller) and one generation ``gen-<id>/``
of packed batch files (:mod:`~pipeline.store.batch_file`, one per chunk of about
``chunk_bytes`` of a unit's partition), each written by its unit straight to the location
from the unit's own worker process. The manifest records each file's digest (BLAKE3 or
SHA-256, ``capture.digest`` read once per save; ``file_digest`` names it) and size in
bytes, and, when ``store.checkpoint-key`` names a key file, an HMAC-SHA256 of its whole
body. Its file names must be ``<generation>/<plain name>`` (resolving inside a local
directory). Commit needs no rename: before the manifest is written every file it names is
checked present with its size; older generations are removed only once the new manifest
was written AND read back. A remote location is probed first (a small object written,
read back, removed: :mod:`~pipeline.store.location_probe`), so a bad URL fails before any
unit writes. Restore is all-or-nothing: every file is hashed, decoded and validated before
the first row is loaded, and a restore that fails while loading removes the rows it
added. While a save runs, it is open on every unit (``begin_checkpoint`` before any
write, ``end_checkpoint`` in ``finally``): concurrent deletes are deferred, so the
checkpoint loses no row to them.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import TYPE_CHECKING

from tasks.errors import CheckpointCorrupt, CheckpointError, ManifestReplaced, RestoreIncomplete

from .. import config
from . import sequence
from .batch_file import FORMAT_VERSION
from .checkpoint_files import load_file, restore_file, verify_file  # noqa: F401 (tasks run them by this path too)
from .checkpoint_losses import LOST_FIELD, restore_lost, split_entries
from .deadline import deadline, settle_all
from .whole_store import moved_answer, table_rounds
from .location import Location, parse
from .location_lease import Lease, location_lease
from .location_lock import location_lock, lock_timeout_s
from .location_probe import probe, probe_timeout_s
from .manifest import (  # noqa: F401 (the checkpoint's public names, re-exported)
    FILE_DIGEST_FIELD,
    HMAC_FIELD,
    MANIFEST,
    MANIFEST_FORMAT,
    _ANY as _ANY_MANIFEST,
    _FROM_CONFIG,
    Where,
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


def save(store: "StoreLike", path: Where, chunk_bytes: int) -> dict:
    """Checkpoint every unit of ``store`` into location ``path`` (a directory or an fsspec
    URL); returns the manifest (signed when ``store.checkpoint-key`` is set).

    Saves to one location run one at a time. A local directory: each holds ``<path>/.lock``
    (:func:`~pipeline.store.location_lock.location_lock`) from before it creates its
    generation until it has removed the others. A remote one: it is probed first
    (:func:`~pipeline.store.location_probe.probe`), then each save holds the lease
    ``<url>/.lease`` (:mod:`~pipeline.store.location_lease`) as long. Either waits for
    another save at most ``store.checkpoint-lock-timeout-s`` seconds (then
    :class:`CheckpointError`). The manifest names the store (``store``) and its
    ``sequence`` (:func:`_write_sequenced`). Storage options
    (``store.checkpoint-storage-options``) and the other knobs are read once, here.
    """
    key = manifest_key()  # a bad key setting fails before anything is written
    loc = parse(path)
    if loc.local:
        try:
            os.makedirs(loc.root, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"checkpoint location {loc.url!r} cannot be created ({e}); check the path and its permissions") from None
        with location_lock(loc.root):
            return _save_locked(store, loc, chunk_bytes, key, None)
    lease_s, timeout_s = float(config.get("store.checkpoint-lease-s")), lock_timeout_s()
    probe(loc, probe_timeout_s())  # before any unit writes: a bad URL fails here, in one line
    with location_lease(loc, lease_s, timeout_s) as lease:
        return _save_locked(store, loc, chunk_bytes, key, lease)


def _write_generation(store: "StoreLike", gen: Location, chunk_bytes: int, digest: str, lease_s: float
                      ) -> tuple[list, list[BaseException]]:
    """Every unit writes its files into generation ``gen``, hashed with ``digest``:
    (entries per unit, errors). A unit fenced by a newer table than the handle's opens
    nothing (a move ended since the handle was made, so it does not name every unit
    holding rows): the handle takes the newest table and the save opens again."""
    for version in table_rounds(store):
        outcomes, errors, moved = _write_generation_once(store, gen, chunk_bytes, digest, lease_s, version)
        if moved is None:
            break
    if moved is not None:
        errors = [CheckpointError(f"storage unit {moved['unit']} is on placement version {moved['moved']}, newer than "
                                  f"this handle's {store.placement.version}, and no newer table could be fetched; "
                                  "save through the store's own handle (pipeline.client.lookup_store)")]
    return outcomes, errors


def _write_generation_once(store: "StoreLike", gen: Location, chunk_bytes: int, digest: str, lease_s: float,
                           version: int) -> tuple[list, list[BaseException], dict | None]:
    """One try of :func:`_write_generation`, plus the first unit's ``moved`` answer (None:
    every unit opened the checkpoint on table ``version``). Opening and closing wait at
    most ``store.admin-call-timeout-s`` for a unit, the writes at most ``lease_s``."""
    token = gen.url  # gen-<id> under the location: unique per save
    outcomes: list = []
    moved = None
    try:
        # Open on EVERY unit before any unit writes: from here on no delete removes a row
        # this checkpoint may still write, whichever process issues it; and no move starts
        # (a unit refuses a change while a checkpoint is open).
        opened = settle_all([unit.begin_checkpoint(token, None, version) for unit in store.units],
                            deadline(_admin_timeout_s(store)))
        errors = _unit_errors(opened, "open the checkpoint", "store.admin-call-timeout-s")
        moved = next((o for o in opened if moved_answer(o)), None)
        if not errors and moved is None:
            # Wait for every unit before deciding: a failed unit must not leave others writing.
            # A replicated store holds every key twice: each unit writes only its primary keys.
            placement = store.placement
            primary_of = list(placement.unit_ids) if placement.replicas == 2 else None
            # Past the lease a unit ends the checkpoint itself (it could not count): no longer.
            outcomes = settle_all([
                unit.checkpoint_write(gen, int(chunk_bytes), primary_of, u, digest, token) for u, unit in enumerate(store.units)
            ], deadline(lease_s or None))
            errors = _unit_errors(outcomes, "write its files", "store.checkpoint-lease-s")
    finally:
        # Closing applies the deletes deferred meanwhile (a lost unit has nothing to close).
        closed = settle_all([unit.end_checkpoint(token) for unit in store.units], deadline(_admin_timeout_s(store)))
    if not errors and moved is None:
        # A unit whose lease ran out applied deletes the checkpoint was holding back: what
        # it wrote may miss rows deleted since, so the checkpoint does not count.
        expired = [c["unit"] for c in closed if isinstance(c, dict) and c.get("expired")]
        if expired:
            errors = [CheckpointError(
                f"the checkpoint outlived store.checkpoint-lease-s on unit(s) {expired}, which applied the "
                "deletes it deferred; raise store.checkpoint-lease-s and save again"
            )]
    return outcomes, errors, moved


def _missing_files(gen: Location, files: list[dict]) -> list[str]:
    """The unit-written ``files`` (plain names) not in ``gen`` with their recorded size:
    e.g. units on other hosts wrote a local path the controller does not share."""
    present = gen.sizes()
    missing = []
    for e in files:
        name, want = e["file"], e["bytes"]
        if name not in present:
            missing.append(f"{name} (absent)")
        elif present[name] != want:
            missing.append(f"{name} ({present[name]} bytes, not {want})")
    return missing


def _admin_timeout_s(store: "StoreLike") -> float | None:
    """The handle's bound on whole-store calls (``store.admin-call-timeout-s``), if it has one."""
    return getattr(getattr(store, "settings", None), "admin_timeout_s", None)


def _unit_errors(answers: list, what: str, knob: str) -> list[BaseException]:
    """The exceptions among the units' ``answers``; a unit that did not answer in time is
    a :class:`CheckpointError` naming it and the setting that bounded the wait."""
    return [CheckpointError(f"storage unit {u} did not {what} in time ({knob})") if isinstance(a, TimeoutError) else a
            for u, a in enumerate(answers) if isinstance(a, Exception)]


def _save_locked(store: "StoreLike", loc: Location, chunk_bytes: int, key: bytes | None, lease: Lease | None) -> dict:
    """:func:`save` with the location's lock or lease held: write a generation, check
    every file is there, write the manifest, read it back, then drop older generations."""
    # Under a lease (a remote location): the manifest this save may replace, as it is now
    # that the lease is ours; a save that outlived its lease cannot overwrite a newer one.
    replacing = loc.etag(MANIFEST) if lease is not None and loc.conditional else _ANY_MANIFEST
    generation = f"gen-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    gen = loc.child(generation)
    if loc.local:
        os.makedirs(gen.root)
    digest = config.digest_algorithm()  # capture.digest, once per save
    outcomes, errors = _write_generation(store, gen, chunk_bytes, digest, float(config.get("store.checkpoint-lease-s")))
    entries, lost = split_entries([e for unit_entries in ([] if errors else outcomes) for e in unit_entries])
    if not errors:
        missing = _missing_files(gen, entries)
        if missing:
            errors = [CheckpointError(
                f"{len(missing)} file(s) the units wrote are not at {gen.url!r} as the controller sees it, e.g. "
                f"{missing[0]}; on several hosts use a location every host shares (an object store URL such as s3://bucket/prefix)"
            )]
    if errors:
        _remove_quietly(loc, generation)  # best effort; a crash leaves it for the next save
        raise CheckpointError(f"checkpoint to {loc.url!r} failed; previous checkpoint kept: {errors[0]!r}") from errors[0]
    files = [dict(e, file=f"{generation}/{e['file']}") for e in entries]
    gen.sync()
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": FORMAT_VERSION,
        "generation": generation,
        "created_unix_s": time.time(),
        "n_units": len(store.units),
        "rows": sum(f["rows"] for f in files),
        "bytes": sum(f["bytes"] for f in files),
        "files": files,
        FILE_DIGEST_FIELD: digest,
        "store": _store_name(store),
    }
    if lost:
        manifest[LOST_FIELD] = lost  # absent when none: such a manifest is as before
    if lease is not None:
        lease.check()  # still this save's: no other save may be writing here
    try:
        _write_sequenced(loc, manifest, key, replacing)
    except ManifestReplaced as e:
        _remove_quietly(loc, generation)
        raise CheckpointError(
            f"checkpoint to {loc.url!r} failed: it outlived its lease and another save has written the checkpoint "
            f"since ({e}); that one is kept; raise token-capture.store.checkpoint-lease-s and save again"
        ) from None
    _read_back(loc, manifest, key)
    # Only now is the new checkpoint current: drop older and half-written generations
    # (never one a concurrent save is writing: saves to one location hold its lock or lease).
    for name in loc.sizes():
        if name.startswith("gen-") and name != generation:
            _remove_quietly(loc, name)
    return manifest


def _read_back(loc: Location, manifest: dict, key: bytes | None) -> None:
    """The manifest now at ``loc`` must be the one just written, fully checked; else the
    save fails and every older generation is kept."""
    try:
        back = read_manifest(loc, key, allow_older=True)
    except CheckpointError as e:
        raise CheckpointError(
            f"checkpoint to {loc.url!r}: its manifest did not read back ({e}); older generations kept, save again"
        ) from None
    if back.get("generation") != manifest["generation"] or back.get("sequence") != manifest.get("sequence"):
        raise CheckpointError(
            f"checkpoint to {loc.url!r}: the manifest read back names {back.get('generation')!r}, not "
            f"{manifest['generation']!r} (another writer?); older generations kept, save again"
        )


def _remove_quietly(loc: Location, name: str) -> None:
    try:
        loc.remove(name)
    except Exception:  # best effort: the next save removes what is left
        pass


def _previous_sequence(path: Location, key: bytes | None) -> int:
    """The sequence of the checkpoint now at ``path`` (0: none, one from before
    sequences, or one that does not verify under ``key``)."""
    try:
        return int(read_manifest(path, key, allow_older=True).get("sequence", 0))
    except CheckpointError:
        return 0


def _write_sequenced(path: Location, manifest: dict, key: bytes | None, replacing: object = _ANY_MANIFEST) -> None:
    """Set ``manifest["sequence"]`` and write the manifest (:func:`write_manifest`).

    Signed (``key``): one more than the highest of the sequence recorded for its store
    name and the checkpoint now at ``path``, allocated, written and recorded under the
    sequence record's lock. Unsigned: one more than the checkpoint now at ``path``; an
    unsigned checkpoint cannot be defended against replay (anyone can rewrite it), so no
    record is kept and none is checked; the sequence is informational only. ``replacing``:
    :func:`write_manifest`'s condition (default: any manifest)."""
    previous = _previous_sequence(path, key)
    record = _record_file() if key is not None else None
    if record is None:
        manifest["sequence"] = previous + 1
        write_manifest(path, manifest, key, replacing)
        return
    with sequence.updating(record) as stores:
        name = manifest["store"]
        manifest["sequence"] = max(stores.get(name, 0), previous) + 1
        write_manifest(path, manifest, key, replacing)
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


def restore(store: "StoreLike", path: Where, client=None, allow_older: bool = False) -> dict:
    """Verify the checkpoint at location ``path`` (a directory or an fsspec URL; storage
    options read once, here) and load it into ``store``, all or nothing.

    1. The manifest: digest, signature when ``store.checkpoint-key`` is set, and every
       file name (``<generation>/<plain name>``, resolving inside a local ``path``).
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
    4. The manifest's lost keys (``lost_keys``, :mod:`~.checkpoint_losses`) are recorded
       lost again on their holders; one that cannot be reached fails them as in 3.

    Returns ``{"rows": restored, "failed": {}, "files": n, "generation": id, "lost_keys": n}``.
    """
    from distributed import get_client

    loc = parse(path)
    path = loc.url
    manifest = read_manifest(loc, allow_older=allow_older)
    files, generation, lost = manifest["files"], manifest["generation"], manifest.get(LOST_FIELD, {})
    if store.partitions is not None:
        unknown = sorted(({e["partition"] for e in files} | set(lost)) - set(store.partitions))
        if unknown:
            raise CheckpointError(f"checkpoint {path!r} holds partition(s) {unknown} this store lacks ({store.partitions})")
    client = client or get_client()
    n = len(files)
    checked = client.gather(client.map(verify_file, [loc] * n, files, [generation] * n, pure=False))
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
        client.map(restore_file, [store] * n, [loc] * n, files, [generation] * n, [claim] * n, pure=False)
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
    if error is None and not failed and lost:
        n_lost, failed = restore_lost(store, lost, set(owner))
    if error is None and not failed:
        store.settle_claim(claim)
        note_restored(manifest)  # a replay of anything older is refused from now on
        return {"rows": rows, "failed": {}, "files": n, "generation": generation, "lost_keys": n_lost if lost else 0}
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
