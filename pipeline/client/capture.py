"""CaptureClient: token capture for generation engines outside this project.

Usable from any Python process that can reach the scheduler (a plain process, a Ray
actor, an inference-server thread, a Dask task). :meth:`CaptureClient.open` gives a
:class:`~pipeline.client.rollout.RolloutCapture` per rollout; the rows of every rollout
staged through one client share one queue, put in ONE ``put_many`` per flush (see
:mod:`pipeline.client.batcher`). Flush thresholds: ``capture-client.flush-calls`` (rows)
and ``capture-client.flush-ms`` (ms). Rows are hashed with ``capture.digest``, read once
when the client is built.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tasks.digests import version_of
from tasks.errors import InvalidInput
from tasks.gate import CaptureGate
from tasks.keys import STAGING_PARTITION

from .. import config
from ..store.protocol import StoreLike
from .batcher import RowBatcher
from .discovery import lookup_store
from .rollout import RolloutCapture

if TYPE_CHECKING:
    from distributed import Client


class CaptureClient:
    """Stages the calls of many rollouts, from many threads, in batched puts.

    ``store``: a :class:`~pipeline.store.client.StagingStore` (or any store with
    ``put_many``). ``flush_calls`` (rows) / ``flush_ms`` (ms) override the config knobs;
    ``digest`` (``"blake3"`` or ``"sha256"``) the ``capture.digest`` setting. Use as a
    context manager, or call :meth:`close`: it puts every queued row first.
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        partition: str = STAGING_PARTITION,
        flush_calls: int | None = None,
        flush_ms: float | None = None,
        digest: str | None = None,
    ) -> None:
        if not callable(getattr(store, "put_many", None)):
            raise InvalidInput(f"store must have put_many (a StagingStore), got {type(store).__name__}")
        self.store = store
        self.digest_version = version_of(config.digest_algorithm() if digest is None else digest)
        self._batcher = RowBatcher(store, partition=partition, flush_calls=flush_calls, flush_ms=flush_ms)
        self._lock = threading.Lock()
        self._open: dict[str, RolloutCapture] = {}
        self._closing = False
        self._dask_client: Client | None = None  # the client connect() made, closed with this one

    @classmethod
    def connect(cls, scheduler: str | Client, name: str | None = None, **kwargs: str | int | float | None) -> "CaptureClient":
        """A capture client on the store published as ``name`` (default
        ``capture-client.store-name``) on ``scheduler``: an address such as
        ``"tcp://127.0.0.1:8786"`` (a Dask client is made, and closed with this one) or an
        existing ``distributed.Client``. ``kwargs`` go to the constructor.

        Raises :class:`~tasks.errors.StoreUnavailable` when no store is published there.
        """
        owned = None
        if isinstance(scheduler, str):
            from distributed import Client

            from ..scheduler_security import check_scheduler_security

            check_scheduler_security(scheduler)  # InvalidSchedulerAddress naming the TLS keys
            owned = client = Client(scheduler)
        else:
            client = scheduler
        try:
            store = lookup_store(client, name)
            cap = cls(store, **kwargs)
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        cap._dask_client = owned
        return cap

    def open(
        self,
        rollout_id: str,
        group_id: str | None = None,
        *,
        vocab_size: int,
        num_experts: int | None = None,
    ) -> RolloutCapture:
        """Start capturing rollout ``rollout_id`` (token ids in ``[0, vocab_size)``, expert
        ids in ``[0, num_experts)``; ``num_experts <= 256`` stages routes as one byte per
        id, routes encoding 2). A rollout id may be open once at a time per client;
        its keys must be new to the store (keys are write-once)."""
        gate = CaptureGate(rollout_id, vocab_size=vocab_size, num_experts=num_experts, group_id=group_id,
                           digest_version=self.digest_version)
        rc = RolloutCapture(gate, self._batcher, on_finish=self._finished)
        with self._lock:
            if self._closing:
                raise InvalidInput("this capture client is closed")
            if gate.rollout_id in self._open:
                raise InvalidInput(f"rollout {gate.rollout_id!r} is already open in this capture client")
            self._open[gate.rollout_id] = rc
        return rc

    def flush(self, timeout_s: float | None = None) -> bool:
        """Put every row queued so far now, and wait for the outcomes; False on timeout."""
        return self._batcher.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        """This client's counters: ``rows`` stored, ``puts``, ``bytes`` put (packed
        buffers), ``refused`` rows, ``failed_puts``, ``queued`` rows and ``queued_bytes``,
        ``open_rollouts``."""
        with self._lock:
            n_open = len(self._open)
        return {**self._batcher.stats(), "open_rollouts": n_open}

    def close(self, timeout_s: float | None = None) -> bool:
        """Put every queued row, stop the flusher, close the Dask client :meth:`connect`
        made. Idempotent; False if the flusher did not finish within ``timeout_s``."""
        with self._lock:
            self._closing = True
        done = self._batcher.close(timeout_s)
        if self._dask_client is not None and done:
            self._dask_client.close()
            self._dask_client = None
        return done

    def __enter__(self) -> "CaptureClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finished(self, rc: RolloutCapture) -> None:
        with self._lock:
            if self._open.get(rc.rollout_id) is rc:
                del self._open[rc.rollout_id]

    def __repr__(self) -> str:
        return f"<CaptureClient store={self.store!r} open={len(self._open)}>"
