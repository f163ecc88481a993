"""One key twice in one put: identical copies are one row; different copies are refused
together (``key_conflict``, nothing stored), so the writer is never told ``ok`` and
``key_conflict`` for the same key. Unit level (real zict spill under tmp_path) and through
the client on a 2-unit store."""
from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.store.protocol import KEY_CONFLICT
from pipeline.store.unit import StorageUnit
from rollout_factory import make_rollout
from support import store_maker
from tasks.packed import pack_rows


def _unit(tmp_path) -> StorageUnit:
    return StorageUnit(0, memory_limit=1 << 20, capacity=1 << 30, spill_directory=str(tmp_path), partitions=["staging", "cut"])


def test_a_key_twice_with_different_content_is_refused_whole(tmp_path):
    unit = _unit(tmp_path)
    rows = make_rollout(np.random.default_rng(4), "dup", n_calls=2).rows
    other = dataclasses.replace(rows[0], token_ids=rows[0].token_ids[::-1].copy())
    res = unit.put_many("staging", pack_rows([rows[0], rows[1], other]))
    key, fine = rows[0].staging_key, rows[1].staging_key
    assert res.ok == [fine] and set(res.failed) == {key}  # never both answers for one key
    assert res.failed[key][0] == KEY_CONFLICT and "2 times in this put" in res.failed[key][1]
    assert unit.keys("staging") == [fine] and unit.stats()["rows"] == 1  # no copy stored
    assert not unit.put_many("staging", pack_rows([other])).failed  # the key is still free
    same = unit.put_many("staging", pack_rows([rows[1], rows[1]]))  # identical copies: one row, ok
    assert not same.failed and unit.stats()["rows"] == 2
    unit.close()


def test_the_client_answers_a_torn_key_failed_only(inprocess_client, tmp_path):
    rows = make_rollout(np.random.default_rng(5), "dupc", n_calls=2).rows
    other = dataclasses.replace(rows[0], logprobs=rows[0].logprobs - 1.0)
    with store_maker(inprocess_client, tmp_path / "spill") as make:
        store = make(n_units=2)
        res = store.put_many(pack_rows([rows[0], other, rows[1]]))
        key = rows[0].staging_key
        assert key in res.failed and key not in res.ok and res.ok == [rows[1].staging_key]
        assert set(store.get_many([key], ["token_ids"]).failed) == {key}
