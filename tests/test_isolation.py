"""Write-once keys and partition isolation, on a real cluster.

A "writer" here is another process: a Dask task on a worker holding its own unpickled
``StagingStore``, as a generation worker would. Rows spill through zict to tmp_path.
"""
from __future__ import annotations

import numpy as np
import pytest
from rollout_factory import make_rollout, resign, set_tokens

from pipeline.finalize import Finalizer
from pipeline.store import StagingStore, StoreError
from tasks import reasons as R
from tasks.keys import cut_key
from tasks.packed import PackedBatch, pack_rows
from tasks.schema import ROUTES_UINT8, STAGING_FIELDS, row_fields

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("keep_staged_rows")]



VOCAB, L, K, E = 64, 2, 2, 8


@pytest.fixture
def store(cluster_client, tmp_path):
    s = StagingStore.start(cluster_client, n_units=2, memory_limit="8KiB", spill_directory=str(tmp_path / "spill"))
    yield s
    s.close()


def writer_put(store, batch, partition="staging"):
    """Task body: another process's put."""
    return store.put_many(batch, partition=partition)


def writer_delete(store, keys, partition="staging"):
    return store.delete(keys, partition=partition)


def under_keys(rows, keys) -> PackedBatch:
    return PackedBatch(list(keys), pack_rows(rows).fields)


def snapshot(store, keys, partition="staging"):
    """Every field of the rows (staged with uint8 routes: 8 experts), as bytes."""
    got = store.get_many(keys, list(row_fields(ROUTES_UINT8)), partition=partition)
    assert not got.failed, got.failed
    return {n: (f.values.tobytes(), f.offsets.tobytes()) for n, f in got.batch.fields.items()}


