"""Finalization as a Dask graph on a real LocalCluster (finalize slots, zict spill to tmp_path)."""
from __future__ import annotations

import copy
import time
from collections import Counter

import dask
import numpy as np
import pytest
from distributed import Client, LocalCluster, wait
from rollout_factory import make_group

from pipeline import events
from pipeline.finalize import FinalizeError, Finalizer
from tasks.keys import unit_for_rollout
from tasks.packed import pack_rows
from tasks.schema import routes_field, row_fields

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("keep_staged_rows")]

VOCAB, L, K, E = 64, 2, 2, 8




@pytest.fixture
def store(store_factory):
    # A small memory limit so rows really spill through zict to tmp_path.
    return store_factory(n_units=2, memory_limit="16KiB")


def stage(store, builts):
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed
    return builts


def row_bytes(rows, with_routes: bool) -> int:
    """Payload bytes of rows as the finalizer fetches them (every STAGING field + routes)."""
    b = pack_rows(rows, with_routes=with_routes)
    return sum(f.values.nbytes for f in b.fields.values())


def readback(store, built):
    """The rollout's chain rows read back from the store on the controller."""
    keys = [f"{built.rollout_id}/{c}" for c in built.chain_ids]
    enc = built.rows[0].routes_encoding
    fields = list(row_fields(enc))  # the staging fields and the rollout's routes field
    got = store.get_many(keys, fields)
    assert not got.failed
    b = got.batch
    cat = lambda name: np.concatenate([b.fields[name].row(i) for i in range(len(b))])  # noqa: E731
    out = {n: cat(n) for n in fields if n in ("token_ids", "token_mask", "logprobs")}
    if routes_field(enc) is not None:
        out["routed_experts"] = cat(routes_field(enc))
    return out


def assert_group_matches(store, group, builts):
    assert group.status == ["ok"] * len(builts)
    assert group.sample_mask.tolist() == [1.0] * len(builts)
    for i, b in enumerate(builts):
        want = readback(store, b)
        n = len(want["token_ids"])
        assert int(group.input_lengths[i]) == n
        np.testing.assert_array_equal(group.input_ids[i, :n].numpy(), want["token_ids"])
        np.testing.assert_array_equal(group.token_mask[i, :n].numpy(), want["token_mask"])
        np.testing.assert_array_equal(group.logprobs[i, :n].numpy(), want["logprobs"])
        assert not group.input_ids[i, n:].any() and not group.token_mask[i, n:].any()
        root = b.rows[0] if b.rows[0].model_call_id == b.chain_ids[0] else b.row(b.chain_ids[0])
        assert int(group.prompt_lengths[i]) == int((root.token_mask == 0).sum())
        assert float(group.rewards[i]) == pytest.approx(b.receipt.reward)
        if "routed_experts" in want:
            np.testing.assert_array_equal(group.routed_experts[i, :n].numpy(), want["routed_experts"])


