"""Store input defects, each through the public API.

* 4: a field of a non-numeric dtype (object, str, bytes, void, structured, datetime) is
  refused per key ``invalid_batch`` naming the field and dtype, by the unit and by the
  client; object arrays used to be stored as pointers (a spilled read then failed
  ``store_error`` and every later checkpoint of the unit failed).
* 5: a key that is not valid UTF-8 (a lone surrogate) fails alone, ``invalid_key``, in
  ``put_many``, ``get_many`` and ``delete``; it used to raise ``UnicodeEncodeError`` for
  every key of the call (client routing by crc32, msgpack-packed names).
* 6: key byte limits (each id within ``MAX_ID_BYTES``, the key within ``MAX_KEY_BYTES``)
  are enforced by the store, and key bytes plus a per-row overhead are charged to
  capacity (``used_bytes``), returning to the start once everything is deleted.
* 9: in the staging and cut partitions the row schema types the fields, not the first
  writer: a junk first write no longer pins its dtype; routed experts' trailing (L, K)
  is still pinned by first write; other partitions keep first-write pinning.

The unit-level tests build a :class:`StorageUnit` in process (real zict spill under
tmp_path); the client-level ones run a 2-unit store on the shared 2-worker cluster.
"""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.store import StorageUnit
from pipeline.store import batch_file
from pipeline.store.protocol import split_valid_keys
from pipeline.store.unit import ROW_OVERHEAD_BYTES
from rollout_factory import make_rollout
from tasks.errors import InvalidKey
from tasks.keys import MAX_ID_BYTES, MAX_KEY_BYTES, MAX_SEQ, cut_key, key_problem, unit_for_key
from tasks.packed import PackedBatch, PackedField, pack_rows, unpack_rows

pytestmark = pytest.mark.timeout(120)

VOCAB, L, K, E = 64, 2, 2, 8
BAD_KEY = "r\ud800/c0"  # a lone surrogate: a str, but not UTF-8 encodable


@pytest.fixture
def make_unit(tmp_path):
    made = []

    def make(memory_limit: int = 1 << 30, capacity: int = 1 << 32, partitions=("staging", "cut")):
        u = StorageUnit(len(made), memory_limit=memory_limit, capacity=capacity, spill_directory=str(tmp_path / "units"),
                        partitions=None if partitions is None else list(partitions))
        made.append(u)
        return u

    yield make
    for u in made:
        u.close()


def rollout_batch(rid: str, seed: int = 0, n_calls: int = 2, routes=(L, K, E), routes_encoding=None) -> tuple[list, PackedBatch]:
    built = make_rollout(np.random.default_rng(seed), rid, n_calls=n_calls, routes=routes, vocab_size=VOCAB, routes_encoding=routes_encoding)
    return built.rows, pack_rows(built.rows)


def with_field(batch: PackedBatch, name: str, values: np.ndarray, offsets: np.ndarray | None = None) -> PackedBatch:
    fields = dict(batch.fields)
    fields[name] = PackedField(values, batch.fields[name].offsets.copy() if offsets is None else offsets)
    return PackedBatch(list(batch.keys), fields)


def fieldless(keys: list[str]) -> PackedBatch:
    return PackedBatch(list(keys), {})


# ---- 4: only fixed-size numeric and bool dtypes ---------------------------------------------


def _bad_values(kind: str, n: int) -> np.ndarray:
    if kind == "object":
        return np.array([object() for _ in range(n)], dtype=object)
    if kind == "object-ints":  # looks numeric, is pointers
        return np.arange(n).astype(object)
    if kind == "unicode":
        return np.array(["ab"] * n)
    if kind == "bytes":
        return np.array([b"ab"] * n)
    if kind == "void":
        return np.zeros(n, dtype="V8")
    if kind == "structured":
        return np.zeros(n, dtype=[("a", "<i8"), ("b", "<f4")])
    if kind == "datetime":
        return np.zeros(n, dtype="M8[s]")
    raise AssertionError(kind)


