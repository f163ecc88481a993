"""What the driver calls on things elsewhere in the cluster, as protocols.

Generation worker and prefix-read batcher actor handles (each call returns a pending
result), and the store the actors write cut prefixes to. For type checking only: the real
objects are ``distributed`` actor handles and a ``StagingStore`` (or a test double).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    from pipeline.store.protocol import StoreResult
    from tasks.cut.prefix import PrefixVerdict
    from tasks.cut.receipt import CallAck, CutReceipt

T = TypeVar("T", covariant=True)


class Pending(Protocol[T]):
    """An actor call in flight (a ``distributed.ActorFuture``)."""

    def result(self) -> T: ...


class GenerationActor(Protocol):
    """A :class:`~pipeline.generation.worker.GenerationWorker` actor handle."""

    def start_calls(self, calls: Sequence[Mapping[str, Any]]) -> Pending[list[dict]]: ...

    def step(self, n_tokens: int = 1) -> Pending[dict]: ...

    def take_completed(self) -> Pending[list[dict]]: ...

    def checkpoint_cut(self, checkpoint_id: str, inventory: Iterable[tuple[str, str]] | None = None,
                       deadline: float | None = None) -> Pending[CutReceipt]: ...

    def resume_call(self, rollout_id: str, model_call_id: str, **kwargs: Any) -> Pending[dict]: ...


class PrefixBatcher(Protocol):
    """A :class:`~pipeline.restore.batcher.PrefixReadBatcher` actor handle."""

    def restore_many(self, continuations: Sequence[CallAck]) -> Pending[list[PrefixVerdict]]: ...

    def stats(self) -> Pending[dict[str, Any]]: ...


class CutStore(Protocol):
    """The store the actors write cut prefixes to, as the driver uses it when an actor is
    lost mid-cut (a :class:`~pipeline.store.client.StagingStore`, or a test double)."""

    def keys(self, partition: str = ..., prefix: str | None = None) -> list[str]: ...

    def delete(self, keys: Sequence[str], partition: str = ...) -> StoreResult: ...