def events_of(client, step_id, kind, n, timeout=10.0):
    """Finalize events of ``step_id`` (group events come from workers: poll, bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        got = [m for _, m in client.get_events(events.FINALIZE) if m.get("step_id") == step_id and m.get("kind") == kind]
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def sites(store, builts) -> int:
    """Workers hosting the units that hold ``builts``' rows: the step reads each site once
    (one union fetch of the staging fields per site, plus one of routes)."""
    workers = list(store.unit_workers)
    return len({workers[unit_for_rollout(b.rollout_id, len(workers))] for b in builts})


METRIC_KEYS = (
    "fetch_ms", "verify_ms", "assemble_ms", "queue_wait_ms", "queue_depth",
    "calls_per_rollout", "fetch_calls", "bytes_fetched",
)


def test_step_with_routes_one_union_fetch_plus_routes(cluster_client, store):
    rng = np.random.default_rng(1)
    groups = {f"g{g}": stage(store, make_group(rng, f"g{g}", 4, rollout_prefix=f"s1g{g}", n_calls=3, routes=(L, K, E), n_branches=1)) for g in range(3)}
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id="routed")
    step = handle.result()

    assert list(step.groups) == ["g0", "g1", "g2"]
    for gid, bs in groups.items():
        group = step.groups[gid]
        assert_group_matches(store, group, bs)
        m = group.metrics
        for key in METRIC_KEYS:
            assert key in m, key
        # One union fetch of STAGING_FIELDS + one of routed_experts, per site holding its rows.
        assert m["fetch_calls"] == 2 * sites(store, bs)
        # Only chain rows are fetched (the off-chain branch call is not).
        chain_rows = [b.row(c) for b in bs for c in b.chain_ids]
        assert m["bytes_fetched"] == row_bytes(chain_rows, with_routes=True)
        assert m["calls_per_rollout"] == pytest.approx(3.0)
        assert m["accepted"] == 4 and m["rejected"] == {}
        assert m["fetch_ms"] > 0 and m["verify_ms"] > 0 and m["assemble_ms"] > 0 and m["queue_wait_ms"] >= 0

    sm = step.metrics
    n_sites = sites(store, [b for bs in groups.values() for b in bs])
    assert sm["fetch_calls"] == 2 * n_sites and sm["groups"] == 3 and sm["rollouts"] == 12 and sm["accepted"] == 12
    assert sm["bytes_fetched"] == sum(step.groups[g].metrics["bytes_fetched"] for g in groups)
    assert sm["tokens"] == sum(int(step.groups[g].input_lengths.sum()) for g in groups)
    assert sm["queue_depth"] == 3 and sm["queue_depth_after"] == 0
    assert sm["dominant"] in ("fetch", "verify")
    # Assembled in this process: the tail runs from the last verify to the groups here.
    assert sm["assembled_on"] == "controller" and sm["cross_host_bytes_planned"] == 0
    assert sm["verified_ms"] > 0 and sm["wall_ms"] > 0 and sm["tail_ms"] >= 0 and sm["collect_ms"] > 0  # measured (how they compare: bench finalize)
    assert fin.queue_depth == 0 and fin.in_flight == []
    # The rows really went through zict's disk side.
    assert sum(s.get("spilled_bytes", 0) + s.get("disk_bytes", 0) for s in store.stats()) > 0

    step_events = events_of(cluster_client, "routed", "step", 1)
    assert len(step_events) == 1 and step_events[0]["fetch_calls"] == 2 * n_sites
    # Logged by the scheduler's plugin with its measure of the step's cross-host bytes.
    assert step_events[0]["cross_host_measured"] is True and sm["cross_host_measured"] is True
    group_events = events_of(cluster_client, "routed", "group", 3)
    assert sorted(e["group_id"] for e in group_events) == ["g0", "g1", "g2"]
    assert all(not any(k.startswith("_") for k in e) for e in group_events + step_events)


def test_step_without_routes_fetches_once(cluster_client, store):
    rng = np.random.default_rng(2)
    bs = stage(store, make_group(rng, "s2", 5, n_calls=2))
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=None)
    step = fin.submit_step([[b.receipt for b in bs]]).result()
    group = step.groups["g0"]
    assert_group_matches(store, group, bs)
    assert group.routed_experts is None
    assert group.metrics["fetch_calls"] == sites(store, bs) and step.metrics["fetch_calls"] == sites(store, bs)
    assert group.metrics["bytes_fetched"] == row_bytes([b.row(c) for b in bs for c in b.chain_ids], with_routes=False)


def several_per_unit(tag: str, n_groups: int, per_group: int, n_units: int) -> str:
    """A rollout prefix ``{tag}{t}`` whose rollouts ``{prefix}g{g}-r{i}`` put at least two
    on every one of ``n_units`` units (a site of several rollouts)."""
    for t in range(1000):
        ids = [f"{tag}{t}g{g}-r{i}" for g in range(n_groups) for i in range(per_group)]
        if min(Counter(unit_for_rollout(r, n_units) for r in ids).get(u, 0) for u in range(n_units)) >= 2:
            return f"{tag}{t}"
    raise AssertionError("no such prefix")


def test_each_verify_task_receives_only_its_rollouts_rows(cluster_client, store):
    rng = np.random.default_rng(3)
    prefix = several_per_unit("s3", 2, 3, len(store.units))
    groups = [stage(store, make_group(rng, f"s3g{g}", 3, rollout_prefix=f"{prefix}g{g}", n_calls=2, routes=(L, K, E))) for g in range(2)]
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, keep_intermediates=True)
    fin.with_settings(verify_token_budget=1)  # one rollout per task
    handle = fin.submit_step([[b.receipt for b in bs] for bs in groups])
    graph = handle.graph
    wait(handle.futures)
    assert len(graph.verify_layout) == 6 and all(len(t) == 1 for t in graph.verify_layout)
    # Scheduler view: a verify task depends on its own pieces, never on a fetch task.
    verify_keys = [f.key for f in graph.verify_futures]
    fetch_keys = {f.key for f in graph.fetch_futures}

    def deps(dask_scheduler, keys):
        return {
            str(k): [(str(d.key), d.nbytes) for d in dask_scheduler.tasks[k].dependencies]
            for k in keys
        }

    dep_map = cluster_client.run_on_scheduler(deps, keys=verify_keys)
    # One staging and one routes fetch per site (each site here holds several rollouts).
    assert len(fetch_keys) == 2 * sites(store, [b for bs in groups for b in bs])
    for k, ds in dep_map.items():
        assert len(ds) == 2, ds  # its staging piece and its routes piece
        assert not ({d for d, _ in ds} & {str(x) for x in fetch_keys})
        assert all("tc-piece-" in d for d, _ in ds)
    # Each piece holds exactly the rows of its task's rollout, nothing else.
    pieces = cluster_client.gather(graph.piece_futures)
    staging = [p for p in pieces if "rollout_id" in p.batch.fields]
    assert len(staging) == 6
    rollouts = graph.plan.rollouts
    for t, task in enumerate(graph.verify_layout):
        want = [k for r in task for k in rollouts[r].keys]
        assert staging[t].batch.keys == want
    step = handle.result()
    for g, bs in zip(step.groups.values(), groups):
        assert_group_matches(store, g, bs)
    assert step.metrics["verify_tasks"] == 6
    assert handle.graph.piece_futures == []  # released once collected


def test_several_steps_in_flight_and_queue_depth(cluster_client, store):
    rng = np.random.default_rng(4)
    steps = [[stage(store, make_group(rng, f"s4s{s}g{g}", 3, n_calls=2)) for g in range(2)] for s in range(3)]
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=None)
    handles = [fin.submit_step([[b.receipt for b in bs] for bs in step]) for step in steps]
    assert len(fin.in_flight) == 3
    # Each step saw itself and whatever was still pending before it.
    assert handles[0].graph.queue_depth == 2
    assert all(h.graph.queue_depth >= 2 for h in handles)
    assert fin.queue_depth <= 6
    results = fin.drain()
    assert [r.step_id for r in results] == ["step-0", "step-1", "step-2"]
    for r, step in zip(results, steps):
        for g, bs in zip(r.groups.values(), step):
            assert_group_matches(store, g, bs)
    assert fin.queue_depth == 0 and fin.in_flight == []
    assert handles[0].result() is results[0]  # collected once, cached


def test_clear_staged_deletes_every_finalized_rollout(cluster_client, store):
    rng = np.random.default_rng(5)
    bs = stage(store, make_group(rng, "s5", 3, n_calls=2, n_branches=1))
    # A rollout whose terminal row is missing is rejected; it is finalized, so its rows go too.
    bad = stage(store, make_group(rng, "s5bad", 1, n_calls=2))[0]
    store.delete([f"{bad.rollout_id}/c1"])
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=None)
    fin.with_settings(clear_staged=True)
    handle = fin.submit_step([[b.receipt for b in bs] + [bad.receipt]])
    step = handle.result()
    assert step.groups["g0"].status == ["ok", "ok", "ok", "missing_staging_row"]
    cleared = handle.clear_future.result()
    all_keys = [r.staging_key for b in bs for r in b.rows] + [f"{bad.rollout_id}/c0"]  # branch calls included
    assert cleared["deleted"] == len(all_keys)
    assert set(store.get_many(all_keys, ["token_ids"]).failed) == set(all_keys)


def test_bad_submissions_are_refused(cluster_client, store):
    fin = Finalizer(cluster_client, store)
    with pytest.raises(FinalizeError, match="at least one group"):
        fin.submit_step({})
    with pytest.raises(FinalizeError, match="no receipts"):
        fin.submit_step({"g0": []})
    with pytest.raises(FinalizeError, match="mapping or a list"):
        fin.submit_step("receipts")
    assert fin.queue_depth == 0


def test_cluster_without_finalize_slots_is_refused():
    # Verify tasks would wait forever for a `finalize` slot: refuse up front.
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0", worker_dashboard_address="127.0.0.1:0") as c, Client(c) as client:
        with pytest.raises(FinalizeError, match="finalize"):
            Finalizer(client, store=None)


# ---- where the work runs, and what travels ---------------------------------------


@pytest.mark.parametrize("budget", [1 << 20, 40])
def test_rows_are_fetched_and_verified_on_the_worker_that_holds_them(cluster_client, store, budget):
    rng = np.random.default_rng(6)
    groups = {f"g{g}": stage(store, make_group(rng, f"g{g}", 4, rollout_prefix=f"s6g{g}", n_calls=2, routes=(L, K, E))) for g in range(4)}
    builts = [b for bs in groups.values() for b in bs]
    workers = list(store.unit_workers)
    site_of = {b.rollout_id: workers[unit_for_rollout(b.rollout_id, len(workers))] for b in builts}
    assert len(set(site_of.values())) == 2  # both sites hold rows, or the check proves nothing
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, keep_intermediates=True)
    fin.with_settings(verify_token_budget=budget)
    handle = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()})
    graph = handle.graph
    assembled = handle.group_futures  # the groups assembled on the cluster, where their rows are
    wait(handle.futures)

    def placement(dask_scheduler, keys):
        out = {}
        for k in keys:
            ts = dask_scheduler.tasks[k]
            out[str(k)] = {
                "restrictions": sorted(ts.worker_restrictions or ()),
                "loose": ts.loose_restrictions,
                "deps": [str(d.key) for d in ts.dependencies],
                "resources": ts.resource_restrictions,
            }
        return out

    keys = [f.key for f in graph.fetch_futures + graph.piece_futures + graph.verify_futures + list(assembled.values())]
    where = cluster_client.run_on_scheduler(placement, keys=keys)
    held = cluster_client.who_has(graph.fetch_futures)
    rollouts = graph.plan.rollouts
    # One staging and one routes fetch per site, pinned (loosely) to the site and run there;
    # a piece stays with its fetch.
    for kind in ("tc-fetch-staging", "tc-fetch-routes"):
        fetches = [f for f in graph.fetch_futures if f.key[0].startswith(kind)]
        assert sorted(w for f in fetches for w in where[str(f.key)]["restrictions"]) == sorted(set(site_of.values())), kind
        for f in fetches:
            assert where[str(f.key)]["loose"] and list(held[f.key]) == where[str(f.key)]["restrictions"]
    site_of_key = {str(f.key): where[str(f.key)]["restrictions"] for f in graph.fetch_futures}
    for f in graph.piece_futures:
        (dep,) = where[str(f.key)]["deps"]
        site_of_key[str(f.key)] = where[str(f.key)]["restrictions"]
        assert site_of_key[str(f.key)] == site_of_key[dep]
    # A verify task's rollouts share a site and it reads only that site's rows, in a slot.
    for t, task in enumerate(graph.verify_layout):
        sites = {site_of[rollouts[r].rollout_id] for r in task}
        assert len(sites) == 1
        info = where[str(graph.verify_futures[t].key)]
        assert info["resources"] == {"finalize": 1} and info["restrictions"] == []
        assert {w for d in info["deps"] for w in site_of_key[d]} == sites
    # Asked for on the cluster, each group is assembled (a hint) on the site holding most of
    # its rows: only the other site's rows of the group cross.
    for gid, bs in groups.items():
        (hint,) = where[str(assembled[gid].key)]["restrictions"]
        held = Counter(site_of[b.rollout_id] for b in bs)  # equal tokens per rollout here
        assert held[hint] == max(held.values())
    step = handle.result()
    assert step.metrics["assembled_on"] == "cluster"
    for gid, bs in groups.items():
        assert_group_matches(store, step.groups[gid], bs)


def test_a_finalized_group_travels_as_its_buffers():
    """A group goes over the wire as its arrays (out-of-band frames), whatever the pickle
    protocol (the scheduler's comms use 4), and comes back bit-identical."""
    import pickle

    import torch
    from distributed.protocol.serialize import merge_and_deserialize, serialize_and_split

    import pipeline.finalize.serializers  # noqa: F401  registers the serializer
    from tasks.finalize.assemble import FinalizedGroup

    n, t = 3, 1000
    g = FinalizedGroup(
        ["a", "b", "c"], torch.arange(n * t, dtype=torch.int64).reshape(n, t), torch.tensor([t, t, 0]),
        torch.tensor([2, 3, 0]), torch.rand(n, t), torch.ones(n, t), torch.tensor([1.0, 1.0, 0.0]),
        torch.tensor([0.5, -1.0, 2.0]), torch.zeros(n, t, L, K, dtype=torch.int16), torch.tensor([True, True, False]),
        ["ok", "ok", "corrupt_digest"], ["", "", "call 'c0': ..."], {"accepted": 2, "nested": {"x": [1, 2]}},
    )
    copies = [pickle.loads(pickle.dumps(g, protocol=p)) for p in (4, 5)]
    for context in ({"pickle-protocol": 4}, None):
        header, frames = serialize_and_split(g, context=context)
        assert header["serializer"] == "dask"
        assert max(len(memoryview(f).cast("B")) for f in frames) >= n * t * 8  # ids: a frame of their own
        copies.append(merge_and_deserialize(header, [bytearray(f) for f in frames]))
    for c in copies:
        assert c.rollout_ids == g.rollout_ids and c.status == g.status and c.details == g.details and c.metrics == g.metrics
        for name in ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask", "sample_mask", "rewards", "routed_experts", "has_routes"):
            a, b = getattr(g, name), getattr(c, name)
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), name
    no_routes = copy.copy(g)
    no_routes.routed_experts = None
    assert pickle.loads(pickle.dumps(no_routes)).routed_experts is None


