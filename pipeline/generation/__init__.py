"""Generation side: decoding actors whose in-flight calls are cut at checkpoints.

- :mod:`~pipeline.generation.worker`: :class:`GenerationWorker`, the Dask actor.
- :mod:`~pipeline.generation.call_buffer`: :class:`CallBuffer`, one call's tokens and lock.
- :mod:`~pipeline.generation.frozen_chunk`: :class:`FrozenChunk`, what a cut froze of a call.
- :mod:`~pipeline.generation.cut`: :func:`run_cut`, the checkpoint-cut transaction.
- :mod:`~pipeline.generation.cpu_gate`: the process-wide gate on cuts' CPU-bound steps.
Test doubles (``FaultyStore``, ``ManualClock``) are in :mod:`pipeline.testing.faults`.
"""
from .call_buffer import CallBuffer
from .cut import run_cut
from .worker import GenerationWorker

__all__ = ["CallBuffer", "GenerationWorker", "run_cut"]
