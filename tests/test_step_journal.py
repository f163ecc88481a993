"""The step journal: a controller that replaces one that died resumes from its records.

A Finalizer with a journal records each step's receipts before submitting it and, once
the step is delivered, the keys its clear owes; ``resume()`` in a replacement submits
again every recorded step it did not deliver (the same tensors bit for bit) and clears
the rows owed. Real clusters; rows staged through the real store.
"""
from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest

from pipeline.finalize import Finalizer
from pipeline.finalize.journal import StepJournal
from pipeline.store.location import Location
from rollout_factory import make_group
from step_tensors import assert_identical, step_tensors
from tasks.errors import FinalizeError
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8


def staged_steps(store, seed: int, n_steps: int) -> dict[str, dict[str, list]]:
    """Step id -> group id -> receipts, every row staged."""
    rng = np.random.default_rng(seed)
    steps = {}
    for s in range(n_steps):
        groups = {f"j{seed}s{s}g{g}": make_group(rng, f"j{seed}s{s}g{g}", 3, n_calls=2, routes=(L, K, E)) for g in range(2)}
        res = store.put_many(pack_rows([r for bs in groups.values() for b in bs for r in b.rows]))
        assert not res.failed, res.failed
        steps[f"s{s}"] = {gid: [b.receipt for b in bs] for gid, bs in groups.items()}
    return steps


def records(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("step-"))


def test_a_replacement_controller_resumes_the_steps_a_dead_one_did_not_deliver(cluster_client, store_factory, tmp_path):
    store = store_factory(n_units=2)
    steps = staged_steps(store, 41, 3)
    reference = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    reference.with_settings(clear_staged=False)
    want = {sid: step_tensors(reference.submit_step(g, step_id=sid).result()) for sid, g in steps.items()}
    journal = tmp_path / "journal"
    dying = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    handles = {sid: dying.submit_step(g, step_id=sid, trainer_version=3) for sid, g in steps.items()}
    assert len(records(journal)) == 3  # every step recorded before it ran
    handles["s0"].result()  # delivered; s1 and s2 never are: the controller "dies" here
    handles["s0"].clear_future.result()
    state = StepJournal(str(journal)).read()
    assert [s.step_id for s in state.steps] == ["s1", "s2"] and [s.trainer_version for s in state.steps] == [3, 3]
    assert set(state.owed) == {"s0"} and state.owed["s0"]  # its clear's keys, until a later clear settles them
    replacement = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    resumed = replacement.resume()
    assert [h.step_id for h in resumed] == ["s1", "s2"]
    for h in resumed:
        assert_identical(want[h.step_id], step_tensors(h.result()), where=h.step_id)
    replacement.drain()
    assert records(journal) == []  # delivered and cleared: nothing left to resume
    assert sum(s["rows"] for s in store.stats()) == 0  # every step's rows cleared once delivered


def test_a_step_whose_record_cannot_be_written_is_not_submitted(cluster_client, store_factory, tmp_path, monkeypatch):
    store = store_factory(n_units=1)
    steps = staged_steps(store, 42, 1)
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(tmp_path / "j"))

    def refuse(self, name, buffers, algorithm="sha256"):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Location, "write", refuse)
    with pytest.raises(FinalizeError, match=r"step 's0' was not submitted: its journal record .* No space left"):
        fin.submit_step(steps["s0"], step_id="s0")
    assert fin.in_flight == []


def test_resume_reads_past_an_unreadable_record_and_needs_a_journal(cluster_client, store_factory, tmp_path):
    store = store_factory(n_units=1)
    journal = tmp_path / "j"
    journal.mkdir()
    (journal / "step-0000.msgpack").write_bytes(b"not msgpack \xff")
    (journal / "step-0001.msgpack").write_bytes(msgpack.packb({"format": "token-capture-step-journal", "version": 1,
                                                                "state": "submitted"}))  # no receipts
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    assert fin.resume() == []
    assert StepJournal(str(journal)).read().unreadable == ["step-0000.msgpack", "step-0001.msgpack"]
    assert (journal / "step-0000.msgpack").exists()  # left for a person to look at
    with pytest.raises(FinalizeError, match=r"resume\(\) needs a journal"):
        Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E).resume()


