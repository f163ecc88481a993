"""Rows a step's clear could not delete are asked for again by later clears (not leaked)."""
from __future__ import annotations

import dataclasses
import logging
import threading

import dask
import numpy as np
import pytest

from pipeline.finalize import Finalizer
from pipeline.finalize.settings import FinalizeSettings
from pipeline.store.unit import StorageUnit
from rollout_factory import make_group
from support import store_maker, wait_until
from tasks.keys import unit_for_key
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)

VOCAB = 64
BROKEN_UNIT = 0


@pytest.fixture
def thread_store(inprocess_client, tmp_path):
    # A unit whose delete raised is not skipped afterwards: the test reads its rows back.
    with dask.config.set({"token-capture.store.skip-unreachable-s": 0.0}):
        with store_maker(inprocess_client, tmp_path / "spill") as make:
            yield make(n_units=2)


class BrokenDeletes:
    """Unit ``BROKEN_UNIT``'s deletes raise while ``broken`` is set; counts them."""

    def __init__(self):
        self.broken = threading.Event()
        self.broken.set()
        self.refused = 0
        self.real = StorageUnit.delete

    def install(self, monkeypatch):
        fault = self

        def delete(unit, *a, **kw):
            if unit.unit_index == BROKEN_UNIT and fault.broken.is_set():
                fault.refused += 1
                raise RuntimeError("injected: the unit cannot delete now")
            return fault.real(unit, *a, **kw)

        monkeypatch.setattr(StorageUnit, "delete", delete)


def staged_group(store, name: str, seed: int):
    builts = make_group(np.random.default_rng(seed), name, 4, rollout_prefix=name, n_calls=2, vocab_size=VOCAB)
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed
    return [b.receipt for b in builts], [r.staging_key for b in builts for r in b.rows]


def present(store, keys) -> set[str]:
    return set(store.get_many(keys, ["token_ids"]).batch.keys)


def finalizer(client, store, **changes) -> Finalizer:
    settings = dataclasses.replace(FinalizeSettings.from_config(vocab_size=VOCAB, num_experts=None), clear_staged=True, **changes)
    return Finalizer(client, store, settings=settings)


def test_rows_a_clear_could_not_delete_go_with_the_next_steps_clear(inprocess_client, thread_store, monkeypatch):
    store, fault = thread_store, BrokenDeletes()
    a_receipts, a_keys = staged_group(store, "ua", 1)
    b_receipts, b_keys = staged_group(store, "ub", 2)
    on_broken = {k for k in a_keys if unit_for_key(k, len(store.units)) == BROKEN_UNIT}
    assert on_broken and len(on_broken) < len(a_keys)
    fin = finalizer(inprocess_client, store)
    fault.install(monkeypatch)
    first = fin.submit_step({"ua": a_receipts})
    assert first.result().groups["ua"].status == ["ok"] * 4
    counts = first.clear_future.result()
    assert set(counts["failed"]) == on_broken and counts["deleted"] == len(a_keys) - len(on_broken)
    wait_until(lambda: len(fin.uncleared) == len(on_broken), what="the failed keys kept for the next clear")
    assert present(store, a_keys) == on_broken
    # The unit answers again: the next step's clear deletes its own rows and the leftovers.
    fault.broken.clear()
    second = fin.submit_step({"ub": b_receipts})
    assert second.result().groups["ub"].status == ["ok"] * 4
    counts = second.clear_future.result()
    assert counts["failed"] == {} and counts["deleted"] == len(b_keys) + len(on_broken)
    wait_until(lambda: len(fin.uncleared) == 0, what="nothing left to clear")
    assert present(store, a_keys + b_keys) == set()
    assert fin.uncleared.given_up == 0


def test_drain_asks_once_more_and_a_row_that_never_deletes_is_given_up(inprocess_client, thread_store, monkeypatch, caplog):
    store, fault = thread_store, BrokenDeletes()
    receipts, keys = staged_group(store, "uf", 3)
    on_broken = {k for k in keys if unit_for_key(k, len(store.units)) == BROKEN_UNIT}
    assert on_broken
    fin = finalizer(inprocess_client, store, clear_attempts=2)
    fault.install(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="pipeline.finalize.uncleared"):
        handle = fin.submit_step({"uf": receipts})
        fin.drain(timeout=60)  # collects the step, then one more clear of what it could not delete
        assert set(handle.clear_future.result()["failed"]) == on_broken
        # Two clears each (the step's, drain's), both refused: given up, logged, still staged.
        wait_until(lambda: fin.uncleared.given_up == len(on_broken), what="the keys given up")
    assert len(fin.uncleared) == 0 and fault.refused >= 2
    assert present(store, keys) == on_broken
    assert any("gave up deleting" in r.getMessage() and str(len(on_broken)) in r.getMessage() for r in caplog.records)
    # Nothing left to ask for: no further clear is submitted.
    assert fin.retry_clears() is None


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "5"])
def test_a_bad_clear_attempts_setting_is_refused_naming_it(bad):
    from tasks.errors import InvalidInput

    with dask.config.set({"token-capture.finalize.clear-attempts": bad}):
        with pytest.raises(InvalidInput, match=r"finalize\.clear-attempts is .*; set an int >= 1"):
            FinalizeSettings.from_config(vocab_size=VOCAB)


def _answer(failed_keys):
    return {"deleted": 0, "deferred": 0, "failed": {k: ("unit_unavailable", "injected") for k in failed_keys}}


def test_a_kept_key_is_in_one_clear_at_a_time_and_missing_means_gone(inprocess_client):
    from distributed import Event, wait

    from pipeline.finalize.uncleared import UnclearedRows

    rows = UnclearedRows(max_attempts=3)
    rows.watch(["a", "b", "c"], inprocess_client.submit(_answer, ["a", "b"], pure=False))
    wait(rows.unanswered())
    assert rows.take() == ["a", "b"] and len(rows) == 2
    # Taken by a clear still running: another clear made meanwhile does not take them again.
    gate = Event("uncleared-gate", client=inprocess_client)

    def held(failed):
        Event("uncleared-gate").wait(30)
        return {"deleted": 1, "deferred": 0, "failed": failed}

    rows.watch(["a", "b"], inprocess_client.submit(held, {"b": ("missing_key", "gone")}, pure=False))
    assert rows.take() == []
    gate.set()
    wait(rows.unanswered())
    # "a" deleted, "b" missing (gone already): nothing kept, nothing given up.
    assert len(rows) == 0 and rows.given_up == 0 and rows.take() == []

