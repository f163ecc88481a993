"""Finalization as a Dask task graph: one union fetch, per-rollout verify, per-group assembly.

    from pipeline.finalize import Finalizer
    fin = Finalizer(client, store)
    handle = fin.submit_step({"g0": receipts})    # Dask futures, several steps may be in flight
    step = handle.result()                        # StepResult(step_id, groups, metrics)

See :mod:`pipeline.finalize.graph` for the graph and :mod:`pipeline.finalize.timing`
for the split timing and the ``token-capture-finalize`` event schema.
"""
from .controller import Finalizer, StepHandle, StepResult, clear_rows
from .graph import FinalizeError, Piece, StepGraph, VerifyOut, submit_graph

__all__ = [
    "Finalizer",
    "StepHandle",
    "StepResult",
    "FinalizeError",
    "Piece",
    "StepGraph",
    "VerifyOut",
    "submit_graph",
    "clear_rows",
]
