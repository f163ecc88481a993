"""Re-replication and deletes: a key deleted while its lost unit is re-replicated stays deleted.

A delete reaching the survivor between the repair's copy and the new unit's install
removes the survivor's copy only (the lost unit is unreachable, the deleter plans on the
old table); the repairer lists each survivor again after the install and removes what it
no longer holds from the new unit. Its own cluster: the test SIGKILLs a worker.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from pipeline.store import StagingStore
from tasks.keys import STAGING_PARTITION
from tasks.packed import pack_rows
from support import wait_for_names
# test_replication's fixtures, instantiated for this module: two copies per key (autouse) and
# a cluster of its own (module scope), so the worker this test kills is restarted for nobody else.
from test_replication import cluster, two_copies  # noqa: F401
from test_replication import counters, make_groups, rows_of, wait_repaired

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_a_key_deleted_while_its_unit_is_re_replicated_does_not_come_back(cluster, tmp_path):
    """A delete between the repair's copy and the new unit's install reaches the survivor
    only: the re-replicated copy of that key is removed once the new unit is installed."""
    names = wait_for_names(cluster, ["a", "b", "c"])
    store = StagingStore.start(cluster, n_units=2, workers=[names["a"], names["b"]], spill_directory=str(tmp_path / "s"))
    try:
        rows = rows_of(make_groups("del", seed=5))
        keys = [r.staging_key for r in rows]
        assert not store.put_many(pack_rows(rows)).failed
        doomed, kept = keys[::2], keys[1::2]
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
        assert owner.repairer.repaired[-1]["rows"] == len(keys)  # every key was copied ...
        assert owner.repairer.repaired[-1]["dropped"] == len(doomed)  # ... the deleted ones removed again
        held = [set(u.keys(STAGING_PARTITION).result(timeout=30)) for u in store.units]
        assert held == [set(kept), set(kept)]
        assert sum(s["rows"] for s in counters(store)) == 2 * len(kept)
    finally:
        store.close()
