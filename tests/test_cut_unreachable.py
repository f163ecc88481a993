"""A generation actor whose cut answer is lost on the connection while it lives on.

The driver cuts every actor at once. When one actor's call fails on the connection but
its worker is still in the cluster, the actor may well have cut and sealed its calls: the
driver retries (a cut is idempotent: the actor answers with the receipt it cached), and
if the actor stays unreachable it reports its calls ``generation_lost`` but leaves their
cut rows in place, since a live actor's later cuts advertise them. Only an actor whose
worker left the cluster has its rows deleted (tests/test_faults_generation.py).
"""
from __future__ import annotations

import dask
import pytest
from distributed.comm.core import CommClosedError

from pipeline.actors import workers_now
from pipeline.capture import policy_from_config
from pipeline.driver import RolloutDriver, cut_round
from support import store_maker
from tasks.cut.prefix import verify_prefix
from tasks.cut.receipt import DURABLE_PREFIX, GENERATION_LOST
from tasks.keys import CUT_PARTITION
from tasks.toy.rollouts import make_step_specs

pytestmark = pytest.mark.timeout(120)


class LosesAnswers:
    """A generation actor handle whose first ``times`` cut answers are lost on the way
    back: the actor cuts (and seals) for real, the caller sees a closed connection."""

    def __init__(self, actor, times: int):
        self.actor, self.times, self.cuts = actor, times, 0

    def checkpoint_cut(self, *args, **kwargs):
        future, outer = self.actor.checkpoint_cut(*args, **kwargs), self
        outer.cuts += 1

        class Answer:
            def result(self, timeout=None):
                receipt = future.result(timeout=timeout)
                if outer.times > 0:
                    outer.times -= 1
                    raise CommClosedError("the cut's answer was lost on the connection (test)")
                return receipt

        return Answer()

    def __getattr__(self, name):
        return getattr(self.actor, name)


def _driver(client, store, prefix):
    groups = make_step_specs(prefix, 2, 2, turns=3, tokens_per_turn=16, tool_tokens=5, prompt_tokens=7,
                             vocab_size=policy_from_config().vocab_size)
    workers = list(workers_now(client))
    driver = RolloutDriver(client, store, step_tokens=6, workers=workers[:2])
    driver.submit(groups)
    driver.run_rounds(cut_round(3, 16, 6))  # every call mid-generation
    return driver


@pytest.fixture
def store(inprocess_client, tmp_path):
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        yield make(n_units=2, memory_limit="1MiB")


def _advertised(acks) -> set[str]:
    return {k for a in acks.values() if a.durable for k in a.staging_keys}


def test_a_lost_answer_is_retried_and_the_cut_is_whole(inprocess_client, store):
    driver = _driver(inprocess_client, store, "ua-")
    pool = driver._pool
    flaky = pool.actors[1] = LosesAnswers(pool.actors[1], times=1)
    cut = driver.cut("ck")
    assert flaky.cuts == 2 and cut.lost_workers == [], cut  # retried once, answered from the actor's cache
    assert cut.durable == cut.calls == 4 and cut.failed == {}, cut
    assert set(store.keys(CUT_PARTITION)) == _advertised(driver.snapshot.acks)


def test_an_unreachable_live_actor_keeps_the_rows_it_sealed(inprocess_client, store):
    driver = _driver(inprocess_client, store, "ub-")
    pool = driver._pool
    pool.actors[1] = LosesAnswers(pool.actors[1], times=10**6)
    with dask.config.set({"token-capture.cut.lost-actor-grace-s": 0.5}):
        pool.settings = type(pool.settings).from_config({}, pool.settings.with_routes)
    cut = driver.cut("ck")
    assert cut.lost_workers == [pool.workers[1]] and cut.failed == {GENERATION_LOST: 2}, cut
    lost = [a for a in driver.snapshot.acks.values() if a.reason == GENERATION_LOST]
    # The live actor sealed its rows in "ck": they stay, and its next cut advertises them.
    pool.actors[1] = pool.actors[1].actor
    again = driver.cut("ck2")
    assert again.durable == again.calls == 4, again
    for ack in driver.snapshot.acks.values():
        assert ack.status == DURABLE_PREFIX
        rows = store.get_many(list(ack.staging_keys), partition=CUT_PARTITION)
        assert not rows.failed, rows.failed  # every advertised row is there
        verdict = verify_prefix(rows.batch, ack)
        assert verdict.usable, (verdict.reason, verdict.detail)
    assert all("left in place" in a.detail for a in lost)


def test_retries_ask_the_scheduler_once_a_round_for_every_unreachable_actor(inprocess_client, store, monkeypatch):
    # Whether each unreachable actor's worker is still in the cluster is one scheduler
    # query per retry round, however many actors are unreachable (each query is a round
    # trip to the scheduler).
    driver = _driver(inprocess_client, store, "uc-")
    pool = driver._pool
    pool.actors[0] = LosesAnswers(pool.actors[0], times=10**6)
    pool.actors[1] = LosesAnswers(pool.actors[1], times=10**6)
    with dask.config.set({"token-capture.cut.lost-actor-grace-s": 0.5}):
        pool.settings = type(pool.settings).from_config({}, pool.settings.with_routes)
    import pipeline.driver.pool as pool_module

    queries, rounds = [], []
    real_query, real_fan_out = pool_module.workers_now, pool.fan_out_surviving
    monkeypatch.setattr(pool_module, "workers_now", lambda *a, **k: queries.append(1) or real_query(*a, **k))
    monkeypatch.setattr(pool, "fan_out_surviving", lambda *a, **k: rounds.append(1) or real_fan_out(*a, **k))
    cut = driver.cut("ck")
    assert sorted(cut.lost_workers) == sorted(pool.workers[:2]) and cut.failed == {GENERATION_LOST: 4}, cut
    retries = len(rounds) - 1  # the first fan-out is the cut itself
    assert retries >= 2, rounds
    assert len(queries) == retries + 1, (len(queries), retries)  # one a round, and one when the grace ends
