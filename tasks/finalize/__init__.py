"""Finalization, pure: plan receipts, verify + linearize rows, assemble group tensors.

``reference`` is the per-token verifier the vectorized path is measured and tested against.
"""
