"""SlabPool: pooled slabs, reused only when nothing refers to them."""
from __future__ import annotations

import gc

from pipeline.store.slab_pool import SlabPool


class _Cycle:
    """Holds a view of a slab inside a reference cycle (as a finished Dask actor call's
    arguments do until the collector runs)."""

    def __init__(self, view) -> None:
        self.view = view
        self.me = self


def test_a_full_pool_collects_cycles_before_allocating_past_its_cap():
    gc.disable()  # only the pool's own collection may free the cycle
    try:
        pool = SlabPool(max_bytes=1 << 20, min_bytes=1)
        slab = pool.take(1 << 20)
        _Cycle(slab[:10])  # unreachable, but alive until collected
        del slab
        again = pool.take(1 << 20)  # the pool is full: it collects, then reuses
        assert pool.collections == 1 and pool.reused == 1 and pool.unpooled == 0
        held = again
        other = pool.take(1 << 20)  # really in use: a plain allocation, not the held slab
        assert pool.unpooled == 1 and other is not held
    finally:
        gc.enable()


def test_process_pools_are_one_per_config_key_and_reread_their_cap_on_reconfigure():
    from pipeline.generation.cut import pack_buffers
    from pipeline.process_state import configured
    from pipeline.store.slab_pool import process_pool
    from pipeline.store.client import client_buffers

    assert client_buffers() is process_pool("store.client-buffer-bytes") is client_buffers()
    assert pack_buffers() is not client_buffers()
    with configured({"token-capture.store.client-buffer-bytes": "3MiB"}):
        assert client_buffers().max_bytes == 3 << 20
