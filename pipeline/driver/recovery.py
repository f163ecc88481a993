"""Recovery: the driver's snapshot at a cut, and a new driver continuing from it.

:class:`RecoveryMixin` gives :class:`~pipeline.driver.core.RolloutDriver` its snapshot
(:class:`DriverSnapshot`, taken by each cut) and :meth:`recover`: gates rebuilt from the
staged rows, then each in-flight call resumed from its verified cut prefix or regenerated
(the choice: :func:`tasks.cut.resume.decide`). Reports :class:`RecoveryStats`.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypedDict

import numpy as np

from tasks.cut.receipt import CallAck
from tasks.cut.resume import decide
from tasks.errors import DriverError, InvalidRecord
from tasks.gate import CaptureGate
from tasks.keys import STAGING_PARTITION
from tasks.packed import unpack_rows
from tasks.receipts import Receipt
from tasks.schema import ALL_FIELDS, STAGING_FIELDS, StagedRow
from tasks.toy.rollouts import RolloutSpec, call_id

from ..store.protocol import MISSING_KEY
from .state import RolloutState

if TYPE_CHECKING:
    from distributed import Client

    from pipeline.store.client import StagingStore

    from .core import RolloutDriver
    from .handles import CutStore, PrefixBatcher


class DriverSettings(TypedDict):
    """A driver's construction arguments, as a snapshot keeps them."""

    policy: dict[str, Any]  # policy settings overrides
    with_routes: bool
    weight_version: int
    step_tokens: int


@dataclass
class RecoveryStats:
    """What :meth:`RolloutDriver.recover` did.

    resumed: calls continued from their prefix; resumed_tokens: prefix tokens not
    regenerated; regenerated: reason -> calls started from scratch (``durable_failure``
    reasons, prefix verdict reasons, :data:`~tasks.cut.resume.NOT_CUT`, ...); poisoned:
    rollouts whose staged rows could not rebuild their gate; gets / keys: store gets the
    batchers issued and keys they fetched; restore_requests: prefixes requested; wall_ms (ms).
    """

    resumed: int = 0
    resumed_tokens: int = 0
    regenerated: dict[str, int] = field(default_factory=dict)
    poisoned: dict[str, str] = field(default_factory=dict)
    restore_requests: int = 0
    gets: int = 0
    keys: int = 0
    wall_ms: float = 0.0

    @property
    def keys_per_get(self) -> float:
        return self.keys / self.gets if self.gets else 0.0


@dataclass
class DriverSnapshot:
    """The controller's state at a cut: enough to recover after the actors are gone.

    Token-free apart from the specs' prompts: completed calls are their receipts
    (records with hashes; the rows are in the store), in-flight calls their cut acks.
    specs: every rollout, submission order; turns: rollout -> turn of its in-flight call
    (``spec.turns`` when finished); receipts: rollout -> receipt of its staged calls
    (final for finished rollouts, whose ``reward`` is set); acks: (rollout, call) -> ack;
    settings: the driver's construction arguments.
    """

    checkpoint_id: str
    specs: list[RolloutSpec]
    turns: dict[str, int]
    receipts: dict[str, Receipt]
    acks: dict[tuple[str, str], CallAck]
    settings: DriverSettings


