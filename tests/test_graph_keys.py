"""Dask's own view of finalize steps, and the store reads a step makes.

Task keys: each step's tasks form their own Dask task groups (so each step's span holds
exactly its own tasks, however many steps are in flight) while the task prefixes (the
task stream's names) are the task kinds. Store reads: counted by the storage units'
own counters (``store.stats()``), not by the number of fetch tasks.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import dask
import numpy as np
import pytest
from distributed import wait
from distributed.utils import key_split, key_split_group
from rollout_factory import Built, make_group

from pipeline.finalize import Finalizer, StepHandle
from tasks.keys import unit_for_key, unit_for_rollout
from tasks.packed import pack_rows

pytestmark = pytest.mark.timeout(180)

VOCAB, L, K, E = 64, 2, 2, 8
SPAN = ("token-capture", "finalize")
KINDS = {"tc-fetch-staging", "tc-fetch-routes", "tc-piece-staging", "tc-piece-routes", "tc-verify", "tc-assembler", "tc-clear"}


def stage(store: Any, builts: list[Built]) -> list[Built]:
    """Put every row of ``builts`` in ``store`` (all must be accepted)."""
    res = store.put_many(pack_rows([r for b in builts for r in b.rows]))
    assert not res.failed, res.failed
    return builts


def mixed_groups(store: Any, rng: np.random.Generator, prefix: str, n: int = 4) -> dict[str, list[Built]]:
    """Two staged groups of one step: ``routed`` (every call has routed experts) and
    ``plain`` (``routes_encoding`` 0), with off-chain branch calls."""
    return {
        "routed": stage(store, make_group(rng, "routed", n, rollout_prefix=f"{prefix}-a", n_calls=3, routes=(L, K, E), n_branches=1)),
        "plain": stage(store, make_group(rng, "plain", n, rollout_prefix=f"{prefix}-b", n_calls=3, n_branches=1)),
    }


def chain_keys(builts: list[Built]) -> list[str]:
    """Staging keys of the rollouts' chain calls (what a step reads), in order."""
    return [f"{b.rollout_id}/{c}" for b in builts for c in b.chain_ids]


def graph_keys(handle: StepHandle) -> list[Any]:
    """Every task key of a step submitted with ``keep_intermediates`` (before collection)."""
    g = handle.graph
    return [f.key for f in g.fetch_futures + g.piece_futures + g.futures]  # futures: verify (+ assemble)


def span_groups(dask_scheduler: Any) -> dict[tuple[str, ...], list[dict[str, tuple[str, int]]]]:
    """Per span name, per span: {task group name: (task prefix name, tasks ever in it)}."""
    ext = dask_scheduler.extensions["spans"]
    return {
        name: [{tg.name: (tg.prefix.name, sum(tg.states.values())) for tg in sp.groups} for sp in spans]
        for name, spans in ext.spans_search_by_name.items()
    }


def test_each_step_span_holds_exactly_its_own_tasks(cluster_client, store_factory):
    store = store_factory(n_units=2)
    rng = np.random.default_rng(21)
    steps = [mixed_groups(store, rng, f"sp{s}", n=3) for s in range(3)]
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E, keep_intermediates=True)
    fin.with_settings(verify_token_budget=1)  # one rollout per verify task: pieces
    handles = [
        fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}, step_id=f"spans-{s}")
        for s, groups in enumerate(steps)
    ]
    assert len(fin.in_flight) == 3
    handles[1].group_futures  # this step's groups assembled on the cluster (the others: here)
    keys = {h.step_id: graph_keys(h) for h in handles}
    for result in fin.drain():
        assert result.metrics["accepted"] == 6
    for h in handles:  # each step's staged rows are its own: every step clears them
        assert h.clear_future is not None
        wait(h.clear_future)
        keys[h.step_id].append(h.clear_future.key)

    # The task stream's names are the task kinds (dask's key_split is distributed's).
    assert dask.utils.key_split is key_split
    assert {key_split(k) for ks in keys.values() for k in ks} == KINDS

    spans = cluster_client.run_on_scheduler(span_groups)
    seen: dict[str, str] = {}
    for h in handles:
        kinds = KINDS if h is handles[1] else KINDS - {"tc-assembler"}
        want = Counter(key_split_group(k) for k in keys[h.step_id])
        assert len(want) == len(kinds)  # one task group per kind, per step
        (got,) = spans[SPAN + (h.step_id,)]  # one span per step, clear included
        assert {g: n for g, (_, n) in got.items()} == dict(want)
        assert {p for p, _ in got.values()} == kinds
        for g in got:
            assert seen.setdefault(g, h.step_id) == h.step_id  # no group shared by two steps
    # No other span (the default one included) holds a task of these steps.
    others = {g for name, sps in spans.items() if name[:2] != SPAN for sp in sps for g in sp}
    assert not others & set(seen)


