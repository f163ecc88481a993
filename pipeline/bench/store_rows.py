"""The rows the store benchmarks move: real staged rows packed once (:func:`template_batch`)
and put again and again under fresh keys (:func:`with_keys`; the store is write-once)."""
from __future__ import annotations

import numpy as np

from tasks.gate import CaptureGate
from tasks.packed import PackedBatch, pack_rows


def template_batch(n: int, tokens: int, *, layers: int, top_k: int, routes: bool, seed: int = 0) -> PackedBatch:
    """``n`` real staged rows (capture gate, one call each) packed; keys are renamed per use."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        gate = CaptureGate(f"t{i}", vocab_size=512, num_experts=8)
        mask = np.ones(tokens, np.float32)
        lp = -rng.random(tokens, dtype=np.float32) - 0.01
        re = rng.integers(0, 8, (tokens, layers, top_k)).astype(np.int16) if routes else None
        rows.append(gate.stage_call("c0", None, rng.integers(0, 512, tokens), mask, lp, routed_experts=re))
    return pack_rows(rows)


def with_keys(template: PackedBatch, tag: str, start: int, n: int) -> PackedBatch:
    """Rows ``0..n`` of ``template`` under fresh keys ``{tag}{start + i}/c0`` (write-once
    means every put needs new keys; the payload is what is being moved)."""
    base = template if n == len(template) else template.take(np.arange(n))
    return PackedBatch([f"{tag}{start + i}/c0" for i in range(n)], base.fields)
