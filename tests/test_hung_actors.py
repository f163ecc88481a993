"""A generation actor whose worker is hung (alive, registered, silent) does not hang the driver.

A stopped process (SIGSTOP here; a swapped or deadlocked one in production) keeps its
connections open and its worker registered until the scheduler's TTL, so a call to its
actor would be awaited forever. A round's calls are awaited ``driver.actor-call-timeout-s``
and then raise :class:`ActorUnresponsive` naming the worker; a cut's answers are awaited
until the cut's deadline plus ``driver.cut-answer-margin-s``, then the silent actor's calls
are reported ``generation_lost`` (rows left in place) and the cut returns.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import dask
import pytest
from distributed import Client

from pipeline.actors import workers_now
from pipeline.capture import policy_from_config
from pipeline.cluster import local_cluster
from pipeline.driver import RolloutDriver, cut_round
from pipeline.driver.settings import PoolSettings
from support import store_maker
from tasks.cut.receipt import DURABLE_PREFIX, GENERATION_LOST
from tasks.errors import ActorUnresponsive, ClusterUnavailable
from tasks.toy.rollouts import make_step_specs

pytestmark = pytest.mark.timeout(180)

# Wide enough that a healthy actor answers within them on a loaded machine.
BOUNDS = {
    "token-capture.driver.actor-call-timeout-s": 5.0,
    "token-capture.driver.cut-answer-margin-s": 2.0,
    "token-capture.cut.lost-actor-grace-s": 0.5,
}
CUT_S = 4.0  # the cuts' deadline, from now (s)


class NeverAnswers:
    """A generation actor handle whose cut answers never arrive (the actor cuts for real):
    ``result()`` blocks until its timeout, forever without one, as a hung worker's does."""

    def __init__(self, actor):
        self.actor, self.cuts = actor, 0

    def checkpoint_cut(self, *args, **kwargs):
        self.actor.checkpoint_cut(*args, **kwargs)
        self.cuts += 1

        class Silent:
            def result(self, timeout=None):
                threading.Event().wait(timeout)
                raise TimeoutError("no answer (test)")

        return Silent()

    def __getattr__(self, name):
        return getattr(self.actor, name)


def _specs(prefix: str):
    return make_step_specs(prefix, 2, 2, turns=3, tokens_per_turn=16, tool_tokens=5, prompt_tokens=7,
                           vocab_size=policy_from_config().vocab_size)


def test_the_settings_bound_every_wait_and_refuse_negative_seconds():
    with dask.config.set(BOUNDS):
        s = PoolSettings.from_config({}, True)
    assert (s.call_timeout_s, s.cut_answer_margin_s, s.lost_actor_grace_s) == (5.0, 2.0, 0.5)
    assert s.cut_wait_s(deadline=105.0, now=100.0) == 7.0  # 5 s to the deadline, 2 s margin
    assert s.cut_wait_s(deadline=None, now=100.0) == s.cut_deadline_s + 2.0
    assert s.cut_wait_s(deadline=90.0, now=100.0) == 2.0  # a deadline already passed: the margin only
    with dask.config.set({"token-capture.driver.actor-call-timeout-s": 0}):
        assert PoolSettings.from_config({}, True).call_timeout_s is None  # 0: no bound
    with dask.config.set({"token-capture.driver.cut-answer-margin-s": -1}):
        with pytest.raises(ValueError, match="driver.cut-answer-margin-s"):
            PoolSettings.from_config({}, True)


def test_a_cut_returns_when_an_actor_never_answers(inprocess_client, tmp_path):
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        store = make(n_units=2, memory_limit="1MiB")
        with dask.config.set(BOUNDS):
            driver = RolloutDriver(inprocess_client, store, step_tokens=6, workers=list(workers_now(inprocess_client))[:2])
        driver.submit(_specs("na-"))
        driver.run_rounds(cut_round(3, 16, 6))
        pool = driver._pool
        silent = pool.actors[1] = NeverAnswers(pool.actors[1])
        cut = driver.cut("ck", deadline=time.time() + CUT_S)
        assert silent.cuts >= 2, silent.cuts  # the cut, then retries within the grace
        assert cut.lost_workers == [pool.workers[1]] and cut.failed == {GENERATION_LOST: 2}, cut
        lost = [a for a in driver.snapshot.acks.values() if a.reason == GENERATION_LOST]
        assert all("ActorUnresponsive" in a.detail and "left in place" in a.detail for a in lost), lost
        assert sum(a.status == DURABLE_PREFIX for a in driver.snapshot.acks.values()) == 2  # the other actor's


def test_a_stopped_worker_fails_the_round_with_one_named_error_and_the_cut_returns(tmp_path):
    with local_cluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client, store_maker(client, tmp_path / "spill") as make:
        workers = sorted(workers_now(client))
        store = make(n_units=1, workers=workers[:1])  # the store stays on the worker that keeps running
        with dask.config.set(BOUNDS):
            driver = RolloutDriver(client, store, step_tokens=6, workers=workers)
        driver.submit(_specs("sw-"))
        driver.run_rounds(2)
        stopped = driver.workers[1]
        pid = client.run(os.getpid, workers=[stopped])[stopped]
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(ActorUnresponsive, match=f"{stopped}.*step") as err:
                driver.run_rounds(1)
            assert isinstance(err.value, ClusterUnavailable) and isinstance(err.value, TimeoutError)
            cut = driver.cut("ck-stopped", deadline=time.time() + CUT_S)
            assert cut.lost_workers == [stopped], cut
            hung = [a for a in driver.snapshot.acks.values() if a.reason == GENERATION_LOST]
            assert len(hung) == cut.failed[GENERATION_LOST] >= 1 and all("left in place" in a.detail for a in hung)
        finally:
            os.kill(pid, signal.SIGCONT)
