"""Re-replication and a restore's provisional rows: a lost unit's replacement holds the
survivor's provisional rows provisional under the same claim, so a later release of the
claim takes back every copy; a row settled or acknowledged to another writer during the
copy (which reached the survivor only) is made ordinary on the new unit too. Its own cluster:
the test SIGKILLs a worker.
"""
from __future__ import annotations

import os
import signal

import pytest

from pipeline.store import StagingStore
from tasks.packed import pack_rows
from support import wait_for_names
# test_replication's fixtures, instantiated for this module: two copies per key (autouse) and
# a cluster of its own (module scope), so the worker this test kills is restarted for nobody else.
from test_replication import cluster, two_copies  # noqa: F401
from test_replication import make_groups, rows_of, wait_repaired

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_a_repair_keeps_provisional_rows_provisional(cluster, tmp_path):
    names = wait_for_names(cluster, ["a", "b", "c"])
    store = StagingStore.start(cluster, n_units=2, workers=[names["a"], names["b"]], spill_directory=str(tmp_path / "s"))
    try:
        rows = rows_of(make_groups("claims", seed=7))
        keys = [r.staging_key for r in rows]
        third = len(rows) // 3
        acked, failing, settling = keys[:third], keys[third : 2 * third], keys[2 * third :]
        assert not store.put_many(pack_rows(rows[:third])).failed
        assert sorted(store.put_claimed(pack_rows(rows[third : 2 * third]), "restore-x").ok) == sorted(failing)
        assert sorted(store.put_claimed(pack_rows(rows[2 * third :]), "restore-y").ok) == sorted(settling)
        owner = store.owner
        install = owner.replace_unit

        def settle_then_install(*args, **kwargs):
            # Rows copied, new unit not installed: restore-y succeeds, and another writer puts
            # one of restore-x's rows (identical); both reach unit 0 only.
            store.settle_claim("restore-y")
            store.put_many(pack_rows(rows[third : third + 1]))
            return install(*args, **kwargs)

        owner.replace_unit = settle_then_install
        victim = store.unit_workers[1]
        os.kill(cluster.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        wait_repaired(store, 1)
        record = owner.repairer.repaired[-1]
        assert record["rows"] == len(keys)
        assert record["settled"] == len(settling) + 1  # made ordinary on the new unit too
        acked, failing = acked + failing[:1], failing[1:]
        new = store.units[1]
        assert new.stats().result(timeout=30)["provisional_rows"] == len(failing)  # restore-x's only
        removed, failed = store.release_claim(failing, "restore-x")  # restore-x failed
        assert not failed and removed == 2 * len(failing)  # both copies of each key
        for u in store.units:
            assert sorted(u.keys("staging").result(timeout=30)) == sorted(acked + settling)
            assert u.stats().result(timeout=30)["provisional_rows"] == 0
        got = store.get_many(keys)
        assert set(got.failed) == set(failing) and {r for r, _ in got.failed.values()} == {"missing_key"}
    finally:
        store.close()
