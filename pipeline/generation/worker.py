"""GenerationWorker: a Dask actor decoding many concurrent calls, cut at checkpoints.

Each call is a toy-policy decode state plus a :class:`~pipeline.generation.call_buffer.CallBuffer`.
:meth:`~GenerationWorker.step` decodes every active call in one batched policy pass on the
actor thread; :meth:`~GenerationWorker.checkpoint_cut` runs the cut transaction in another
thread, so decoding continues while a cut's puts are in flight (per-call locks order the two).
"""
from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from tasks.cut.receipt import CallId, CutReceipt, InventoryEntry, normalize_inventory, pairs_digest
from tasks.errors import DuplicateCall, InvalidCall, UnknownCall
from tasks.toy.policy import MoEPolicy, PolicyConfig
from tasks.toy.rollouts import CallState, advance, resume_state, start_calls

from .. import config, events
from ..answers import WireList
from .call_buffer import ACTIVE, COMPLETED_STATE, CallBuffer
from .cut import Clock, CutSettings, CutStore, run_cut


class _Call:
    __slots__ = ("state", "buffer")

    def __init__(self, state: CallState, buffer: CallBuffer):
        self.state = state
        self.buffer = buffer


class GenerationWorker:
    """Dask actor: many concurrent calls of the toy policy, stepwise decoding, cuts.

    store: a :class:`~pipeline.store.client.StagingStore` (or a wrapper with
        ``put_many``/``delete``, e.g. :class:`~pipeline.testing.faults.FaultyStore`).
    name: reported in receipts and events (default: the hosting worker's address).
    policy: policy settings (default: config section ``token-capture.policy``).
    with_routes: capture routed experts (router replay).
    clock: seconds callable for cut deadlines; default the store's ``clock`` attribute
        when it has one (test wrappers), else ``time.time``.

    Threads: sync methods (``start_calls``, ``step``, ``finish_call``, ...) run on the
    worker's single actor thread. ``checkpoint_cut`` is ``async``: it runs the cut in a
    separate thread (``asyncio.to_thread``), so store I/O never occupies the actor thread.
    A cut can land between any two steps. Typical use (controller)::

        gen = client.submit(GenerationWorker, store, actor=True).result()
        gen.start_calls([{"rollout_id": "r0", "model_call_id": "call-0",
                          "context": prompt, "max_new_tokens": 64}]).result()
        gen.step(8).result()
        receipt = gen.checkpoint_cut("ckpt-1").result()     # CutReceipt
    """

    def __init__(
        self,
        store: CutStore,
        *,
        name: str | None = None,
        policy: Mapping[str, Any] | None = None,
        with_routes: bool = True,
        clock: Clock | None = None,
    ):
        self.store = store
        self.policy = MoEPolicy(PolicyConfig.from_mapping(policy if policy is not None else config.get("policy")))
        self.with_routes = bool(with_routes)
        self.cut_settings = CutSettings.from_config()  # read once, like the policy
        self.clock: Clock = clock or getattr(store, "clock", None) or time.time
        self._name = name
        self._calls: "OrderedDict[CallId, _Call]" = OrderedDict()
        self._calls_lock = threading.Lock()  # guards the dict, not the calls
        self._cut_lock = threading.Lock()  # one cut at a time per worker
        self._receipts: "OrderedDict[tuple[str, bytes], CutReceipt]" = OrderedDict()

    @property
    def name(self) -> str:
        if self._name is None:
            self._name = events.host_name(f"local-{uuid.uuid4().hex[:6]}")
        return self._name

    # ---- lifecycle -------------------------------------------------------------------

    def start_calls(self, calls: Sequence[Mapping[str, Any]]) -> list[dict]:
        """Open calls (one batched prefill for all). Each spec is a mapping with:

        rollout_id, model_call_id, context (int ids, mask 0), max_new_tokens (tokens);
        optional parent_call_id, history (rollout tokens before the call, or a tail of at
        least ``policy.window`` tokens with ``prev_len``), prev_len, weight_version.
        Raises (and opens nothing) on a bad spec or a duplicate call.
        """
        specs = [dict(c) for c in calls]
        ids = [(c["rollout_id"], c["model_call_id"]) for c in specs]
        if len(set(ids)) != len(ids):
            raise DuplicateCall("the same call appears twice in one start_calls")
        with self._calls_lock:
            dup = [i for i in ids if i in self._calls]
        if dup:
            raise DuplicateCall(f"calls already held: {dup[:3]}")
        histories = [np.asarray(c.get("history", np.zeros(0, np.int64))) for c in specs]
        prev_lens = [int(c["prev_len"]) if c.get("prev_len") is not None else len(h) for c, h in zip(specs, histories)]
        states = start_calls(
            self.policy, [c["rollout_id"] for c in specs], histories, [c["context"] for c in specs],
            [int(c["max_new_tokens"]) for c in specs], prev_lens=prev_lens, with_routes=self.with_routes,
        )
        opened = []
        for c, st in zip(specs, states):
            buf = CallBuffer(
                c["rollout_id"], c["model_call_id"], st.context,
                parent_call_id=c.get("parent_call_id"), weight_version=int(c.get("weight_version", 0)),
                routes_shape=self.policy.routes_shape if self.with_routes else None,
                context_routes=st.context_routes, max_new_tokens=st.max_new_tokens,
                digest_version=self.cut_settings.digest_version, routes_dtype=st.routes_dtype,
            )
            opened.append(_Call(st, buf))
        with self._calls_lock:
            for call in opened:
                self._calls[call.buffer.call] = call
        return WireList(c.buffer.info() for c in opened)

    def start_call(self, rollout_id: str, model_call_id: str, context: npt.ArrayLike, *, max_new_tokens: int, **kw: Any) -> dict:
        """One call; see :meth:`start_calls` for the keyword arguments."""
        return self.start_calls([dict(kw, rollout_id=rollout_id, model_call_id=model_call_id, context=context,
                                      max_new_tokens=max_new_tokens)])[0]

    def resume_call(
        self,
        rollout_id: str,
        model_call_id: str,
        *,
        history: npt.ArrayLike,
        prefix: Mapping[str, np.ndarray],
        prefix_keys: Sequence[str],
        chunk_lengths: Sequence[int],
        max_new_tokens: int,
        prev_len: int | None = None,
        parent_call_id: str | None = None,
        weight_version: int = 0,
        expected_digest: bytes | None = None,
        digest_version: int | None = None,
    ) -> dict:
        """Reopen a call from its cut prefix (chunks concatenated in chain order).

        ``prefix`` holds ``token_ids``, ``token_mask``, ``logprobs`` and (with routes)
        ``routed_experts``; ``prefix_keys``/``chunk_lengths`` are its chunks' cut keys and
        lengths (tokens). The prefix counts as already cut: the next cut writes only new
        tokens, continuing the chain. ``expected_digest`` (the receipt's prefix digest)
        is checked; a mismatch raises :class:`~tasks.errors.InvalidCall`.
        ``digest_version``: the prefix's (the call keeps hashing with it, whatever
        ``capture.digest`` says now: one call, one algorithm); None: this worker's setting.
        """
        call_key = (rollout_id, model_call_id)
        with self._calls_lock:
            if call_key in self._calls:
                raise DuplicateCall(f"call {call_key} already held")
        routes = prefix.get("routed_experts") if self.with_routes else None
        st = resume_state(
            self.policy, rollout_id, np.asarray(history), prefix["token_ids"], prefix["token_mask"],
            prefix["logprobs"], routes, int(max_new_tokens), prev_len=prev_len,
        )
        buf = CallBuffer(
            rollout_id, model_call_id, st.context, parent_call_id=parent_call_id, weight_version=weight_version,
            routes_shape=self.policy.routes_shape if self.with_routes else None,
            context_routes=st.context_routes, max_new_tokens=st.max_new_tokens,
            digest_version=self.cut_settings.digest_version if digest_version is None else digest_version,
            routes_dtype=st.routes_dtype,  # the prefix's: a call's chunks share one routes encoding
        )
        buf.restore_prefix(st.tokens, st.logprobs, st.routes, list(prefix_keys), list(chunk_lengths), expected_digest)
        with self._calls_lock:
            self._calls[call_key] = _Call(st, buf)
        return buf.info()

    def step(self, n_tokens: int = 1, calls: Iterable[Sequence[str]] | None = None) -> dict:
        """Decode up to ``n_tokens`` more tokens for every active call (or ``calls``).

        One batched policy pass; each call's new tokens are appended under its lock.
        Returns {"calls": advanced, "tokens": added, "completed": [[rollout, call], ...]}.
        """
        with self._calls_lock:
            if calls is None:
                chosen = [c for c in self._calls.values() if c.buffer.state == ACTIVE]
            else:
                chosen = [self._calls[tuple(k)] for k in calls if tuple(k) in self._calls]
                chosen = [c for c in chosen if c.buffer.state == ACTIVE]
        if not chosen:
            return {"calls": 0, "tokens": 0, "completed": []}
        before = [c.state.n_generated for c in chosen]
        counts = advance(self.policy, [c.state for c in chosen], int(n_tokens))
        added, completed = 0, []
        for c, b, n in zip(chosen, before, counts):
            if n <= 0:
                continue
            st = c.state
            try:
                done = c.buffer.append(st.tokens[b : b + n], st.logprobs[b : b + n],
                                       None if st.routes is None else st.routes[b : b + n])
            except InvalidCall:
                continue  # failed or finished meanwhile: its tokens are no longer wanted
            added += n
            if done:
                completed.append(list(c.buffer.call))
        return {"calls": len(chosen), "tokens": added, "completed": completed}

    def _get(self, rollout_id: str, model_call_id: str) -> _Call:
        with self._calls_lock:
            call = self._calls.get((rollout_id, model_call_id))
        if call is None:
            raise UnknownCall(f"no call {rollout_id}/{model_call_id} on {self.name}")
        return call

    def finish_call(self, rollout_id: str, model_call_id: str) -> dict:
        """Complete a call now (if still active), remove it and return its output."""
        call = self._get(rollout_id, model_call_id)
        call.buffer.complete()
        with self._calls_lock:
            self._calls.pop(call.buffer.call, None)
        return call.buffer.output()

    def fail_call(self, rollout_id: str, model_call_id: str, reason: str = "aborted") -> dict:
        """Terminal failure (abort): a cut in flight reports the call ``generation_lost``."""
        call = self._get(rollout_id, model_call_id)
        call.buffer.fail(reason)
        return call.buffer.info()

    def take_completed(self) -> list[dict]:
        """Outputs of every completed call (removed from the worker), in start order."""
        with self._calls_lock:
            done = [k for k, c in self._calls.items() if c.buffer.state == COMPLETED_STATE]
            calls = [self._calls.pop(k) for k in done]
        return WireList(c.buffer.output() for c in calls)

    def output(self, rollout_id: str, model_call_id: str) -> dict:
        """The call's tokens so far (context + every generated token), without removing it."""
        return self._get(rollout_id, model_call_id).buffer.output()

    def list_calls(self) -> list[dict]:
        """Token-free summaries of every held call (state, lengths, cut keys)."""
        with self._calls_lock:
            calls = list(self._calls.values())
        return WireList(c.buffer.info() for c in calls)

    # ---- checkpoint cut --------------------------------------------------------------

    async def checkpoint_cut(
        self, checkpoint_id: str, inventory: Iterable[InventoryEntry] | None = None, deadline: float | None = None
    ) -> CutReceipt:
        """Cut the inventory's calls (default: every held call); returns the :class:`CutReceipt`.

        ``deadline`` is absolute, in the worker clock's seconds (``time.time()`` by
        default; None: now + ``cut.deadline-s``). Runs :meth:`cut` off the actor thread.
        """
        return await asyncio.to_thread(self.cut, checkpoint_id, inventory, deadline)

    def cut(self, checkpoint_id: str, inventory: Iterable[InventoryEntry] | None = None, deadline: float | None = None) -> CutReceipt:
        """The cut, synchronously (in-process use; the actor entry point is :meth:`checkpoint_cut`).

        Receipts are cached by (checkpoint_id, inventory digest): a retry answers the same.
        """
        pairs = normalize_inventory(inventory)
        digest = pairs_digest(pairs)
        cache_key = (checkpoint_id, digest)
        with self._cut_lock:
            cached = self._receipts.get(cache_key)
            if cached is not None:
                return cached
            with self._calls_lock:
                if pairs is None:
                    targets = [(k, c.buffer) for k, c in self._calls.items()]
                else:
                    targets = [(k, self._calls[k].buffer if k in self._calls else None) for k in pairs]
            receipt, stats = run_cut(
                targets, self.store, checkpoint_id=checkpoint_id, inventory_digest=digest,
                deadline=deadline, clock=self.clock, worker=self.name,
                limits=self.cut_settings.limits, deadline_s=self.cut_settings.deadline_s,
                puts_in_flight=self.cut_settings.puts_in_flight,
            )
            self._receipts[cache_key] = receipt
            while len(self._receipts) > self.cut_settings.receipt_cache_size:
                self._receipts.popitem(last=False)
        counts = receipt.counts()
        events.publish(events.CUT, {
            "checkpoint_id": checkpoint_id, "worker": receipt.worker, "calls": len(receipt.acks),
            "rows": receipt.rows_written, "puts": receipt.put_calls, "wall_ms": receipt.wall_ms,
            "durable": len(receipt.durable),
            "failures": {a.reason: sum(1 for b in receipt.failures if b.reason == a.reason) for a in receipt.failures},
            "completed": counts.get("completed", 0),
        })
        return receipt

    def cached_receipts(self) -> list[CutReceipt]:
        """Receipts cached on this worker, oldest first."""
        with self._cut_lock:
            return list(self._receipts.values())
