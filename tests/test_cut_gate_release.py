"""The cut's use of the process CPU gate and its per-cut setup, with in-process stores.

A cut takes its CPU slot for freezing and packing only: once a batch's put is answered
it seals that batch without waiting for a slot again (it takes one for its next freeze or
pack), so a cut whose store answered is not queued behind every cut still packing. A
store's method signature (does it take ``timeout=``) is inspected once per store class.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from pipeline.generation import cut as cut_module
from pipeline.generation.call_buffer import CallBuffer
from pipeline.generation.cut import run_cut
from pipeline.process_state import configured, process_state
from pipeline.store import deadline as deadline_module
from pipeline.store.protocol import StoreResult
from tasks.cut.batching import BatchLimits
from tasks.cut.receipt import DURABLE_PREFIX

WAIT_S = 30.0  # bounds every wait (a broken gate fails the test instead of hanging it)


def _buffers(n: int, prefix: str) -> list[CallBuffer]:
    out = []
    for i in range(n):
        b = CallBuffer(f"{prefix}{i}", "call-0", np.arange(4, dtype=np.int64))
        b.append(np.arange(8, dtype=np.int64), -np.ones(8, dtype=np.float32))
        out.append(b)
    return out


def _cut(bufs, store, checkpoint_id: str, limits=BatchLimits(64, 1 << 22, 1 << 28), puts_in_flight=None):
    return run_cut([(b.call, b) for b in bufs], store, checkpoint_id=checkpoint_id, inventory_digest=b"",
                   limits=limits, puts_in_flight=puts_in_flight)


class MemoryStore:
    """Acknowledges every put (counted); a put carrying a key containing ``hold`` first
    signals ``entered`` and waits for ``release``."""

    def __init__(self, hold: str = "\0"):
        self.hold = hold
        self.entered, self.release = threading.Event(), threading.Event()
        self.puts = 0

    def put_many(self, batch, partition: str = "", adopt: bool = False, timeout: float | None = None) -> StoreResult:
        self.puts += 1
        if any(self.hold in k for k in batch.keys):
            self.entered.set()
            assert self.release.wait(WAIT_S), "held put never released"
        return StoreResult(ok=list(batch.keys))

    def delete(self, keys, partition: str = "", timeout: float | None = None) -> StoreResult:
        return StoreResult(ok=list(keys))


class HeldPack:
    """Wraps ``pack_chunks``: a pack of a chunk whose key contains ``hold`` signals
    ``entered`` and waits for ``release`` (holding its cut's CPU slot meanwhile)."""

    def __init__(self, real, hold: str):
        self.real, self.hold = real, hold
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, chunks, *args):
        if any(self.hold in c.key for c in chunks):
            self.entered.set()
            assert self.release.wait(WAIT_S), "held pack never released"
        return self.real(chunks, *args)


@contextlib.contextmanager
def two_cuts(store: "MemoryStore", pack: HeldPack, run_a, run_b):
    """Cut A in a thread until its put is held, then cut B until its pack is held (B
    holds the only CPU slot); yields ``(thread_a, thread_b, results)``. On exit both are
    released and joined."""
    results: dict = {}
    ta = threading.Thread(target=lambda: results.setdefault("a", run_a()), daemon=True)
    tb = threading.Thread(target=lambda: results.setdefault("b", run_b()), daemon=True)
    with configured({"token-capture.cut.cpu-slots": 1}):
        ta.start()
        try:
            assert store.entered.wait(WAIT_S), "cut A reached its put"
            tb.start()
            assert pack.entered.wait(WAIT_S), "cut B reached its pack"
            yield ta, tb, results
        finally:
            store.release.set()
            pack.release.set()
            ta.join(WAIT_S)
            tb.join(WAIT_S)
    assert not ta.is_alive() and not tb.is_alive()


def test_a_cut_whose_put_is_answered_seals_without_waiting_for_a_cpu_slot(monkeypatch):
    store = MemoryStore(hold="/gate-a/")
    pack = HeldPack(cut_module.pack_chunks, hold="/gate-b/")
    monkeypatch.setattr(cut_module, "pack_chunks", pack)
    a, b = _buffers(3, "ga"), _buffers(3, "gb")
    with two_cuts(store, pack, lambda: _cut(a, store, "gate-a"), lambda: _cut(b, store, "gate-b")) as (ta, tb, results):
        store.release.set()  # A's put is answered while B holds the only slot
        ta.join(WAIT_S)
        assert not ta.is_alive(), "cut A sealed its answered batch without the slot B holds"
        assert tb.is_alive() and "b" not in results
    for key, bufs in (("a", a), ("b", b)):
        receipt, stats = results[key]
        assert receipt.counts() == {DURABLE_PREFIX: 3} and stats.put_calls == 1
        assert all(buf.info()["cut_keys"] for buf in bufs)
    assert store.puts == 2


