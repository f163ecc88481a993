"""The store's placement value and its plans, alone: no Dask, no cluster.

Every routable key goes to exactly its primary (and, with two copies, its replica) in
exactly one call per unit within the byte cap; a read asks each key's primary once; a
fail-over goes to the replica; witnesses never sit on a copy's worker. (The rendezvous
ranking itself: tests/test_hrw_placement.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pipeline.store.placement import Placement, chunks_by_bytes, failover, plan_all_copies, plan_put, plan_read
from pipeline.store.protocol import UNIT_UNAVAILABLE, GetResult
from tasks.errors import InvalidStoreRequest
from tasks.keys import unit_for_key
from tasks.packed import PackedBatch, PackedField

KEYS = st.lists(st.from_regex(r"[a-z]{1,6}/c[0-9]{1,2}", fullmatch=True), min_size=1, max_size=40, unique=True)


def placement(n_units: int, n_workers: int, copies: int) -> Placement:
    workers = tuple(f"tcp://127.0.0.{1 + u % n_workers}:4000" for u in range(n_units))
    return Placement(0, workers, replicas=copies)


def batch_of(keys: list[str], row_len: int = 8) -> PackedBatch:
    offsets = np.arange(len(keys) + 1, dtype=np.int64) * row_len
    return PackedBatch(list(keys), {"token_ids": PackedField(np.zeros(len(keys) * row_len, np.int64), offsets, None)})


@settings(max_examples=60, deadline=None)
@given(keys=KEYS, n_units=st.integers(2, 7), n_workers=st.integers(2, 4), copies=st.sampled_from([1, 2]),
       cap_rows=st.integers(1, 10))
def test_a_put_plan_sends_every_copy_once_within_the_cap(keys, n_units, n_workers, copies, cap_rows):
    p = placement(n_units, n_workers, copies)
    plan = plan_put(p, batch_of(keys), max_call_bytes=cap_rows * 8 * 8)
    assert plan.failed == {}
    sent: dict[str, list[int]] = {}
    for u, chunk in plan.parts:
        assert len(chunk) <= cap_rows and list(chunk) == sorted(chunk)
        for i in chunk:
            sent.setdefault(keys[i], []).append(u)
    loc = p.locate(keys)
    for i, k in enumerate(keys):
        primary = unit_for_key(k, n_units)
        assert loc.primary[i] == primary
        want = [primary] if copies == 1 else sorted({primary, int(loc.replica[i])})
        assert sorted(sent[k]) == want, k
        if copies == 2:
            assert p.host(int(loc.replica[i])) != p.host(primary), "copies on two hosts"
    if copies == 2:
        witnessed = [k for names in plan.witness.values() for k in names]
        assert len(witnessed) == len(set(witnessed)), "one witness per key"
        for w, names in plan.witness.items():
            for k in names:
                i = keys.index(k)
                assert loc.witness[i] == w
                assert p.workers[w] not in {p.workers[loc.primary[i]], p.workers[loc.replica[i]]}
        # A key has a witness exactly when some worker hosts neither of its copies.
        has_third = [len(set(p.workers) - {p.workers[loc.primary[i]], p.workers[loc.replica[i]]}) > 0 for i in range(len(keys))]
        assert sorted(witnessed) == sorted(k for k, third in zip(keys, has_third) if third)


@settings(max_examples=60, deadline=None)
@given(keys=KEYS, n_units=st.integers(1, 7))
def test_a_read_plan_asks_each_primary_once(keys, n_units):
    p = placement(n_units, 2, 1)
    parts, failed = plan_read(p, keys + keys[:3])  # duplicates are read once
    assert failed == {}
    asked = [k for _, ks in parts for k in ks]
    assert sorted(asked) == sorted(keys)
    assert all(unit_for_key(k, n_units) == u for u, ks in parts for k in ks)


def test_all_copies_and_failover_go_to_the_replica():
    p = placement(3, 3, 2)
    keys = [f"r{i}/c0" for i in range(30)]
    _, parts, _ = plan_all_copies(p, keys)
    assert sum(len(ks) for _, ks in parts) == 2 * len(keys)
    lost = GetResult(PackedBatch([], {}), {k: (UNIT_UNAVAILABLE, "gone") for k in keys if unit_for_key(k, 3) == 0})
    again = failover(p, [lost])
    replica = dict(zip(keys, p.copies_of(keys).tolist()))
    want: dict[int, list[str]] = {}
    for k in lost.failed:
        want.setdefault(replica[k], []).append(k)
    assert again == sorted(want.items()) and 0 not in want
    assert sum(len(ks) for _, ks in again) == len(lost.failed) > 0
    assert failover(placement(3, 3, 1), [lost]) == []


def test_unusable_keys_and_batches_fail_before_any_call():
    p = placement(2, 2, 1)
    plan = plan_put(p, batch_of(["ok/c0", "\ud800bad"]), 1 << 20)
    assert set(plan.failed) == {"\ud800bad"} and [k for _, c in plan.parts for k in c] == [0]
    broken = batch_of(["a/c0"])
    broken.fields["token_ids"] = PackedField(np.zeros(3, np.int64), np.array([0, 9]), None)
    assert plan_put(p, broken, 1 << 20).failed["a/c0"][0] == "invalid_batch"
    with pytest.raises(InvalidStoreRequest, match="PackedBatch"):
        plan_put(p, {"a": 1}, 1 << 20)  # type: ignore[arg-type]


def test_a_replaced_unit_moves_one_version_on_and_keeps_every_keys_units():
    p = placement(3, 3, 2)
    q = p.replaced(1, "tcp://127.0.0.9:4000")
    assert (q.version, q.workers[1], q.unit_ids, q.homes) == (1, "tcp://127.0.0.9:4000", p.unit_ids, p.homes)
    assert q.host(1) == "127.0.0.9" and p.workers[1] != q.workers[1]
    keys = [f"r{i}/c0" for i in range(200)]
    a, b = p.locate(keys), q.locate(keys)
    for x, y in ((a.primary, b.primary), (a.replica, b.replica), (a.witness, b.witness)):
        assert np.array_equal(x, y)


def test_chunks_by_bytes_keeps_order_and_lets_a_big_row_go_alone():
    idx = np.arange(6)
    sizes = np.array([5, 5, 50, 5, 5, 5])
    chunks = chunks_by_bytes(idx, sizes, 10)
    assert [list(c) for c in chunks] == [[0, 1], [2], [3, 4], [5]]
    assert chunks_by_bytes(np.arange(0), sizes, 10) == []