def test_writer_cannot_overwrite_a_sealed_row_of_another_rollout(cluster_client, store):
    rng = np.random.default_rng(1)
    victim = make_rollout(rng, "victim", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
    other = make_rollout(rng, "other", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
    assert not store.put_many(pack_rows(victim.rows)).failed
    keys = [r.staging_key for r in victim.rows]
    before = snapshot(store, keys)

    # Another rollout's rows under the victim's keys, a forged re-signed copy of the
    # victim's rows, and one batch mixing the writer's own rows with one overwrite try.
    forged = resign(victim, set_tokens("c1", 0, 1))
    mixed_rows = other.rows + [forged.row("c2")]
    mixed = under_keys(mixed_rows, [r.staging_key for r in other.rows] + [keys[2]])
    attempts = [under_keys(other.rows, keys), pack_rows(forged.rows), mixed]
    results = cluster_client.gather([cluster_client.submit(writer_put, store, b, pure=False) for b in attempts])
    # The forgery changed c1 (and so c2's hashes); its c0 is identical: an idempotent re-put.
    for res, refused in zip(results[:2], (keys, keys[1:])):
        assert set(res.failed) == set(refused) and sorted(res.ok) == sorted(set(keys) - set(refused))
        assert {reason for reason, _ in res.failed.values()} == {"key_conflict"}
        assert all("already holds different content" in d for _, d in res.failed.values())
    # One refused row fails alone: the writer's own rows of the same batch are stored.
    assert sorted(results[2].ok) == sorted(r.staging_key for r in other.rows)
    assert set(results[2].failed) == {keys[2]}

    # An identical re-put is an idempotent success, and nothing changed.
    again = cluster_client.submit(writer_put, store, pack_rows(victim.rows), pure=False).result()
    assert sorted(again.ok) == sorted(keys) and not again.failed
    assert snapshot(store, keys) == before
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g": [victim.receipt, other.receipt]}).result(timeout=60)
    assert step.groups["g"].status == [R.OK, R.OK]


def test_delete_then_rewrite_is_still_rejected_by_the_receipt(cluster_client, store):
    """The store has no per-writer ownership: a writer may delete a row and stage a forged
    one in its place. The receipt (held by the controller) still pins every digest, so the
    forgery never reaches training."""
    rng = np.random.default_rng(2)
    victim = make_rollout(rng, "victim2", n_calls=3, routes=(L, K, E), vocab_size=VOCAB)
    assert not store.put_many(pack_rows(victim.rows)).failed
    forged = resign(victim, set_tokens("c1", 0, 1))
    assert cluster_client.submit(writer_delete, store, ["victim2/c1"], pure=False).result().ok == ["victim2/c1"]
    assert not cluster_client.submit(writer_put, store, pack_rows([forged.row("c1")]), pure=False).result().failed
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g": [victim.receipt]}).result(timeout=60)
    assert step.groups["g"].status == [R.wrong("digest")]


def test_keys_of_one_partition_are_invisible_to_another(cluster_client, store):
    rng = np.random.default_rng(3)
    built = make_rollout(rng, "part", n_calls=2, routes=(L, K, E), vocab_size=VOCAB)
    keys = [r.staging_key for r in built.rows]
    assert not store.put_many(pack_rows(built.rows), partition="staging").failed

    # Invisible: every key is missing from "cut"; deleting there touches nothing.
    got = store.get_many(keys, list(STAGING_FIELDS), partition="cut")
    assert len(got.batch) == 0 and {r for r, _ in got.failed.values()} == {"missing_key"} and set(got.failed) == set(keys)
    assert set(store.delete(keys, partition="cut").failed) == set(keys)
    # The same keys in "cut" with different content do not conflict with "staging".
    other = resign(built, set_tokens("c0", 0, 2))
    assert not cluster_client.submit(writer_put, store, pack_rows(other.rows), "cut", pure=False).result().failed
    staged, cut = snapshot(store, keys, "staging"), snapshot(store, keys, "cut")
    assert staged != cut and staged["token_ids"][0] == pack_rows(built.rows).fields["token_ids"].values.tobytes()
    # Field dtypes are pinned per partition: int32 tokens are refused in "staging" (pinned
    # int64 there) but pinned fresh in a partition that has never seen the field.
    narrow = PackedBatch(["part/x9"], {"token_ids": pack_rows([built.rows[0]]).fields["token_ids"]})
    narrow.fields["token_ids"].values = narrow.fields["token_ids"].values.astype(np.int32)
    assert {r for r, _ in store.put_many(narrow, partition="staging").failed.values()} == {"dtype_mismatch"}
    # Deleting in "cut" leaves "staging" whole, and the finalizer (which reads "staging")
    # accepts the original rollout.
    assert sorted(store.delete(keys, partition="cut").ok) == sorted(keys)
    assert snapshot(store, keys, "staging") == staged
    # Rows that exist only in "cut" are never found by a staging finalization.
    ghost = make_rollout(rng, "ghost", n_calls=2, vocab_size=VOCAB)
    assert not store.put_many(pack_rows(ghost.rows), partition="cut").failed
    ck = cut_key("ck1", "ghost", "c0", 0)
    assert not store.put_many(under_keys([ghost.rows[0]], [ck]), partition="cut").failed
    assert set(store.get_many([ck], partition="staging").failed) == {ck}
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    step = fin.submit_step({"g": [built.receipt, ghost.receipt]}).result(timeout=60)
    assert step.groups["g"].status == [R.OK, R.MISSING_STAGING_ROW]
    per_unit = [s["partitions"] for s in store.stats()]
    assert sum(p.get("staging", 0) for p in per_unit) == len(keys)
    assert sum(p.get("cut", 0) for p in per_unit) == len(ghost.rows) + 1


@pytest.mark.parametrize("partition", ["other", "../staging", "", "staging/x", None, 7])
def test_unknown_or_malformed_partition_is_refused(store, partition):
    with pytest.raises(StoreError, match="partition"):
        store.get_many(["a/b"], partition=partition)
    with pytest.raises(StoreError, match="partition"):
        store.put_many(pack_rows(make_rollout(np.random.default_rng(0), "p", n_calls=1).rows), partition=partition)
