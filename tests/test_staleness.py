"""Staleness: every row carries its rollout's oldest and newest weight version, the batch
its lag behind the trainer, ``finalize.max-staleness`` drops exactly the stale rollouts
(reason ``stale``, rows cleared with the step's, never earlier), and the step event's
figures by rollout length."""
from __future__ import annotations

import dataclasses
import pickle

import dask
import msgpack
import numpy as np
import pytest
import torch
from distributed import wait
from rollout_factory import VOCAB, fetch, make_rollout

from pipeline.dashboard.state import TokenCaptureState
from pipeline.dashboard.trainer_events import parse_staleness
from pipeline.events import FINALIZE
from pipeline.finalize import Finalizer
from pipeline.finalize.serializers import dump_group, dump_verify_out, load_group, load_verify_out
from pipeline.finalize.task_outputs import VerifyOut
from pipeline.finalize.settings import FinalizeSettings
from pipeline.finalize.timing import public
from pipeline.metrics.families import staleness_families
from support import store_maker
from tasks import reasons as R
from tasks.errors import FinalizeError, InvalidInput
from tasks.finalize.assemble import Staleness, assemble_group, rebuild_group
from tasks.finalize.plan import plan_group
from tasks.finalize.staleness import BUCKET_LABELS, staleness_figures, step_staleness
from tasks.finalize.step_batch import group_advantages, step_batch
from tasks.finalize.verify import rejected_result, verify_many
from tasks.packed import pack_rows

# Per rollout, the weight version of each of its three chain calls.
VERSIONS = [(3, 4, 5), (5, 5, 5), (1, 2, 2), (6, 7, 7)]


def results(seed: int = 0, versions=VERSIONS, **kw):
    rng = np.random.default_rng(seed)
    builts = [make_rollout(rng, f"v{seed}-r{i}", n_calls=len(v), weight_version=list(v), **kw) for i, v in enumerate(versions)]
    step = plan_group([b.receipt for b in builts])
    rows, routes = fetch(builts, step.staging_keys, step.routes_keys)
    res = verify_many(step.rollouts, rows, routes, vocab_size=VOCAB, num_experts=None)
    assert all(r.ok for r in res)
    return res


def test_rows_carry_oldest_and_newest_versions_and_the_lag():
    res = results()
    res[3] = rejected_result(res[3].rollout_id, R.CORRUPT_DIGEST, "test", n_calls=3)
    g = assemble_group(res, [1.0, 0.0, 2.0, 1.0])
    assert g.weight_version_oldest.tolist() == [3, 5, 1, 0]  # a rejected row: 0, like its other fields
    assert g.weight_version_newest.tolist() == [5, 5, 2, 0]
    b = step_batch([g, g], trainer_version=7)
    assert b["weight_version_oldest"].dtype == torch.int64 and b["weight_version_oldest"].tolist() == [3, 5, 1, 0] * 2
    assert b["weight_version_newest"].tolist() == [5, 5, 2, 0] * 2
    assert b["weight_lag"].dtype == torch.int64 and b["weight_lag"].tolist() == [4, 2, 6, 7] * 2  # rejected rows too
    assert "weight_lag" not in step_batch([g])
    for bad in (True, 1.5, "7", 2**63):
        with pytest.raises(InvalidInput, match="trainer_version"):
            step_batch([g], trainer_version=bad)


