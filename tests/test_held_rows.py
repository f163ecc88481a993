"""A unit's held rows (pipeline.store.held_rows) fitting their memory limit with the bytes
adopted buffers pin: which rows spill and which groups are compacted at the end of a call."""
from __future__ import annotations

import numpy as np

from pipeline.store.held_rows import HeldRows
from pipeline.store.spill import row_nbytes

N = 1024  # float64 elements per row: 8 KiB of payload


def _store(held: HeldRows, rows: list[dict], prefix: str) -> list[str]:
    slots = []
    for i, row in enumerate(rows):
        failure, slot = held.store("p", f"{prefix}{i}", row, row_nbytes(row), None)
        assert failure is None and slot is not None
        slots.append(slot)
    return slots


def test_an_eviction_that_leaves_a_group_dead_compacts_it_instead_of_spilling_more(tmp_path):
    """Rows fit the limit by their own weights, the slack their adopted buffer pins takes
    the unit past it. Spilling the least recently used row (one of the group's) gives the
    group dead bytes: it is compacted then and there, and nothing else spills."""
    row_bytes = N * 8
    weight = row_bytes + row_nbytes({"t": np.zeros(0)})
    held = HeldRows(str(tmp_path / "spill"), memory_limit=20 * weight, capacity=1 << 30, unit_index=0)
    buf = np.arange(16 * N, dtype=np.float64)  # 16 rows' worth: 8 covered by rows, 8 slack
    adopted = [{"t": buf[i * N : (i + 1) * N]} for i in range(8)]
    slots = _store(held, adopted, "a")
    held.adopt(["t"], slots, covered=8 * row_bytes, held=buf.nbytes)
    copied = [{"t": np.full(N, float(i))} for i in range(8)]
    _store(held, copied, "c")
    assert held.adopted.pinned_bytes == 8 * row_bytes
    assert held.resident_bytes > held.memory_limit  # 16 rows + 8 pinned > 20 rows

    held.compact()

    assert held.rows.spilled_rows == 1, "one eviction, then the group's compaction fits"
    assert (len(held.adopted), held.adopted.pinned_bytes, held.adopted.compacted_groups) == (0, 0, 1)
    assert held.resident_bytes <= held.memory_limit
    found, rows, absent, failed, more = held.find("p", [f"a{i}" for i in range(8)] + [f"c{i}" for i in range(8)])
    assert not absent and not failed and not more and len(found) == 16
    for i, row in enumerate(rows[:8]):
        assert np.array_equal(row["t"], np.arange(i * N, (i + 1) * N, dtype=np.float64))
        assert not np.shares_memory(row["t"], buf), "compacted rows are copies"
    for i, row in enumerate(rows[8:]):
        assert np.array_equal(row["t"], np.full(N, float(i)))
    held.clear()


def test_shared_bytes_sum_the_adopted_fields_of_the_rows_that_have_them():
    """Columns.shared_bytes: the adopted fields' bytes over the given rows, rows without a
    field (presence) and small (batch-copied) fields counted as nothing."""
    from pipeline.store.put_columns import batch_columns
    from pipeline.store.registry import FieldRegistry
    from tasks.packed import PackedBatch, PackedField

    lengths = np.array([100, 300, 0, 200, 150])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(offsets[-1])
    present = np.array([True, False, True, True, True])
    batch = PackedBatch(
        keys=[f"k{i}" for i in range(5)],
        fields={
            "tokens": PackedField(np.zeros(total, np.int32), offsets),
            "routes": PackedField(np.zeros((total, 2, 3), np.uint8), offsets, present),
            "ids": PackedField(np.zeros(5, np.int64), np.arange(6, dtype=np.int64)),  # small: copied
        },
    )
    columns = batch_columns(batch, FieldRegistry(), adopt=True)
    assert sorted(columns.shared) == ["routes", "tokens"]
    rows = [0, 1, 3, 4]
    expected = sum(a.nbytes for i in rows for name, a in columns.row(i).items() if name in columns.shared)
    assert expected == 4 * 750 + 6 * 450
    assert columns.shared_bytes(rows) == expected
    assert columns.shared_bytes([1]) == 4 * 300, "row 1 has no routes"


def test_find_reads_the_keys_within_max_bytes_and_leaves_the_rest(tmp_path):
    """One lookup per key: rows are read until their weights pass ``max_bytes`` (at least
    one key answered; keys not held weigh nothing), the rest are left over in order."""
    held = HeldRows(str(tmp_path / "spill"), memory_limit=1 << 30, capacity=1 << 30, unit_index=0)
    _store(held, [{"t": np.full(N, float(i))} for i in range(4)], "k")
    weight = held.weights[held.index["p"]["k0"]]
    keys = ["k0", "nope", "k1", "k2", "k3"]
    found, rows, absent, failed, more = held.find("p", keys, max_bytes=2 * weight)
    assert (found, absent, failed, more) == (["k0", "k1"], ["nope"], {}, ["k2", "k3"])
    assert [float(r["t"][0]) for r in rows] == [0.0, 1.0]
    assert held.find("p", keys, max_bytes=1)[0] == ["k0"], "the first key is always answered"
    assert held.find("p", keys)[4] == [] and len(held.find("p", keys)[0]) == 4
    held.clear()
