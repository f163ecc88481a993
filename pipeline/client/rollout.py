"""One rollout's capture in the capture client: gate on the caller's thread, rows queued.

:meth:`RolloutCapture.stage` validates and hashes a call's delta through the rollout's
:class:`~tasks.gate.CaptureGate` synchronously (bad input raises
:class:`~tasks.errors.InvalidRecord` naming the rule; nothing is kept or queued) and queues
the row. :meth:`RolloutCapture.finish` waits until the rollout's rows have their outcomes
and returns the receipt, poisoned with the first refusal if a row was not stored.
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING

import numpy as np

from tasks.errors import InvalidInput
from tasks.gate import CaptureGate, record_of
from tasks.receipts import CallRecord, Receipt

from .. import config
from .refusals import FLUSH_TIMEOUT, Refusal, put_error, staging_failure

if TYPE_CHECKING:
    from .batcher import RowBatcher


class RolloutCapture:
    """Stages the calls of ONE rollout through a shared :class:`RowBatcher`.

    Thread-safe: calls of one rollout may be staged from several threads (each call's
    parent must have been staged first). Build with :meth:`CaptureClient.open`.
    """

    def __init__(self, gate: CaptureGate, batcher: "RowBatcher", on_finish=None) -> None:
        self._gate = gate
        self._batcher = batcher
        self._on_finish = on_finish
        self._lock = threading.Lock()  # the gate's state and ``_finished``
        self._finished = False
        self._engine_poisoned = False  # the engine's own reason wins over a store refusal
        # Guarded by the batcher's lock (the flusher reports outcomes under it):
        self._pending = 0
        self._refusal: Refusal | None = None

    @property
    def rollout_id(self) -> str:
        return self._gate.rollout_id

    @property
    def group_id(self) -> str | None:
        return self._gate.group_id

    @property
    def refusal(self) -> Refusal | None:
        """The first refusal of one of this rollout's rows so far, or ``None``."""
        with self._batcher.lock:
            return self._refusal

    def stage(
        self,
        model_call_id: str,
        parent_call_id: str | None,
        token_ids: np.ndarray,
        token_mask: np.ndarray,
        logprobs: np.ndarray,
        routed_experts: np.ndarray | None = None,
        weight_version: int = 0,
    ) -> CallRecord:
        """Validate, hash and queue one call's delta; returns the receipt's record of it.

        ``token_ids`` int (< vocab_size), ``token_mask`` float32 (0 for carried context
        tokens, then 1 for generated ones), ``logprobs`` float32 (<= 0, 0 where the mask
        is 0), ``routed_experts`` integer ids ``[delta_len, L, K]`` (any integer dtype: the
        gate stages them as uint8 when the rollout was opened with ``num_experts <= 256``,
        else int16) or ``None``: all ``delta_len`` long (the tokens new since ``parent_call_id``); ``weight_version`` an int within
        int64 (the digest stores it as ``<q``). The arrays are copied: reuse them.
        Raises :class:`~tasks.errors.InvalidRecord` (``reason`` names the rule) on bad
        input, keeping nothing; the rollout's other calls are unaffected.
        """
        with self._lock:
            if self._finished:
                raise InvalidInput(f"rollout {self.rollout_id!r} is finished; no call can be staged")
            row = self._gate.stage_call(
                model_call_id, parent_call_id, token_ids, token_mask, logprobs,
                routed_experts=routed_experts, weight_version=weight_version,
            )
            with self._batcher.lock:
                self._pending += 1
            try:
                self._batcher.add(row, self)
            except BaseException as e:
                # The receipt lists the call, so a row that never got queued must poison it.
                with self._batcher.lock:
                    self._pending -= 1
                    self._refusal = self._refusal or put_error(e)
                raise
        return record_of(row)

    def poison(self, reason: str) -> None:
        """Mark this capture unusable (e.g. the engine failed mid-call); the receipt says so."""
        with self._lock:
            self._gate.poison(reason)
            self._engine_poisoned = True

    def finish(self, reward: float, terminal_model_call_id: str | None = None, timeout_s: float | None = None) -> Receipt:
        """Wait until every staged row of this rollout is put (or refused); the receipt.

        Waits at most ``timeout_s`` (default ``capture-client.finish-timeout-s``); rows
        still unconfirmed then poison the receipt (``flush_timeout``). A refused row
        poisons it with ``"staging_failed: <reason>: <detail>"`` (the first refusal).

        The arguments are checked before anything changes: a ``reward`` that is not a
        number finite in float32 (NaN, inf, ``10**400``) or a terminal that is not a str
        raises :class:`~tasks.errors.InvalidRecord` (``invalid_receipt``), a bad
        ``timeout_s`` :class:`~tasks.errors.InvalidInput`; the rollout stays open, so
        finish it again with good arguments.
        """
        timeout_s = _finish_timeout(timeout_s)
        self._gate.check_receipt_args(reward, terminal_model_call_id)
        with self._lock:
            if self._finished:
                raise InvalidInput(f"rollout {self.rollout_id!r} is already finished")
            self._finished = True
        with self._batcher.lock:
            done = self._batcher.lock.wait_for(lambda: self._pending == 0, timeout_s)
            refusal = self._refusal
            if not done:
                refusal = refusal or (FLUSH_TIMEOUT, f"{self._pending} row(s) unconfirmed after {timeout_s} s")
        if refusal is not None and not self._engine_poisoned:
            self._gate.poison(staging_failure(*refusal))
        receipt = self._gate.receipt(reward, terminal_model_call_id)
        if self._on_finish is not None:
            self._on_finish(self)
        return receipt

    def _row_settled(self, key: str, refusal: Refusal | None) -> None:
        # Called by the flusher with the batcher's lock held.
        self._pending -= 1
        if refusal is not None and self._refusal is None:
            self._refusal = refusal

    def __repr__(self) -> str:
        return f"<RolloutCapture {self.rollout_id!r} group={self.group_id!r}>"


def _finish_timeout(timeout_s: float | None) -> float:
    """``timeout_s`` (default ``capture-client.finish-timeout-s``) as seconds, or
    :class:`~tasks.errors.InvalidInput` unless it is a finite number >= 0."""
    raw = config.get("capture-client.finish-timeout-s") if timeout_s is None else timeout_s
    try:
        value = math.nan if isinstance(raw, bool) else float(raw)
    except (OverflowError, TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        where = "timeout_s" if timeout_s is not None else "config capture-client.finish-timeout-s"
        raise InvalidInput(f"{where} is {raw!r}; pass a finite number of seconds >= 0")
    return value
