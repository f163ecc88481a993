"""A bug in the verifier is an internal error, never bad data.

A verifier step made to raise for one rollout: that rollout reads ``internal_error``
(not ``invalid_staging_row``), the error is logged, the rest of its group verifies
bit-identically, and the count reaches the group's metrics, event and step result.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
from rollout_factory import fetch, make_group
from support import store_maker
from test_finalize_graph import events_of, readback
from test_verify import same_rows

from pipeline.finalize import Finalizer, timing
from tasks import reasons as R
from tasks.finalize import chain, verify
from tasks.finalize.assemble import assemble_group
from tasks.finalize.plan import plan_group
from tasks.finalize.verify import verify_many
from tasks.packed import pack_rows

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("keep_staged_rows")]



VOCAB, L, K, E = 64, 2, 2, 8


def _fail_linearize(monkeypatch: pytest.MonkeyPatch, rollout_id: str) -> None:
    original = verify.linearize_chain

    def faulty(walk, *args, **kwargs):
        if walk.plan.rollout_id == rollout_id:
            raise RuntimeError("injected fault in linearize")
        return original(walk, *args, **kwargs)

    monkeypatch.setattr(verify, "linearize_chain", faulty)


def _fail_chain(monkeypatch: pytest.MonkeyPatch, rollout_id: str) -> None:
    original = chain.ChainCheck.run

    def faulty(self, rules):
        if self.plan.rollout_id == rollout_id:
            raise RuntimeError("injected fault in the chain walk")
        return original(self, rules)

    monkeypatch.setattr(chain.ChainCheck, "run", faulty)


FAULTS = {"linearize": _fail_linearize, "chain": _fail_chain}


def test_internal_error_is_outside_the_rejection_vocabulary():
    assert R.INTERNAL_ERROR == "internal_error"
    assert R.INTERNAL_ERROR not in R.ALL_REASONS
    assert not R.is_reason(R.INTERNAL_ERROR)
    for group in (R.RECEIPT_REASONS, R.ROW_REASONS, R.LINEAGE_REASONS, R.CONTENT_REASONS):
        assert R.INTERNAL_ERROR not in group


@pytest.mark.parametrize("where", sorted(FAULTS))
@pytest.mark.parametrize("routes", [None, (L, K, E)])
def test_a_raising_step_is_an_internal_error_and_spares_the_group(monkeypatch, caplog, where, routes):
    builts = make_group(np.random.default_rng(7), "ie", 4, n_calls=3, routes=routes, n_branches=1)
    step = plan_group([b.receipt for b in builts])
    rows, batch_routes = fetch(builts, step.staging_keys, step.routes_keys)
    num_experts = None if routes is None else E
    clean = verify_many(step.rollouts, rows, batch_routes, vocab_size=VOCAB, num_experts=num_experts)
    assert all(r.ok for r in clean)

    bad = builts[1].rollout_id
    FAULTS[where](monkeypatch, bad)
    with caplog.at_level(logging.ERROR, logger=verify.__name__):
        got = verify_many(step.rollouts, rows, batch_routes, vocab_size=VOCAB, num_experts=num_experts)

    by_id = {r.rollout_id: r for r in got}
    assert by_id[bad].status == R.INTERNAL_ERROR and by_id[bad].status != R.INVALID_STAGING_ROW
    assert by_id[bad].internal_error and not by_id[bad].ok and by_id[bad].linearized is None
    assert "RuntimeError" in by_id[bad].detail and by_id[bad].n_calls == 3
    for before, after in zip(clean, got):
        if after.rollout_id == bad:
            continue
        assert not after.internal_error
        assert (after.status, after.detail, after.n_calls) == (before.status, before.detail, before.n_calls)
        assert same_rows(after.linearized, before.linearized)

    logged = [rec for rec in caplog.records if rec.levelno >= logging.ERROR and bad in rec.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert logged[0].exc_info[0] is RuntimeError

    fg = assemble_group(got, step.rewards)
    assert fg.metrics["internal_errors"] == 1
    assert fg.metrics["accepted"] == 3 and fg.metrics["rejected"] == 0
    assert fg.metrics["rejected_by_reason"] == {}
    assert fg.status[1] == R.INTERNAL_ERROR and float(fg.sample_mask[1]) == 0.0


def test_status_counts_keep_internal_errors_apart():
    accepted, rejected, internal = timing.status_counts(
        [R.OK, R.INTERNAL_ERROR, R.CORRUPT_DIGEST, R.OK, R.INTERNAL_ERROR]
    )
    assert (accepted, rejected, internal) == (2, {R.CORRUPT_DIGEST: 1}, 2)




def test_graph_reports_internal_errors_in_group_event_and_step(monkeypatch, caplog, inprocess_client, tmp_path):
    client = inprocess_client
    builts = make_group(np.random.default_rng(8), "g0", 3, rollout_prefix="ieg", n_calls=2, routes=(L, K, E))
    bad = builts[0].rollout_id
    with store_maker(client, tmp_path / "spill") as make:
        store = make(n_units=1)
        res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
        assert not res.failed, res.failed
        _fail_linearize(monkeypatch, bad)
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
        with caplog.at_level(logging.ERROR, logger=verify.__name__):
            step = fin.submit_step({"g0": [b.receipt for b in builts]}, step_id="internal-errors").result()

        group = step.groups["g0"]
        assert group.status == [R.INTERNAL_ERROR, R.OK, R.OK]
        assert group.sample_mask.tolist() == [0.0, 1.0, 1.0]
        for i, b in enumerate(builts[1:], start=1):
            want = readback(store, b)
            n = len(want["token_ids"])
            assert int(group.input_lengths[i]) == n
            np.testing.assert_array_equal(group.input_ids[i, :n].numpy(), want["token_ids"])
            np.testing.assert_array_equal(group.routed_experts[i, :n].numpy(), want["routed_experts"])

    assert group.metrics["internal_errors"] == 1
    assert group.metrics["accepted"] == 2 and group.metrics["rejected"] == {}
    assert step.internal_errors == 1 and step.metrics["internal_errors"] == 1
    assert step.rejected == {}
    (event,) = events_of(client, "internal-errors", "group", 1)
    assert event["internal_errors"] == 1 and event["rejected"] == {}
    assert any(bad in rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR)


def test_verify_task_whose_verifier_raises_marks_internal_errors(monkeypatch, caplog):
    from pipeline.finalize import worker_tasks

    builts = make_group(np.random.default_rng(9), "iet", 2, n_calls=2)
    step = plan_group([b.receipt for b in builts])

    def boom(*args, **kwargs):
        raise RuntimeError("injected fault in verify_many")

    monkeypatch.setattr(worker_tasks, "verify_many", boom)
    with caplog.at_level(logging.ERROR, logger=worker_tasks.__name__):
        out = worker_tasks.verify_piece(0, list(enumerate(step.rollouts)), None, None, VOCAB, None)
    assert [out.results[r].status for r in range(2)] == [R.INTERNAL_ERROR] * 2
    assert all(out.results[r].n_calls == 2 for r in range(2))
    assert any(rec.exc_info and rec.exc_info[0] is RuntimeError for rec in caplog.records)
