"""tasks.packed: PackedBatch round trips (from_rows/row/take/select/concat) and
pack_rows/unpack_rows bit-exactness, with and without routed experts, also across a
Dask worker process."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.hashing import row_digest
from tasks.packed import PackedBatch, PackedField, pack_rows, unpack_rows
from tasks.toy.policy import MoEPolicy, PolicyConfig
from tasks.toy.rollouts import generate_rollouts, make_step_specs
from tasks.schema import HASH_FIELDS, ID_FIELDS, ROUTES_FIELD, ROUTES_U8_FIELD, SCALAR_FIELDS, STAGING_FIELDS, TOKEN_FIELDS

CFG = PolicyConfig(vocab_size=300, hidden=16, layers=3, experts=5, top_k=2, seed=3, window=4)


def generated_rows(with_routes: bool, prefix: str = "pk"):
    specs = [s for g in make_step_specs(prefix, 2, 3, turns=3, tokens_per_turn=6, tool_tokens=3, prompt_tokens=5,
                                         vocab_size=CFG.vocab_size) for s in g]
    return [r for g in generate_rollouts(MoEPolicy(CFG), specs, with_routes=with_routes) for r in g.rows]


@pytest.fixture(scope="module")
def routed_rows():
    return generated_rows(True)


@pytest.fixture(scope="module")
def plain_rows():
    return generated_rows(False, "pl")


def assert_rows_bit_exact(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.same_content(b), (a.staging_key, b.staging_key)
        for name in tuple(TOKEN_FIELDS) + (ROUTES_FIELD,):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None)
            if x is not None:
                assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        assert row_digest(a) == a.digest  # the digest still verifies after the round trip


# ---- pack_rows / unpack_rows ------------------------------------------------------------------


def test_pack_unpack_with_routes_is_bit_exact(routed_rows):
    batch = pack_rows(routed_rows)
    assert batch.keys == [r.staging_key for r in routed_rows]
    # The toy policy's 5 experts: one-byte ids, in their own field.
    assert set(batch.fields) == set(STAGING_FIELDS) | {ROUTES_U8_FIELD}
    # One contiguous buffer per field, offsets consistent with delta_len.
    lengths = batch.fields["delta_len"].values
    for name in TOKEN_FIELDS:
        assert np.array_equal(batch.fields[name].lengths(), lengths)
        assert batch.fields[name].values.flags.c_contiguous
    assert batch.fields[ROUTES_U8_FIELD].spec == ("|u1", (CFG.layers, CFG.top_k))
    assert batch.fields["token_ids"].spec == ("<i8", ())
    assert_rows_bit_exact(unpack_rows(batch), routed_rows)


def test_pack_unpack_without_routes_is_bit_exact(plain_rows):
    batch = pack_rows(plain_rows)
    assert set(batch.fields) == set(STAGING_FIELDS)
    got = unpack_rows(batch)
    assert all(r.routes_encoding == 0 and r.routed_experts is None for r in got)
    assert_rows_bit_exact(got, plain_rows)


def test_pack_without_routes_field_keeps_encoding(routed_rows):
    # The finalizer's first fetch carries no routes: rows say encoding 2 but lack them.
    got = unpack_rows(pack_rows(routed_rows, with_routes=False))
    for a, b in zip(got, routed_rows):
        assert a.routes_encoding == 2 and a.routed_experts is None
        assert a.token_ids.tobytes() == b.token_ids.tobytes() and a.digest == b.digest


def test_mixed_routed_and_plain_rows(routed_rows, plain_rows):
    rows = [routed_rows[0], plain_rows[0], routed_rows[1], plain_rows[1]]
    batch = pack_rows(rows)
    assert ROUTES_FIELD not in batch.fields  # no int16 row
    f = batch.fields[ROUTES_U8_FIELD]
    assert f.present.tolist() == [True, False, True, False]
    assert f.row(1) is None and not f.has(1) and f.has(2)
    assert ROUTES_U8_FIELD not in batch.row(1) and ROUTES_U8_FIELD in batch.row(0)
    assert_rows_bit_exact(unpack_rows(batch), rows)
    # Splitting off only the routes (the second fetch) and only the routed keys.
    routed = batch.select([ROUTES_U8_FIELD]).take(np.flatnonzero(f.present if f.present is not None else np.ones(len(f), bool)))
    assert routed.keys == [rows[0].staging_key, rows[2].staging_key]
    assert routed.fields[ROUTES_U8_FIELD].present is None
    assert routed.fields[ROUTES_U8_FIELD].row(1).tobytes() == rows[2].routed_experts.tobytes()


def test_pack_empty_and_bad_hash():
    empty = pack_rows([])
    assert len(empty) == 0 and unpack_rows(empty) == []
    rows = generated_rows(False, "e")[:2]
    rows[1].chain_hash = rows[1].chain_hash[:31]
    with pytest.raises(ValueError, match="chain_hash"):
        pack_rows(rows)


def test_take_select_concat_on_staged_rows(routed_rows):
    batch = pack_rows(routed_rows)
    n = len(batch)
    order = np.array([n - 1, 0, 3, 3, 1])  # reordered, with a repeat
    taken = batch.take(order)
    assert taken.keys == [batch.keys[i] for i in order]
    assert_rows_bit_exact(unpack_rows(taken), [routed_rows[i] for i in order])
    assert_rows_bit_exact(unpack_rows(batch.take([])), [])
    # Split in three and concatenate back: identical buffers.
    parts = [batch.take(range(0, 4)), batch.take([]), batch.take(range(4, 9)), batch.take(range(9, n))]
    back = PackedBatch.concat(parts)
    assert back.keys == batch.keys
    for name, f in batch.fields.items():
        g = back.fields[name]
        assert g.values.dtype == f.values.dtype and g.values.tobytes() == f.values.tobytes()
        assert np.array_equal(g.offsets, f.offsets) and (g.present is None) == (f.present is None)
    sel = batch.select(["token_ids", "digest", "not-a-field"])
    assert list(sel.fields) == ["token_ids", "digest"] and sel.keys == batch.keys
    assert sel.fields["token_ids"] is batch.fields["token_ids"]  # select copies nothing
    assert batch.nbytes > sel.nbytes > 0
    assert PackedBatch.concat([]).keys == [] and PackedBatch.concat([batch]) is batch


# ---- generic PackedBatch.from_rows --------------------------------------------------------------


def test_from_rows_marks_absent_fields_and_keeps_dtypes():
    rows = [
        {"a": np.arange(3, dtype=np.int64), "b": np.ones((2, 2, 3), np.int16)},
        {"a": np.arange(0, dtype=np.int64)},
        {"b": np.zeros((1, 2, 3), np.int16), "c": np.array([1.5], np.float32)},
    ]
    batch = PackedBatch.from_rows(["k0", "k1", "k2"], rows)
    assert list(batch.fields) == ["a", "b", "c"]
    assert batch.fields["a"].present.tolist() == [True, True, False]
    assert batch.fields["b"].spec == ("<i2", (2, 3))
    assert batch.fields["c"].present.tolist() == [False, False, True]
    for i, r in enumerate(rows):
        got = batch.row(i)
        assert set(got) == set(r)
        for k, v in r.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape and got[k].tobytes() == v.tobytes()
    only = PackedBatch.from_rows(["k0", "k1", "k2"], rows, names=["c", "zz"])
    assert list(only.fields) == ["c", "zz"] and only.fields["zz"].present.tolist() == [False] * 3
    with pytest.raises(ValueError, match="2 keys for 3 rows"):
        PackedBatch.from_rows(["a", "b"], rows)


def test_concat_mixes_present_masks():
    a = PackedBatch.from_rows(["x"], [{"f": np.array([1, 2], np.int64)}])
    b = PackedBatch.from_rows(["y", "z"], [{"f": np.array([3], np.int64)}, {}], names=["f"])
    c = PackedBatch.concat([a, b])
    assert c.keys == ["x", "y", "z"] and c.fields["f"].present.tolist() == [True, True, False]
    assert c.fields["f"].row(0).tolist() == [1, 2] and c.fields["f"].row(1).tolist() == [3] and c.fields["f"].row(2) is None


ragged = st.integers(0, 6).flatmap(
    lambda trail: st.lists(
        st.one_of(st.none(), st.integers(0, 7)), min_size=1, max_size=12
    ).map(lambda lens: (trail, lens))
)


@settings(max_examples=80, deadline=None)
@given(spec=ragged, seed=st.integers(0, 2**31), perm_seed=st.integers(0, 2**31))
def test_from_rows_take_concat_property(spec, seed, perm_seed):
    trail, lens = spec
    rng = np.random.default_rng(seed)
    shape = () if trail == 0 else (trail, 2)
    rows = [{} if n is None else {"v": rng.integers(-(2**62), 2**62, (n, *shape)), "s": rng.random(1).astype(np.float32)}
            for n in lens]
    keys = [f"r{i}" for i in range(len(rows))]
    batch = PackedBatch.from_rows(keys, rows, names=["v", "s"])

    def check(b, want_rows, want_keys):
        assert b.keys == want_keys
        for i, r in enumerate(want_rows):
            got = b.row(i)
            assert set(got) == set(r)
            for k in r:
                assert got[k].tobytes() == r[k].tobytes() and got[k].shape == r[k].shape

    check(batch, rows, keys)
    perm = np.random.default_rng(perm_seed).permutation(len(rows))
    check(batch.take(perm), [rows[i] for i in perm], [keys[i] for i in perm])
    cut = len(rows) // 2
    check(PackedBatch.concat([batch.take(range(cut)), batch.take(range(cut, len(rows)))]), rows, keys)


def test_packed_field_from_arrays_all_absent_and_lengths():
    f = PackedField.from_arrays([None, None], dtype=np.dtype("<f4"), trailing=(3,))
    assert f.values.shape == (0, 3) and f.values.dtype == np.float32
    assert f.present.tolist() == [False, False] and f.lengths().tolist() == [0, 0] and len(f) == 2
    g = PackedField.from_arrays([np.arange(2), np.arange(5)])
    assert g.present is None and g.lengths().tolist() == [2, 5] and g.offsets.tolist() == [0, 2, 7]


# ---- across a Dask worker process --------------------------------------------------------------


def _roundtrip_in_worker(batch: PackedBatch) -> PackedBatch:
    from tasks.packed import pack_rows, unpack_rows

    return pack_rows(unpack_rows(batch))


def test_packed_batch_survives_dask_serialization(routed_rows, plain_rows):
    from distributed import Client, LocalCluster

    rows = routed_rows[:5] + plain_rows[:4]
    batch = pack_rows(rows)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0") as cluster, Client(cluster) as client:
        [remote] = client.scatter([batch])
        back = client.submit(_roundtrip_in_worker, remote, pure=False).result()
    assert_rows_bit_exact(unpack_rows(back), rows)
    assert back.fields[ROUTES_U8_FIELD].present.tolist() == [True] * 5 + [False] * 4
    for name in ID_FIELDS + tuple(SCALAR_FIELDS) + HASH_FIELDS:
        assert back.fields[name].values.tobytes() == batch.fields[name].values.tobytes()
