"""RolloutDriver: drives multi-turn rollouts on GenerationWorker actors, cut and resumed.

The controller side of the checkpointable generation path (SPEC sections 7-9). One
:class:`~pipeline.generation.worker.GenerationWorker` actor per Dask worker (by default)
holds the in-flight calls; the driver keeps everything a rollout needs to survive the
loss of those actors: its :class:`~tasks.gate.CaptureGate` (chain and cumulative hashing
of completed calls), its turn, the last ``policy.window`` tokens and its generated tokens
(for the reward).

A *round* (:meth:`RolloutDriver.run_rounds`): every actor decodes ``driver.step-tokens``
more tokens for all its calls (one ``step`` per actor, all actors at once); completed
calls are taken (one ``take_completed`` per actor that has some), passed through their
rollout's gate, and staged in ONE ``put_many`` for the whole round; each finished call's
rollout then opens its next turn (one ``start_calls`` per actor; the context is the
prompt at turn 0, :class:`~tasks.toy.environment.ToolEnvironment` tool tokens afterwards).

Checkpoint and resume::

    driver = RolloutDriver(client, store)
    driver.submit(groups)                      # lists of RolloutSpec, one list per group
    driver.run_rounds(3)                       # mid-generation
    cut = driver.cut("ckpt-1")                 # CutStats; driver.snapshot is now set
    store.checkpoint(path)                     # or driver.checkpoint_store(path)
    snapshot = driver.snapshot
    driver.kill()                              # the generation actors are gone
    store2 = StagingStore.from_checkpoint(client, path)
    driver2, rec = RolloutDriver.recover(client, store2, snapshot)   # RecoveryStats
    receipts = driver2.finish()                # {group_id: [Receipt, ...]}
    step = Finalizer(client, store2).submit_step(receipts).result()

:meth:`RolloutDriver.recover` rebuilds every gate from the staged rows in the store
(recomputing each hash: :meth:`CaptureGate.resume`), then resumes each in-flight call
from its durable prefix, read and verified through the per-worker
:class:`~pipeline.restore.batcher.PrefixReadBatcher` (``restore_many``: one actor call
per worker, reads coalesced). A call whose cut said ``durable_failure``, whose prefix is
unusable, or which the cut never saw starts over from scratch: sampling is keyed by
(rollout_id, position), so it regenerates the same tokens. Finalized rows are
bit-identical to an uninterrupted run (:func:`reference_mismatches` checks that).
"""
from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from tasks.cut.receipt import DURABLE_FAILURE, GENERATION_LOST, CallAck, CutReceipt, inventory_digest
from tasks.toy.environment import ToolEnvironment
from tasks.errors import DriverError, InvalidRecord
from tasks.gate import CaptureGate
from tasks.keys import CUT_PARTITION, CUT_PREFIX
from tasks.packed import pack_rows, unpack_rows
from tasks.receipts import Receipt
from tasks.toy.rollouts import GeneratedRollout, RolloutSpec, call_id, parent_call_id, toy_reward
from tasks.schema import ALL_FIELDS, STAGING_FIELDS

from . import config
from .actors import current_workers, start_pinned_actors
from .capture import STAGING_PARTITION, policy_from_config

# Why a call regenerated from scratch instead of resuming (RecoveryStats.regenerated).
NOT_CUT = "not_cut"  # started after the cut (or the cut never listed it)
RESUME_FAILED = "resume_failed"  # the worker refused the verified prefix
CONTEXT_MISMATCH = "context_mismatch"  # the prefix's carried context is not this call's


@dataclass
class CutStats:
    """A cut over every generation actor.

    calls: in-flight calls listed; rows/puts: cut rows written and ``put_many`` calls
    (all actors); durable: calls with a sealed prefix; failed: ``durable_failure``
    reason -> calls; completed: calls that finished during the cut; wall_ms: controller
    wall time of the whole cut (ms); receipts: one :class:`CutReceipt` per actor;
    lost_workers: workers whose generation actor died mid-cut (its calls come back
    ``generation_lost``; recover the driver from :attr:`RolloutDriver.snapshot`).
    """

    checkpoint_id: str
    calls: int
    rows: int
    puts: int
    durable: int
    failed: dict[str, int]
    completed: int
    wall_ms: float
    receipts: list[CutReceipt] = field(repr=False, default_factory=list)
    lost_workers: list[str] = field(default_factory=list)


