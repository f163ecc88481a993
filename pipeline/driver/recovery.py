"""Recovery: rollouts continued on fresh actors from the snapshot of a cut.

:func:`rebuild_rollouts` puts the snapshot's rollouts in a
:class:`~pipeline.driver.book.RolloutBook`, gates rebuilt from the staged rows;
:func:`resume_calls` resumes each in-flight call on the
:class:`~pipeline.driver.pool.ActorPool` from its verified cut prefix, or names it for
regeneration (the choice: :func:`tasks.cut.resume.decide`). Reports :class:`RecoveryStats`.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import numpy as np

from tasks.cut.prefix import PrefixVerdict
from tasks.cut.receipt import CallAck
from tasks.cut.resume import decide
from tasks.errors import InvalidRecord
from tasks.keys import STAGING_PARTITION
from tasks.packed import unpack_rows
from tasks.schema import ROUTES_NONE, StagedRow, row_fields
from tasks.toy.policy import MoEPolicy
from tasks.toy.rollouts import call_id

from ..store.protocol import MISSING_KEY
from .book import RolloutBook
from .handles import BatcherStats, Pending, PrefixBatcher
from .pool import ActorPool, await_answer
from .snapshot import DriverSettings, DriverSnapshot
from .state import RolloutState

if TYPE_CHECKING:
    from distributed import Client

    from pipeline.store.client import StagingStore

__all__ = ["DriverSettings", "DriverSnapshot", "RecoveryStats", "rebuild_rollouts", "resume_calls", "start_batchers"]


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


def start_batchers(client: Client, store: StagingStore, workers: list[str], policy: MoEPolicy,
                   with_routes: bool) -> dict[str, PrefixBatcher]:
    """One prefix-read batcher on each of ``workers``, for ``policy``'s shapes."""
    from ..restore.batcher import start_batchers as start

    return start(client, store, workers=workers, vocab_size=policy.vocab_size, num_experts=policy.num_experts,
                 routes_shape=policy.routes_shape if with_routes else None)


# ---- rebuild -----------------------------------------------------------------------------


def rebuild_rollouts(book: RolloutBook, store: StagingStore, snapshot: DriverSnapshot, n_slots: int,
                     with_routes: bool, stats: RecoveryStats) -> list[RolloutState]:
    """The snapshot's rollouts into ``book`` (spec ``i`` on slot ``i % n_slots``), gates
    rebuilt from the staged rows (one get per routes encoding for all rollouts); the running ones.

    A rollout whose rows are missing or do not hash to its receipt is poisoned (named
    in ``stats.poisoned``); the others go on.
    """
    running: list[RolloutState] = []
    for i, spec in enumerate(snapshot.specs):
        r = book.add(spec, i % n_slots)
        r.turn = snapshot.turns[spec.rollout_id]
        rec = snapshot.receipts[spec.rollout_id]
        if rec.poisoned or r.turn >= spec.turns:
            r.final = rec  # finished before the cut: its receipt is final
        else:
            running.append(r)
    # One get per routes encoding the receipts name (rows staged as int16 before uint8
    # existed and new uint8 rows each come with their own routes field).
    by_encoding: dict[int, list[str]] = defaultdict(list)
    for r in running:
        for c in snapshot.receipts[r.spec.rollout_id].calls:
            by_encoding[c.routes_encoding if with_routes else ROUTES_NONE].append(c.staging_key)
    rows, failed = {}, {}
    for encoding, keys in by_encoding.items():
        got_rows, got_failed = _staged_rows(store, keys, encoding)
        rows.update(got_rows)
        failed.update(got_failed)
    alive = []
    for r in running:
        problem = _replay(book, r, snapshot, rows, failed)
        if problem is not None:
            stats.poisoned[r.spec.rollout_id] = problem
            book.poison(r, f"resume_failed: {problem}")
            continue
        alive.append(r)
    return alive


def _staged_rows(store: StagingStore, keys: list[str],
                 encoding: int) -> tuple[dict[str, StagedRow], dict[str, tuple[str, str]]]:
    """Rows of ``keys`` (staged with routes ``encoding``) from the staging partition (one
    get, when there are keys) and the keys that failed: ``(rows by key, failed[key] =
    (reason, detail))``."""
    if not keys:
        return {}, {}
    fields = list(row_fields(encoding))
    got = store.get_many(keys, fields, partition=STAGING_PARTITION)
    return dict(zip(got.batch.keys, unpack_rows(got.batch))), dict(got.failed)