def test_max_staleness_drops_exactly_the_stale_rollouts():
    res = results(1)
    rewards = [1.0, 0.0, 2.0, 3.0]
    g = assemble_group(res, rewards, staleness=Staleness(trainer_version=7, max_staleness=4))
    # lags 4, 2, 6, 1: only the third is past 4 (a lag equal to the bound is kept)
    assert g.status == [R.OK, R.OK, R.STALE, R.OK]
    assert "6 versions behind trainer_version 7" in g.details[2] and "max-staleness 4" in g.details[2]
    assert g.sample_mask.tolist() == [1, 1, 0, 1] and int(g.input_lengths[2]) == 0
    assert g.weight_version_oldest.tolist() == [3, 5, 1, 6]  # the stale row keeps its versions
    assert g.metrics["rejected_by_reason"] == {R.STALE: 1} and g.metrics["accepted"] == 3
    # the stale row's verified tokens ride on the group (its input_lengths is 0), not in its metrics
    assert g.verified_tokens.dtype == torch.int64
    assert g.verified_tokens.tolist() == [r.linearized.length for r in res] and g.verified_tokens[2] > 0
    assert not any(k.startswith("_") for k in g.metrics)
    b = step_batch([g], trainer_version=7)
    assert not b["loss_mask"][2].any() and b["advantages"][2] == 0.0
    want = group_advantages(torch.tensor(rewards), torch.tensor([True, True, False, True]), torch.zeros(4, dtype=torch.int64), 1)
    assert torch.equal(b["advantages"], want)  # as if rejected: no share in the group's statistics
    assert b["weight_lag"].tolist() == [4, 2, 6, 1]
    # without the bound (or without a trainer version) nothing is stale
    assert assemble_group(res, rewards).status == [R.OK] * 4


def test_groups_without_versions_read_as_zeros_and_versions_survive_the_wire():
    g = assemble_group(results(2), [0.0] * 4)
    _, (ids, tensors, status, details, metrics) = g.__reduce__()
    old = {k: v for k, v in tensors.items() if not k.startswith("weight_version")}  # an older pickle
    back = rebuild_group(ids, old, status, details, metrics)
    assert back.weight_version_oldest.tolist() == [0] * 4 and back.weight_version_oldest.dtype == torch.int64
    assert step_batch([back], trainer_version=3)["weight_lag"].tolist() == [3] * 4
    older = {k: v for k, v in tensors.items() if k != "verified_tokens"}  # without verified tokens: its lengths
    assert rebuild_group(ids, older, status, details, metrics).verified_tokens.tolist() == g.input_lengths.tolist()
    for copy in (pickle.loads(pickle.dumps(g)), load_group(*dump_group(g))):
        assert torch.equal(copy.weight_version_oldest, g.weight_version_oldest)
        assert torch.equal(copy.weight_version_newest, g.weight_version_newest)
        assert torch.equal(copy.verified_tokens, g.verified_tokens)
    # a verify task's output carries each verdict's versions to wherever the group is assembled
    res = results(2)
    out = load_verify_out(*dump_verify_out(VerifyOut(0, dict(enumerate(res)), {}, {}, {})))
    assert [out.results[i].weight_versions for i in range(4)] == [(3, 5), (5, 5), (1, 2), (6, 7)]


def test_figures_by_length_bucket():
    tokens = np.array([100, 2000, 5000, 20000, 500, 1023, 1024])
    oldest = np.array([9, 8, 5, 2, 10, 10, 7])
    stale = np.array([False, False, True, True, False, False, False])
    f = staleness_figures(tokens, oldest, stale, reference=10, trainer_version=10, max_staleness=4)
    by = {b["bucket"]: b for b in f["buckets"]}
    assert list(by) == list(BUCKET_LABELS)
    assert [by[k]["rollouts"] for k in BUCKET_LABELS] == [3, 2, 1, 1]  # 1023 is short, 1024 is not
    assert [by[k]["stale"] for k in BUCKET_LABELS] == [0, 0, 1, 1]
    assert by["<1k"]["mean_lag"] == pytest.approx(1 / 3) and by["1-4k"]["mean_lag"] == pytest.approx(2.5)
    assert by[">=16k"]["mean_lag"] == 8.0
    assert f["rollouts"] == 7 and f["stale"] == 2 and f["max_lag"] == 8
    assert f["mean_lag"] == pytest.approx(float(np.mean(10 - oldest)))


def test_step_figures_count_stale_rows_at_their_verified_length():
    res = results(3)
    g = assemble_group(res, [0.0] * 4, staleness=Staleness(7, 4))
    f = step_staleness([g], trainer_version=7, max_staleness=4)
    assert f["rollouts"] == 4 and f["stale"] == 1 and f["reference_version"] == 7
    assert f["buckets"][0]["rollouts"] == 4 and f["buckets"][0]["lag_sum"] == 4 + 2 + 6 + 1
    # without a trainer version, lags run from the newest version the step saw (7)
    f = step_staleness([assemble_group(res, [0.0] * 4)], trainer_version=None, max_staleness=None)
    assert f["reference_version"] == 7 and f["trainer_version"] is None and f["stale"] == 0


