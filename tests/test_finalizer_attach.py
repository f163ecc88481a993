"""A controller that replaced one that died: ``Finalizer.attach`` finds the store by its
published name, and resubmitting the same receipts gives the same tensors bit for bit
(another step id, another Finalizer, another layout, after a first submission was left
partly computed). Real clusters; rows staged through the real capture gate.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from pipeline.client import lookup_store, publish_store, unpublish_store
from pipeline.finalize import Finalizer
from pipeline.finalize import worker_tasks
from rollout_factory import make_group, make_rollout
from step_tensors import assert_identical, n_fields, step_tensors
from support import store_maker, wait_until
from tasks.errors import StoreUnavailable
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8


def stage(store, builts):
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed
    return builts


def staged_groups(store, rng, prefix: str) -> dict[str, list]:
    """Three routed groups of 3 rollouts, one with an off-chain branch, plus a rollout
    whose terminal row is missing (rejected: its row of the tensors is zeros, masked)."""
    groups = {f"{prefix}{g}": stage(store, make_group(rng, f"{prefix}{g}", 3, n_calls=3, routes=(L, K, E), n_branches=g % 2)) for g in range(3)}
    bad = stage(store, [make_rollout(rng, f"{prefix}-bad", n_calls=2, group_id=f"{prefix}0", routes=(L, K, E))])[0]
    store.delete([f"{bad.rollout_id}/c1"])
    groups[f"{prefix}0"].append(bad)
    return groups


def receipts_of(groups) -> dict[str, list]:
    return {gid: [b.receipt for b in bs] for gid, bs in groups.items()}


# ---- attach: the store by its published name ------------------------------------------


def test_attach_finalizes_on_the_store_published_under_a_name(cluster_client, store_factory):
    store = store_factory(n_units=2)
    rng = np.random.default_rng(11)
    groups = {"at0": stage(store, make_group(rng, "at0", 3, n_calls=2))}
    publish_store(cluster_client, store, name="attach-named")
    try:
        fin = Finalizer.attach(cluster_client, "attach-named", vocab_size=VOCAB, num_experts=None, keep_intermediates=True)
        assert fin.store is not store and fin.store.unit_workers == store.unit_workers  # the published copy
        assert fin.keep_intermediates and fin.settings.vocab_size == VOCAB  # kwargs reach the constructor
        step = fin.submit_step(receipts_of(groups)).result()
        assert step.groups["at0"].status == ["ok"] * 3
    finally:
        unpublish_store(cluster_client, "attach-named")


def test_attach_defaults_to_the_configured_store_name(cluster_client, store_factory):
    import dask

    store = store_factory(n_units=1)
    with dask.config.set({"token-capture.capture-client.store-name": "attach-configured"}):
        publish_store(cluster_client, store)
        try:
            fin = Finalizer.attach(cluster_client, vocab_size=VOCAB)
            assert fin.store.unit_workers == store.unit_workers
            assert cluster_client.list_datasets() and "attach-configured" in cluster_client.list_datasets()
        finally:
            unpublish_store(cluster_client)


def test_attach_without_a_published_store_says_which_dataset_and_how(cluster_client):
    address = cluster_client.scheduler.address
    with pytest.raises(StoreUnavailable) as info:
        Finalizer.attach(cluster_client, "attach-nothing-here")
    message = str(info.value)
    assert "\n" not in message  # one line
    assert "'attach-nothing-here'" in message and address in message
    assert "publish_store(client, store, name='attach-nothing-here')" in message
    assert "start_hosted(client, name='attach-nothing-here')" in message
    with pytest.raises(StoreUnavailable, match="attach-nothing-here"):
        lookup_store(cluster_client, "attach-nothing-here")


# ---- resubmission: bit for bit -----------------------------------------------------------


def test_resubmitted_receipts_give_the_same_tensors_bit_for_bit(cluster_client, store_factory):
    store = store_factory(n_units=2, memory_limit="16KiB")  # rows spill: read back from disk too
    rng = np.random.default_rng(12)
    groups = staged_groups(store, rng, "rs")
    first = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    first.with_settings(clear_staged=False)
    reference = first.submit_step(receipts_of(groups), step_id="first").result()
    assert reference.groups["rs0"].status == ["ok"] * 3 + ["missing_staging_row"]
    want = step_tensors(reference)
    assert n_fields(want) >= 3 * 9 + 10
    publish_store(cluster_client, store, name="resubmit-store")
    try:
        # Another Finalizer, on the published copy, another step id, another layout (one
        # rollout per verify task, so other sites assemble other groups), twice.
        again = Finalizer.attach(cluster_client, "resubmit-store", vocab_size=VOCAB, num_experts=E)
        again.with_settings(clear_staged=False, verify_token_budget=1)
        handles = [again.submit_step(receipts_of(groups), step_id=f"again-{i}") for i in range(2)]
        assert handles[0].graph.token != handles[1].graph.token
        assert len(handles[0].graph.verify_layout) > len(first.submit_step(receipts_of(groups)).graph.verify_layout)
        for h in handles:
            assert_identical(want, step_tensors(h.result()))
        first.drain()
    finally:
        unpublish_store(cluster_client, "resubmit-store")


class AssembleOnce:
    """Holds the FIRST assemble of a group containing ``rollout`` until released; any later
    one (a resubmission's) runs straight through."""

    def __init__(self, rollout: str) -> None:
        self.rollout = rollout
        self.started = threading.Event()
        self.release = threading.Event()
        self.real = worker_tasks.assemble_group
        self._lock = threading.Lock()

    def __call__(self, rows, rewards, **kw):
        if any(r.rollout_id == self.rollout for r in rows):
            with self._lock:
                first = not self.started.is_set()
                self.started.set()
            if first:
                assert self.release.wait(60), "the test never released the assemble"
        return self.real(rows, rewards, **kw)


def test_a_resubmission_after_a_partly_computed_step_gives_the_same_tensors(inprocess_client, tmp_path, monkeypatch):
    rng = np.random.default_rng(13)
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        store = make(n_units=2)
        groups = staged_groups(store, rng, "pc")
        reference = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=E)
        reference.with_settings(clear_staged=False)
        want = step_tensors(reference.submit_step(receipts_of(groups), step_id="reference").result())
        gate = AssembleOnce(groups["pc2"][0].rollout_id)
        monkeypatch.setattr(worker_tasks, "assemble_group", gate)
        dying = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=E)
        partial = dying.submit_step(receipts_of(groups), step_id="dying")
        partial.group_futures  # its groups assembled on the cluster, one held there by the gate
        try:
            assert gate.started.wait(30)
            wait_until(lambda: partial.group_futures["pc0"].done(), what="a first group assembled")
            assert not partial.group_futures["pc2"].done()  # the step is partly computed
            # Its replacement resubmits the same receipts while the first is still running,
            # then the first is abandoned (as a dead controller's futures are released).
            replacement = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=E)
            replacement.with_settings(verify_token_budget=1)
            handle = replacement.submit_step(receipts_of(groups), step_id="replacement")
            got = step_tensors(handle.result())
            partial.cancel()
        finally:
            gate.release.set()
        assert_identical(want, got)
        # The replacement delivered and cleared the rows the abandoned step no longer reads.
        assert partial.failed() and handle.clear_future is not None and not handle.kept_keys
        handle.clear_future.result()
        assert all(s["rows"] == 0 for s in store.stats())
