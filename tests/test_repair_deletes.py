"""Re-replication and deletes: a deleted key never comes back on a lost unit's replacement.

A delete reaching the survivor between the repair's copy and the new unit's install
removes the survivor's copy only (the lost unit is unreachable, the deleter plans on the
old table): the repairer lists each survivor again after the install and removes what it
no longer lists from the new unit. A delete deferred by an open checkpoint leaves its row
on the survivor until the checkpoint ends, unlisted: the repair does not copy it. Its own cluster:
the test SIGKILLs a worker.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from pipeline.store import StagingStore
from tasks.keys import CUT_PARTITION, STAGING_PARTITION
from tasks.packed import pack_rows
from support import wait_for_names
# test_replication's fixtures, instantiated for this module: two copies per key (autouse) and
# a cluster of its own (module scope), so the worker this test kills is restarted for nobody else.
from test_replication import cluster, two_copies  # noqa: F401
from test_replication import counters, make_groups, rows_of, wait_repaired

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_a_deleted_key_is_not_re_replicated(cluster, tmp_path):
    """Two deletes a unit's re-replication must not undo, with one unit lost:

    - in the staging partition, a delete between the repair's copy and the new unit's
      install reaches the survivor only: the new unit's copy is removed after the install;
    - in the cut partition, a delete made while a checkpoint is open there is deferred (the
      rows stay until it ends): the repair does not copy those rows at all.
    """
    names = wait_for_names(cluster, ["a", "b", "c"])
    store = StagingStore.start(cluster, n_units=2, workers=[names["a"], names["b"]], spill_directory=str(tmp_path / "s"))
    try:
        rows = rows_of(make_groups("del", seed=5))
        keys = [r.staging_key for r in rows]
        for partition in (STAGING_PARTITION, CUT_PARTITION):
            assert not store.put_many(pack_rows(rows), partition=partition).failed
        doomed, kept = keys[::2], keys[1::2]  # staging: deleted during the repair
        held_back, cut_kept = keys[:5], keys[5:]  # cut: deleted under an open checkpoint
        for u in store.units:
            u.begin_checkpoint("ck", [CUT_PARTITION]).result(timeout=30)
        res = store.delete(held_back, partition=CUT_PARTITION)
        assert sorted(res.ok) == sorted(held_back) and sorted(res.deferred) == sorted(held_back)
        owner, answers = store.owner, {}
        install = owner.replace_unit

        def delete_then_install(*args, **kwargs):
            # Rows copied, new unit not installed: this delete reaches unit 0 only.
            t = threading.Thread(target=lambda: answers.setdefault("deleted", store.delete(doomed)))
            t.start()
            t.join(60)
            return install(*args, **kwargs)

        owner.replace_unit = delete_then_install
        victim = store.unit_workers[1]
        os.kill(cluster.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        wait_repaired(store, 1)
        res = answers["deleted"]
        assert {r for r, _ in res.failed.values()} == {"unit_unavailable"} and set(res.failed) == set(doomed)
        record = owner.repairer.repaired[-1]
        assert record["rows"] == len(keys) + len(cut_kept)  # staging: every key; cut: not the held-back ones
        assert record["dropped"] == len(doomed)  # the staging keys deleted during the copy, removed again
        new = store.units[1]
        assert set(new.keys(STAGING_PARTITION).result(timeout=30)) == set(kept)
        assert set(new.keys(CUT_PARTITION).result(timeout=30)) == set(cut_kept)
        survivor = store.units[0]
        assert set(survivor.keys(CUT_PARTITION).result(timeout=30)) == set(cut_kept)  # deleted: not listed ...
        assert set(survivor.deferred_keys(CUT_PARTITION).result(timeout=30)) == set(held_back)
        assert survivor.stats().result(timeout=30)["partitions"][CUT_PARTITION] == len(keys)  # ... held until it ends
        assert store.units[0].end_checkpoint("ck").result(timeout=30)["applied"] == len(held_back)
        for u in store.units:
            assert set(u.keys(STAGING_PARTITION).result(timeout=30)) == set(kept)
            assert set(u.keys(CUT_PARTITION).result(timeout=30)) == set(cut_kept)
        assert sum(s["rows"] for s in counters(store)) == 2 * (len(kept) + len(cut_kept))
    finally:
        store.close()
