"""A delete and the witness of a key's name (``store.replicas: 2``): the witness forgets
the name only once the delete was applied on the key's copies. A delete that failed on a
copy (its unit unreachable, or the call raising) leaves the name, so when the remaining
copies die together later the key still reads ``lost_key`` and refuses new content.

No Dask: three in-process units behind handles answering done futures (:class:`LocalUnit`),
driven by a real :class:`StagingStore`; the double loss is the repairer's own marking
(:meth:`Repairer._mark_lost_together`) onto fresh units.
"""
from __future__ import annotations

import uuid
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import pytest

from pipeline.store.client import StagingStore
from pipeline.store.placement import Placement
from pipeline.store.protocol import LOST_KEY, MISSING_KEY, UNIT_UNAVAILABLE
from pipeline.store.repair import Repairer
from pipeline.store.settings import StoreSettings
from pipeline.store.unit import StorageUnit
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from test_store import make_rows

# Three hosts: every key has a primary, a replica and a witness on a third unit.
WORKERS = ("tcp://127.0.0.31:1", "tcp://127.0.0.32:1", "tcp://127.0.0.33:1")
PART = STAGING_PARTITION


class LocalUnit:
    """A unit handle over an in-process :class:`StorageUnit`: each call answers a done
    future, or fails with ``fail[method]`` when set (an unreachable unit, a raising call)."""

    def __init__(self, unit: StorageUnit):
        self.unit, self.fail = unit, {}
        self.key = f"local-unit-{uuid.uuid4().hex}"  # its identity for the process's unit health

    def __getattr__(self, name: str):
        method = getattr(self.unit, name)

        def call(*args, **kwargs) -> Future:
            f: Future = Future()
            if name in self.fail:
                f.set_exception(self.fail[name])
            else:
                try:
                    f.set_result(method(*args, **kwargs))
                except Exception as e:  # noqa: BLE001 - answered as the actor call would
                    f.set_exception(e)
            return f

        return call


@pytest.fixture
def store(tmp_path):
    units = [LocalUnit(StorageUnit(u, 1 << 26, 1 << 28, spill_directory=str(tmp_path / f"u{u}"))) for u in range(3)]
    # A unit found unreachable is called again at once (no skip window): the tests heal it.
    settings = replace(StoreSettings.from_config(), skip_unreachable_s=0.0)
    s = StagingStore(units, WORKERS, placement=Placement(1, WORKERS, replicas=2), settings=settings)
    s.made = list(units)  # closed at the end, whatever the test installed
    yield s
    for h in s.made:
        h.unit.close()


def _staged(store: StagingStore, seed: int) -> tuple[list, dict]:
    rows = make_rows(6, calls=1, tokens=16, seed=seed, prefix=f"w{seed}-")
    assert not store.put_many(pack_rows(rows)).failed
    loc = store.placement.locate([r.staging_key for r in rows])
    where = {r.staging_key: (int(p), int(q), int(w)) for r, p, q, w in zip(rows, loc.primary, loc.replica, loc.witness)}
    return rows, where


def _witnessed(store: StagingStore, w: int) -> set[str]:
    return set(store.units[w].witnessed_keys(PART).result())


def _lose_both(store: StagingStore, tmp_path, p: int, r: int) -> None:
    """Units ``p`` and ``r`` die together: each is replaced by a fresh unit onto which the
    repairer records, from the surviving witnesses, the keys whose two copies they held."""
    repairer = Repairer.__new__(Repairer)  # its marking only: no thread, no client
    repairer.store, repairer.call_timeout_s = store, 10.0
    survivors = [v for v in range(3) if v not in (p, r)]
    fresh = {}
    for u, d in ((p, r), (r, p)):
        fresh[u] = LocalUnit(StorageUnit(u, 1 << 26, 1 << 28, spill_directory=str(tmp_path / f"new{u}")))
        store.made.append(fresh[u])
        repairer._mark_lost_together(fresh[u], PART, store.placement, u, [d], survivors)
    for u, h in fresh.items():
        store.units[u] = h


def _other_content(row, seed: int):
    other = pack_rows(make_rows(1, calls=1, tokens=16, seed=seed + 100, prefix="x-"))
    other.keys = [row.staging_key]
    return other


@pytest.mark.parametrize("failure", ["unreachable", "raises"])
def test_a_delete_that_failed_on_a_copy_keeps_the_name_and_the_key_reads_lost_after_a_double_loss(store, tmp_path, failure):
    rows, where = _staged(store, seed=1)
    row = rows[0]
    key = row.staging_key
    p, r, w = where[key]
    assert key in _witnessed(store, w)
    # The delete reaches the replica (its copy goes) but not the primary.
    store.units[p].fail["delete"] = OSError("connection refused") if failure == "unreachable" else ValueError("injected")
    if failure == "unreachable":
        res = store.delete([key])
        assert res.failed[key][0] == UNIT_UNAVAILABLE and not res.ok
    else:
        with pytest.raises(ValueError, match="injected"):
            store.delete([key])
    assert key not in store.units[r].keys(PART).result()  # the replica's copy went
    assert key in _witnessed(store, w), "the delete was not applied on the primary: its name must stay"
    # Later the primary's copy and its partner die together: the key was staged, never
    # deleted, so it must read lost, and refuse a put of other content.
    del store.units[p].fail["delete"]
    _lose_both(store, tmp_path, p, r)
    got = store.get_many([key])
    assert got.failed[key][0] == LOST_KEY, got.failed[key]
    assert store.put_many(_other_content(row, 1)).failed[key][0] == LOST_KEY


def test_a_delete_applied_on_every_copy_forgets_the_name_and_a_retry_after_a_failure_does_too(store, tmp_path):
    rows, where = _staged(store, seed=2)
    done, retried = rows[0].staging_key, rows[1].staging_key
    p, r, w = where[retried]
    assert not store.delete([done]).failed
    assert done not in _witnessed(store, where[done][2])
    store.units[p].fail["delete"] = OSError("connection refused")
    assert store.delete([retried]).failed[retried][0] == UNIT_UNAVAILABLE
    assert retried in _witnessed(store, w)
    del store.units[p].fail["delete"]  # the primary answers again
    assert store.delete([retried]).ok == [retried]  # the primary removes it, the replica misses it
    assert retried not in _witnessed(store, w)
    # Deleted everywhere, then both holders lost: it reads missing, a fresh put is taken.
    _lose_both(store, tmp_path, p, r)
    assert store.get_many([retried]).failed[retried][0] == MISSING_KEY
    assert not store.put_many(_other_content(rows[1], 2)).failed
    assert np.asarray(store.get_many([retried]).batch.keys).tolist() == [retried]
