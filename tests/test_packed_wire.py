"""A PackedBatch crosses Dask's comms as a handful of frames: each big field's values as
one frame (no copy), every small array together in one more (tasks/packed.py)."""
from __future__ import annotations

import pickle

import numpy as np
from distributed.protocol import deserialize, serialize

from tasks.packed import OWN_BUFFER_MIN_BYTES, PackedBatch, PackedField


def _batch(n: int = 64, tokens: int = 1024) -> PackedBatch:
    rng = np.random.default_rng(0)
    offsets = np.arange(n + 1, dtype=np.int64) * tokens
    present = np.ones(n, bool)
    present[3] = False
    routes_offsets = offsets.copy()
    routes_offsets[4:] -= tokens  # row 3 has no routes
    return PackedBatch(
        [f"r{i}/c0" for i in range(n)],
        {
            "token_ids": PackedField(rng.integers(0, 512, n * tokens), offsets),
            "logprobs": PackedField(-rng.random(n * tokens, dtype=np.float32), offsets),
            "routed_experts": PackedField(rng.integers(0, 8, ((n - 1) * tokens, 4, 2)).astype(np.int16), routes_offsets, present),
            "prev_len": PackedField(np.arange(n, dtype=np.int64), np.arange(n + 1, dtype=np.int64)),
            "routes_encoding": PackedField(np.ones(n, dtype=np.int8), np.arange(n + 1, dtype=np.int64)),
            "parent_call_id": PackedField(np.zeros(0, np.uint8), np.zeros(n + 1, np.int64)),
        },
    )


def _same(a: PackedBatch, b: PackedBatch) -> None:
    assert a.keys == b.keys and list(a.fields) == list(b.fields)
    for name, f in a.fields.items():
        g = b.fields[name]
        assert g.values.dtype == f.values.dtype and g.values.shape == f.values.shape, name
        assert np.array_equal(g.values, f.values) and np.array_equal(g.offsets, f.offsets), name
        assert (g.present is None) == (f.present is None), name
        if f.present is not None:
            assert np.array_equal(g.present, f.present), name


def test_out_of_band_pickle_is_one_buffer_per_big_field_plus_one():
    batch = _batch()
    big = sum(f.values.nbytes >= OWN_BUFFER_MIN_BYTES for f in batch.fields.values())
    buffers: list = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == big + 1  # not 2-3 per field
    back = pickle.loads(data, buffers=buffers)
    _same(batch, back)
    # The big values are views of the buffers they arrived in, not copies.
    assert np.shares_memory(back.fields["token_ids"].values, np.asarray(buffers[1]))


def test_dask_serializes_a_batch_as_a_few_frames_and_back_bit_exact():
    batch = _batch()
    header, frames = serialize(batch)
    assert len(frames) <= 2 + len(batch.fields) // 2
    _same(batch, deserialize(header, frames))


def test_unaligned_small_buffer_and_in_band_pickles_round_trip():
    batch = _batch(n=5, tokens=3)  # every field small: all in the shared buffer
    buffers: list = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    raw = np.frombuffer(pickle.PickleBuffer(buffers[0]).raw(), np.uint8)
    shifted = np.empty(raw.nbytes + 1, np.uint8)[1:]  # the buffer lands at an odd address
    shifted[:] = raw
    _same(batch, pickle.loads(data, buffers=[shifted]))
    _same(batch, pickle.loads(pickle.dumps(batch, protocol=5)))
    _same(batch, pickle.loads(pickle.dumps(batch, protocol=4)))


def test_a_malformed_batch_pickles_as_is_for_the_unit_to_refuse():
    bad = PackedBatch(["a"], {"x": PackedField([1, 2], np.array([0, 2]))})
    back = pickle.loads(pickle.dumps(bad, protocol=5))
    assert back.fields["x"].values == [1, 2]


def test_gathered_nbytes_is_what_take_rows_allocates_per_field():
    from tasks.packed import gathered_nbytes, take_rows

    batch = _batch(n=12, tokens=40)
    rows = np.array([1, 3, 4, 9])
    got = take_rows([batch], np.zeros(len(rows), np.int64), rows)
    assert gathered_nbytes(batch, rows) == [f.values.nbytes for f in got.fields.values()]