def test_with_a_journal_step_ids_are_the_finalizers_own_and_a_refused_step_leaves_no_record(
        cluster_client, store_factory, tmp_path):
    store = store_factory(n_units=1)
    steps = staged_steps(store, 43, 2)
    journal = str(tmp_path / "j")
    one = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=journal)
    two = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=journal)
    a, b = one.submit_step(steps["s0"]), two.submit_step(steps["s1"])
    assert a.step_id != b.step_id and a.step_id.startswith("step-") and a.step_id.endswith("-0")
    assert len(records(journal)) == 2  # a replacement's own steps never overwrite a recorded one
    with pytest.raises(FinalizeError, match=r"step id .* is already in flight"):
        one.submit_step(steps["s1"], step_id=a.step_id)
    with pytest.raises(FinalizeError):
        one.submit_step({"empty": []}, step_id="refused")  # planning refuses an empty group
    assert len(records(journal)) == 2  # the refused step was never submitted: no record
    a.result(), b.result()
    one.drain(), two.drain()
    assert records(journal) == []


def test_a_step_collected_but_not_acknowledged_keeps_its_rows_and_record_until_acknowledged(
        cluster_client, store_factory, tmp_path):
    # A trainer that consumes a batch before it lets the rows go (acknowledge after its
    # optimizer step or checkpoint): a controller dying in between leaves the step to the
    # replacement's resume, bit for bit; acknowledged, the step is delivered and cleared.
    store = store_factory(n_units=2)
    steps = staged_steps(store, 43, 1)
    journal = tmp_path / "journal"
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    handle = fin.submit_step(steps["s0"], step_id="s0")
    with pytest.raises(FinalizeError, match="before result"):
        handle.acknowledge()
    got = handle.result(acknowledge=False)
    assert handle.collected and not handle.acknowledged and handle.clear_future is None
    assert [s.step_id for s in StepJournal(str(journal)).read().steps] == ["s0"]  # still to resume
    rows = sum(s["rows"] for s in store.stats())
    assert rows > 0
    fin.drain()  # a step collected and not acknowledged stays so
    assert not handle.acknowledged and sum(s["rows"] for s in store.stats()) == rows
    replacement = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    [again] = replacement.resume()
    assert_identical(step_tensors(got), step_tensors(again.result(acknowledge=False)), where="s0")
    handle.acknowledge()
    handle.acknowledge()  # once only
    assert handle.acknowledged and handle.clear_future.result()["deleted"] > 0
    assert handle.result() is got
    state = StepJournal(str(journal)).read()
    assert state.steps == [] and set(state.owed) <= {"s0"}  # delivered: nothing to resubmit
    assert sum(s["rows"] for s in store.stats()) == 0


def test_a_failed_step_is_resubmitted_under_its_own_id_with_one_record(cluster_client, store_factory, tmp_path):
    # A step given up on (its result timed out, then cancelled: failed) is submitted
    # again with the same receipts and id: the same tensors, and the journal keeps the
    # step's one record throughout (a controller dying now would resume it once).
    from distributed import Event

    from failover_controller import HOLD, hold_every_slot

    store = store_factory(n_units=2)
    steps = staged_steps(store, 44, 1)
    reference = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    reference.with_settings(clear_staged=False)
    want = step_tensors(reference.submit_step(steps["s0"], step_id="s0").result())
    journal = tmp_path / "journal"
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, journal=str(journal))
    holders = hold_every_slot(cluster_client)  # the step's verify tasks wait for a slot
    try:
        handle = fin.submit_step(steps["s0"], step_id="s0", trainer_version=5)
        with pytest.raises(TimeoutError):
            handle.result(timeout=0.5)
        with pytest.raises(FinalizeError, match="still running"):
            handle.resubmit()
        handle.cancel()
        again = handle.resubmit()
    finally:
        Event(HOLD, client=cluster_client).set()
        cluster_client.gather(holders)
        Event(HOLD, client=cluster_client).clear()
    assert again is not handle and again.step_id == "s0" and again.trainer_version == 5
    assert fin.in_flight == [again] and [s.step_id for s in StepJournal(str(journal)).read().steps] == ["s0"]
    assert_identical(want, step_tensors(again.result()), where="s0")
    with pytest.raises(FinalizeError, match="collected"):
        again.resubmit()
    fin.drain()
    assert records(journal) == [] and fin.in_flight == []
    assert sum(s["rows"] for s in store.stats()) == 0  # delivered once, cleared once
