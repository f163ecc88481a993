"""The cut fan-out: ``checkpoint_cut`` on every generation actor at once.

:func:`cut_actors` asks each actor of an :class:`~pipeline.driver.pool.ActorPool` to cut
its in-flight calls and gathers one receipt per actor (:class:`CutOutcome`). A call that
fails on the connection, or is not answered by the cut's deadline plus
``driver.cut-answer-margin-s`` (a hung worker), is retried while the actor's worker stays in the cluster (a cut
is idempotent: the actor answers a retry with the receipt it cached). An actor whose
worker left gets a ``generation_lost`` receipt (:func:`lost_cut_receipts`), and the cut
rows it may have written are listed and deleted so no unadvertised row stays behind; one
still in the cluster but unreachable gets the same receipt with its rows left in place
(:func:`unreachable_cut_receipts`: alive, it may have sealed them into its calls'
prefixes). :class:`CutStats` reports a cut; :func:`cut_round` says when to cut.
"""
from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from tasks.cut.receipt import (
    DURABLE_FAILURE,
    GENERATION_LOST,
    CallAck,
    CutReceipt,
    inventory_digest,
)
from tasks.keys import CUT_PARTITION, CUT_PREFIX

from ..store.protocol import MISSING_KEY
from .handles import CutStore
from .pool import ActorCall, ActorPool

Inventory = Mapping[int, Sequence[tuple[str, str]]]  # slot -> its in-flight (rollout, call)s
RETRY_INTERVAL_S = 0.2  # between rounds of retries of unreachable actors (s)


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


@dataclass(frozen=True)
class CutOutcome:
    """The actors' answers to one cut: receipts (one per actor cut, slot order of the
    inventory), acks by call, the slots whose receipt has completed calls (to collect),
    and the workers whose actor was lost."""

    checkpoint_id: str
    receipts: list[CutReceipt]
    acks: dict[tuple[str, str], CallAck]
    completed_slots: list[int]
    lost_workers: list[str]

    def stats(self, wall_ms: float) -> CutStats:
        counts = Counter(a.reason if a.status == DURABLE_FAILURE else a.status for a in self.acks.values())
        return CutStats(
            checkpoint_id=self.checkpoint_id,
            calls=len(self.acks),
            rows=sum(rc.rows_written for rc in self.receipts),
            puts=sum(rc.put_calls for rc in self.receipts),
            durable=sum(len(rc.durable) for rc in self.receipts),
            failed={k: v for k, v in counts.items() if k not in ("durable_prefix", "completed")},
            completed=counts.get("completed", 0),
            wall_ms=wall_ms,
            receipts=self.receipts,
            lost_workers=self.lost_workers,
        )


def cut_actors(pool: ActorPool, inventory: Inventory, cut_store: CutStore, checkpoint_id: str,
               deadline: float | None = None) -> CutOutcome:
    """``checkpoint_cut`` of each slot's ``inventory`` on its actor, all at once.

    ``deadline``: absolute, in the workers' ``time.time()`` seconds (None: the workers'
    ``cut.deadline-s`` from now). Actors lost meanwhile answer :func:`lost_cut_receipts`.
    """
    def call(slot: int, actor) -> object:
        return actor.checkpoint_cut(checkpoint_id, inventory[slot], deadline)

    wait_s = pool.settings.cut_wait_s(deadline, time.time()) if pool.settings is not None else None
    answers, lost = pool.fan_out_surviving(inventory, call, wait_s, what=f"cut {checkpoint_id!r}")
    if lost:
        grace = pool.settings.lost_actor_grace_s if pool.settings is not None else 0.0
        again, gone, unsure = settle_unreachable(pool, lost, call, grace)
        answers.update(again)
        workers = {s: pool.workers[s] for s in lost}
        if gone:
            answers.update(lost_cut_receipts(cut_store, checkpoint_id, {s: inventory[s] for s in gone}, gone, workers))
        answers.update(unreachable_cut_receipts(checkpoint_id, {s: inventory[s] for s in unsure}, unsure, workers))
        lost = {**gone, **unsure}
    receipts = [answers[s] for s in inventory]
    return CutOutcome(
        checkpoint_id=checkpoint_id,
        receipts=receipts,
        acks={a.call: a for rc in receipts for a in rc.acks},
        completed_slots=[s for s, rc in zip(inventory, receipts) if rc.counts().get("completed")],
        lost_workers=[pool.workers[s] for s in lost],
    )


