"""Lost-key records in a store checkpoint (``store.replicas: 2``): a key recorded lost
(both its copies died, :mod:`.losses`) is saved lost and restored lost, so a restore
never turns it into a key never staged that takes new content.

Save: each unit's ``checkpoint_write`` answers, beside its file entries, one entry
``{"lost": {partition: {key: how}}}`` (read on its actor thread with its rows); the
controller merges them into the manifest's optional field ``lost_keys``
(``{partition: {how: [keys]}}``), digested and signed with the rest of the manifest.
A manifest without it (saved before lost keys were, or by a store with none) restores as
before. Restore: once the rows loaded, each key is recorded lost on every unit of the
restoring store's table that holds a copy of it (a unit holding the key's row records
nothing: the row stands), and its witness records its name, as a put's does. A key the
checkpoint also holds a row of is not recorded lost.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .deadline import settle_all
from .moving import plan_all_moving
from .placement import plan_delete
from .protocol import PARTITION_RE, UNIT_UNAVAILABLE, check_key, pack_names

if TYPE_CHECKING:  # pragma: no cover
    from .losses import LossBook

LOST_FIELD = "lost_keys"  # the manifest's field: {partition: {how: [keys]}}; absent: none
LOST_ENTRY = "lost"  # a unit's records in its checkpoint_write answer (not a file)

Lost = dict[str, dict[str, list[str]]]


def unit_lost_entries(losses: "LossBook") -> list[dict]:
    """A unit's lost-key records as checkpoint_write entries: none, or one ``{"lost": ...}``."""
    lost = {p: dict(d) for p, d in losses.lost.items() if d}
    return [{LOST_ENTRY: lost}] if lost else []


def split_entries(entries: list[dict]) -> tuple[list[dict], Lost]:
    """The units' checkpoint_write entries -> (the file entries, the manifest's
    ``lost_keys``: each key once, with the first unit's ``how``)."""
    files: list[dict] = []
    lost: Lost = {}
    seen: set[tuple[str, str]] = set()
    for entry in entries:
        if LOST_ENTRY not in entry:
            files.append(entry)
            continue
        for partition, records in entry[LOST_ENTRY].items():
            for key, how in records.items():
                if (partition, key) not in seen:
                    seen.add((partition, key))
                    lost.setdefault(partition, {}).setdefault(str(how), []).append(key)
    return files, lost


def lost_problem(value: Any) -> str | None:
    """Why a manifest's ``lost_keys`` value is unusable, or ``None``."""
    if not isinstance(value, dict):
        return f"{LOST_FIELD} must be an object, got {type(value).__name__}"
    for partition, by_how in value.items():
        if not isinstance(partition, str) or not PARTITION_RE.match(partition):
            return f"{LOST_FIELD}: partition {partition!r} is not a partition name"
        if not isinstance(by_how, dict):
            return f"{LOST_FIELD}[{partition!r}] must be an object of how -> keys"
        for how, keys in by_how.items():
            if not isinstance(keys, list):
                return f"{LOST_FIELD}[{partition!r}][{how!r}] must be a list of keys"
            for key in keys:
                why = check_key(key)
                if why is not None:
                    return f"{LOST_FIELD}[{partition!r}]: key {key!r}: {why}"
    return None


def restore_lost(store: Any, lost: Lost, rows: set[tuple[str, str]]) -> tuple[int, dict]:
    """Record the checkpoint's lost keys (``lost``: its ``lost_keys``) on every unit of
    ``store`` holding a copy of them, their names on their witnesses; keys the checkpoint
    holds a row of (``rows``: (partition, key)) are skipped. Returns (keys recorded,
    ``{key: (reason, detail)}`` of the keys a holder of which could not be reached)."""
    done, failed = 0, {}
    moving = getattr(store, "moving", None)
    for partition, by_how in lost.items():
        for how, keys in by_how.items():
            keys = [k for k in dict.fromkeys(keys) if (partition, k) not in rows]
            if not keys:
                continue
            if moving is None:
                _, parts, names, _ = plan_delete(store.placement, keys)
            else:  # every copy of either table; the move hands witnessed names on itself
                (_, parts, _), names = plan_all_moving(moving, keys), {}
            answers = settle_all([store.units[u].mark_lost(partition, pack_names(ks), how) for u, ks in parts])
            for (u, ks), a in zip(parts, answers):
                if isinstance(a, Exception):
                    failed.update({k: (UNIT_UNAVAILABLE, f"lost key not recorded on unit {u}: {type(a).__name__}: {a}") for k in ks})
            # A witness that cannot be reached fails no key, as for a put.
            settle_all([store.units[w].witness(partition, pack_names(ks)) for w, ks in names.items()])
            done += sum(k not in failed for k in keys)
    return done, failed
