"""The packed batch file format (pipeline/store/batch_file.py): round trip and truncation."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.store import CheckpointCorrupt
from pipeline.store import batch_file as ck
from tasks.packed import pack_rows

from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)


def test_packed_batch_file_format_roundtrip_and_truncation():
    batch = pack_rows(make_rows(3, routes=True) + make_rows(2, routes=False, prefix="n"))
    buf = bytearray(b"".join(bytes(b) for b in ck.encode_batch(batch)))
    back = ck.decode_batch(buf)
    assert back.keys == batch.keys
    for name, f in batch.fields.items():
        g = back.fields[name]
        assert g.values.tobytes() == f.values.tobytes() and np.array_equal(g.offsets, f.offsets)
        assert (g.present is None) == (f.present is None)
    with pytest.raises(CheckpointCorrupt, match="truncated"):
        ck.decode_batch(buf[: len(buf) // 2])
    with pytest.raises(CheckpointCorrupt, match="not a v1"):
        ck.decode_batch(b"XXXX" + bytes(buf[4:]))