def settle_unreachable(pool: ActorPool, lost: Mapping[int, BaseException], call: ActorCall, grace_s: float,
                       clock: Callable[[], float] = time.monotonic) -> tuple[dict, dict[int, BaseException], dict[int, BaseException]]:
    """The actors whose cut call failed on the connection, settled: ``(answers, gone,
    unsure)``. Each is retried while its worker stays in the cluster, for ``grace_s``
    seconds: a retry of the same cut answers the receipt the actor cached. ``gone``: the
    last error of each actor whose worker left the cluster; ``unsure``: of each still
    registered but unreachable when the grace ended."""
    end = clock() + grace_s
    pending, answers, gone = dict(lost), {}, {}
    while pending:
        for s, present in pool.slots_in_cluster(pending).items():  # one scheduler query a round
            if present is False:
                gone[s] = pending.pop(s)
        if not pending or clock() >= end:
            break
        got, failed = pool.fan_out_surviving(pending, call, max(end - clock(), 0.0), what="a retried cut")
        answers.update(got)
        pending = dict(failed)
        if pending:
            time.sleep(RETRY_INTERVAL_S)
    return answers, gone, pending


def unreachable_cut_receipts(checkpoint_id: str, inventories: Inventory, errors: Mapping[int, BaseException],
                             workers: Mapping[int, str]) -> dict[int, CutReceipt]:
    """Receipts for cuts whose actor could not be reached although its worker is still in
    the cluster: every listed call ``durable_failure`` / ``generation_lost`` (this cut
    advertises none of its rows), and its cut rows are left in place: the actor may be
    alive and have sealed them into its calls' prefixes, which its later cuts advertise."""
    out = {}
    for s, inv in inventories.items():
        detail = (f"generation actor on {workers[s]} unreachable mid-cut ({type(errors[s]).__name__}: {errors[s]}) "
                  f"though its worker is still in the cluster; its cut rows are left in place")
        out[s] = CutReceipt(checkpoint_id=checkpoint_id, inventory_digest=inventory_digest(inv),
                            acks=tuple(CallAck.failure(c, GENERATION_LOST, detail) for c in inv), worker=workers[s])
    return out


def lost_cut_receipts(cut_store: CutStore, checkpoint_id: str, inventories: Inventory,
                      errors: Mapping[int, BaseException], workers: Mapping[int, str]) -> dict[int, CutReceipt]:
    """Receipts for cuts whose generation actor died before answering: every listed call
    is ``durable_failure`` / ``generation_lost`` (it regenerates after recovery).

    The dead actor may have written rows of this cut (sealed on its side or not) that
    no receipt will ever advertise: they are found by listing the cut partition for
    ``__cut__/{checkpoint_id}/{rollout}/{call}/`` (one listing for all lost actors) and
    deleted in one batched delete, so no unadvertised row stays behind. ``workers``:
    slot -> the lost actor's worker.
    """
    prefixes = tuple(f"{CUT_PREFIX}/{checkpoint_id}/{r}/{c}/" for inv in inventories.values() for r, c in inv)
    cleared, problem = _delete_orphans(cut_store, prefixes)
    out = {}
    for s, inv in inventories.items():
        detail = (f"generation actor on {workers[s]} lost mid-cut ({type(errors[s]).__name__}: {errors[s]}); "
                  f"{cleared} unadvertised cut rows of the lost calls deleted{problem}")
        out[s] = CutReceipt(checkpoint_id=checkpoint_id, inventory_digest=inventory_digest(inv),
                            acks=tuple(CallAck.failure(c, GENERATION_LOST, detail) for c in inv),
                            worker=workers[s], delete_calls=int(bool(cleared)))
    return out


def _delete_orphans(cut_store: CutStore, prefixes: tuple[str, ...]) -> tuple[int, str]:
    """Delete the cut rows under ``prefixes`` (one listing, one delete): ``(rows deleted,
    what went wrong, as a detail suffix or "")``."""
    cleared, problem = 0, ""
    try:
        orphans = [k for k in cut_store.keys(CUT_PARTITION) if k.startswith(prefixes)]
        if orphans:
            res = cut_store.delete(orphans, partition=CUT_PARTITION)
            bad = {k: v for k, v in res.failed.items() if v[0] != MISSING_KEY}
            cleared = len(orphans) - len(bad)
            if bad:
                problem = f"; {len(bad)} of its cut rows could not be deleted, e.g. {next(iter(bad.items()))}"
    except (OSError, RuntimeError) as e:  # includes StoreError: the rows stay unadvertised either way
        problem = f"; its cut rows could not be listed or deleted: {type(e).__name__}: {e}"
    return cleared, problem


def cut_round(turns: int, tokens_per_turn: int, step_tokens: int) -> int:
    """Rounds to run so a cut then lands mid-generation of the middle turn.

    Each turn takes ``ceil(tokens_per_turn / step_tokens)`` rounds; the answer is half
    of the middle turn's rounds into it (at least one round, so every call has tokens
    generated when a turn takes more than one round), and always before the last round.
    """
    per_turn = max(1, math.ceil(tokens_per_turn / step_tokens))
    middle = per_turn * (turns // 2) + max(1, per_turn // 2)
    return max(0, min(middle, per_turn * turns - 1))