@dataclass
class RecoveryStats:
    """What :meth:`RolloutDriver.recover` did.

    resumed: calls continued from their prefix; resumed_tokens: prefix tokens not
    regenerated; regenerated: reason -> calls started from scratch (``durable_failure``
    reasons, prefix verdict reasons, :data:`NOT_CUT`, ...); poisoned: rollouts whose
    staged rows could not rebuild their gate; gets / keys: store gets the batchers issued
    and keys they fetched; restore_requests: prefixes requested; wall_ms (ms).
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
    settings: dict[str, Any]


class _Rollout:
    """Controller state of one rollout."""

    __slots__ = ("spec", "slot", "gate", "turn", "prev_len", "tail", "generated", "final")

    def __init__(self, spec: RolloutSpec, slot: int, gate: CaptureGate):
        self.spec = spec
        self.slot = slot  # index of the generation actor holding its in-flight call
        self.gate = gate
        self.turn = 0  # turn of the in-flight call
        self.prev_len = 0  # tokens of the rollout before that call (tokens)
        self.tail = np.zeros(0, np.int64)  # the last policy.window of them
        self.generated: list[np.ndarray] = []  # generated tokens per completed call (reward)
        self.final: Optional[Receipt] = None  # set once the rollout ends (done or poisoned)

    @property
    def active(self) -> bool:
        return self.final is None and self.turn < self.spec.turns

    @property
    def call(self) -> tuple[str, str]:
        return (self.spec.rollout_id, call_id(self.turn))


class RolloutDriver:
    """Places rollouts on GenerationWorker actors and drives them turn by turn.

    client: a ``distributed.Client``; store: the
    :class:`~pipeline.store.client.StagingStore` completed calls are staged in.
    n_workers: generation actors, one per Dask worker (default: every worker now).
    policy: policy settings overrides (default config ``token-capture.policy``).
    cut_store: the store actors write cut prefixes to (default ``store``; a
    :class:`~pipeline.generation.cut.FaultyStore` in tests).
    step_tokens: tokens per call per round (default ``driver.step-tokens``).
    """

    def __init__(
        self,
        client: Any,
        store: Any,
        n_workers: Optional[int] = None,
        *,
        policy: Optional[Mapping[str, Any]] = None,
        with_routes: bool = True,
        weight_version: int = 0,
        cut_store: Any = None,
        step_tokens: Optional[int] = None,
        workers: Optional[Sequence[str]] = None,
    ):
        self.client = client
        self.store = store
        self.cut_store = store if cut_store is None else cut_store
        self.policy_overrides = dict(policy or {})
        self.policy = policy_from_config(self.policy_overrides)
        self.with_routes = bool(with_routes)
        self.weight_version = int(weight_version)
        self.step_tokens = int(config.get("driver.step-tokens") if step_tokens is None else step_tokens)
        if self.step_tokens < 1:
            raise DriverError(f"step_tokens {self.step_tokens} must be >= 1")
        self.env = ToolEnvironment(seed=self.policy.config.seed, vocab_size=self.policy.vocab_size)
        self._rollouts: dict[str, _Rollout] = {}
        self._order: list[str] = []
        self.snapshot: Optional[DriverSnapshot] = None
        self.rounds = 0  # rounds run (count)
        self.stage_puts = 0  # put_many calls that staged completed calls (count)
        self._start_actors(n_workers, workers)

    # ---- actors -------------------------------------------------------------------------

    def _start_actors(self, n_workers: Optional[int], workers: Optional[Sequence[str]]) -> None:
        from .generation.worker import GenerationWorker

        workers = current_workers(self.client) if workers is None else list(workers)
        if n_workers is not None:
            workers = workers[: int(n_workers)]
        if not workers:
            raise DriverError("no workers to host generation actors")
        settings = dict(config.get("policy"))
        settings.update(self.policy_overrides)
        # Completed calls carry their tokens: the handles talk to their worker directly.
        actors, self._futures = start_pinned_actors(
            self.client, GenerationWorker, workers, args=[(self.cut_store,)] * len(workers),
            policy=settings, with_routes=self.with_routes,
        )
        self.actors = list(actors)
        self.workers = workers

    def kill(self) -> list[str]:
        """Drop the generation actors (a simulated crash): their in-flight calls are lost.

        Releases the actors' futures and handles, so the workers delete them; returns the
        actors' keys. The driver is unusable afterwards: recover with :meth:`recover`.
        """
        keys = [f.key for f in self._futures]
        self.client.cancel(self._futures, force=True)
        self._futures, self.actors = [], []
        return keys

    # ---- submission -----------------------------------------------------------------------

    def submit(self, groups: Sequence[Sequence[RolloutSpec]]) -> None:
        """Place every rollout (round-robin over the actors, submission order) and open
        its first call. ``groups``: lists of specs, or one flat list of specs."""
        specs = [s for g in groups for s in (g if isinstance(g, (list, tuple)) else [g])]
        ids = [s.rollout_id for s in specs]
        if len(set(ids)) != len(ids) or any(i in self._rollouts for i in ids):
            raise DriverError("duplicate rollout_id (in this submission or already driven)")
        if not self.actors:
            raise DriverError("the driver has no generation actors (killed?)")
        opened = []
        for s in specs:
            r = _Rollout(s, len(self._order) % len(self.actors), self._new_gate(s))
            self._rollouts[s.rollout_id] = r
            self._order.append(s.rollout_id)
            p = s.prompt_tokens
            if p.size and (int(p.min()) < 0 or int(p.max()) >= self.policy.vocab_size):
                # A prompt this policy cannot read poisons its rollout only.
                self._poison(r, f"invalid_token: prompt of {s.rollout_id!r} holds ids outside [0, {self.policy.vocab_size})")
                continue
            opened.append(r)
        self._start(opened)

    def _new_gate(self, spec: RolloutSpec) -> CaptureGate:
        return CaptureGate(spec.rollout_id, vocab_size=self.policy.vocab_size, num_experts=self.policy.num_experts,
                           group_id=spec.group_id)

    def _call_specs(self, rollouts: Sequence[_Rollout]) -> list[dict]:
        """Start specs of each rollout's current call (tool tokens drawn in one pass)."""
        later = [r for r in rollouts if r.turn > 0]
        tools = self.env.tool_outputs([r.spec.rollout_id for r in later], [r.turn for r in later],
                                      [r.spec.tool_tokens for r in later])
        tool_of = {r.spec.rollout_id: t for r, t in zip(later, tools)}
        return [
            {
                "rollout_id": r.spec.rollout_id,
                "model_call_id": call_id(r.turn),
                "parent_call_id": parent_call_id(r.turn),
                "context": r.spec.prompt_tokens if r.turn == 0 else tool_of[r.spec.rollout_id],
                "history": r.tail,
                "prev_len": r.prev_len,
                "max_new_tokens": r.spec.tokens_per_turn,
                "weight_version": self.weight_version,
            }
            for r in rollouts
        ]

    def _start(self, rollouts: Sequence[_Rollout]) -> None:
        """Open the current call of each rollout: one ``start_calls`` per actor, all at once."""
        by_slot: dict[int, list[_Rollout]] = defaultdict(list)
        for r in rollouts:
            by_slot[r.slot].append(r)
        futures = {slot: self.actors[slot].start_calls(self._call_specs(rs)) for slot, rs in by_slot.items()}
        for slot, fut in futures.items():
            fut.result()

    # ---- rounds -------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        """Rollouts with a call in flight."""
        return sum(r.active for r in self._rollouts.values())

    def run_rounds(self, n: int) -> int:
        """Run up to ``n`` rounds (fewer if every rollout finishes); returns rounds run."""
        done = 0
        while done < n and self.active:
            self._round()
            done += 1
        return done

    def finish(self, max_rounds: Optional[int] = None) -> dict[str, list[Receipt]]:
        """Run rounds until every rollout has finished; returns :meth:`receipts`."""
        limit = max_rounds if max_rounds is not None else self._rounds_left() + 1
        self.run_rounds(limit)
        if self.active:
            raise DriverError(f"{self.active} rollouts still running after {limit} rounds")
        return self.receipts()

    def _rounds_left(self) -> int:
        per_turn = lambda s: math.ceil(s.tokens_per_turn / self.step_tokens)  # noqa: E731
        return max((per_turn(r.spec) * (r.spec.turns - r.turn) for r in self._rollouts.values() if r.active), default=0)

    def _round(self) -> None:
        slots = sorted({r.slot for r in self._rollouts.values() if r.active})
        steps = {s: self.actors[s].step(self.step_tokens) for s in slots}
        finished = [s for s in slots if steps[s].result()["completed"]]
        self._collect(finished)
        self.rounds += 1

    def _collect(self, slots: Sequence[int]) -> list[_Rollout]:
        """Take completed calls from ``slots``, stage them (one put), open next turns."""
        taken = {s: self.actors[s].take_completed() for s in slots}
        outputs = [o for s in slots for o in taken[s].result()]
        if not outputs:
            return []
        rows, owners = [], []
        for out in outputs:
            r = self._rollouts.get(out["rollout_id"])
            if r is None or not r.active or out["model_call_id"] != call_id(r.turn):
                continue  # not a call of ours (or a stale one): nothing to stage
            try:
                row = r.gate.stage_call(
                    out["model_call_id"], parent_call_id(r.turn), out["token_ids"], out["token_mask"], out["logprobs"],
                    routed_experts=out.get("routed_experts"), weight_version=self.weight_version,
                )
            except InvalidRecord as e:
                self._poison(r, f"{e.reason}: {e.detail}")
                continue
            rows.append(row)
            owners.append((r, row, int(out["context_tokens"])))
        if rows:
            result = self.store.put_many(pack_rows(rows, with_routes=self.with_routes), partition=STAGING_PARTITION)
            self.stage_puts += 1
        nxt = []
        for r, row, n_ctx in owners:
            bad = result.failed.get(row.staging_key)
            if bad is not None:
                self._poison(r, f"staging_failed: {bad[0]}: {bad[1]}")
                continue
            self._advance(r, row.token_ids, n_ctx)
            if r.active:
                nxt.append(r)
            else:
                r.final = r.gate.receipt(self._reward(r))
        self._start(nxt)
        return nxt

    def _advance(self, r: _Rollout, delta_ids: np.ndarray, n_ctx: int) -> None:
        r.generated.append(np.asarray(delta_ids[n_ctx:]))
        r.prev_len += len(delta_ids)
        r.tail = np.concatenate([r.tail, delta_ids])[-self.policy.window :]
        r.turn += 1

    def _reward(self, r: _Rollout) -> float:
        gen = np.concatenate(r.generated) if r.generated else np.zeros(0, np.int64)
        return toy_reward(gen)

    def _poison(self, r: _Rollout, reason: str) -> None:
        r.gate.poison(reason)
        r.final = r.gate.receipt(self._reward(r))

    def receipts(self) -> dict[str, list[Receipt]]:
        """Receipts per group (submission order); running rollouts get their receipt so far."""
        out: dict[str, list[Receipt]] = {}
        for rid in self._order:
            r = self._rollouts[rid]
            rec = r.final if r.final is not None else r.gate.receipt(self._reward(r))
            out.setdefault(r.spec.group_id, []).append(rec)
        return out

    # ---- cut ------------------------------------------------------------------------------------

    def cut(self, checkpoint_id: str, deadline: Optional[float] = None) -> CutStats:
        """Cut every in-flight call on every actor (``checkpoint_cut``, all actors at once).

        ``deadline``: absolute, in the workers' ``time.time()`` seconds (None: now +
        ``cut.deadline-s``). Calls that completed meanwhile are collected as usual. Sets
        :attr:`snapshot` (what :meth:`recover` needs) and returns :class:`CutStats`.
        """
        t0 = time.perf_counter()
        inventory: dict[int, list[tuple[str, str]]] = defaultdict(list)
        for rid in self._order:
            r = self._rollouts[rid]
            if r.active:
                inventory[r.slot].append(r.call)
        futures = {s: self.actors[s].checkpoint_cut(checkpoint_id, inv, deadline) for s, inv in inventory.items()}
        answers: dict[int, Optional[CutReceipt]] = {}
        lost: dict[int, BaseException] = {}
        for s, f in futures.items():
            try:
                answers[s] = f.result()
            except Exception as e:
                if not self._actor_lost(s, e):
                    raise
                lost[s] = e
        if lost:
            answers.update(self._lost_cuts(checkpoint_id, {s: inventory[s] for s in lost}, lost))
        receipts = [answers[s] for s in futures]
        acks = {a.call: a for rc in receipts for a in rc.acks}
        completed = [s for s, rc in zip(futures, receipts) if rc.counts().get("completed")]
        self._collect(completed)
        wall_ms = (time.perf_counter() - t0) * 1e3
        self.snapshot = self._snapshot(checkpoint_id, acks)
        counts = Counter(a.reason if a.status == DURABLE_FAILURE else a.status for a in acks.values())
        return CutStats(
            checkpoint_id=checkpoint_id,
            calls=len(acks),
            rows=sum(rc.rows_written for rc in receipts),
            puts=sum(rc.put_calls for rc in receipts),
            durable=sum(len(rc.durable) for rc in receipts),
            failed={k: v for k, v in counts.items() if k not in ("durable_prefix", "completed")},
            completed=counts.get("completed", 0),
            wall_ms=wall_ms,
            receipts=receipts,
            lost_workers=[self.workers[s] for s in lost],
        )

    def _actor_lost(self, slot: int, error: BaseException) -> bool:
        """Whether ``error`` (raised by an actor call of ``slot``) means the actor is gone:
        a connection failure, or its worker no longer in the cluster. Other errors are
        the actor's own (a bug, a bad argument) and propagate."""
        if isinstance(error, OSError):  # CommClosedError, refused connect, timeouts
            return True
        try:
            alive = self.workers[slot] in self.client.scheduler_info(n_workers=-1)["workers"]
        except Exception:  # the scheduler cannot say: treat the actor as reachable
            return False
        return not alive

    def _lost_cuts(self, checkpoint_id: str, inventories: Mapping[int, list[tuple[str, str]]],
                   errors: Mapping[int, BaseException]) -> dict[int, CutReceipt]:
        """Receipts for cuts whose generation actor died before answering: every listed call
        is ``durable_failure`` / ``generation_lost`` (it regenerates after recovery).

        The dead actor may have written rows of this cut (sealed on its side or not) that
        no receipt will ever advertise: they are found by listing the cut partition for
        ``__cut__/{checkpoint_id}/{rollout}/{call}/`` (one listing for all lost actors) and
        deleted in one batched delete, so no unadvertised row stays behind.
        """
        prefixes = tuple(f"{CUT_PREFIX}/{checkpoint_id}/{r}/{c}/" for inv in inventories.values() for r, c in inv)
        cleared, problem = 0, ""
        try:
            orphans = [k for k in self.cut_store.keys(CUT_PARTITION) if k.startswith(prefixes)]
            if orphans:
                res = self.cut_store.delete(orphans, partition=CUT_PARTITION)
                bad = {k: v for k, v in res.failed.items() if v[0] != "missing_key"}
                cleared = len(orphans) - len(bad)
                if bad:
                    problem = f"; {len(bad)} of its cut rows could not be deleted, e.g. {next(iter(bad.items()))}"
        except (OSError, RuntimeError) as e:  # includes StoreError: the rows stay unadvertised either way
            problem = f"; its cut rows could not be listed or deleted: {type(e).__name__}: {e}"
        out = {}
        for s, inv in inventories.items():
            detail = (f"generation actor on {self.workers[s]} lost mid-cut ({type(errors[s]).__name__}: {errors[s]}); "
                      f"{cleared} unadvertised cut rows of the lost calls deleted{problem}")
            out[s] = CutReceipt(checkpoint_id=checkpoint_id, inventory_digest=inventory_digest(inv),
                                acks=tuple(CallAck.failure(c, GENERATION_LOST, detail) for c in inv),
                                worker=self.workers[s], delete_calls=int(bool(cleared)))
        return out

    def checkpoint_store(self, path: str) -> dict:
        """Checkpoint the staging store (staged rows and cut prefixes) to ``path``; the manifest."""
        return self.store.checkpoint(path)

    def _snapshot(self, checkpoint_id: str, acks: dict[tuple[str, str], CallAck]) -> DriverSnapshot:
        receipts = {
            rid: (r.final if r.final is not None else r.gate.receipt(0.0)) for rid, r in self._rollouts.items()
        }
        return DriverSnapshot(
            checkpoint_id=checkpoint_id,
            specs=[self._rollouts[rid].spec for rid in self._order],
            turns={rid: r.turn for rid, r in self._rollouts.items()},
            receipts=receipts,
            acks=dict(acks),
            settings=dict(policy=self.policy_overrides, with_routes=self.with_routes,
                          weight_version=self.weight_version, step_tokens=self.step_tokens),
        )

    # ---- recovery --------------------------------------------------------------------------------

    @classmethod
    def recover(
        cls,
        client: Any,
        store: Any,
        snapshot: DriverSnapshot,
        n_workers: Optional[int] = None,
        *,
        batchers: Optional[Mapping[str, Any]] = None,
        cut_store: Any = None,
        workers: Optional[Sequence[str]] = None,
    ) -> tuple["RolloutDriver", RecoveryStats]:
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
            from .restore.batcher import start_batchers

            batchers = start_batchers(client, store, workers=sorted(set(driver.workers)),
                                      vocab_size=driver.policy.vocab_size, num_experts=driver.policy.num_experts,
                                      routes_shape=driver.policy.routes_shape if driver.with_routes else None)
        driver._resume(running, snapshot.acks, batchers, stats)
        stats.wall_ms = (time.perf_counter() - t0) * 1e3
        return driver, stats

    def _rebuild(self, snapshot: DriverSnapshot, stats: RecoveryStats) -> list[_Rollout]:
        """Rollouts and gates from the snapshot and the staged rows; the running ones."""
        running: list[_Rollout] = []
        for i, spec in enumerate(snapshot.specs):
            r = _Rollout(spec, i % len(self.actors), self._new_gate(spec))
            r.turn = snapshot.turns[spec.rollout_id]
            rec = snapshot.receipts[spec.rollout_id]
            if rec.poisoned or r.turn >= spec.turns:
                r.final = rec  # finished before the cut: its receipt is final
            else:
                running.append(r)
            self._rollouts[spec.rollout_id] = r
            self._order.append(spec.rollout_id)
        keys = [k for r in running for k in snapshot.receipts[r.spec.rollout_id].staging_keys]
        rows: dict[str, Any] = {}
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
                    why = failed.get(bad, ("missing_key", "not returned"))
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

    def _resume(self, running: list[_Rollout], acks: Mapping[tuple[str, str], CallAck], batchers: Mapping[str, Any],
                stats: RecoveryStats) -> None:
        """Resume each running rollout's call from its durable prefix, else start it over."""
        regen: list[tuple[_Rollout, str]] = []
        want: dict[int, list[tuple[_Rollout, CallAck]]] = defaultdict(list)
        for r in running:
            ack = acks.get(r.call)
            if ack is None:
                regen.append((r, NOT_CUT))
            elif not ack.durable:
                regen.append((r, ack.reason or ack.status))
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
                if not v.usable:
                    regen.append((r, v.reason or "unusable_prefix"))
                    continue
                p = v.prefix
                ctx = np.asarray(contexts[r.spec.rollout_id], np.int64)
                if p.context_tokens != len(ctx) or not np.array_equal(p.token_ids[: len(ctx)], ctx):
                    regen.append((r, CONTEXT_MISMATCH))
                    continue
                fut = self.actors[slot].resume_call(
                    r.spec.rollout_id, call_id(r.turn), history=r.tail, prev_len=r.prev_len,
                    max_new_tokens=r.spec.tokens_per_turn, **p.resume_kwargs(),
                )
                resumes.append((r, p.tokens, fut))
        for r, tokens, fut in resumes:  # issued together, awaited together
            try:
                fut.result()
            except Exception:  # the worker refused the prefix: this call starts over
                regen.append((r, RESUME_FAILED))
                continue
            stats.resumed += 1
            stats.resumed_tokens += tokens
        after = self._batcher_stats(set(pick.values()))
        stats.gets = sum(a["gets"] - before[k]["gets"] for k, a in after.items())
        stats.keys = sum(a["keys_fetched"] - before[k]["keys_fetched"] for k, a in after.items())
        stats.regenerated = dict(Counter(why for _, why in regen))
        self._start([r for r, _ in regen])

    @staticmethod
    def _batcher_stats(batchers: set) -> dict[Any, dict]:
        futures = {b: b.stats() for b in batchers}
        return {b: f.result() for b, f in futures.items()}