class RecoveryMixin:
    """Snapshot, checkpoint and :meth:`recover` (mixed into RolloutDriver)."""

    def checkpoint_store(self: RolloutDriver, path: str) -> dict:
        """Checkpoint the staging store (staged rows and cut prefixes) to ``path``; the manifest."""
        return self.store.checkpoint(path)

    def _snapshot(self: RolloutDriver, checkpoint_id: str, acks: dict[tuple[str, str], CallAck]) -> DriverSnapshot:
        receipts = {
            rid: (r.final if r.final is not None else r.gate.receipt(0.0)) for rid, r in self._rollouts.items()
        }
        return DriverSnapshot(
            checkpoint_id=checkpoint_id,
            specs=[self._rollouts[rid].spec for rid in self._order],
            turns={rid: r.turn for rid, r in self._rollouts.items()},
            receipts=receipts,
            acks=dict(acks),
            settings=DriverSettings(policy=self.policy_overrides, with_routes=self.with_routes,
                                    weight_version=self.weight_version, step_tokens=self.step_tokens),
        )

    @classmethod
    def recover(
        cls: type[RolloutDriver],
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
        running = driver._rebuild(snapshot, stats)
        if batchers is None:
            from ..restore.batcher import start_batchers

            batchers = start_batchers(client, store, workers=sorted(set(driver.workers)),
                                      vocab_size=driver.policy.vocab_size, num_experts=driver.policy.num_experts,
                                      routes_shape=driver.policy.routes_shape if driver.with_routes else None)
        driver._resume(running, snapshot.acks, batchers, stats)
        stats.wall_ms = (time.perf_counter() - t0) * 1e3
        return driver, stats

    def _rebuild(self: RolloutDriver, snapshot: DriverSnapshot, stats: RecoveryStats) -> list[RolloutState]:
        """Rollouts and gates from the snapshot and the staged rows; the running ones."""
        running: list[RolloutState] = []
        for i, spec in enumerate(snapshot.specs):
            r = RolloutState(spec, i % len(self.actors), self._new_gate(spec))
            r.turn = snapshot.turns[spec.rollout_id]
            rec = snapshot.receipts[spec.rollout_id]
            if rec.poisoned or r.turn >= spec.turns:
                r.final = rec  # finished before the cut: its receipt is final
            else:
                running.append(r)
            self._rollouts[spec.rollout_id] = r
            self._order.append(spec.rollout_id)
        keys = [k for r in running for k in snapshot.receipts[r.spec.rollout_id].staging_keys]
        rows: dict[str, StagedRow] = {}
        failed: dict[str, tuple[str, str]] = {}
        if keys:
            fields = list(ALL_FIELDS) if self.with_routes else list(STAGING_FIELDS)
            got = self.store.get_many(keys, fields, partition=STAGING_PARTITION)
            failed = dict(got.failed)
            rows = dict(zip(got.batch.keys, unpack_rows(got.batch)))
        alive = []
        for r in running:
            rid = r.spec.rollout_id
            records = snapshot.receipts[rid].calls
            bad = next((k for k in (c.staging_key for c in records) if k in failed or k not in rows), None)
            try:
                if bad is not None:
                    why = failed.get(bad, (MISSING_KEY, "not returned"))
                    raise InvalidRecord("missing_staging_row", f"{bad!r}: {why[0]}: {why[1]}")
                chain = [rows[c.staging_key] for c in records]
                r.gate = CaptureGate.resume(rid, chain, vocab_size=self.policy.vocab_size,
                                            num_experts=self.policy.num_experts, group_id=r.spec.group_id, records=records)
            except InvalidRecord as e:
                stats.poisoned[rid] = f"{e.reason}: {e.detail}"
                self._poison(r, f"resume_failed: {e.reason}: {e.detail}")
                continue
            r.turn = 0  # replay the staged calls: history tail, length, generated tokens
            for row in chain:
                self._advance(r, row.token_ids, int(np.count_nonzero(row.token_mask == 0.0)))
            if r.turn != snapshot.turns[rid]:
                stats.poisoned[rid] = f"turn {snapshot.turns[rid]} but {len(chain)} staged calls"
                self._poison(r, f"resume_failed: {stats.poisoned[rid]}")
                continue
            alive.append(r)
        return alive

    def _resume(self: RolloutDriver, running: list[RolloutState], acks: Mapping[tuple[str, str], CallAck],
                batchers: Mapping[str, PrefixBatcher], stats: RecoveryStats) -> None:
        """Resume each running rollout's call from its durable prefix, else start it over.

        The I/O around :func:`~tasks.cut.resume.decide`: asked with the ack alone, then
        with the prefix's verdict, then with the worker's answer to the resume.
        """
        regen: list[tuple[RolloutState, str]] = []
        want: dict[int, list[tuple[RolloutState, CallAck]]] = defaultdict(list)
        for r in running:
            ack = acks.get(r.call)
            d = decide(ack)
            if d.regenerate:
                regen.append((r, d.reason))
            else:
                want[r.slot].append((r, ack))
        # One restore_many per actor, on the batcher of the actor's worker, all at once.
        addrs = list(batchers)
        pick = {slot: batchers.get(self.workers[slot]) or batchers[addrs[slot % len(addrs)]] for slot in want}
        before = self._batcher_stats(set(pick.values()))
        verdicts = {slot: pick[slot].restore_many([a for _, a in pairs]) for slot, pairs in want.items()}
        contexts = {r.spec.rollout_id: c["context"] for r, c in zip(running, self._call_specs(running))}
        resumes = []
        for slot, pairs in want.items():
            stats.restore_requests += len(pairs)
            for (r, ack), v in zip(pairs, verdicts[slot].result()):
                context = contexts[r.spec.rollout_id]
                d = decide(ack, v, context)
                if d.regenerate:
                    regen.append((r, d.reason))
                    continue
                fut = self.actors[slot].resume_call(
                    r.spec.rollout_id, call_id(r.turn), history=r.tail, prev_len=r.prev_len,
                    max_new_tokens=r.spec.tokens_per_turn, **v.prefix.resume_kwargs(),
                )
                resumes.append((r, ack, v, context, fut))
        for r, ack, v, context, fut in resumes:  # issued together, awaited together
            try:
                fut.result()
                accepted = True
            except Exception:  # the worker refused the prefix: this call starts over
                accepted = False
            d = decide(ack, v, context, resumed=accepted)
            if d.regenerate:
                regen.append((r, d.reason))
                continue
            stats.resumed += 1
            stats.resumed_tokens += d.prefix_tokens
        after = self._batcher_stats(set(pick.values()))
        stats.gets = sum(a["gets"] - before[k]["gets"] for k, a in after.items())
        stats.keys = sum(a["keys_fetched"] - before[k]["keys_fetched"] for k, a in after.items())
        stats.regenerated = dict(Counter(why for _, why in regen))
        self._start([r for r, _ in regen])

    @staticmethod
    def _batcher_stats(batchers: set[PrefixBatcher]) -> dict[PrefixBatcher, dict[str, Any]]:
        futures = {b: b.stats() for b in batchers}
        return {b: f.result() for b, f in futures.items()}
