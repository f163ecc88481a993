"""Generation side: the GenerationWorker actor and the batched checkpoint cut (SPEC section 7).

- :mod:`pipeline.generation.worker`: :class:`GenerationWorker`, a Dask actor decoding many
  concurrent calls of the toy policy in steps, with ``checkpoint_cut``.
- :mod:`pipeline.generation.cut`: :class:`CallBuffer` (a call's tokens + lifecycle lock),
  :func:`run_cut` (the cut transaction) and failure injection (:class:`FaultyStore`,
  :class:`ManualClock`) for tests and benchmarks.
"""
from .cut import CallBuffer, FaultRules, FaultyStore, ManualClock, run_cut
from .worker import GenerationWorker

__all__ = ["CallBuffer", "FaultRules", "FaultyStore", "GenerationWorker", "ManualClock", "run_cut"]
