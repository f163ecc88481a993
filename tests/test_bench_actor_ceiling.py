"""The bare Dask actor ceiling of ``bench store`` (:mod:`pipeline.bench.actor_ceiling`):
calls shaped like the store's, every byte read back, a wrong answer fails the run.
No timing is asserted."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.bench import actor_ceiling
from pipeline.bench.store import template_batch


@pytest.fixture(scope="module")
def batch():
    return template_batch(6, 64, layers=2, top_k=2, routes=True)


def row_bytes(batch, lo: int, hi: int) -> int:
    return sum(f.nbytes for f in actor_ceiling.frames_of(batch, lo, hi))


def test_row_chunks_split_evenly_and_cut_at_the_call_limit(batch):
    one = row_bytes(batch, 0, 1)
    plan = actor_ceiling.row_chunks(batch, 2, 2 * one)
    # Rows 0-2 to the first worker, 3-5 to the second, each cut after 2 rows.
    assert plan == [[(0, 2), (2, 3)], [(3, 5), (5, 6)]]
    for chunks in plan:
        assert all(row_bytes(batch, lo, hi) <= 2 * one for lo, hi in chunks)
    # A row bigger than the limit goes alone, never split.
    assert actor_ceiling.row_chunks(batch, 1, 1) == [[(i, i + 1) for i in range(6)]]


def test_frames_are_views_of_the_batch(batch):
    frames = actor_ceiling.frames_of(batch, 1, 3)
    assert len(frames) == len(batch.fields)
    assert all(np.shares_memory(f, fld.values) for f, fld in zip(frames, batch.fields.values()) if f.size)


def test_measure_moves_every_byte_through_actors_on_each_worker(inprocess_client, batch):
    out = actor_ceiling.measure(inprocess_client, batch, 2, row_bytes(batch, 0, 2))
    assert out["put_bytes_per_s"] > 0 and out["get_bytes_per_s"] > 0


class CorruptSink(actor_ceiling.Sink):
    """Answers the frames it kept with one byte changed."""

    def get(self, calls):
        out = []
        for frames in super().get(calls):
            first = frames[0].copy()
            first.view(np.uint8)[0] ^= 1
            out.append((first, *frames[1:]))
        return out


def test_measure_fails_on_an_answer_that_differs(inprocess_client, batch):
    with pytest.raises(RuntimeError, match="differ from what was put"):
        actor_ceiling.measure(inprocess_client, batch, 1, 1 << 20, sink=CorruptSink)
