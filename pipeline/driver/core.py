"""RolloutDriver: drives multi-turn rollouts on GenerationWorker actors, round by round.

The controller side of checkpointable generation, composed of: an
:class:`~pipeline.driver.pool.ActorPool` (one generation actor per Dask worker, holding the
in-flight calls), a :class:`~pipeline.driver.book.RolloutBook` (each rollout's state, gate
and receipt), a :class:`~pipeline.driver.rounds.RoundRunner` (rounds: step, stage through
the gates, open next turns), the cut (:mod:`.cut`) and recovery (:mod:`.recovery`).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping, Sequence

from tasks.errors import DriverError
from tasks.receipts import Receipt
from tasks.toy.environment import ToolEnvironment
from tasks.toy.rollouts import RolloutSpec

from .. import config
from ..capture import policy_from_config
from .book import RolloutBook
from .cut import CutStats, cut_actors
from .handles import CutStore, GenerationActor, PrefixBatcher
from .pool import ActorPool
from .recovery import RecoveryStats, rebuild_rollouts, resume_calls, start_batchers
from .rounds import RoundRunner
from .settings import PolicySettings, PoolSettings, RoundSettings
from .snapshot import DriverSettings, DriverSnapshot

if TYPE_CHECKING:
    from distributed import Client

    from pipeline.store.client import StagingStore


class RolloutDriver:
    """Places rollouts on GenerationWorker actors and drives them turn by turn.

    client: a ``distributed.Client``; store: the
    :class:`~pipeline.store.client.StagingStore` completed calls are staged in.
    n_workers: generation actors, one per Dask worker (default: every worker now).
    policy: policy settings overrides (default config ``token-capture.policy``).
    cut_store: the store actors write cut prefixes to (default ``store``; a
    :class:`~pipeline.testing.faults.FaultyStore` in tests).
    step_tokens: tokens per call per round (default ``driver.step-tokens``).
    Knobs are read once, here.
    """

    def __init__(
        self,
        client: Client,
        store: StagingStore,
        n_workers: int | None = None,
        *,
        policy: PolicySettings | None = None,
        with_routes: bool = True,
        weight_version: int = 0,
        cut_store: CutStore | None = None,
        step_tokens: int | None = None,
        workers: Sequence[str] | None = None,
    ):
        self.client = client
        self.store = store
        self.cut_store: CutStore = store if cut_store is None else cut_store
        self.policy_overrides: dict[str, int] = dict(policy or {})
        pool_settings = PoolSettings.from_config(self.policy_overrides, with_routes)
        self.policy = policy_from_config(pool_settings.policy)  # the same settings the actors get
        self._settings = RoundSettings.from_config(step_tokens, weight_version, with_routes)
        self.env = ToolEnvironment(seed=self.policy.config.seed, vocab_size=self.policy.vocab_size)
        self.snapshot: DriverSnapshot | None = None
        self._book = RolloutBook(self.policy, config.digest_version())  # capture.digest, read once
        self._pool = ActorPool.start(client, ActorPool.placement(client, n_workers, workers), self.cut_store,
                                     pool_settings)
        self._rounds = RoundRunner(self._pool, self._book, store, self.env, self._settings)

    # ---- settings and counters -----------------------------------------------------------

    @property
    def with_routes(self) -> bool:
        return self._settings.with_routes

    @property
    def weight_version(self) -> int:
        return self._settings.weight_version

    @property
    def step_tokens(self) -> int:
        """Tokens per call per round."""
        return self._settings.step_tokens

    @property
    def rounds(self) -> int:
        """Rounds run (count)."""
        return self._rounds.rounds

    @property
    def stage_puts(self) -> int:
        """``put_many`` calls that staged completed calls (count)."""
        return self._rounds.stage_puts

    # ---- actors -------------------------------------------------------------------------

    @property
    def actors(self) -> list[GenerationActor]:
        """The generation actors by slot (empty once killed)."""
        return self._pool.actors

    @property
    def workers(self) -> list[str]:
        """The worker hosting each actor, by slot."""
        return self._pool.workers

    def kill(self) -> list[str]:
        """Drop the generation actors (a simulated crash): their in-flight calls are lost.

        Releases the actors' futures and handles, so the workers delete them; returns the
        actors' keys. The driver is unusable afterwards: recover with :meth:`recover`.
        """
        return self._pool.kill()

    # ---- submission and rounds --------------------------------------------------------------

    def submit(self, groups: Sequence[Sequence[RolloutSpec]]) -> None:
        """Place every rollout (round-robin over the actors, submission order) and open
        its first call. ``groups``: lists of specs, or one flat list of specs."""
        specs = [s for g in groups for s in (g if isinstance(g, (list, tuple)) else [g])]
        ids = [s.rollout_id for s in specs]
        if len(set(ids)) != len(ids) or any(i in self._book for i in ids):
            raise DriverError("duplicate rollout_id (in this submission or already driven)")
        if not self.actors:
            raise DriverError("the driver has no generation actors (killed?)")
        opened = []
        vocab = self.policy.vocab_size
        for s in specs:
            r = self._book.add(s, len(self._book) % len(self._pool))
            p = s.prompt_tokens
            if p.size and (int(p.min()) < 0 or int(p.max()) >= vocab):
                # A prompt this policy cannot read poisons its rollout only.
                self._book.poison(r, f"invalid_token: prompt of {s.rollout_id!r} holds ids outside [0, {vocab})")
                continue
            opened.append(r)
        self._rounds.start(opened)

    @property
    def active(self) -> int:
        """Rollouts with a call in flight."""
        return self._book.active

    def run_rounds(self, n: int) -> int:
        """Run up to ``n`` rounds (fewer if every rollout finishes); returns rounds run."""
        done = 0
        while done < n and self.active:
            self._rounds.step()
            done += 1
        return done

    def finish(self, max_rounds: int | None = None) -> dict[str, list[Receipt]]:
        """Run rounds until every rollout has finished; returns :meth:`receipts`."""
        limit = max_rounds if max_rounds is not None else self._book.rounds_left(self.step_tokens) + 1
        self.run_rounds(limit)
        if self.active:
            raise DriverError(f"{self.active} rollouts still running after {limit} rounds")
        return self.receipts()

    def receipts(self) -> dict[str, list[Receipt]]:
        """Receipts per group (submission order); running rollouts get their receipt so far."""
        return self._book.receipts()

    # ---- cut and recovery ---------------------------------------------------------------------

    def cut(self, checkpoint_id: str, deadline: float | None = None) -> CutStats:
        """Cut every in-flight call on every actor (``checkpoint_cut``, all actors at once).

        ``deadline``: absolute, in the workers' ``time.time()`` seconds (None: now +
        ``cut.deadline-s``). Calls that completed meanwhile are collected as usual. Sets
        :attr:`snapshot` (what :meth:`recover` needs) and returns :class:`CutStats`.
        """
        t0 = time.perf_counter()
        outcome = cut_actors(self._pool, self._book.inventory(), self.cut_store, checkpoint_id, deadline)
        self._rounds.collect(outcome.completed_slots)
        wall_ms = (time.perf_counter() - t0) * 1e3
        self.snapshot = self._book.snapshot(checkpoint_id, outcome.acks, self._driver_settings())
        return outcome.stats(wall_ms)

    def _driver_settings(self) -> DriverSettings:
        return DriverSettings(policy=self.policy_overrides, with_routes=self.with_routes,
                              weight_version=self.weight_version, step_tokens=self.step_tokens)

    def checkpoint_store(self, path: str) -> dict:
        """Checkpoint the staging store (staged rows and cut prefixes) to ``path``; the manifest."""
        return self.store.checkpoint(path)

    @classmethod
    def recover(
        cls,
        client: Client,
        store: StagingStore,
        snapshot: DriverSnapshot,
        n_workers: int | None = None,
        *,
        batchers: Mapping[str, PrefixBatcher] | None = None,
        cut_store: CutStore | None = None,
        workers: Sequence[str] | None = None,
    ) -> tuple[RolloutDriver, RecoveryStats]:
        """A new driver on fresh generation actors, continuing ``snapshot``'s rollouts.

        ``store`` holds the staged rows and cut prefixes (the original store, or one
        restored from its checkpoint). ``batchers``: ``{worker: PrefixReadBatcher}``
        (default: :func:`~pipeline.restore.batcher.start_batchers` on the actors' workers).
        Gates are rebuilt from the staged rows (ONE get for all rollouts); a rollout whose
        rows are missing or do not hash to its receipt is poisoned, the others go on.
        """
        if not isinstance(snapshot, DriverSnapshot):
            raise DriverError(f"recover needs the DriverSnapshot of a cut, got {type(snapshot).__name__}")
        t0 = time.perf_counter()
        s = snapshot.settings
        driver = cls(client, store, n_workers, policy=s["policy"], with_routes=s["with_routes"],
                     weight_version=s["weight_version"], cut_store=cut_store, step_tokens=s["step_tokens"], workers=workers)
        stats = RecoveryStats()
        running = rebuild_rollouts(driver._book, store, snapshot, len(driver._pool), driver.with_routes, stats)
        if batchers is None:
            batchers = start_batchers(client, store, sorted(set(driver.workers)), driver.policy, driver.with_routes)
        contexts = {r.spec.rollout_id: c["context"] for r, c in zip(running, driver._rounds.call_specs(running))}
        regenerate = resume_calls(driver._pool, running, snapshot.acks, batchers, contexts, stats)
        driver._rounds.start(regenerate)
        stats.wall_ms = (time.perf_counter() - t0) * 1e3
        return driver, stats
