"""A multi-host cluster for tests, built on :class:`pipeline.deploy.LocalHosts`: a
``dask scheduler`` (with the pipeline's preload) and hosts of ``dask worker`` processes
started from Dask's CLI, each host on its own loopback address (127.0.0.2, ...) with its
own directory. Default 4 hosts x 2 single-threaded workers: generation on host1-2,
storage on host3-4, finalize slots everywhere.

Workers run ``--no-nanny``: a nanny is one more process per worker to start (4 x 2 hosts
registered in 3.5-3.9 s without nannies against 4.5-5.1 s with them on this 2-core
machine; a host killed and a new one up in 0.9-1.3 s against 1.5-2.3 s) and it would
restart a worker the tests mean to lose; no test here needs a restart. Share one cluster
per module.

Also the generation task the tests run on generation hosts (:func:`capture_group`): the
worker processes import this module, so the fixture puts ``tests/`` on their path.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import dask

HERE = os.path.dirname(os.path.abspath(__file__))
GENERATION = ("generation", "finalize")
STORAGE = ("storage", "finalize")
# What the scheduler and worker processes run with (they read DASK_* at start): a call to
# a dead worker gives up after 3 s, not distributed's 30 s; the store host looks for lost
# units every 0.2 s and units send no periodic reports.
CHILD_ENV = {
    "DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s",
    "DASK_TOKEN_CAPTURE__STORE__REPAIR_INTERVAL_S": "0.2",
    "DASK_TOKEN_CAPTURE__STORE__REPORT_INTERVAL_S": "0",
}


@contextlib.contextmanager
def multi_host_cluster(hosts: int = 4, workers_per_host: int = 2, storage_hosts: int = 2,
                       settings: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Iterator[tuple[Any, Any]]:
    """``(LocalHosts, Client)``: ``hosts`` hosts of ``workers_per_host`` workers, the last
    ``storage_hosts`` of them storage, the others generation; the Client (and this
    process) under ``settings`` plus a 3 s connect timeout; ``env``: more variables for
    the cluster's processes."""
    from distributed import Client

    from pipeline.deploy import LocalHosts

    own = {
        "distributed.comm.timeouts.connect": "3s",
        "token-capture.hosts.nanny": False,
        "token-capture.hosts.threads-per-worker": 1,
        "token-capture.hosts.workers-per-host": workers_per_host,
        **(settings or {}),
    }
    path = os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p)
    with dask.config.set(own), LocalHosts(env={**CHILD_ENV, **(env or {}), "PYTHONPATH": path}) as cluster:
        cluster.start(port=0, dashboard_address="127.0.0.1:0")
        cluster.add_hosts([cluster.spec(STORAGE if k >= hosts - storage_hosts else GENERATION) for k in range(hosts)])
        with Client(cluster.address) as client:
            yield cluster, client
        cluster.close(graceful=False)  # nothing to keep: SIGKILL, no graceful close to wait for


def host_address(k: int) -> str:
    """The loopback address host ``k`` (1-based: ``host1``) of a LocalHosts gets under this
    process's ``hosts.first-address`` (127.0.0.2, ... in a serial run)."""
    from pipeline.deploy.settings import HostSettings

    return HostSettings.from_config().host_address(k - 1)


def host_of(address: str) -> str:
    """``tcp://127.0.0.3:4000`` -> ``127.0.0.3``."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0]


def small_specs(prefix: str, groups: int = 2) -> list[Any]:
    """``groups`` groups of 3 small toy rollouts (2 turns of 8 tokens), ids from ``prefix``."""
    from pipeline.capture import policy_from_config
    from tasks.toy.rollouts import make_step_specs

    return make_step_specs(prefix, groups, 3, turns=2, tokens_per_turn=8, tool_tokens=3, prompt_tokens=5,
                           vocab_size=policy_from_config().vocab_size)


def stage_on_generation_hosts(hosts: Any, client: Any, groups: Sequence[Any], store_name: str) -> dict[str, list[Any]]:
    """One :func:`capture_group` task per group, spread over the generation hosts' workers,
    staging into the store published as ``store_name``: group id -> receipts."""
    workers = hosts.role_workers("generation")
    futures = {g[0].group_id: client.submit(capture_group, g, store_name, workers=[workers[i % len(workers)]], pure=False)
               for i, g in enumerate(groups)}
    return {gid: f.result(timeout=120) for gid, f in futures.items()}


def capture_group(specs: Sequence[Any], store_name: str) -> list[Any]:
    """Task body on a generation worker: generate ``specs`` with the toy policy and stage
    every call through a :class:`~pipeline.client.CaptureClient` on the store published
    as ``store_name``; the receipts."""
    from distributed import get_client

    from pipeline.capture import policy_from_config
    from pipeline.client import CaptureClient
    from tasks.toy.rollouts import generate_rollouts

    policy = policy_from_config()
    receipts = []
    with CaptureClient.connect(get_client(), store_name) as cap:
        for ro in generate_rollouts(policy, list(specs)):
            rc = cap.open(ro.spec.rollout_id, group_id=ro.spec.group_id, vocab_size=policy.vocab_size, num_experts=policy.num_experts)
            for row in ro.rows:
                rc.stage(row.model_call_id, row.parent_call_id, row.token_ids, row.token_mask, row.logprobs,
                         routed_experts=row.routed_experts, weight_version=row.weight_version)
            receipts.append(rc.finish(ro.receipt.reward))
    return receipts


# ---- an S3 checkpoint location: a moto server on 127.0.0.1 --------------------------------

S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "multi-host-test", "AWS_SECRET_ACCESS_KEY": "multi-host-test", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3(log_path: str, bucket: str) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port) holding ``bucket``; yields its endpoint URL."""
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    from support import wait_until

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
            return True
        except OSError:
            return False

    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(answers, 60, "the moto server to answer")
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10).read()
            yield endpoint
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