I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def saturated(n: int) -> int:
    return min(max(n, I64_MIN), I64_MAX)


@pytest.mark.parametrize("reference, oldest", [
    (10, [I64_MIN, 5, I64_MIN + 20, 9]),  # lags past int64's max
    (-5, [I64_MAX, -6, I64_MAX - 1, -5]),  # a negative trainer version: lags past int64's min
    (-1, [I64_MIN, 0, -1, -1]),  # a lag exactly at int64's max fits
    (0, [2**60 + 1, -(2**60) - 1, -3, 7]),  # exact sums past float64's 2**53
])
def test_lags_past_int64_saturate_and_never_wrap(reference, oldest):
    tokens = np.array([100, 200, 2000, 3000])
    f = staleness_figures(tokens, np.array(oldest, dtype=np.int64), np.zeros(4, bool),
                          reference=reference, trainer_version=reference, max_staleness=None)
    lags = [saturated(reference - v) for v in oldest]  # Python ints: no overflow
    assert f["max_lag"] == max(lags) and type(f["max_lag"]) is int
    assert f["mean_lag"] == sum(lags) / 4
    by = {b["bucket"]: b for b in f["buckets"]}
    for label, part in (("<1k", lags[:2]), ("1-4k", lags[2:])):
        assert by[label]["lag_sum"] == saturated(sum(part)) and by[label]["mean_lag"] == sum(part) / 2
    msgpack.packb(f)  # fits the step event as it travels (int64 at most)


def test_step_figures_agree_with_the_batch_on_an_absurd_weight_version():
    res = results(4, versions=[(3, 4), (I64_MIN, I64_MIN), (5, 6)])
    g = assemble_group(res, [0.0] * 3)
    f = step_staleness([g], trainer_version=7, max_staleness=None)
    lags = step_batch([g], trainer_version=7)["weight_lag"].tolist()  # the batch saturates its lag too
    assert lags[1] == I64_MAX and f["max_lag"] == max(lags) and f["mean_lag"] == sum(lags) / 3
    assert f["buckets"][0]["lag_sum"] == I64_MAX  # the exact sum is past int64: saturated, never wrapped
    # without a trainer version, lags run from the newest version seen (6), still saturated
    f = step_staleness([g], trainer_version=None, max_staleness=None)
    assert f["reference_version"] == 6 and f["max_lag"] == I64_MAX
    # the page and /metrics take the figures as they are
    agg = TokenCaptureState(history=8)
    agg.trainer.fold_staleness("s", 0.0, parse_staleness(FINALIZE, f))
    assert agg.snapshot()["staleness"]["steps"][0]["max_lag"] == float(I64_MAX)
    fams = {m.name: m for m in staleness_families(agg)}
    lag_sums = {s.labels["bucket"]: s.value for s in fams["token_capture_staleness_lag_versions"].samples}
    assert lag_sums["<1k"] == float(I64_MAX)


def test_max_staleness_setting_is_checked():
    with dask.config.set({"token-capture.finalize.max-staleness": 3}):
        assert FinalizeSettings.from_config().max_staleness == 3
    assert FinalizeSettings.from_config().max_staleness is None  # the default: off
    for bad in (-1, "2", 1.5, True):
        with dask.config.set({"token-capture.finalize.max-staleness": bad}):
            with pytest.raises(InvalidInput, match="finalize.max-staleness"):
                FinalizeSettings.from_config()
        with pytest.raises(InvalidInput, match="finalize.max-staleness"):  # Finalizer.with_settings replaces
            dataclasses.replace(FinalizeSettings.from_config(), max_staleness=bad)
    with dask.config.set({"token-capture.monitor.mismatch-eps": [0.1, 0]}):
        with pytest.raises(InvalidInput, match="monitor.mismatch-eps"):
            FinalizeSettings.from_config()


