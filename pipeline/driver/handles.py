"""What the driver calls on things elsewhere in the cluster, as protocols, and the payloads.

Generation worker and prefix-read batcher actor handles (each call returns a pending
result), the store the actors write cut prefixes to, and the dicts those calls carry
(:class:`CallSpec` in, :class:`CompletedCall` / :class:`StepResult` out). For type checking
only: the real objects are ``distributed`` actor handles and a ``StagingStore`` (or a test
double), the payloads plain dicts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence, TypedDict, TypeVar

import numpy as np

if TYPE_CHECKING:
    from pipeline.store.protocol import StoreResult
    from tasks.cut.prefix import PrefixVerdict
    from tasks.cut.receipt import CallAck, CutReceipt

T = TypeVar("T", covariant=True)


class Pending(Protocol[T]):
    """An actor call in flight (a ``distributed.ActorFuture``)."""

    def result(self, timeout: float | None = None) -> T: ...


class CallSpec(TypedDict):
    """One call to open (``GenerationWorker.start_calls``)."""

    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    context: np.ndarray  # int ids the call starts from (prompt or tool output)
    history: np.ndarray  # the rollout's last policy.window tokens before the call
    prev_len: int  # tokens of the rollout before the call (tokens)
    max_new_tokens: int
    weight_version: int


class _CompletedCall(TypedDict):
    rollout_id: str
    model_call_id: str
    state: str
    token_ids: np.ndarray
    token_mask: np.ndarray
    logprobs: np.ndarray
    context_tokens: int


class CompletedCall(_CompletedCall, total=False):
    """A finished call's output (``GenerationWorker.take_completed``)."""

    routed_experts: np.ndarray  # with routes only


class StepResult(TypedDict):
    """``GenerationWorker.step``: calls stepped, tokens added, (rollout, call) completed."""

    calls: int
    tokens: int
    completed: list[list[str]]


class BatcherStats(TypedDict):
    """The counters of ``PrefixReadBatcher.stats`` the driver reads (there are more)."""

    gets: int
    keys_fetched: int


class GenerationActor(Protocol):
    """A :class:`~pipeline.generation.worker.GenerationWorker` actor handle."""

    def start_calls(self, calls: Sequence[CallSpec]) -> Pending[list[dict[str, object]]]: ...

    def step(self, n_tokens: int = 1) -> Pending[StepResult]: ...

    def take_completed(self) -> Pending[list[CompletedCall]]: ...

    def checkpoint_cut(self, checkpoint_id: str, inventory: Iterable[tuple[str, str]] | None = None,
                       deadline: float | None = None) -> Pending[CutReceipt]: ...

    # ``prefix``: ``PrefixVerdict.prefix.resume_kwargs()`` (arrays, keys, lengths, digest).
    def resume_call(self, rollout_id: str, model_call_id: str, *, history: np.ndarray, prev_len: int,
                    max_new_tokens: int, **prefix: Any) -> Pending[dict[str, object]]: ...


class PrefixBatcher(Protocol):
    """A :class:`~pipeline.restore.batcher.PrefixReadBatcher` actor handle."""

    def restore_many(self, continuations: Sequence[CallAck]) -> Pending[list[PrefixVerdict]]: ...

    def stats(self) -> Pending[BatcherStats]: ...


class CutStore(Protocol):
    """The store the actors write cut prefixes to, as the driver uses it when an actor is
    lost mid-cut (a :class:`~pipeline.store.client.StagingStore`, or a test double)."""

    def keys(self, partition: str = ..., prefix: str | None = None) -> list[str]: ...

    def delete(self, keys: Sequence[str], partition: str = ...) -> StoreResult: ...