def _replay(book: RolloutBook, r: RolloutState, snapshot: DriverSnapshot, rows: Mapping[str, StagedRow],
            failed: Mapping[str, tuple[str, str]]) -> str | None:
    """Rebuild ``r``'s gate from its staged rows and replay them (history tail, length,
    generated tokens); None, or why the rollout cannot go on."""
    rid = r.spec.rollout_id
    records = snapshot.receipts[rid].calls
    bad = next((k for k in (c.staging_key for c in records) if k in failed or k not in rows), None)
    try:
        if bad is not None:
            why = failed.get(bad, (MISSING_KEY, "not returned"))
            raise InvalidRecord("missing_staging_row", f"{bad!r}: {why[0]}: {why[1]}")
        chain = [rows[c.staging_key] for c in records]
        r.gate = book.resume_gate(r.spec, chain, records)
    except InvalidRecord as e:
        return f"{e.reason}: {e.detail}"
    r.turn = 0
    for row in chain:
        book.advance(r, row.token_ids, int(np.count_nonzero(row.token_mask == 0.0)))
    if r.turn != snapshot.turns[rid]:
        return f"turn {snapshot.turns[rid]} but {len(chain)} staged calls"
    return None


# ---- resume --------------------------------------------------------------------------------

# A resume_call in flight: the rollout, its ack, the prefix verdict, the pending call.
Resume = tuple[RolloutState, CallAck, PrefixVerdict, Pending[dict[str, object]]]


def resume_calls(pool: ActorPool, running: list[RolloutState], acks: Mapping[tuple[str, str], CallAck],
                 batchers: Mapping[str, PrefixBatcher], contexts: Mapping[str, np.ndarray],
                 stats: RecoveryStats) -> list[RolloutState]:
    """Resume each running rollout's call from its durable prefix; the rollouts whose call
    must start over instead (their reasons counted in ``stats.regenerated``).

    The I/O around :func:`~tasks.cut.resume.decide`: asked with the ack alone, then
    with the prefix's verdict, then with the worker's answer to the resume. ``contexts``:
    rollout -> the context its current call starts from.
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
    pick = {slot: batchers.get(pool.workers[slot]) or batchers[addrs[slot % len(addrs)]] for slot in want}
    before = _batcher_stats(set(pick.values()), pool.call_deadline())
    verdicts = {slot: pick[slot].restore_many([a for _, a in pairs]) for slot, pairs in want.items()}
    resumes = _issue_resumes(pool, want, verdicts, contexts, regen, stats)
    end = pool.call_deadline()
    for r, ack, v, fut in resumes:  # issued together, awaited together
        try:
            await_answer(fut, end, f"the generation actor of slot {r.slot}", f"resume_call of {r.spec.rollout_id}")
            accepted = True
        except Exception:  # the worker refused the prefix: this call starts over
            accepted = False
        d = decide(ack, v, contexts[r.spec.rollout_id], resumed=accepted)
        if d.regenerate:
            regen.append((r, d.reason))
            continue
        stats.resumed += 1
        stats.resumed_tokens += d.prefix_tokens
    after = _batcher_stats(set(pick.values()), pool.call_deadline())
    stats.gets = sum(a["gets"] - before[k]["gets"] for k, a in after.items())
    stats.keys = sum(a["keys_fetched"] - before[k]["keys_fetched"] for k, a in after.items())
    stats.regenerated = dict(Counter(why for _, why in regen))
    return [r for r, _ in regen]


def _issue_resumes(pool: ActorPool, want: Mapping[int, list[tuple[RolloutState, CallAck]]],
                   verdicts: Mapping[int, Pending[list[PrefixVerdict]]], contexts: Mapping[str, np.ndarray],
                   regen: list[tuple[RolloutState, str]], stats: RecoveryStats) -> list[Resume]:
    """``resume_call`` for each call whose prefix verdict allows it (not awaited); the
    others join ``regen`` with the verdict's reason."""
    resumes: list[Resume] = []
    end = pool.call_deadline()
    for slot, pairs in want.items():
        stats.restore_requests += len(pairs)
        answer = await_answer(verdicts[slot], end, f"the prefix-read batcher for the actor on {pool.workers[slot]}",
                              "restore_many")
        for (r, ack), v in zip(pairs, answer):
            d = decide(ack, v, contexts[r.spec.rollout_id])
            if d.regenerate:
                regen.append((r, d.reason))
                continue
            fut = pool.actors[slot].resume_call(
                r.spec.rollout_id, call_id(r.turn), history=r.tail, prev_len=r.prev_len,
                max_new_tokens=r.spec.tokens_per_turn, **v.prefix.resume_kwargs(),
            )
            resumes.append((r, ack, v, fut))
    return resumes


def _batcher_stats(batchers: set[PrefixBatcher], end: float | None) -> dict[PrefixBatcher, BatcherStats]:
    futures = {b: b.stats() for b in batchers}
    return {b: await_answer(f, end, "a prefix-read batcher", "stats") for b, f in futures.items()}