@pytest.mark.timeout(120)
def test_stale_rollouts_are_dropped_and_their_rows_cleared_only_at_consumption(inprocess_client, tmp_path):
    rng = np.random.default_rng(7)
    versions = [(5, 5), (3, 4), (2, 5), (5, 6)]  # trainer at 6: lags 1, 3, 4, 1
    builts = [make_rollout(rng, f"st-r{i}", n_calls=2, n_branches=1, group_id="st", weight_version=list(v))
              for i, v in enumerate(versions)]
    keys = [r.staging_key for b in builts for r in b.rows]
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        store = make(n_units=2)
        assert not store.put_many(pack_rows([r for b in builts for r in b.rows])).failed
        fin = Finalizer(inprocess_client, store, vocab_size=VOCAB, num_experts=None)
        fin.with_settings(clear_staged=True, max_staleness=2)
        with pytest.raises(FinalizeError, match="trainer_version"):
            fin.submit_step({"st": [b.receipt for b in builts]}, trainer_version="6")
        handle = fin.submit_step({"st": [b.receipt for b in builts]}, trainer_version=6)
        wait(list(handle.group_futures.values()), timeout=60)  # assembled (stale rows decided) on the cluster
        assert handle.clear_future is None
        assert set(store.get_many(keys, ["token_ids"]).batch.keys) == set(keys)  # nothing cleared before delivery
        step = handle.result(timeout=60)
        g = step.groups["st"]
        assert g.status == [R.OK, R.STALE, R.STALE, R.OK]
        assert step.rejected == {R.STALE: 2} and step.metrics["accepted"] == 2
        assert handle.clear_future.result()["deleted"] == len(keys)  # stale rows go with the accepted ones
        assert len(store.get_many(keys, ["token_ids"]).batch) == 0
    b = step.to_batch(trainer_version=6)
    assert b["weight_lag"].tolist() == [1, 3, 4, 1] and b["sample_mask"].tolist() == [1, 0, 0, 1]
    st = step.metrics["staleness"]
    assert (st["trainer_version"], st["max_staleness"], st["rollouts"], st["stale"]) == (6, 2, 4, 2)
    assert st["mean_lag"] == pytest.approx(9 / 4) and st["buckets"][0]["stale"] == 2
    # the step event as published reaches the scheduler's state as it is
    agg = TokenCaptureState(history=8)
    assert agg.ingest(FINALIZE, public(g.metrics)) and agg.ingest(FINALIZE, step.metrics)
    snap = agg.snapshot()
    assert snap["staleness"]["buckets"][0] == {"bucket": "<1k", "rollouts": 4, "stale": 2, "lag_sum": 9.0, "mean_lag": 2.25}
    assert snap["staleness"]["steps"][0]["stale"] == 2 and snap["rejected"] == {R.STALE: 2}


def test_the_page_shows_staleness_over_the_recent_steps_and_metrics_since_the_start():
    """The chart's buckets cover the steps the state keeps (``history``), so a lag that
    has gone away leaves the chart; the counters behind /metrics keep every step."""
    from pipeline.dashboard.trainer_state import TrainerState

    def record(lag: float, stale: int) -> dict:
        bucket = {"bucket": "<1k", "rollouts": 4, "stale": stale, "lag_sum": 4 * lag, "mean_lag": lag}
        return {"rollouts": 4, "stale": stale, "mean_lag": lag, "max_lag": lag, "trainer_version": 9, "buckets": [bucket]}

    state = TrainerState(history=3)
    for k in range(5):  # two stale steps, then three fresh ones
        state.fold_staleness(f"s{k}", float(k), record(5.0 if k < 2 else 0.0, 2 if k < 2 else 0))
    snap = state.snapshot()["staleness"]
    since_start = {b["bucket"]: b for b in snap["buckets"]}["<1k"]
    recent = {b["bucket"]: b for b in snap["recent_buckets"]}["<1k"]
    assert (since_start["rollouts"], since_start["stale"], since_start["lag_sum"]) == (20, 4, 40.0)
    assert (recent["rollouts"], recent["stale"], recent["mean_lag"]) == (12, 0, 0.0)
    assert snap["recent_steps"] == 3 and [s["step_id"] for s in snap["steps"]] == ["s2", "s3", "s4"]