# ---- checking a run against the uninterrupted reference ----------------------------------------

TENSOR_FIELDS = ("input_ids", "logprobs", "token_mask", "routed_experts", "input_lengths", "prompt_lengths", "rewards")


def reference_mismatches(groups: Mapping[str, Any], reference: Sequence[GeneratedRollout]) -> dict[str, list[str]]:
    """Compare finalized groups with uninterrupted rollouts (:func:`tasks.toy.rollouts.generate_rollouts`).

    For every rollout of ``groups`` (``{group_id: FinalizedGroup}``), the finalized row
    must be ``ok`` and equal, bit for bit, the linearized reference chain: ids, logprobs
    (bytes), mask, routes, lengths (tokens), prompt length, reward; padding must be zeros.
    Returns ``{rollout_id: [mismatching fields]}`` for the rollouts that differ (empty:
    all matched). A reference rollout absent from ``groups`` is reported ``missing``.
    """
    ref = {g.spec.rollout_id: g for g in reference}
    bad: dict[str, list[str]] = {}
    seen = set()
    for group in groups.values():
        for i, rid in enumerate(group.rollout_ids):
            seen.add(rid)
            want = ref.get(rid)
            if want is None:
                bad[rid] = ["unexpected"]
                continue
            diffs = [] if group.status[i] == "ok" else [f"status={group.status[i]}"]
            ids = np.concatenate([r.token_ids for r in want.rows])
            exp = {
                "input_ids": ids,
                "logprobs": np.concatenate([r.logprobs for r in want.rows]),
                "token_mask": np.concatenate([r.token_mask for r in want.rows]),
            }
            if want.rows[0].routed_experts is not None:
                exp["routed_experts"] = np.concatenate([r.routed_experts for r in want.rows])
            n = len(ids)
            if int(group.input_lengths[i]) != n:
                diffs.append("input_lengths")
            if int(group.prompt_lengths[i]) != int(want.rows[0].delta_len - np.count_nonzero(want.rows[0].token_mask)):
                diffs.append("prompt_lengths")
            if np.float32(want.receipt.reward).tobytes() != group.rewards[i].numpy().tobytes():
                diffs.append("rewards")
            for name, arr in exp.items():
                t = getattr(group, name)
                got = None if t is None else t[i].numpy()
                if got is None or got[:n].tobytes() != np.ascontiguousarray(arr).astype(got.dtype).tobytes() or got[n:].any():
                    diffs.append(name)
            if diffs:
                bad[rid] = diffs
    for rid in ref:
        if rid not in seen:
            bad[rid] = ["missing"]
    return bad


def cut_round(turns: int, tokens_per_turn: int, step_tokens: int) -> int:
    """Rounds to run so a cut then lands mid-generation of the middle turn.

    Each turn takes ``ceil(tokens_per_turn / step_tokens)`` rounds; the answer is half
    of the middle turn's rounds into it (at least one round, so every call has tokens
    generated when a turn takes more than one round), and always before the last round.
    """
    per_turn = max(1, math.ceil(tokens_per_turn / step_tokens))
    middle = per_turn * (turns // 2) + max(1, per_turn // 2)
    return max(0, min(middle, per_turn * turns - 1))