def test_a_cut_with_several_batches_takes_the_slot_again_to_pack_the_next(monkeypatch):
    """After sealing batch 1 (no slot), the cut's next pack waits for the slot: with one
    slot, a second cut's held pack keeps the first cut from packing its batch 2."""
    store = MemoryStore(hold="/multi-a/")
    pack = HeldPack(cut_module.pack_chunks, hold="/multi-b/")
    monkeypatch.setattr(cut_module, "pack_chunks", pack)
    calls = []
    real = pack.real

    def counting(chunks, *args):
        calls.append(chunks[0].key.split("/")[1])
        return real(chunks, *args)

    pack.real = counting
    a, b = _buffers(4, "ma"), _buffers(2, "mb")
    run_a = lambda: _cut(a, store, "multi-a", BatchLimits(2, 1 << 22, 1 << 28), puts_in_flight=1)  # noqa: E731
    with two_cuts(store, pack, run_a, lambda: _cut(b, store, "multi-b")) as (ta, _, results):
        store.release.set()
        ta.join(0.5)  # A seals batch 1, then waits for the slot to freeze/pack batch 2
        assert ta.is_alive() and calls == ["multi-a"], "A's second pack waited for the slot"
    assert calls.count("multi-a") == 2 and calls.count("multi-b") == 1
    assert results["a"][0].counts() == {DURABLE_PREFIX: 4} and results["a"][1].put_calls == 2
    assert results["b"][0].counts() == {DURABLE_PREFIX: 2}


def test_a_cut_packs_its_next_batch_while_its_put_is_on_the_wire(monkeypatch):
    """Two puts in flight: while batch 1's put is held, batch 2 is frozen, packed and
    sent, and batch 3 waits for batch 1's answer (never more than two puts out); once
    released every call is sealed, in three puts."""
    store = MemoryStore(hold="/pipe/pa0/")
    packed: list[str] = []
    real = cut_module.pack_chunks
    monkeypatch.setattr(cut_module, "pack_chunks", lambda chunks, *args: (packed.append(chunks[0].rollout_id), real(chunks, *args))[1])
    results: dict = {}
    bufs = _buffers(6, "pa")
    t = threading.Thread(target=lambda: results.update(r=_cut(bufs, store, "pipe", BatchLimits(2, 1 << 22, 1 << 28),
                                                                 puts_in_flight=2)), daemon=True)
    t.start()
    try:
        assert store.entered.wait(WAIT_S)
        end = time.monotonic() + WAIT_S
        while store.puts < 2 and time.monotonic() < end:
            time.sleep(0.01)
        assert packed == ["pa0", "pa2"] and store.puts == 2, "batch 2 packed and sent while batch 1's put is held"
        t.join(0.2)
        assert packed == ["pa0", "pa2"], "batch 3 waits for batch 1's answer"
    finally:
        store.release.set()
        t.join(WAIT_S)
    receipt, stats = results["r"]
    assert receipt.counts() == {DURABLE_PREFIX: 6} and stats.put_calls == 3 and store.puts == 3
    assert [b.info()["cut_keys"] for b in bufs] == [[f"__cut__/pipe/pa{i}/call-0/0"] for i in range(6)]


def test_store_signature_is_inspected_once_per_store_class(monkeypatch):
    asked = []
    real = deadline_module._inspect_timeout

    def counting(method):
        asked.append(getattr(method, "__name__", "?"))
        return real(method)

    monkeypatch.setattr(deadline_module, "_inspect_timeout", counting)
    monkeypatch.setattr(process_state().get(deadline_module.TimeoutAnswers), "answers", {})
    for i in range(3):  # three cuts, two instances of one store class
        receipt, _ = _cut(_buffers(2, f"sig{i}-"), MemoryStore() if i < 2 else MemoryStore(), f"sig-{i}")
        assert receipt.counts() == {DURABLE_PREFIX: 2}
    assert sorted(asked) == ["delete", "put_many"]

    # A store whose methods are plain callables (no class method to key on): asked per cut.
    class Plain:
        def __init__(self):
            inner = MemoryStore()
            self.put_many = lambda batch, partition="", adopt=False: inner.put_many(batch, partition, adopt)
            self.delete = lambda keys, partition="": inner.delete(keys, partition)

    for i in range(2):
        receipt, _ = _cut(_buffers(2, f"plain{i}-"), Plain(), f"plain-{i}")
        assert receipt.counts() == {DURABLE_PREFIX: 2}
    assert len(asked) == 2 + 2 * 2


def test_store_timeout_answer_is_the_store_classes_own():
    """A class whose put_many takes no ``timeout=`` is called without one, even after a
    class whose put_many does (the cache is per method, not per cut)."""

    class NoTimeout(MemoryStore):
        def put_many(self, batch, partition: str = "", adopt: bool = False) -> StoreResult:
            return super().put_many(batch, partition, adopt)

        def delete(self, keys, partition: str = "") -> StoreResult:
            return super().delete(keys, partition)

    for store in (MemoryStore(), NoTimeout(), MemoryStore()):
        receipt, stats = _cut(_buffers(2, f"to-{type(store).__name__}-{id(store)}-"), store, f"to-{id(store)}")
        assert receipt.counts() == {DURABLE_PREFIX: 2} and store.puts == 1


def test_call_id_is_made_once():
    buf = _buffers(1, "cid")[0]
    assert buf.call == ("cid0", "call-0") and buf.call is buf.call
