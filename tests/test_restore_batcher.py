"""PrefixReadBatcher end to end: a real LocalCluster, a real StagingStore spilling to disk,
cut rows written by the real cut code, restores verified, and a resumed call that continues
bit for bit like the uninterrupted one."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from distributed import Client, LocalCluster

from pipeline.generation.call_buffer import CallBuffer
from pipeline.generation.worker import GenerationWorker
from pipeline.restore import PrefixReadError
from pipeline.restore.batcher import start_batchers
from pipeline.store.client import StagingStore
from tasks.cut.receipt import prefix_digest
from tasks.packed import pack_rows
from support import resume_and_compare

pytestmark = pytest.mark.timeout(120)

VOCAB = 512


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spill = tmp_path_factory.mktemp("spill")
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address="127.0.0.1:0", host="127.0.0.1"
    ) as lc, Client(lc) as client:
        # A tiny memory limit: most rows live on disk (zict spill under tmp_path).
        store = StagingStore.start(client, n_units=2, memory_limit="16KiB", spill_directory=str(spill))
        batchers = start_batchers(client, store)
        yield client, store, batchers, spill
        store.close()


def stage_calls(store, n_calls: int, tag: str, *, chunks=(40, 30), context=16, seed=0):
    """Cut ``n_calls`` synthetic calls (real CallBuffer freeze/seal) into the cut partition.

    Returns [(ack, buffer)] in call order.
    """
    rng = np.random.default_rng(seed)
    out, rows = [], []
    for i in range(n_calls):
        buf = CallBuffer(f"{tag}-r{i}", "c0", rng.integers(0, VOCAB, context))
        ack = None
        for j, n in enumerate(chunks):
            buf.append(rng.integers(0, VOCAB, n), -rng.random(n).astype(np.float32))
            frozen = buf.freeze(f"{tag}-ck{j}")
            ack = buf.seal(frozen)
            rows.append((frozen.key, frozen.row))
        out.append((ack, buf))
    batch = pack_rows([r for _, r in rows])
    batch.keys = [k for k, _ in rows]
    res = store.put_many(batch, partition="cut")
    assert not res.failed, res.failed
    return out


def test_restores_are_coalesced_verified_and_in_chain_order(cluster):
    client, store, batchers, spill = cluster
    calls = stage_calls(store, 12, "ok")
    assert any(s["spilled_bytes"] > 0 for s in store.stats())  # rows really went to disk
    b = batchers[sorted(batchers)[0]]
    before = b.stats().result()
    verdicts = b.restore_many([ack for ack, _ in calls], vocab_size=VOCAB).result()
    for (ack, buf), v in zip(calls, verdicts):
        assert v.usable, (v.reason, v.detail)
        out = buf.output()
        np.testing.assert_array_equal(v.prefix.token_ids, out["token_ids"])
        np.testing.assert_array_equal(v.prefix.logprobs, out["logprobs"])
        assert v.prefix.keys == ack.staging_keys and v.prefix.chunk_lengths == (56, 30)
    after = b.stats().result()
    requests = after["requests"] - before["requests"]
    gets = after["gets"] - before["gets"]
    assert requests == 12
    assert gets < requests  # 12 restores shared their gets
    assert after["keys_fetched"] - before["keys_fetched"] == 24  # each key read once
    assert after["verdicts"]["ok"] >= 12

    # A plain read keeps the caller's order, whatever the store's placement.
    keys = [k for ack, _ in calls[:3] for k in ack.staging_keys][::-1]
    rows = b.read(keys).result()
    assert rows.keys == keys


def test_bad_prefixes_fail_only_themselves(cluster):
    client, store, batchers, _ = cluster
    calls = stage_calls(store, 6, "mix", seed=1)
    good = [ack for ack, _ in calls]
    # A continuation whose rows were never written (e.g. the cut lost its put).
    missing = dataclasses.replace(good[0], staging_keys=("__cut__/gone/mix-r0/c0/0",))
    # A continuation claiming another prefix digest / a longer prefix.
    wrong_digest = dataclasses.replace(good[1], prefix_digest=prefix_digest(np.arange(3)))
    wrong_len = dataclasses.replace(good[2], prefix_tokens=good[2].prefix_tokens - 1)
    # A tampered row in the store: another call's chunk written under this call's key.
    tampered_calls = stage_calls(store, 1, "tmp", seed=2)
    forged_key = "__cut__/forged/mix-r3/c0/0"
    src = store.get_many([tampered_calls[0][0].staging_keys[0]], partition="cut").batch
    src.keys = [forged_key]
    assert not store.put_many(src, partition="cut").failed
    forged = dataclasses.replace(good[3], staging_keys=(forged_key,) + good[3].staging_keys[1:])
    b = batchers[sorted(batchers)[-1]]
    verdicts = b.restore_many([missing, wrong_digest, wrong_len, forged, good[4], good[5]]).result()
    assert [v.reason for v in verdicts] == [
        "missing_staging_row",
        "prefix_digest_mismatch",
        "prefix_length_mismatch",
        "identity_mismatch",
        None,
        None,
    ]
    assert "missing_key" in verdicts[0].detail
    assert all(v.usable for v in verdicts[4:])
    with pytest.raises(PrefixReadError) as err:
        b.read(["__cut__/gone/x/c0/0", good[4].staging_keys[0]]).result()
    assert list(err.value.failed) == ["__cut__/gone/x/c0/0"]


def test_cut_then_restore_resumes_bit_identically(cluster):
    """GenerationWorker cuts mid-generation; the batcher restores and verifies the prefix;
    a fresh GenerationWorker resumes from it and finishes exactly like the original."""
    client, store, batchers, _ = cluster
    addr = sorted(batchers)[0]
    policy = {"vocab-size": 64, "hidden": 16, "layers": 2, "experts": 4, "top-k": 2, "seed": 0, "window": 8}
    gen = client.submit(GenerationWorker, store, policy=policy, actor=True, workers=[addr]).result()
    specs = [
        {"rollout_id": f"gen-r{i}", "model_call_id": "c0", "context": list(range(1 + i, 9 + i)), "max_new_tokens": 24}
        for i in range(3)
    ]
    gen.start_calls(specs).result()
    gen.step(5).result()
    gen.checkpoint_cut("gk1").result()
    gen.step(4).result()
    receipt = gen.checkpoint_cut("gk2").result()
    acks = {a.call: a for a in receipt.durable}
    assert len(acks) == 3 and all(len(a.staging_keys) == 2 for a in acks.values())
    verdicts = batchers[addr].restore_many(list(acks.values()), vocab_size=64, num_experts=4).result()
    resume_and_compare(client, store, gen, specs, verdicts, acks, policy=policy, worker=addr, max_new_tokens=24, rounds=30)


def test_a_continuation_with_no_key_list_fails_only_itself(cluster):
    # staging_keys that is not a list at all (a corrupted receipt record): that call's
    # verdict is invalid_continuation; the restores batched with it are still answered.
    client, store, batchers, _ = cluster
    calls = stage_calls(store, 2, "nolist", seed=3)
    bad = {"staging_keys": 7, "prefix_tokens": 1, "prefix_digest": bytes(32)}
    b = batchers[sorted(batchers)[0]]
    verdicts = b.restore_many([calls[0][0], bad, calls[1][0]], vocab_size=VOCAB).result()
    assert [v.reason for v in verdicts] == [None, "invalid_continuation", None]
    assert verdicts[0].usable and verdicts[2].usable
