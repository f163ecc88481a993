"""``bench store``'s elastic block at a tiny size: rows/s while a storage worker joins vs
without and the seconds of a rebalance, on the block's own cluster (the healthy run on the
default kind, a scheduler process and CLI hosts; the failing one on a LocalCluster;
storage workers retired by ``client.retire_workers``). A healthy run is
``ok`` with every figure in place and exit status 0; a row read back wrong or a refused put
makes it and ``bench store`` ``ok: false``, names the failure, reports no ratio and exits 1.
No timing is asserted."""
from __future__ import annotations

import argparse
import json

import pytest

from pipeline import cli
from pipeline.bench import store as bench_store
from pipeline.bench import store_elastic
from pipeline.bench.store_elastic_loop import Rows, read_back_problems
from pipeline.store.client import StagingStore
from pipeline.store.protocol import GetResult, StoreResult
from tasks.packed import PackedBatch, PackedField

STORE_TINY = ("--batch-size", "2", "--rows-1024", "2", "--rows-16384", "2", "--single-rows-1024", "1",
              "--single-rows-16384", "1", "--repeats", "1")
ELASTIC_TINY = ("--elastic-gb", "0.02", "--elastic-fill-mb", "1", "--elastic-live-mb", "0.5", "--elastic-seconds", "0.3",
                "--elastic-alternations", "1", "--elastic-rows-per-call", "8", "--elastic-tokens", "256")


