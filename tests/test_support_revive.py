"""The fault tests' waits revive a named worker whose nanny failed to restart it.

A nanny restarts a killed worker once; when that restart fails it does not try again.
Here the restart is made to fail (the nanny's ``instantiate`` raises once), then
:func:`support.wait_replaced` must bring the worker back through :func:`support.revive_missing`.
"""
from __future__ import annotations

import pytest

import support
from support import addresses, named_nanny_cluster, wait_replaced, wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_worker_whose_restart_failed_is_started_again(monkeypatch):
    from distributed.core import Status

    monkeypatch.setattr(support, "REVIVE_AFTER_S", 3.0)
    with named_nanny_cluster({"w": {}}) as client:
        nanny, old = client.cluster.workers["w"], addresses(client)["w"]
        failed = []

        async def fail_once():
            failed.append(True)
            del nanny.instantiate  # the next call is the nanny's own method again
            raise RuntimeError("restart failed (test)")

        nanny.instantiate = fail_once
        client.cluster.sync(nanny.kill)
        wait_until(lambda: failed and "w" not in addresses(client), 30, "the failed restart")
        assert nanny.status == Status.running and nanny.process.status not in (Status.running, Status.starting)
        new = wait_replaced(client, "w", old, timeout_s=60)  # revived past REVIVE_AFTER_S
        assert new != old and client.submit(lambda: 41 + 1, pure=False).result(timeout=30) == 42
