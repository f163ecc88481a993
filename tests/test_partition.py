"""Network partitions (pipeline/testing/partition.py): one loopback host cut off from
everything else, both ways, and healed.

First on two bare processes (no Dask): while the child's address is cut, this process cannot
connect to it, it cannot connect out (its outgoing connections leave from 127.0.0.1), and
bytes sent either way on a connection opened before the cut do not arrive; after the heal
all three work again (the stalled bytes arrive) and no rule is left behind.

Then on the multi-host cluster (tests/multi_host.py, replicas 2): rows are staged from the
generation host, one storage host is cut off for ``CUT_S`` seconds while the controller
(this process) keeps finalizing steps and reading every acknowledged row; after the heal
every acknowledged row reads back exactly once (two copies on two units, no third), and
every step's tensors equal the fault-free oracle's. Skipped, with the reason, where the
machine cannot cut (no iptables, no root, no net_cls controller).
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from pipeline.actors import workers_now
from pipeline.testing.partition import chain_name, check_address, partition, unavailable
from tasks.errors import InvalidInput

pytestmark = pytest.mark.timeout(120)

CUT_S = 20.0  # how long the storage host stays cut off (s)


def _bare_address() -> str:
    """The bare process's address: .250 of this test process's block of host addresses
    (127.0.0.250 in a serial run; conftest.py gives each xdist process its own block), so
    no other test process's host is ever cut."""
    from pipeline.deploy.settings import HostSettings

    return HostSettings.from_config().first_address.rsplit(".", 1)[0] + ".250"


BARE = _bare_address()


def skip_unless_partitions() -> None:
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network partition on this machine: {why}")


def test_only_a_hosts_own_loopback_address_can_be_cut():
    assert check_address("127.0.0.4") == "127.0.0.4"
    for bad in ("127.0.0.1", "10.0.0.4", "::1", "localhost", "127.0.0.256"):
        with pytest.raises(InvalidInput, match="partition address"):
            check_address(bad)


CHILD = r"""
import socket, sys
srv = socket.create_server((sys.argv[1], 0))
old = socket.create_connection(("127.0.0.1", int(sys.argv[2])))  # opened before the cut
print(srv.getsockname()[1], flush=True)
for line in sys.stdin:
    cmd = line.split()
    try:
        if cmd[0] == "connect":
            socket.create_connection(("127.0.0.1", int(cmd[1])), timeout=float(cmd[2])).close()
            out = "ok"
        elif cmd[0] == "send":
            old.sendall(b"c")
            out = "sent"
        elif cmd[0] == "recv":
            old.settimeout(float(cmd[1]))
            out = "got " + old.recv(16).decode()
        elif cmd[0] == "accept":
            srv.settimeout(float(cmd[1]))
            srv.accept()[0].close()
            out = "ok"
    except socket.timeout:
        out = "timeout"
    except OSError as e:
        out = f"error {e.errno}"
    print(out, flush=True)
"""


class Bare:
    """A process listening on ``BARE`` with one connection to this process opened at start."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        port = self.listener.getsockname()[1]
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, BARE, str(port)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.old, _ = self.listener.accept()

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def connect_in(self, timeout_s: float) -> str:
        """This process connects to the bare process's listener."""
        try:
            socket.create_connection((BARE, self.port), timeout=timeout_s).close()
            return "ok"
        except socket.timeout:
            return "timeout"
        except OSError as e:
            return f"error {e.errno}"

    def connect_out(self, timeout_s: float) -> str:
        """The bare process connects to this process's listener (and it is accepted)."""
        return self.ask(f"connect {self.listener.getsockname()[1]} {timeout_s}")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.old.close()
        self.listener.close()


def rules() -> str:
    return subprocess.run(["iptables", "-w", "10", "-S"], capture_output=True, text=True).stdout


def test_a_cut_address_is_unreachable_both_ways_until_healed():
    skip_unless_partitions()
    bare = Bare()
    try:
        assert bare.connect_in(2) == "ok" and bare.connect_out(2) == "ok"
        with partition(BARE, [bare.proc.pid]) as cut:
            assert chain_name(BARE) in rules() and cut.pids == [bare.proc.pid]
            assert bare.connect_in(1) != "ok"  # in: to its address
            assert bare.connect_out(1) != "ok"  # out: from 127.0.0.1, its own socket
            bare.old.sendall(b"t")  # on a connection opened before the cut, both ways
            assert bare.ask("recv 1") == "timeout"
            assert bare.ask("send") == "sent"
            bare.old.settimeout(1)
            with pytest.raises(socket.timeout):
                bare.old.recv(16)
        assert cut.healed and chain_name(BARE) not in rules()
        # Healed: the stalled bytes arrive (retransmitted), new connections work both ways.
        assert bare.ask("recv 30") == "got t"
        bare.old.settimeout(30)
        assert bare.old.recv(16) == b"c"
        assert bare.connect_in(5) == "ok" and bare.connect_out(5) == "ok"
    finally:
        bare.close()


def test_a_partition_heals_when_its_block_raises():
    skip_unless_partitions()
    bare = Bare()
    try:
        with pytest.raises(RuntimeError, match="inside the cut"):
            with partition(BARE, [bare.proc.pid]):
                assert bare.connect_in(1) != "ok"
                raise RuntimeError("inside the cut")
        assert chain_name(BARE) not in rules()
        assert bare.connect_in(5) == "ok" and bare.connect_out(5) == "ok"
    finally:
        bare.close()


