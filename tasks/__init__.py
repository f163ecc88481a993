"""Pure building blocks of token capture: data model, hashing, packing, verification.

Nothing in ``tasks`` imports Dask: every function here runs (and is tested) on plain
numpy/torch objects. ``pipeline`` wires these into Dask graphs and actors.
"""
