"""Restore side of checkpoint cuts: coalesced prefix reads.

* :class:`~pipeline.restore.coalescer.PrefixReadCoalescer`: the pure-asyncio core that
  merges concurrent prefix reads into bounded, deduplicated gets (when it issues, by load:
  :mod:`~pipeline.restore.dispatch`; its pending keys and queue:
  :mod:`~pipeline.restore.pending`; its sliced get answers: :mod:`~pipeline.restore.answer`);
* :class:`~pipeline.restore.batcher.PrefixReadBatcher`: the Dask actor (one per generation
  worker) wrapping a coalescer over a StagingStore's ``cut`` partition, which also
  verifies a restored prefix (:mod:`tasks.cut.prefix`) before a call resumes from it.
"""
from .coalescer import PrefixReadCoalescer, PrefixReadError

__all__ = ["PrefixReadCoalescer", "PrefixReadError", "PrefixReadBatcher", "start_batchers"]


def __getattr__(name):  # the actor pulls in distributed: import it only when asked for
    if name in ("PrefixReadBatcher", "start_batchers"):
        from . import batcher

        return getattr(batcher, name)
    raise AttributeError(name)
