"""The rows the store benchmarks move: real staged rows packed once (:func:`template_batch`)
and put again and again under fresh keys (:func:`with_keys`; the store is write-once)."""
from __future__ import annotations

import numpy as np

from tasks.gate import CaptureGate
from tasks.packed import PackedBatch, pack_rows

DISTINCT_ROWS = 8  # rows built by the gate; a template of more repeats them (the payload is what moves)


def template_batch(n: int, tokens: int, *, layers: int, top_k: int, routes: bool, seed: int = 0,
                   experts: int = 8) -> PackedBatch:
    """``n`` real staged rows (capture gate, one call each; routes of ``layers`` x
    ``top_k`` ids below ``experts``, in the encoding the gate picks for that many) packed;
    keys are renamed per use. At most :data:`DISTINCT_ROWS` distinct rows, repeated."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(min(n, DISTINCT_ROWS)):
        gate = CaptureGate(f"t{i}", vocab_size=512, num_experts=experts)
        mask = np.ones(tokens, np.float32)
        lp = -rng.random(tokens, dtype=np.float32) - 0.01
        re = rng.integers(0, experts, (tokens, layers, top_k), dtype=np.int16) if routes else None
        rows.append(gate.stage_call("c0", None, rng.integers(0, 512, tokens), mask, lp, routed_experts=re))
    return pack_rows([rows[i % len(rows)] for i in range(n)])


def with_keys(template: PackedBatch, tag: str, start: int, n: int) -> PackedBatch:
    """Rows ``0..n`` of ``template`` under fresh keys ``{tag}{start + i}/c0`` (write-once
    means every put needs new keys; the payload is what is being moved)."""
    base = template if n == len(template) else template.take(np.arange(n))
    return PackedBatch([f"{tag}{start + i}/c0" for i in range(n)], base.fields)