def ratio_keys(obj, path: str = "") -> list[str]:
    """Every key anywhere in the result that carries a ratio or a target verdict."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if "ratio" in k or "meets_target" in k:
                out.append(path + k)
            out += ratio_keys(v, f"{path}{k}.")
    return out


def corrupt(batch: PackedBatch, name: str = "logprobs") -> PackedBatch:
    f = batch.fields[name]
    values = f.values.copy()
    values.reshape(-1)[-1] += 1  # the last row's last element
    return PackedBatch(list(batch.keys), {**batch.fields, name: PackedField(values, f.offsets, f.present)})


def test_read_back_check_names_a_row_that_differs():
    rows = Rows(4, 16, 2, 2, True)
    want = rows.batch("f", 1)
    assert read_back_problems(want, rows.batch("f", 1)) == []
    bad = read_back_problems(want, corrupt(want))
    assert bad and "f1-3/c0" in bad[0] and "logprobs" in bad[0]
    assert read_back_problems(want, rows.batch("f", 5)) != []  # another batch's keys
    # Batch j holds template j % 4: the same keys with another batch's content differ.
    other = PackedBatch(list(want.keys), rows.batch("f", 2).fields)
    assert read_back_problems(want, other) != []


def test_flags_and_the_skip_on_an_existing_cluster():
    p = argparse.ArgumentParser()
    bench_store.add_arguments(p)
    args = p.parse_args([])
    assert args.elastic is store_elastic.DEFAULT_ON and args.elastic_gb == 1.0 and args.elastic_replicas == (1, 2)
    assert p.parse_args(["--elastic", "--elastic-replicas", "2"]).elastic_replicas == (2,)
    with pytest.raises(SystemExit):
        p.parse_args(["--elastic-replicas", "3"])
    failures: list[str] = []
    out = store_elastic.block(p.parse_args(["--elastic", "--scheduler", "tcp://127.0.0.1:1"]), failures)
    assert "skipped" in out and failures == []


def test_bench_store_elastic_tiny_run_is_ok(capsys):
    rc = cli.main(["bench", "store", "--json", "--quiet", *STORE_TINY, "--elastic", *ELASTIC_TINY])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["ok"] is True, result["failures"]
    block = result["elastic"]
    assert block["ok"] is True and block["failures"] == []
    for r in (1, 2):
        part = block[f"replicas_{r}"]
        for kind in ("baseline", "during_add", "during_drain"):
            w = part[kind]
            assert w["put_calls_runs"][0] + w["get_calls_runs"][0] > 0, (r, kind, w)  # the loop went on in every window
            for op in ("put", "get"):  # a short drain may overlap one call only (under load: a put, no get)
                assert (w[f"{op}_rows_per_s"] > 0) == (w[f"{op}_calls_runs"][0] > 0), (r, kind, w)
            assert len(w["put_rows_per_s_runs"]) == 1
        assert part["baseline"]["put_rows_per_s"] > 0 and part["baseline"]["get_rows_per_s"] > 0, part["baseline"]
        move = part["during_move"]  # the change's own interval (its record's wall-clock bounds)
        assert move["seconds_runs"][0] > 0 and part["during_add"]["seconds_runs"][0] > 0, (move, part["during_add"])
        for op in ("put", "get"):  # a tiny move may fall between two calls of the loop
            assert (move[f"{op}_rows_per_s"] > 0) == (move[f"{op}_calls_runs"][0] > 0), move
        assert part["put_rows_per_s_during_vs_without"] > 0 and part["get_rows_per_s_during_vs_without"] > 0
        assert "put_rows_per_s_during_move_vs_without" in part and "get_rows_per_s_during_move_vs_without" in part
        assert part["target_ratio"] == store_elastic.TARGET_RATIO and isinstance(part["meets_target"], bool)
        assert [c["kind"] for c in part["changes"]] == ["add", "drain"]
        assert part["changes"][0]["rows_moved"] > 0
        assert part["unit_move_counters"]["moved_in_rows"] > 0  # the drain moved rows back onto the 2 units
        assert part["rows_read_back_in_loop"] > 0 and part["rows_read_back_after"] >= part["prefilled_rows"]
    move = block["rebalance"]
    assert move["rows_read_back"] == move["rows"] == move["copies"]
    assert 0.2 < move["copies_moved_fraction"] < 0.47  # about 1/3 of the copies move to the third unit
    assert move["bytes_moved"] > 0 and move["seconds"] > 0 and move["join_to_record_s"] >= 0
    assert move["move_gb_per_s"] > 0 and move["move_vs_loopback_ratio"] > 0 and move["drain_seconds"] > 0


def test_a_wrong_row_or_a_refused_put_fails_the_block(monkeypatch, capsys):
    real_get, real_put = StagingStore.get_many, StagingStore.put_many

    def get_many(self, keys, *a, **kw):  # pre-filled batches and rebalanced batch 0 come back wrong
        got = real_get(self, keys, *a, **kw)
        wrong = keys and (keys[0].startswith("f") or keys[0] == "R0-0/c0")
        return GetResult(corrupt(got.batch), got.failed) if wrong else got

    def put_many(self, batch, *a, **kw):  # the loop's third put is refused
        if batch.keys and batch.keys[0] == "L2-0/c0":
            return StoreResult(failed={k: ("refused", "made to fail by the test") for k in batch.keys})
        return real_put(self, batch, *a, **kw)

    monkeypatch.setattr(StagingStore, "get_many", get_many)
    monkeypatch.setattr(StagingStore, "put_many", put_many)
    rc = cli.main(["bench", "store", "--json", "--quiet", *STORE_TINY, "--elastic", *ELASTIC_TINY, "--elastic-replicas", "1",
                   "--elastic-cluster", "local"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 1 and result["ok"] is False and bench_store.exit_status(result) == 1
    assert result["failures"] and all(f.startswith("elastic ") for f in result["failures"]), result["failures"]
    block = result["elastic"]
    assert block["ok"] is False and store_elastic.exit_status(block) == 1
    text = " ".join(block["failures"])
    assert "replicas=1: get of batch f" in text and "-7/c0" in text and "differs" in text  # in the loop, the last row
    assert "replicas=1: read-back of batch f" in text  # after the loop
    assert "rebalance: read-back of batch R0" in text
    assert "put of batch L2" in text and "refused" in text
    assert ratio_keys(result) == []  # neither the block's ratios nor the store bench's
    assert block["rebalance"]["rows_moved"] > 0  # the figures stay, only ratios go