# ---- a storage host of the multi-host cluster cut off ---------------------------------

NAME = "partition-store"
# How soon a cut-off peer counts as gone: a connection whose data goes unacknowledged for
# 11 s is dead (Dask's default 30 s; 11 is the least it takes), a worker the scheduler has
# not heard from for 5 s is removed (default 5 minutes): its tasks run elsewhere and the
# store repairs its units.
CUT_TIMEOUTS = {"distributed.comm.timeouts.tcp": "11s", "distributed.scheduler.worker-ttl": "5s"}
SETTINGS = {"token-capture.store.replicas": 2, "token-capture.finalize.clear-staged": False, **CUT_TIMEOUTS}
CUT_ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "11s", "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "5s"}


def stage(hosts, client, groups) -> dict:
    from multi_host import stage_on_generation_hosts

    return stage_on_generation_hosts(hosts, client, groups, NAME)


def copies(store) -> dict[str, int]:
    """Key -> how many units hold it (the units' own listings, not the deduplicated one)."""
    held: dict[str, int] = {}
    for unit in store.units:
        for key in unit.keys("staging").result():
            held[key] = held.get(key, 0) + 1
    return held


@pytest.mark.parametrize("cut_s", [CUT_S])
def test_a_storage_host_cut_off_loses_nothing_and_finalization_goes_on(cut_s):
    skip_unless_partitions()
    from multi_host import multi_host_cluster, small_specs
    from support import assert_rows_read_back, wait_until

    from pipeline.capture import policy_from_config
    from pipeline.client.discovery import lookup_store
    from pipeline.finalize import Finalizer
    from pipeline.store.hosted import close_hosted, hosted_stores, start_hosted
    from pipeline.testing.oracle import reference_mismatches
    from pipeline.testing.partition import partition_host
    from tasks.toy.rollouts import generate_rollouts

    with multi_host_cluster(hosts=3, storage_hosts=2, settings=SETTINGS, env=CUT_ENV) as (hosts, client):
        t0 = time.monotonic()
        store = start_hosted(client, NAME, n_units=4, workers=hosts.role_workers("storage"))
        try:
            steps = {f"p{i}": small_specs(f"pt{i}-") for i in range(3)}
            staged = stage(hosts, client, [g for groups in steps.values() for g in groups])  # all at once
            receipts = {sid: {g[0].group_id: staged[g[0].group_id] for g in groups} for sid, groups in steps.items()}
            reference = {sid: generate_rollouts(policy_from_config(), [s for g in groups for s in g]) for sid, groups in steps.items()}
            assert not [r for rs in receipts.values() for g in rs.values() for r in g if r.poisoned]  # all acknowledged
            rows = [row for ros in reference.values() for ro in ros for row in ro.rows]
            fin = Finalizer(client, store)
            victim = next(n for n, h in hosts.hosts.items() if "storage" in h.spec.roles)

            finalized_while_cut = []
            t_cut = time.monotonic() - t0
            with partition_host(hosts, victim) as cut:
                assert cut.pids and cut.connections > 0
                while not finalized_while_cut or cut.duration_s() < cut_s:
                    sid = list(steps)[len(finalized_while_cut) % len(steps)]
                    step = fin.submit_step(receipts[sid], step_id=f"{sid}-cut-{len(finalized_while_cut)}").result(timeout=120)
                    assert step.metrics["accepted"] == 6 and reference_mismatches(step.groups, reference[sid]) == {}, step.rejected
                    finalized_while_cut.append((sid, round(cut.duration_s(), 1)))
                    if len(finalized_while_cut) == 1:  # every acknowledged row readable while cut
                        assert_rows_read_back(lookup_store(client, NAME), rows)
            t_healed = time.monotonic() - t0
            print(f"cut {victim} for {cut.duration_s():.1f} s; finalized while cut (step, s into the cut): {finalized_while_cut}")

            def settled():
                live = set(workers_now(client))
                info = next(i for i in hosted_stores(client) if i["name"] == NAME)
                return set(info["workers"]) <= live and info["interrupted"] is None

            wait_until(settled, 60, "every unit of the store on a live worker")
            healed = lookup_store(client, NAME)
            assert_rows_read_back(healed, rows)
            held = copies(healed)
            keys = [row.staging_key for row in rows]
            assert {k: held.get(k, 0) for k in keys if held.get(k, 0) != 2} == {}  # two copies each, no third
            assert sorted(held) == sorted(keys)  # nothing else
            stats = healed.stats()
            assert sum(s["rows"] for s in stats) == 2 * len(keys) and sum(s.get("lost_keys", 0) for s in stats) == 0
            # After the heal: every step's groups again, in one step: the same tensors.
            step = Finalizer(client, healed).submit_step(staged, step_id="healed").result(timeout=120)
            assert step.metrics["accepted"] == 18 and reference_mismatches(step.groups, [ro for ros in reference.values() for ro in ros]) == {}
            print(f"partition test: cut at {t_cut:.1f} s, healed at {t_healed:.1f} s, checked at {time.monotonic() - t0:.1f} s")
        finally:
            close_hosted(client, NAME)