BAD_KINDS = ["object", "object-ints", "unicode", "bytes", "void", "structured", "datetime"]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("name, partition", [("weight_version", "staging"), ("notes", "staging"), ("notes", "scratch")])
def test_non_numeric_dtype_refused_per_key_naming_field_and_dtype(make_unit, kind, name, partition):
    # A schema field, a field the schema does not know, a partition without a schema.
    unit = make_unit(memory_limit=1, partitions=None)  # every stored row goes to disk
    _, batch = rollout_batch("obj", seed=1)
    n = len(batch)
    fields = dict(batch.fields)
    fields[name] = PackedField(_bad_values(kind, n), np.arange(n + 1, dtype=np.int64))
    bad = PackedBatch(list(batch.keys), fields)
    res = unit.put_many(partition, bad)
    assert not res.ok and set(res.failed) == set(batch.keys)
    for reason, detail in res.failed.values():
        assert reason == "invalid_batch"
        assert name in detail and fields[name].values.dtype.str in detail
    assert unit.keys(partition) == [] and unit.held.used_bytes == 0
    # The unit is unharmed: the real rows are stored, read back from disk, checkpointed.
    assert not unit.put_many(partition, batch).failed
    got = unit.get_many(partition, list(batch.keys))
    assert not got.failed and unit.held.rows.spilled_rows == n
    assert [r.digest for r in unpack_rows(got.batch)] == [r.digest for r in unpack_rows(batch)]


def test_object_field_never_poisons_spill_or_checkpoint(make_unit, tmp_path):
    """The reported failure: a spilled object row read back ``store_error`` and every later
    checkpoint of the unit raised; in memory the checkpoint "succeeded" with pointers."""
    for memory_limit in (1, 1 << 30):  # spilled, then in memory
        unit = make_unit(memory_limit=memory_limit)
        rows, batch = rollout_batch(f"ck{memory_limit}", seed=2)
        n = len(batch)
        junk = PackedBatch([f"junk{memory_limit}/c{i}" for i in range(n)],
                           {"notes": PackedField(np.arange(n).astype(object), np.arange(n + 1, dtype=np.int64))})
        assert {r for r, _ in unit.put_many("staging", junk).failed.values()} == {"invalid_batch"}
        assert not unit.put_many("staging", batch).failed
        got = unit.get_many("staging", list(junk.keys) + list(batch.keys))
        assert {r for r, _ in got.failed.values()} == {"missing_key"} and got.batch.keys == batch.keys
        out = tmp_path / f"ckpt-{memory_limit}"
        out.mkdir()
        entries = unit.checkpoint_write(str(out), 1 << 20)
        restored = [batch_file.decode_batch((out / e["file"]).read_bytes()) for e in entries]
        assert sum(len(b) for b in restored) == n
        assert [r.digest for b in restored for r in unpack_rows(b)] == [r.digest for r in rows]


def test_client_refuses_object_field_per_key(store_factory):
    store = store_factory(n_units=2)
    _, batch = rollout_batch("cobj", seed=3)
    bad = with_field(batch, "logprobs", batch.fields["logprobs"].values.astype(object))
    res = store.put_many(bad)
    assert not res.ok and {r for r, _ in res.failed.values()} == {"invalid_batch"} and set(res.failed) == set(batch.keys)
    assert "logprobs" in next(iter(res.failed.values()))[1]
    assert not store.put_many(batch).failed  # the canonical rows are stored afterwards


# ---- 5: keys that are not valid UTF-8 fail alone ----------------------------------------------


def test_split_valid_keys_reports_each_bad_key():
    keys = ["r0/c0", BAD_KEY, "__cut__/ck/r1/c0/0", "x" * 600 + "/c0", 7, "a/b/c", "é/c0"]
    valid, failed = split_valid_keys(keys)
    assert valid == [0, 2, 6]
    assert set(failed) == {BAD_KEY, "x" * 600 + "/c0", "7", "a/b/c"}
    assert all(reason == "invalid_key" for reason, _ in failed.values())
    assert "UTF-8" in failed[BAD_KEY][1]
    for detail in (d for _, d in failed.values()):
        detail.encode("utf-8")  # details are printable whatever the key
    with pytest.raises(InvalidKey):
        unit_for_key(BAD_KEY, 4)  # not a UnicodeEncodeError


def test_non_utf8_key_fails_alone_in_put_get_delete(store_factory):
    store = store_factory(n_units=2)
    rows, batch = rollout_batch("r", seed=4, n_calls=3)
    good = list(batch.keys)
    mixed = PackedBatch(good[:2] + [BAD_KEY] + good[2:3], {n: f for n, f in batch.take([0, 1, 2, 2]).fields.items()})
    res = store.put_many(mixed)
    assert sorted(res.ok) == sorted(good) and set(res.failed) == {BAD_KEY}
    assert res.failed[BAD_KEY][0] == "invalid_key"

    got = store.get_many([good[0], BAD_KEY, good[1], good[2]])
    assert got.batch.keys == good and set(got.failed) == {BAD_KEY} and got.failed[BAD_KEY][0] == "invalid_key"
    assert [r.digest for r in unpack_rows(got.batch)] == [r.digest for r in rows]

    gone = store.delete([BAD_KEY, good[0]])
    assert gone.ok == [good[0]] and gone.failed[BAD_KEY][0] == "invalid_key"
    assert store.get_many([good[0]]).failed[good[0]][0] == "missing_key"


