"""The spill layer against the installed zict: the private attributes it relies on exist
and behave as it assumes.

``pipeline/store/spill.py`` reaches into zict (``LRU.d``, ``LRU._cancel_evict``,
``LRU.weights``, ``LRU.total_weight``, ``Buffer._cancel_restore``, ``zict.common.discard``)
for speed. ``pyproject.toml`` pins zict to the 3.0 line; this test is what catches a zict
release that changes them, with real spilling to ``tmp_path``.
"""
from __future__ import annotations

import numpy as np
import zict

from pipeline.store.spill import SpillMapping, row_nbytes


def row(i: int, n: int = 256) -> dict[str, np.ndarray]:
    return {"ids": np.arange(i, i + n, dtype="<i8"), "mask": np.ones(n, dtype="u1")}


def test_private_zict_attributes_used_by_spill_exist(tmp_path):
    m = SpillMapping(str(tmp_path / "spill"), memory_limit=10_000)
    try:
        lru = m.fast
        assert isinstance(lru, zict.LRU)
        assert isinstance(lru.d, dict)
        assert hasattr(lru, "_cancel_evict")
        assert isinstance(lru.weights, dict)
        assert hasattr(lru, "total_weight")
        assert hasattr(m, "_cancel_restore")
        assert callable(zict.common.discard)
    finally:
        m.close()


def test_spill_accounting_and_reads_through_zict(tmp_path):
    r = row(0)
    weight = row_nbytes(r)
    m = SpillMapping(str(tmp_path / "spill"), memory_limit=3 * weight)
    try:
        for i in range(8):
            m[f"k{i}"] = row(i)
        # The LRU kept 3 rows in memory (its weights are ours), the rest went to disk.
        assert len(m.fast) == 3 and m.memory_bytes == 3 * weight
        assert m.spilled_rows == 5 and m.spilled_bytes > 0
        assert m.row_weight("k7") == weight and m.row_weight("k0") is None
        # peek reads a spilled row without promoting it; a plain read promotes it.
        assert np.array_equal(m.peek("k0")["ids"], row(0)["ids"])
        assert "k0" in m.slow
        assert np.array_equal(m["k0"]["ids"], row(0)["ids"])
        assert "k0" in m.fast.d and "k0" not in m.slow
        # Re-putting a key that is on disk replaces it (zict's own path, not the fast one).
        m["k1"] = row(100)
        assert np.array_equal(m["k1"]["ids"], row(100)["ids"])
        assert sorted(m.iter_keys()) == sorted(f"k{i}" for i in range(8))
        # Deleting a key held in memory goes through the patched discard.
        del m["k1"]
        assert "k1" not in m and m.memory_bytes == sum(m.fast.weights.values())
    finally:
        m.close()
    assert not (tmp_path / "spill").exists()
