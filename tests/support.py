"""Small helpers shared by the cluster tests."""
from __future__ import annotations

import time
import urllib.request
from typing import Any, Callable

from pipeline.actors import workers_now


def wait_until(cond: Callable[[], Any], timeout_s: float = 30.0, what: str = "") -> Any:
    """Poll ``cond`` until it returns something truthy (returned), or fail after ``timeout_s``.

    Waits on a condition, never asserts on elapsed time.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what or cond}")


def dashboard_base(client: Any) -> str:
    """``http://127.0.0.1:<port>`` of the client's scheduler dashboard."""
    return f"http://127.0.0.1:{client.scheduler_info()['services']['dashboard']}"


def http_get(url: str, timeout_s: float = 30.0) -> tuple[int, str]:
    """(status, body) of a GET."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.status, r.read().decode()


# ---- named-worker clusters for fault tests --------------------------------------------


def named_nanny_cluster(workers: dict[str, dict[str, Any]], connect_timeout: str = "3s"):
    """A SpecCluster of named nannies on 127.0.0.1 (``{name: worker options}``) and its
    Client, as a context manager yielding the client.

    A killed worker's nanny restarts it under the same name (not the same port). Calls to
    a dead worker are retried until ``timeouts.connect`` (30 s by default); loopback
    connects to live workers take milliseconds, so ``connect_timeout`` keeps tests short.
    """
    import contextlib

    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    @contextlib.contextmanager
    def _cluster():
        with dask.config.set({"distributed.comm.timeouts.connect": connect_timeout}):
            spec = {name: {"cls": Nanny, "options": {"nthreads": 1, "host": "127.0.0.1", **opts}} for name, opts in workers.items()}
            scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1"}}
            with SpecCluster(workers=spec, scheduler=scheduler) as cluster, Client(cluster) as client:
                client.wait_for_workers(len(workers))
                yield client

    return _cluster()


def addresses(client: Any) -> dict[str, str]:
    """Worker name -> current address (a restarted worker keeps its name, not its port)."""
    return {w["name"]: a for a, w in workers_now(client).items()}


REVIVE_AFTER_S = 20.0  # a named worker still missing after this long: its nanny is asked to start it


def revive_missing(client: Any, names) -> list[str]:
    """Ask the in-process nanny of each worker in ``names`` whose process is not running
    or starting to start it again (:meth:`distributed.Nanny.instantiate`); the names asked.

    A nanny restarts a killed worker once; if that restart fails (seen under a loaded
    two-process test run: the worker did not come back within a minute) it does not try
    again, and the tests after the kill would wait for a worker that never returns.
    """
    from distributed.core import Status

    cluster, asked = getattr(client, "cluster", None), []
    for name in names:
        nanny = None if cluster is None else cluster.workers.get(name)
        process = getattr(nanny, "process", None)
        if nanny is None or nanny.status != Status.running:
            continue  # not a nanny of this process's cluster, or one that closed itself
        if process is None or process.status not in (Status.running, Status.starting):
            print(f"support: worker {name!r} not running after {REVIVE_AFTER_S:.0f} s; its nanny starts it again")
            cluster.sync(nanny.instantiate)
            asked.append(name)
    return asked


def _wait_reviving(client: Any, cond: Callable[[], Any], names, timeout_s: float, what: str) -> Any:
    """:func:`wait_until` ``cond``; past :data:`REVIVE_AFTER_S`, :func:`revive_missing` once."""
    first = min(REVIVE_AFTER_S, timeout_s)
    try:
        return wait_until(cond, first, what)
    except AssertionError:
        if first >= timeout_s:
            raise
    revive_missing(client, names)
    return wait_until(cond, timeout_s - first, what)


def wait_for_names(client: Any, names, timeout_s: float = 60.0) -> dict[str, str]:
    """Wait until every worker in ``names`` is registered; returns :func:`addresses`."""
    def registered():
        got = addresses(client)
        return got if set(names) <= set(got) else None

    return _wait_reviving(client, registered, [n for n in names], timeout_s, f"workers {set(names)}")


def wait_replaced(client: Any, name: str, old: str, timeout_s: float = 60.0) -> str:
    """Wait until worker ``name`` is registered at an address other than ``old`` (its
    nanny restarted it); returns the new address."""
    def replaced():
        new = addresses(client).get(name)
        return new not in (None, old) and new

    return _wait_reviving(client, replaced, [name], timeout_s, f"worker {name} replaced")


def store_maker(client: Any, spill_directory: Any):
    """Context manager yielding ``make(**start_kwargs) -> StagingStore`` on ``client``,
    spilling under ``spill_directory`` by default; every store made is closed on exit."""
    import contextlib

    from pipeline.store.client import StagingStore

    @contextlib.contextmanager
    def _maker():
        made = []

        def make(**kw):
            kw.setdefault("spill_directory", str(spill_directory))
            store = StagingStore.start(client, **kw)
            made.append(store)
            return store

        try:
            yield make
        finally:
            for store in made:
                store.close()

    return _maker()


def resume_and_compare(client: Any, store: Any, gen: Any, specs, verdicts, acks, *, policy, worker: str, max_new_tokens: int, rounds: int) -> None:
    """Resume every call of ``specs`` from its restored prefix (``verdicts``) on a fresh
    GenerationWorker, finish both workers, and assert the resumed outputs equal the
    uninterrupted ``gen``'s bit for bit (ids, mask, logprobs, routes)."""
    import numpy as np

    from pipeline.generation.worker import GenerationWorker

    assert all(v.usable for v in verdicts), [(v.reason, v.detail) for v in verdicts]
    fresh = client.submit(GenerationWorker, store, policy=policy, actor=True, workers=[worker]).result()
    for spec, v in zip(specs, verdicts):
        fresh.resume_call(
            spec["rollout_id"], spec["model_call_id"], history=np.zeros(0, np.int64), max_new_tokens=max_new_tokens, **v.prefix.resume_kwargs()
        ).result()
    for _ in range(rounds):
        gen.step(4).result()
        fresh.step(4).result()
    original = {(o["rollout_id"], o["model_call_id"]): o for o in gen.take_completed().result()}
    resumed = {(o["rollout_id"], o["model_call_id"]): o for o in fresh.take_completed().result()}
    assert set(original) == set(resumed) == set(acks)
    for k in original:
        for field in ("token_ids", "token_mask", "logprobs", "routed_experts"):
            np.testing.assert_array_equal(original[k][field], resumed[k][field])