def test_non_utf8_key_refused_by_the_unit(make_unit, tmp_path):
    """A unit called directly (not through the client) refuses the key too, so it is never
    stored where a checkpoint would have to encode it."""
    unit = make_unit()
    _, batch = rollout_batch("u", seed=5)
    keys = list(batch.keys)
    res = unit.put_many("staging", PackedBatch([BAD_KEY, keys[1]], batch.fields))
    assert res.ok == [keys[1]] and res.failed[BAD_KEY][0] == "invalid_key"
    assert unit.keys("staging") == [keys[1]]
    entries = unit.checkpoint_write(str(tmp_path), 1 << 20)
    assert sum(e["rows"] for e in entries) == 1


# ---- 6: key size limits and key bytes charged -----------------------------------------------


def test_key_limits_match_the_gate(make_unit):
    unit = make_unit()
    longest = cut_key("c" * MAX_ID_BYTES, "r" * MAX_ID_BYTES, "m" * MAX_ID_BYTES, MAX_SEQ)
    assert len(longest.encode()) == MAX_KEY_BYTES and key_problem(longest) is None
    fine = ["r" * MAX_ID_BYTES + "/c0", "é" * (MAX_ID_BYTES // 2) + "/c0", longest]
    too_long = {
        "600-byte id": "r" * 600 + "/c0",
        "513-byte utf-8 id": "é" * 256 + "x/c0",
        "id in a cut key": cut_key("c", "r", "m", 0).replace("/r/", "/" + "r" * (MAX_ID_BYTES + 1) + "/"),
        "1 MiB key": "r" * (1 << 20) + "/c0",
        "key past MAX_KEY_BYTES": longest + "0",
    }
    res = unit.put_many("cut", fieldless(fine + list(too_long.values())))
    assert sorted(res.ok) == sorted(fine)
    assert set(res.failed) == set(too_long.values())
    for what, key in too_long.items():
        reason, detail = res.failed[key]
        assert reason == "invalid_key", what
        assert len(detail) < 400, f"{what}: the detail must not echo a huge key"
    assert sorted(unit.keys("cut")) == sorted(fine)


def test_key_bytes_and_row_overhead_are_charged(make_unit):
    """The report: 64 field-less rows with 64 KiB keys went into a 256 KiB unit without
    moving used_bytes. Now a row weighs its arrays + its key's bytes + ROW_OVERHEAD_BYTES."""
    capacity = 256 << 10
    unit = make_unit(capacity=capacity)
    keys = [f"__cut__/ck/{'r' * 500}{i:03d}/{'m' * 500}/0" for i in range(256)]
    per_row = len(keys[0]) + ROW_OVERHEAD_BYTES
    res = unit.put_many("cut", fieldless(keys))
    fits = capacity // per_row
    assert len(res.ok) == fits and {r for r, _ in res.failed.values()} == {"store_full"}
    assert unit.held.used_bytes == fits * per_row <= capacity
    # A key's UTF-8 bytes are charged, not its characters.
    unit.delete("cut", res.ok)
    assert unit.held.used_bytes == 0
    wide = "é" * 200 + "/c0"
    assert unit.put_many("staging", fieldless([wide])).ok == [wide]
    assert unit.held.used_bytes == len(wide.encode()) + ROW_OVERHEAD_BYTES


def test_used_bytes_returns_to_start_after_deleting_everything(make_unit):
    """Put and delete charge the same weight, whether rows spilled, were adopted, or had
    their delete deferred by an open checkpoint."""
    unit = make_unit(memory_limit=8 << 10)
    start = unit.held.used_bytes
    batches = [rollout_batch(f"acc{i}é", seed=10 + i, n_calls=3)[1] for i in range(4)]
    batches.append(fieldless(["é" * 200 + "/c0", "__cut__/c/x/y/1"]))
    for i, b in enumerate(batches):
        assert not unit.put_many("staging", b, adopt=bool(i % 2)).failed
    assert unit.held.rows.spilled_rows > 0 and unit.held.used_bytes > start
    keys = [k for b in batches for k in b.keys]
    unit.begin_checkpoint("t")
    half = keys[: len(keys) // 2]
    assert sorted(unit.delete("staging", half).deferred) == sorted(half)
    unit.end_checkpoint("t")
    assert sorted(unit.delete("staging", keys[len(keys) // 2 :]).ok) == sorted(keys[len(keys) // 2 :])
    assert unit.keys("staging") == [] and unit.held.used_bytes == start and unit.pinned_bytes == 0


# ---- 9: the schema types the staged-row partitions ----------------------------------------------


@pytest.mark.parametrize("partition", ["staging", "cut"])
def test_first_junk_write_does_not_pin_the_partition(make_unit, partition):
    unit = make_unit()
    _, junk = rollout_batch("junk", seed=20)
    junk = with_field(junk, "logprobs", junk.fields["logprobs"].values.astype(np.float64))
    res = unit.put_many(partition, junk)
    assert not res.ok and {r for r, _ in res.failed.values()} == {"dtype_mismatch"}
    detail = next(iter(res.failed.values()))[1]
    assert "logprobs" in detail and "expected <f4" in detail and "<f8" in detail
    # Canonical rows written afterwards are stored, and the registry holds the schema's spec.
    _, good = rollout_batch("good", seed=21)
    assert not unit.put_many(partition, good).failed
    assert unit.registry.get(partition).specs["logprobs"] == ("<f4", ())


@pytest.mark.parametrize("enc,name,spec", [(1, "routed_experts", "<i2"), (2, "routed_experts_u8", "|u1")])
def test_routed_experts_dtype_from_schema_trailing_by_first_write(make_unit, enc, name, spec):
    # Each routes encoding's field has its dtype from the schema (int16, uint8).
    unit = make_unit()
    _, batch = rollout_batch("re", seed=22, n_calls=4, routes_encoding=enc)
    routes = batch.fields[name].values  # [tokens, 2, 2]
    first = batch.take([0])
    for values, why in [(routes.astype(np.int32), "<i4"), (routes.reshape(len(routes), -1), "[4]")]:
        res = unit.put_many("staging", with_field(first, name, values[: len(first.fields["token_ids"].values)]))
        assert {r for r, _ in res.failed.values()} == {"dtype_mismatch"}, why
        assert why in next(iter(res.failed.values()))[1] and f"{spec}[L, K]" in next(iter(res.failed.values()))[1]
    assert name not in unit.registry.get("staging").specs  # refused writes pin nothing
    # This deployment's (L, K) = (2, 2) is pinned by the first good write ...
    assert not unit.put_many("staging", batch.take([0, 1])).failed
    # ... and another (L, K) is refused afterwards, naming the pinned one.
    other = batch.take([2])
    n = len(other.fields["token_ids"].values)
    res = unit.put_many("staging", with_field(other, name, np.zeros((n, 4, 2), routes.dtype)))
    assert res.failed[other.keys[0]][0] == "dtype_mismatch" and "[2, 2]" in res.failed[other.keys[0]][1]
    assert not unit.put_many("staging", batch.take([2, 3])).failed
    # Rows of the other encoding share the partition: their own field, pinned on its own.
    _, old = rollout_batch("re-other", seed=23, routes_encoding=3 - enc)
    assert not unit.put_many("staging", old).failed
    got = unit.get_many("staging", list(batch.keys) + list(old.keys), None)
    assert not got.failed and {"routed_experts", "routed_experts_u8"} <= set(got.batch.fields)


def test_other_partitions_keep_first_write_pinning(make_unit):
    unit = make_unit(partitions=None)
    _, batch = rollout_batch("o", seed=23)
    wide = with_field(batch, "logprobs", batch.fields["logprobs"].values.astype(np.float64))
    assert not unit.put_many("scratch", wide).failed  # not a schema partition: first write pins
    _, more = rollout_batch("p", seed=24)
    res = unit.put_many("scratch", more)
    assert {r for r, _ in res.failed.values()} == {"dtype_mismatch"}
    assert "existing <f8" in next(iter(res.failed.values()))[1]


def test_junk_first_write_through_the_client(store_factory):
    """The reported sequence on a real store: a float64-logprobs put first, then every
    canonical row used to be dtype_mismatch on that unit."""
    store = store_factory(n_units=2)
    _, junk = rollout_batch("j", seed=25)
    junk = with_field(junk, "logprobs", junk.fields["logprobs"].values.astype(np.float64))
    assert {r for r, _ in store.put_many(junk).failed.values()} == {"dtype_mismatch"}
    rows, good = rollout_batch("j", seed=26)  # same rollout id: same unit as the junk
    assert not store.put_many(good).failed
    got = store.get_many(list(good.keys))
    assert not got.failed and [r.digest for r in unpack_rows(got.batch)] == [r.digest for r in rows]
