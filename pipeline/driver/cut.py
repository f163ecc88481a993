"""The cut fan-out: ``checkpoint_cut`` on every generation actor at once.

:class:`CutMixin` gives :class:`~pipeline.driver.core.RolloutDriver` its :meth:`cut`: one
call per actor, calls finished meanwhile collected, the snapshot taken. An actor that dies
mid-cut gets a ``generation_lost`` receipt, and the cut rows it may have written are
listed and deleted so no unadvertised row stays behind. :func:`cut_round` says when to cut.
"""
from __future__ import annotations

import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from tasks.cut.receipt import (
    DURABLE_FAILURE,
    GENERATION_LOST,
    CallAck,
    CutReceipt,
    inventory_digest,
)
from tasks.keys import CUT_PARTITION, CUT_PREFIX

from ..store.protocol import MISSING_KEY

if TYPE_CHECKING:
    from .core import RolloutDriver


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


class CutMixin:
    """:meth:`cut` and the handling of actors lost mid-cut (mixed into RolloutDriver)."""

    def cut(self: RolloutDriver, checkpoint_id: str, deadline: float | None = None) -> CutStats:
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
        answers: dict[int, CutReceipt] = {}
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

    def _actor_lost(self: RolloutDriver, slot: int, error: BaseException) -> bool:
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

    def _lost_cuts(self: RolloutDriver, checkpoint_id: str, inventories: Mapping[int, list[tuple[str, str]]],
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
                bad = {k: v for k, v in res.failed.items() if v[0] != MISSING_KEY}
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


def cut_round(turns: int, tokens_per_turn: int, step_tokens: int) -> int:
    """Rounds to run so a cut then lands mid-generation of the middle turn.

    Each turn takes ``ceil(tokens_per_turn / step_tokens)`` rounds; the answer is half
    of the middle turn's rounds into it (at least one round, so every call has tokens
    generated when a turn takes more than one round), and always before the last round.
    """
    per_turn = max(1, math.ceil(tokens_per_turn / step_tokens))
    middle = per_turn * (turns // 2) + max(1, per_turn // 2)
    return max(0, min(middle, per_turn * turns - 1))