def assert_rows_read_back(store: Any, rows: list) -> None:
    """Every staged row of ``rows`` reads back from ``store`` bit for bit (values and offsets)."""
    import numpy as np

    from tasks.packed import pack_rows
    from tasks.schema import STAGING_FIELDS

    got = store.get_many([r.staging_key for r in rows], list(STAGING_FIELDS))
    assert not got.failed, list(got.failed.items())[:3]
    want = pack_rows(rows)
    for f in STAGING_FIELDS:
        assert np.array_equal(got.batch.fields[f].values, want.fields[f].values), f
        assert np.array_equal(got.batch.fields[f].offsets, want.fields[f].offsets), f


def preloaded_nanny_cluster(names: str, settings: dict[str, Any]):
    """A SpecCluster of nannies ``names`` (each with 2 ``finalize`` slots) on 127.0.0.1,
    its scheduler preloading the token-capture plugins (store host included), and its
    Client, under ``settings``; a context manager yielding the client."""
    import contextlib

    import dask
    from distributed import Client, Nanny, Scheduler, SpecCluster

    from pipeline.dashboard.preload import PRELOAD

    @contextlib.contextmanager
    def _cluster():
        with dask.config.set(settings):
            opts = {"nthreads": 1, "host": "127.0.0.1", "resources": {"finalize": 2}}
            spec = {n: {"cls": Nanny, "options": opts} for n in names}
            scheduler = {"cls": Scheduler, "options": {"dashboard_address": "127.0.0.1:0", "host": "127.0.0.1", "preload": [PRELOAD]}}
            with SpecCluster(workers=spec, scheduler=scheduler) as cl, Client(cl) as client:
                client.wait_for_workers(len(names))
                yield client

    return _cluster()
