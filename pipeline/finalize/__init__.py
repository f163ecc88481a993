"""Finalization as a Dask task graph: one union fetch per storage site, verify, per-group assembly.

    fin = Finalizer(client, store)
    step = fin.submit_step({"g0": receipts}).result()   # StepResult(step_id, groups, metrics)

Several steps may be in flight; events are listed at :data:`pipeline.events.FINALIZE`.
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
