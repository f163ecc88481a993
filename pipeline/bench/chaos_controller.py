"""The chaos soak's controller, a process of its own (so it can be SIGKILLed and replaced).

    python -m pipeline.bench.chaos_controller STATE_DIR INCARNATION

Reads ``STATE_DIR/config.json`` (:class:`ControllerConfig`), attaches to the hosted store by
name (``Finalizer.attach``) and keeps ``in_flight`` steps finalizing: each step's groups
are generated on the generation workers (a group whose receipts come back poisoned, e.g. a
unit lost mid-put, is generated again: same rows, write-once puts), its receipts are saved
to ``steps/<id>.pkl`` BEFORE it is submitted, and once collected its verdict against the
oracle (:mod:`pipeline.testing.oracle`) is appended to ``delivered.jsonl`` (fsync) with
the keys to clear BEFORE its rows are cleared (a ``clear_rows`` task; its id goes to
``cleared.jsonl`` once every row is deleted); a step with acknowledged rollouts whose
rows the store could not read just then is finalized again first. A replacement (the
next incarnation) resubmits every saved step not delivered and clears the rows of those
delivered and not cleared, then goes on with new ones. ``STATE_DIR/stop`` ends it: no new step, the ones in
flight are collected, exit 0. Progress on stderr.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tasks import reasons
from tasks.errors import FinalizeError

from ..store.batch_file import write_atomic

if TYPE_CHECKING:
    from distributed import Client

    from tasks.receipts import Receipt
    from tasks.toy.rollouts import RolloutSpec

    from ..finalize.controller import Finalizer, StepHandle, StepResult

LOST_REASONS = (reasons.MISSING_STAGING_ROW, reasons.LOST_STAGING_ROW)  # an acknowledged row not read back
GENERATION_ATTEMPTS = 8  # a group poisoned this many times is submitted as it is (its rollouts unacknowledged)
STEP_ATTEMPTS = 3  # a step whose graph fails (or times out) this many times is recorded failed
UNREAD_RETRY_S = 1.0  # before finalizing again a step some of whose acknowledged rows could not be read (s)


@dataclass(frozen=True)
class ControllerConfig:
    """What every incarnation runs with (``config.json``)."""

    scheduler: str
    store: str
    seed: int
    groups: int
    rollouts: int
    turns: int
    tokens_per_turn: int
    in_flight: int
    step_timeout_s: float  # one attempt at collecting a step (s)
    experts: int | None = None

    def save(self, state_dir: str) -> None:
        write_atomic(os.path.join(state_dir, "config.json"), [json.dumps(asdict(self)).encode()])

    @classmethod
    def load(cls, state_dir: str) -> ControllerConfig:
        with open(os.path.join(state_dir, "config.json")) as f:
            return cls(**json.load(f))


def step_id(index: int) -> str:
    return f"s{index:05d}"


def step_specs(cfg: ControllerConfig, index: int) -> list[list[RolloutSpec]]:
    """Step ``index``'s groups: the same in every run of the same seed (the oracle's too)."""
    from tasks.toy.rollouts import make_step_specs

    from .. import config

    return make_step_specs(f"c{cfg.seed}-{step_id(index)}-", cfg.groups, cfg.rollouts, turns=cfg.turns,
                           tokens_per_turn=cfg.tokens_per_turn, tool_tokens=config.get("demo.tool-tokens"),
                           prompt_tokens=config.get("demo.prompt-tokens"), vocab_size=config.get("policy.vocab-size"),
                           seed=config.get("policy.seed"))


class Book:
    """The controller's durable state in ``state_dir``: saved steps and delivered verdicts."""

    def __init__(self, state_dir: str) -> None:
        self.dir = state_dir
        self.steps_dir = os.path.join(state_dir, "steps")
        os.makedirs(self.steps_dir, exist_ok=True)
        self._receipts: dict[str, dict[str, list[Receipt]]] = {}  # undelivered steps' receipts, read once

    def saved(self) -> dict[str, int]:
        """Step id -> index of every saved step."""
        out = {}
        for name in os.listdir(self.steps_dir):
            if name.endswith(".pkl"):
                with open(os.path.join(self.steps_dir, name), "rb") as f:
                    out[name[:-4]] = int(pickle.load(f)["index"])
        return out

    def save(self, index: int, receipts: dict[str, list[Receipt]]) -> None:
        body = {"index": index, "receipts": {g: [r.to_dict() for r in rs] for g, rs in receipts.items()}}
        write_atomic(os.path.join(self.steps_dir, f"{step_id(index)}.pkl"), [pickle.dumps(body)])
        self._receipts[step_id(index)] = receipts

    def receipts(self, sid: str) -> dict[str, list[Receipt]]:
        """Step ``sid``'s receipts: as saved by this controller, or read from its file once
        (a new controller resubmitting its predecessor's steps)."""
        from tasks.receipts import Receipt

        if sid not in self._receipts:
            with open(os.path.join(self.steps_dir, f"{sid}.pkl"), "rb") as f:
                body = pickle.load(f)
            self._receipts[sid] = {g: [Receipt.from_dict(d) for d in rs] for g, rs in body["receipts"].items()}
        return self._receipts[sid]

    def delivered(self) -> dict[str, dict]:
        """Step id -> its verdict record (a torn last line, from a kill mid-write, is skipped)."""
        return read_delivered(self.dir)

    def cleared(self) -> set[str]:
        """Ids of the delivered steps whose clear finished with every row deleted."""
        try:
            with open(os.path.join(self.dir, "cleared.jsonl")) as f:
                return {line.strip() for line in f if line.strip()}
        except OSError:
            return set()

    def mark_cleared(self, sid: str) -> None:
        with open(os.path.join(self.dir, "cleared.jsonl"), "a") as f:
            f.write(sid + "\n")

    def deliver(self, record: dict) -> None:
        with open(os.path.join(self.dir, "delivered.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._receipts.pop(record["step"], None)  # delivered: never submitted again


def read_delivered(state_dir: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    try:
        with open(os.path.join(state_dir, "delivered.jsonl")) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                out.setdefault(record["step"], record)
    except OSError:
        pass
    return out


def owed_clears(delivered: dict[str, dict], cleared: set[str]) -> dict[str, list[str]]:
    """Step id -> the keys still to clear, of each delivered step not seen cleared."""
    return {sid: r["clear_keys"] for sid, r in delivered.items() if r.get("clear_keys") and sid not in cleared}


def rollout_digest(group: Any, i: int) -> str:
    """SHA-256 of row ``i`` of a FinalizedGroup: its tokens, logprobs, mask, routes, reward."""
    n = int(group.input_lengths[i])
    h = hashlib.sha256()
    for name in ("input_ids", "logprobs", "token_mask", "routed_experts"):
        t = getattr(group, name)
        if t is not None:
            h.update(t[i][:n].contiguous().numpy().tobytes())
    h.update(group.rewards[i].numpy().tobytes())
    h.update(str(group.status[i]).encode())
    return h.hexdigest()


def verdict(cfg: ControllerConfig, sid: str, index: int, receipts: dict[str, list[Receipt]], step: StepResult,
            incarnation: int, attempts: int) -> dict:
    """A delivered step against the oracle: acknowledged rollouts (receipts not poisoned),
    their rows, rows lost (a missing or lost staging row), rollouts whose tensors differ."""
    from tasks.toy.rollouts import generate_rollouts

    from ..capture import policy_from_config
    from ..testing.oracle import reference_mismatches

    acked = {r.rollout_id: r for rs in receipts.values() for r in rs if not r.poisoned}
    reference = generate_rollouts(policy_from_config(), [s for g in step_specs(cfg, index) for s in g])
    mismatched = {rid: v for rid, v in reference_mismatches(step.groups, reference).items() if rid in acked}
    status = {rid: g.status[i] for g in step.groups.values() for i, rid in enumerate(g.rollout_ids)}
    lost = sum(len(acked[rid].calls) for rid in acked if status.get(rid) in LOST_REASONS)
    digests = {rid: rollout_digest(g, i) for g in step.groups.values() for i, rid in enumerate(g.rollout_ids) if rid in acked}
    rejected = {rid: f"{g.status[i]}: {g.details[i] if i < len(g.details) else ''}" for g in step.groups.values()
                for i, rid in enumerate(g.rollout_ids) if rid in acked and g.status[i] != "ok"}
    return {
        "step": sid, "index": index, "incarnation": incarnation, "attempts": attempts, "t": time.time(),
        "rollouts": sum(len(rs) for rs in receipts.values()), "acknowledged": len(acked),
        "rows": sum(len(r.calls) for r in acked.values()), "tokens": int(step.metrics.get("tokens", 0)),
        "rows_lost": lost, "mismatched": mismatched, "digests": digests, "rejected": rejected,
    }


class Controller:
    """One incarnation's loop (module docstring)."""

    def __init__(self, client: Client, cfg: ControllerConfig, state_dir: str, incarnation: int) -> None:
        from ..finalize.controller import Finalizer

        self.client, self.cfg, self.dir, self.incarnation = client, cfg, state_dir, incarnation
        self.book = Book(state_dir)
        self.fin: Finalizer = Finalizer.attach(client, cfg.store, num_experts=cfg.experts)
        self.fin.with_settings(clear_staged=False)  # cleared here, once the verdict is on disk
        self.in_flight: deque[tuple[str, int, StepHandle, int]] = deque()  # (step id, index, handle, attempt)
        self.resubmitted: set[str] = set()  # steps an earlier incarnation saved and did not deliver
        self.clears: list[tuple[str, Any]] = []  # (step id, future of its clear_rows task)

    def say(self, text: str) -> None:
        print(f"[controller {self.incarnation}] {text}", file=sys.stderr, flush=True)

    def run(self) -> None:
        saved, delivered = self.book.saved(), self.book.delivered()
        for sid, index in sorted(saved.items()):
            if sid not in delivered:
                self.submit(sid, index, 1)
                self.resubmitted.add(sid)
        if self.in_flight:
            self.say(f"resubmitted {len(self.in_flight)} undelivered step(s): {[s for s, *_ in self.in_flight]}")
        self.clear_owed(delivered)
        next_index = max(saved.values(), default=-1) + 1
        while True:
            stopping = os.path.exists(os.path.join(self.dir, "stop"))
            if not stopping and len(self.in_flight) < self.cfg.in_flight:
                self.book.save(next_index, self.generate(next_index))
                self.submit(step_id(next_index), next_index, 1)
                next_index += 1
                continue
            if not self.in_flight:
                self.reap_clears(wait_s=self.cfg.step_timeout_s)
                retry = self.fin.retry_clears()  # rows the clears above could not delete
                if retry is not None:
                    self.clears.append(("leftovers", retry))
                    self.reap_clears(wait_s=self.cfg.step_timeout_s)
                return
            self.collect(*self.in_flight.popleft())

    def clear_owed(self, delivered: dict[str, dict]) -> None:
        """Clear the rows of the steps an earlier incarnation delivered and did not see
        cleared (killed in between): nobody else would (a delete of a gone row is fine)."""
        owed = owed_clears(delivered, self.book.cleared())
        for sid, keys in sorted(owed.items()):
            clear = self.fin.submit_clear(keys, f"{sid}-i{self.incarnation}-owed")
            if clear is not None:
                self.clears.append((sid, clear))
        if owed:
            self.say(f"clearing the rows of {len(owed)} delivered step(s) not seen cleared: {sorted(owed)}")

    def submit(self, sid: str, index: int, attempt: int) -> None:
        handle = self.fin.submit_step(self.book.receipts(sid), step_id=f"{sid}-i{self.incarnation}-a{attempt}")
        self.in_flight.append((sid, index, handle, attempt))

    def resubmit(self, sid: str, index: int, failed: StepHandle, attempt: int) -> None:
        """The failed (cancelled) step again under its own id (:meth:`StepHandle.resubmit`);
        one the Finalizer does not see failed (say its gather raised with every task done)
        goes in under a new id."""
        try:
            self.in_flight.append((sid, index, failed.resubmit(), attempt))
        except FinalizeError:
            self.submit(sid, index, attempt)

    def generate(self, index: int) -> dict[str, list[Receipt]]:
        """Step ``index``'s receipts, each group generated again while any receipt of it comes
        back poisoned (up to :data:`GENERATION_ATTEMPTS`)."""
        from .. import config
        from ..capture import generate_and_stage

        out = {}
        for specs in step_specs(self.cfg, index):
            for attempt in range(1, GENERATION_ATTEMPTS + 1):
                fut = self.client.submit(generate_and_stage, self.fin.store, list(specs), pure=False,
                                         resources={"generation": 1}, digest_version=config.digest_version())
                receipts = fut.result()
                if not any(r.poisoned for r in receipts):
                    break
                why = next(r.failure_reason for r in receipts if r.poisoned)
                self.say(f"{step_id(index)} group {specs[0].group_id}: poisoned ({why}), generating again ({attempt})")
                time.sleep(min(0.5 * attempt, 3.0))
                self.fin.store = _fresh_store(self.client, self.cfg.store, self.fin.store)
            out[specs[0].group_id] = receipts
        return out

    def collect(self, sid: str, index: int, handle: StepHandle, attempt: int) -> None:
        try:
            step = handle.result(timeout=self.cfg.step_timeout_s)
        except Exception as e:  # noqa: BLE001 - retried, then recorded
            handle.cancel()
            self.say(f"{sid} attempt {attempt} failed: {type(e).__name__}: {e}")
            if attempt < STEP_ATTEMPTS:
                self.resubmit(sid, index, handle, attempt + 1)
                self.in_flight.rotate(1)  # keep it first: steps are collected in order
            else:
                self.book.deliver({"step": sid, "index": index, "failed": f"{type(e).__name__}: {e}", "t": time.time()})
            return
        if attempt < STEP_ATTEMPTS and self.unread(sid, step):
            time.sleep(UNREAD_RETRY_S)
            self.fin.store = _fresh_store(self.client, self.cfg.store, self.fin.store)
            self.submit(sid, index, attempt + 1)  # its rows were kept (not cleared): the same receipts again
            self.in_flight.rotate(1)
            return
        record = verdict(self.cfg, sid, index, self.book.receipts(sid), step, self.incarnation, attempt)
        record["resubmitted"] = sid in self.resubmitted or attempt > 1
        record["clear_keys"] = keys = handle.clear_keys()  # a replacement clears them if this one dies first
        self.book.deliver(record)
        self.say(f"{sid} delivered: {record['acknowledged']}/{record['rollouts']} acknowledged, "
                 f"{len(record['mismatched'])} differ, {record['rows_lost']} rows lost")
        for rid, why in list(record["rejected"].items())[:4]:  # an acknowledged rollout rejected: why, as delivered
            self.say(f"{sid}: acknowledged rollout {rid} rejected: {why}")
        # Cleared on the cluster, as the Finalizer's own clear is: a delete that waits out
        # its deadline on a lost unit holds no step of this loop. Rows earlier clears could
        # not delete go with it.
        clear = self.fin.submit_clear(keys, f"{sid}-i{self.incarnation}-a{attempt}")
        if clear is not None:
            self.clears.append((sid, clear))
        self.reap_clears()

    def unread(self, sid: str, step: StepResult) -> list[str]:
        """The acknowledged rollouts of ``step`` rejected only because the store could not
        read their rows just then (both copies' units unreachable at that moment, say a
        unit lost while the other copy's replacement was being installed), said once: a
        trainer finalizes them again rather than count them (their rows were kept)."""
        acked = {r.rollout_id for rs in self.book.receipts(sid).values() for r in rs if not r.poisoned}
        unread = [rid for rid in step.retryable if rid in acked]
        if unread:
            self.say(f"{sid}: {len(unread)} acknowledged rollout(s) whose rows could not be read now, e.g. "
                     f"{unread[0]}: finalizing the step again")
        return unread

    def reap_clears(self, wait_s: float = 0.0) -> None:
        """Say which finished clears left rows staged (waiting up to ``wait_s`` for the rest)."""
        from distributed import wait

        if wait_s and self.clears:
            wait([f for _, f in self.clears], timeout=wait_s, return_when="ALL_COMPLETED")
        for sid, fut in [c for c in self.clears if c[1].done()]:
            self.clears.remove((sid, fut))
            try:
                failed = fut.result()["failed"]
            except Exception as e:  # noqa: BLE001 - said, the rows stay staged
                failed = {"?": (type(e).__name__, str(e))}
            if failed:
                self.say(f"{sid}: {len(failed)} row(s) not cleared (left staged)")
            elif sid != "leftovers":
                self.book.mark_cleared(sid)


def _fresh_store(client: Client, name: str, current: Any) -> Any:
    """The published handle (a repair republishes it), or ``current`` if none can be had."""
    from ..client.discovery import lookup_store

    try:
        return lookup_store(client, name)
    except Exception:  # noqa: BLE001 - keep the one we have
        return current


def main(argv: list[str]) -> int:
    from distributed import Client

    state_dir, incarnation = argv[0], int(argv[1])
    cfg = ControllerConfig.load(state_dir)
    with Client(cfg.scheduler, timeout=60, set_as_default=True) as client:
        Controller(client, cfg, state_dir, incarnation).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