def test_a_verify_output_travels_as_one_buffer_per_field_viewing_its_rows():
    """A verify task's rows, back to back in the fetched batch, leave as ONE view per field
    (no copy); rows that are not back to back are concatenated once. Both come back
    bit-identical, with every other field of the results and the output as they were."""
    from distributed.protocol.serialize import merge_and_deserialize, serialize_and_split

    from pipeline.finalize import serializers
    from pipeline.finalize.task_outputs import VerifyOut
    from tasks.finalize.linearize import Linearized
    from tasks.finalize.verify import RolloutResult

    ids, mask = np.arange(300, dtype=np.int64), np.ones(300, np.float32)
    routes = np.arange(300 * L * K, dtype=np.int16).reshape(300, L, K)

    def row(a, b, lps):
        return Linearized(ids[a:b], mask[a:b], lps, routes[a:b], 2, [("c0", 0, b - a)])

    rows = {0: row(0, 100, -mask[:100]), 2: row(100, 250, -mask[:150])}  # logprobs: separate arrays
    out = VerifyOut(7, {0: RolloutResult("a", "ok", "", rows[0], 2), 1: RolloutResult("b", "corrupt_digest", "x", None, 1),
                        2: RolloutResult("c", "ok", "", rows[2], 3)}, {0: 1.0, 1: 0.5, 2: 2.0}, {0: 10, 1: 0, 2: 20},
                    {"task": 7, "start_s": 1.0, "ms": 2.0, "cpu_ms": 1.0, "rollouts": 3, "out_bytes": 0})
    assert serializers.span([ids[0:100], ids[100:250]]) is not None
    assert serializers.span([ids[0:100], ids[101:250]]) is None and serializers.span([ids[0:100], mask[100:200]]) is None
    header, frames = serialize_and_split(out, context=None)
    assert header["serializer"] == "dask"
    sizes = sorted(len(memoryview(f).cast("B")) for f in frames)
    assert sizes[-4:] == sorted([250 * 8, 250 * 4, 250 * 4, 250 * L * K * 2])  # one buffer per field
    # The ids, mask and routes buffers are views of the rows' own memory.
    assert serializers.field_buffer([rows[0].input_ids, rows[2].input_ids]).base is not None
    assert np.shares_memory(serializers.field_buffer([rows[0].input_ids, rows[2].input_ids]), ids)
    back = merge_and_deserialize(header, [bytearray(f) for f in frames])
    assert (back.task, back.verify_ms, back.bytes_fetched, back.timing) == (out.task, out.verify_ms, out.bytes_fetched, out.timing)
    assert back.results[1] == out.results[1]
    for r, lin in rows.items():
        got = back.results[r]
        assert (got.rollout_id, got.status, got.n_calls) == (out.results[r].rollout_id, "ok", out.results[r].n_calls)
        assert got.linearized.spans == lin.spans and got.linearized.prompt_length == lin.prompt_length
        for name in ("input_ids", "token_mask", "logprobs", "routed_experts"):
            a, b = getattr(lin, name), getattr(got.linearized, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


def test_groups_are_gathered_straight_from_the_workers_unless_the_client_says_otherwise():
    from pipeline.finalize.collect import gather as _gather

    class FakeClient:
        def __init__(self, direct_to_workers):
            self.direct_to_workers = direct_to_workers
            self.calls = []

        def gather(self, futures, errors, direct):
            self.calls.append(direct)
            return list(futures)

    for setting, own, want in ((True, None, True), (False, None, False), (True, False, False), (False, True, True)):
        client = FakeClient(own)
        assert _gather(client, [], None, setting) == []
        assert client.calls == [want]


def test_packing_is_greedy_up_to_the_budget_in_submission_order():
    from tasks.finalize.plan import pack_verify_tasks

    class P:
        def __init__(self, n):
            self.n_tokens = n

    plans = [P(10) for _ in range(6)]
    # Greedy up to the budget, in submission order; a rollout over the budget alone.
    assert [len(t) for t in pack_verify_tasks(plans, 40)] == [4, 2]
    assert [len(t) for t in pack_verify_tasks(plans, 1000)] == [6]
    assert [len(t) for t in pack_verify_tasks(plans[:2] + [P(50)] + plans[2:], 40)] == [2, 1, 4]