def unit_counters(store: Any) -> list[dict[str, int]]:
    """Per storage unit, its own get counters: calls, keys asked for, rows found."""
    return [{c: s[c] for c in ("gets", "get_keys", "get_rows")} for s in store.stats()]


def reads_of_step(store: Any, fin: Finalizer, groups: dict[str, list[Built]]) -> list[dict[str, int]]:
    """Per storage unit: how much its own get counters moved while one step finalized."""
    before = unit_counters(store)
    step = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}).result()
    assert step.metrics["accepted"] == sum(len(bs) for bs in groups.values()), step.metrics
    after = unit_counters(store)
    return [{c: a[c] - b[c] for c in a} for a, b in zip(after, before)]


def per_unit(keys: list[str], n_units: int) -> Counter:
    """Unit index -> how many of ``keys`` it holds."""
    return Counter(unit_for_key(k, n_units) for k in keys)


def test_finalized_step_reads_each_unit_once_plus_one_routes_read(cluster_client, store_factory):
    n_units = 3
    store = store_factory(n_units=n_units)
    groups = mixed_groups(store, np.random.default_rng(22), "one", n=6)
    staging, routed = chain_keys(groups["routed"] + groups["plain"]), chain_keys(groups["routed"])
    # The check means something: every unit holds rows of several rollouts, routed ones included.
    rollouts_on = Counter(unit_for_rollout(b.rollout_id, n_units) for b in groups["routed"] + groups["plain"])
    assert len(rollouts_on) == n_units and min(rollouts_on.values()) > 1
    assert len(per_unit(routed, n_units)) > 1
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    fin.with_settings(verify_token_budget=1)  # many verify tasks, still one read
    moved = reads_of_step(store, fin, groups)
    on_unit, routed_on = per_unit(staging, n_units), per_unit(routed, n_units)
    for u, m in enumerate(moved):
        # One union get per unit holding the step's rows, plus one routes get per unit
        # holding routed rows; never one per rollout or per verify task.
        assert m["gets"] == (u in on_unit) + (u in routed_on), (u, m)
        assert m["get_keys"] == on_unit[u] + routed_on[u], (u, m)


def test_routes_read_asks_only_for_routed_keys(cluster_client, store_factory):
    n_units = 3
    store = store_factory(n_units=n_units)
    groups = mixed_groups(store, np.random.default_rng(23), "reads", n=4)
    staging, routed = chain_keys(groups["routed"] + groups["plain"]), chain_keys(groups["routed"])
    assert all(r.routes_encoding == 0 for b in groups["plain"] for r in b.rows)
    assert all(r.routes_encoding != 0 for b in groups["routed"] for r in b.rows)
    fin = Finalizer(cluster_client, store, vocab_size=VOCAB, num_experts=E)
    moved = reads_of_step(store, fin, groups)
    # Every key asked for: the union read of the chain rows, and the routes read of the
    # routed chain rows only (not the plain rollouts', not the off-chain branches').
    assert sum(m["get_keys"] for m in moved) == len(staging) + len(routed)
    assert sum(m["get_rows"] for m in moved) == len(staging) + len(routed)
    assert sum(m["gets"] for m in moved) == len(per_unit(staging, n_units)) + len(per_unit(routed, n_units))


def test_an_all_letter_token_stays_out_of_the_task_prefix(monkeypatch):
    """key_split keeps an all-letter word: a step token is never one."""
    import uuid

    from pipeline.finalize import graph

    class Letters:
        hex = "abcdefabcdefabcdefabcdefabcdefab"

    monkeypatch.setattr(uuid, "uuid4", lambda: Letters())
    token = graph.new_token()
    assert len(token) == 16 and not token.isalpha()
    for kind in (graph.FETCH_STAGING, graph.VERIFY, graph.ASSEMBLE, graph.CLEAR):
        assert key_split(graph.task_key(kind, token, 3)) == kind
        assert key_split_group(graph.task_key(kind, token, 3)) == f"{kind}-{token}"
