"""Benchmarks with failed rows, failed gets or mismatched content: ``ok`` false,
the failure named, no ratio or speedup, exit status 1; a healthy tiny run is ``ok``.

Every bench runs at its smallest scale against one shared 2-worker LocalCluster
(``--scheduler``); failures are made by monkeypatching the controller-side store client
(the restore bench's: its staging puts).
No timing is asserted."""
from __future__ import annotations

import argparse

import numpy as np
import pytest

from pipeline.bench import cut as bench_cut
from pipeline.bench import restore as bench_restore
from pipeline.bench import store as bench_store
from pipeline.store.client import StagingStore
from pipeline.store.protocol import GetResult, StoreResult
from tasks.keys import unit_for_key
from tasks.packed import PackedBatch, PackedField
from tasks.schema import STAGING_FIELDS


@pytest.fixture(scope="module")
def address(cluster_client):
    return cluster_client.scheduler.address


def parse(module, address: str, *flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(["--scheduler", address, "--quiet", *flags])


def ratio_keys(obj, path: str = "") -> list[str]:
    """Every key anywhere in the result that carries a ratio, speedup or target verdict."""
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if any(w in k for w in ("ratio", "speedup", "meets_target")):
                out.append(path + k)
            out += ratio_keys(v, f"{path}{k}.")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += ratio_keys(v, f"{path}{i}.")
    return out


def assert_failed(module, result: dict, *words: str) -> None:
    assert result["ok"] is False
    assert result["failures"], result
    text = " ".join(result["failures"])
    for w in words:
        assert w in text, (w, result["failures"])
    assert ratio_keys(result) == []
    assert module.exit_status(result) == 1


def assert_healthy(module, result: dict) -> None:
    assert result["failures"] == [], result["failures"]
    assert result["ok"] is True
    assert module.exit_status(result) == 0


def refuse_key(monkeypatch, marker: str) -> None:
    """The store refuses every row whose key contains ``marker`` (as a unit would)."""
    real = StagingStore.put_many

    def put_many(self, batch, *a, **kw):
        keep = [i for i, k in enumerate(batch.keys) if marker not in k]
        if len(keep) == len(batch.keys):
            return real(self, batch, *a, **kw)
        res = real(self, batch.take(np.asarray(keep, dtype=np.int64)), *a, **kw) if keep else StoreResult()
        for k in batch.keys:
            if marker in k:
                res.failed[k] = ("refused", "made to fail by the test")
        return res

    monkeypatch.setattr(StagingStore, "put_many", put_many)


def corrupt(batch: PackedBatch, name: str = "logprobs") -> PackedBatch:
    """A copy of ``batch`` whose ``name`` values differ in one element."""
    f = batch.fields[name]
    values = f.values.copy()
    if values.size:
        values.reshape(-1)[0] += 1
    return PackedBatch(list(batch.keys), {**batch.fields, name: PackedField(values, f.offsets, f.present)})


# ---- store ---------------------------------------------------------------------------

STORE_FLAGS = ("--batch-size", "2", "--rows-1024", "2", "--rows-16384", "2", "--single-rows-1024", "1",
               "--single-rows-16384", "1", "--repeats", "1")


def test_store_bench_healthy(address):
    result = bench_store.run(parse(bench_store, address, *STORE_FLAGS, "--repeats", "3", "--steady"))
    assert_healthy(bench_store, result)
    r = result["1024"]
    assert r["put_ratio"] > 0 and len(r["put_rows_per_s_bs2_runs"]) == 3
    assert r["get_rows_per_s_bs1_median"] == r["get_rows_per_s_bs1"]
    # Dask's own ceiling for the same calls, measured in the same run.
    assert r["dask_put_mb_per_s"] > 0 and len(r["dask_get_mb_per_s_runs"]) == 3
    assert r["put_vs_dask"] > 0 and r["dask_get_vs_loopback"] > 0
    # The steady mode beside it, same runs: rates, ratios, the units' pool counters per run.
    steady = result["16384"]["steady"]
    assert len(steady["get_rows_per_s_runs"]) == 3 and steady["put_vs_loopback"] > 0
    assert len(steady["pool_growth_runs"]) == 3 and "meets_loopback_target" in steady
    assert result["profile"] == "toy" and result["bytes_per_token"] > 0 and r["get_gb_s_bs2"] > 0


def test_store_bench_refused_steady_delete_fails(address, monkeypatch):
    real = StagingStore.delete

    def delete(self, keys, *a, **kw):
        res = real(self, keys, *a, **kw)
        if any(k.startswith("d") for k in keys):  # the steady mode's keys
            res.failed[keys[0]] = ("refused", "made to fail by the test")
        return res

    monkeypatch.setattr(StagingStore, "delete", delete)
    result = bench_store.run(parse(bench_store, address, *STORE_FLAGS, "--steady"))
    assert_failed(bench_store, result, "steady delete", "refused")
    assert "put_vs_loopback" not in result["1024"].get("steady", {})


def test_store_bench_failed_bare_actor_run_fails(address, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("bare actor ceiling: worker 0 answered frames that differ from what was put")

    monkeypatch.setattr(bench_store.actor_ceiling, "measure", broken)
    result = bench_store.run(parse(bench_store, address, *STORE_FLAGS))
    assert_failed(bench_store, result, "bare Dask actors", "differ")
    assert "put_vs_dask" not in result["1024"]


def test_store_bench_refused_put_fails(address, monkeypatch):
    refuse_key(monkeypatch, "b1/c0")  # the second row of each batched put
    result = bench_store.run(parse(bench_store, address, *STORE_FLAGS))
    assert_failed(bench_store, result, "put bs2", "b1/c0", "refused", "get bs2")
    assert not any("vs_dask" in k or "vs_loopback" in k for k in result["1024"])


def test_store_bench_corrupt_read_back_fails(address, monkeypatch):
    real = StagingStore.get_many

    def get_many(self, keys, *a, **kw):
        got = real(self, keys, *a, **kw)
        return GetResult(corrupt(got.batch), got.failed) if any("a0/c0" in k for k in keys) else got

    monkeypatch.setattr(StagingStore, "get_many", get_many)
    result = bench_store.run(parse(bench_store, address, *STORE_FLAGS))
    assert_failed(bench_store, result, "get bs1", "logprobs", "differs")


# ---- cut -----------------------------------------------------------------------------

CUT_FLAGS = ("--rows", "8", "--clients", "2", "--batch-size", "4", "--tokens", "1024", "--repeats", "1")


def test_cut_bench_healthy(address):
    result = bench_cut.run(parse(bench_cut, address, *CUT_FLAGS, "--repeats", "3"))
    assert_healthy(bench_cut, result)
    assert result["speedup_1024"] > 0
    assert [(r["mode"], r["rows_per_put"]) for r in result["table"]] == [("one_row", 1), ("batched", 4), ("batched_serial", 4)]
    for r in result["table"]:
        assert len(r["wall_s_runs"]) == 3 and r["wall_s"] == r["wall_s_median"] and r["failed"] == 0
        assert r["gb_s"] > 0
    # The rows carried the default (toy) profile's routes, 4 x 2 ids per token, through the store.
    assert result["profile"] == "toy" and result["route_id_bytes"] in (1, 2)
    assert result["bytes_per_token"] == 16 + 8 * result["route_id_bytes"]


def test_cut_bench_refused_put_fails(address, monkeypatch):
    refuse_key(monkeypatch, "c1r2/")  # one call of client 1: its ack is a durable_failure
    result = bench_cut.run(parse(bench_cut, address, *CUT_FLAGS))
    assert_failed(bench_cut, result, "durable_failure", "c1r2")


def test_cut_bench_corrupt_read_back_fails(address, monkeypatch):
    real = StagingStore.get_many

    def get_many(self, keys, *a, **kw):
        got = real(self, keys, *a, **kw)
        return GetResult(corrupt(got.batch), got.failed)

    monkeypatch.setattr(StagingStore, "get_many", get_many)
    result = bench_cut.run(parse(bench_cut, address, *CUT_FLAGS))
    assert_failed(bench_cut, result, "read back", "logprobs", "differs")


# ---- restore -------------------------------------------------------------------------
#
# The restore reads run on the cluster's workers (the batchers' real callers), out of reach
# of a controller-side patch: failures are made where the controller acts, the staging puts
# (a row reported written but never stored, or stored different from what the content
# check expects).

RESTORE_FLAGS = ("--workers", "2", "--restores", "4", "--tokens", "64", "--gap-workers", "2", "--gap-restores", "2",
                 "--scenarios", "mass_resume,gap_50ms", "--repeats", "1", "--gap-repeats", "1", "--gc", "none")


def patch_staging(monkeypatch, marker: str, change) -> None:
    """Staging puts write ``change(batch)`` for the rows whose key contains ``marker``
    (``None``: those rows are dropped) and still report every row written."""
    real = StagingStore.put_many

    def put_many(self, batch, *a, **kw):
        hit = [i for i, k in enumerate(batch.keys) if marker in k]
        if not hit:
            return real(self, batch, *a, **kw)
        rest = [i for i in range(len(batch.keys)) if i not in hit]
        res = real(self, batch.take(np.asarray(rest, dtype=np.int64)), *a, **kw) if rest else StoreResult()
        changed = change(batch.take(np.asarray(hit, dtype=np.int64)))
        if changed is not None:
            assert not real(self, changed, *a, **kw).failed
        return res

    monkeypatch.setattr(StagingStore, "put_many", put_many)


def test_restore_bench_healthy_reports_medians_through_the_batchers(address):
    result = bench_restore.run(parse(bench_restore, address, *RESTORE_FLAGS, "--repeats", "3", "--gap-repeats", "3"))
    assert_healthy(bench_restore, result)
    assert result["mass_resume_speedup"] > 0 and set(result["gap_p50_ratio"]) == {"50"}
    assert set(result["meets_targets"]) == {"mass_resume_speedup", "gap_p50_ratio"}
    rows = {(r["scenario"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in ("mass_resume", "gap_50ms") for m in ("per-request", "coalesced")}
    for r in rows.values():
        assert r["errors"] == 0 and r["runs"] == 3 and len(r["wall_s_runs"]) == 3 and len(r["p50_ms_runs"]) == 3
        assert r["wall_s"] == sorted(r["wall_s_runs"])[1] and r["p50_ms"] == sorted(r["p50_ms_runs"])[1]
    # per-request: one store get per restore; coalesced: the batchers' own count. In a mass
    # resume (all at once) each simulated worker's first restore finds its batcher idle and
    # goes alone; the rest share one get per storage unit.
    sc = bench_restore.scenarios(parse(bench_restore, address, *RESTORE_FLAGS))[0]
    by_worker: dict[int, list[int]] = {}
    for i, ks in enumerate(bench_restore.restore_keys(sc)):
        by_worker.setdefault(i // 4, []).append(unit_for_key(ks[0], 2))

    def gets(units: list[int]) -> set[int]:
        # Whichever restore goes first goes alone; the others share one get per unit.
        return {1 + len(set(units[:j] + units[j + 1 :])) for j in range(len(units))}

    assert rows["mass_resume", "per-request"]["gets"] == 8
    fewest, most = sum(min(gets(u)) for u in by_worker.values()), sum(max(gets(u)) for u in by_worker.values())
    assert fewest <= rows["mass_resume", "coalesced"]["gets"] <= most < 8, (fewest, most)
    assert result["knobs"]["eager-inflight"] >= 0
    # The restores read the rows' routes (toy profile) and report the payload rate.
    assert len(result["scale"]["fields"]) == len(STAGING_FIELDS) + 1 and result["route_id_bytes"] in (1, 2)
    assert all(r["gb_s"] > 0 for r in rows.values())


def test_restore_bench_failed_reads_fail(address, monkeypatch):
    patch_staging(monkeypatch, "w1r1/", lambda b: None)  # reported written, never stored
    result = bench_restore.run(parse(bench_restore, address, *RESTORE_FLAGS))
    assert_failed(bench_restore, result, "mass_resume per-request", "mass_resume coalesced", "w1r1", "missing_key")


def test_restore_bench_corrupt_read_back_fails(address, monkeypatch):
    patch_staging(monkeypatch, "w0r0/", corrupt)  # restore 0 is always in the checked sample
    result = bench_restore.run(parse(bench_restore, address, *RESTORE_FLAGS))
    assert_failed(bench_restore, result, "read back", "logprobs", "differs")


# ---- soak at a MoE profile -------------------------------------------------------------


def test_soak_at_a_moe_profile_stages_and_accepts_its_routes(address):
    """The toy engine runs at deepseek-v3's shape: its rows carry 58 x 8 one-byte expert
    ids of 256 experts, and the finalizer verifies them against that range (at the
    policy's default range of 8 experts every rollout would be rejected)."""
    from pipeline.bench import soak

    flags = ("--steps", "2", "--first-step", "1", "--in-flight", "1", "--groups", "1", "--rollouts", "2", "--turns", "1",
             "--tokens-per-turn", "4", "--profile", "deepseek-v3", "--max-rss-growth", "1000")  # 2 steps: RSS is still warming up
    result = soak.run(parse(soak, address, *flags))
    assert result["ok"] and result["rejected_rollouts"] == 0 and not result["failed_steps"], result["missed"]
    assert (result["layers"], result["top_k"], result["experts"], result["route_id_bytes"]) == (58, 8, 256, 1)
    assert result["bytes_per_token"] == 16 + 58 * 8 and result["tokens"] > 0 and result["gb_s"] > 0
