"""The chaos soak's cluster and its faults: hosts of ``dask worker`` processes
(:class:`~pipeline.deploy.LocalHosts`, one worker per host, so a worker lost is a host
lost), a store hosted by the scheduler (replicas 2), the controller process
(:mod:`.chaos_controller`) and the faults of :mod:`.chaos_schedule` done to them.

A killed worker's host is SIGKILLed and a replacement host of the same roles joins (the
store host gives a new storage worker a unit, the repairer re-replicates the lost one);
before the next storage kill the driver waits until no unit sits on a gone worker, so two
kills never take both copies of a key. A killed controller is SIGKILLed and the next
incarnation attaches by name. A stalled host's processes are stopped (SIGSTOP: alive,
registered, silent; their connections stay open) and continued after the stall; a cut
storage host (:mod:`pipeline.testing.partition`) is healed after its duration. Either is
then watched for the worker TTL: if its workers closed (removed by the scheduler, or
their scheduler connection broke) it is replaced like a killed host. Each fault is one
timeline entry: what, where, when (s from the run's start), and what followed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Callable

from .chaos_controller import ControllerConfig
from .chaos_schedule import KILL_CONTROLLER, KILL_FINALIZE, KILL_STORAGE, PARTITION, STALL, Fault

if TYPE_CHECKING:
    from distributed import Client

    from ..deploy import LocalHosts

GENERATION = ("generation", "finalize")
STORAGE = ("storage", "finalize")
FINALIZE = ("finalize",)
STORE_NAME = "chaos-store"
REPAIR_WAIT_S = 90.0  # the longest the driver waits for a lost unit's repair (s)
WORKER_TTL_S = 10.0  # the scheduler removes a worker not heard from this long (s)
# What every process of the cluster runs with: dead or cut-off peers noticed in seconds
# (a connection whose data goes unacknowledged for 11 s is dead, the least Dask takes; a
# worker not heard from for 10 s is removed, so a cut-off host's tasks run elsewhere), the
# store host looking for lost units often, no periodic unit reports.
TIMEOUTS = {"distributed.comm.timeouts.connect": "3s", "distributed.comm.timeouts.tcp": "11s"}  # this process's too
CHILD_CONFIG = {
    **TIMEOUTS,
    "distributed.scheduler.worker-ttl": f"{WORKER_TTL_S:g}s",
    "token-capture.store.repair-interval-s": "0.5",
    "token-capture.store.report-interval-s": "0",
}


def env_name(key: str) -> str:
    """The environment variable Dask reads config ``key`` from (``a.b-c`` -> ``DASK_A__B_C``)."""
    return "DASK_" + "__".join(part.upper().replace("-", "_") for part in key.split("."))


CHILD_ENV = {env_name(k): v for k, v in CHILD_CONFIG.items()}


class ChaosCluster:
    """One run's cluster (a context manager): hosts, hosted store, controller process."""

    def __init__(self, state_dir: str, cfg: ControllerConfig, *, storage_hosts: int = 3,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.state_dir, self.cfg, self.say = state_dir, cfg, say
        self.storage_hosts = storage_hosts
        self.hosts: LocalHosts | None = None
        self.controller: subprocess.Popen | None = None
        self.incarnation = 0
        self.t0 = time.monotonic()
        self.timeline: list[dict] = []

    def __enter__(self) -> ChaosCluster:
        import dask

        from ..deploy import LocalHosts
        from ..store.hosted import start_hosted

        settings = {"token-capture.hosts.nanny": False, "token-capture.hosts.workers-per-host": 1,
                    "token-capture.hosts.threads-per-worker": 1, **TIMEOUTS, "token-capture.store.replicas": 2}
        self._config = dask.config.set(settings)
        self._config.__enter__()
        self.hosts = LocalHosts(os.path.join(self.state_dir, "hosts"), env=CHILD_ENV)
        try:
            self.hosts.start(port=0, dashboard_address="127.0.0.1:0")
            specs = [self.hosts.spec(GENERATION, workers=2), self.hosts.spec(FINALIZE)]
            specs += [self.hosts.spec(STORAGE) for _ in range(self.storage_hosts)]
            self.hosts.add_hosts(specs)
            client = self.hosts.client()
            start_hosted(client, STORE_NAME, n_units=self.storage_hosts, workers=self.hosts.role_workers("storage"))
            client.run(warm)  # imports and the policy, once per worker, before anything is timed
            dataclasses.replace(self.cfg, scheduler=str(self.hosts.address), store=STORE_NAME).save(self.state_dir)
            self.start_controller()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self.controller is not None and self.controller.poll() is None:
                self.controller.kill()
                self.controller.wait()
            if self.hosts is not None:
                self.hosts.close(graceful=False)
        finally:
            self._config.__exit__(None, None, None)

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    # ---- the controller ---------------------------------------------------------------

    def start_controller(self) -> None:
        self.incarnation += 1
        log = open(os.path.join(self.state_dir, f"controller-{self.incarnation}.log"), "ab")
        env = {**os.environ, **CHILD_ENV}
        self.controller = subprocess.Popen([sys.executable, "-m", "pipeline.bench.chaos_controller", self.state_dir,
                                            str(self.incarnation)], stdout=log, stderr=subprocess.STDOUT,
                                           stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()

    def stop_controller(self, timeout_s: float) -> bool:
        """Ask the controller to finish (no new step, the ones in flight collected); True
        if it exited 0 within ``timeout_s``."""
        open(os.path.join(self.state_dir, "stop"), "w").close()
        assert self.controller is not None
        try:
            return self.controller.wait(timeout=timeout_s) == 0
        except subprocess.TimeoutExpired:
            return False

    def controller_log_tail(self, lines: int = 15) -> list[str]:
        path = os.path.join(self.state_dir, f"controller-{self.incarnation}.log")
        try:
            with open(path, errors="replace") as f:
                return f.read().splitlines()[-lines:]
        except OSError:
            return []

    # ---- faults -------------------------------------------------------------------------

    def do(self, fault: Fault, rng: random.Random) -> dict:
        """Do ``fault``; its timeline entry."""
        entry = {"at_s": self.now(), "planned_s": fault.at_s, "kind": fault.kind}
        if fault.kind == KILL_CONTROLLER:
            assert self.controller is not None
            self.controller.send_signal(signal.SIGKILL)
            self.controller.wait()
            self.start_controller()
            entry["incarnation"] = self.incarnation
        elif fault.kind in (KILL_STORAGE, KILL_FINALIZE):
            role = STORAGE if fault.kind == KILL_STORAGE else FINALIZE
            # Any host may hold a unit (a repair puts one where none of its partners is).
            entry.update(self._repaired_first())
            name = rng.choice(self.live(role))
            entry.update(self.replace(name, role))
        elif fault.kind == STALL:
            entry.update(self._repaired_first())  # never both copies' units at once
            role = rng.choice((STORAGE, FINALIZE))
            entry.update(self.stall(rng.choice(self.live(role)), role, fault.duration_s))
        elif fault.kind == PARTITION:
            from tasks.errors import PartitionUnavailable

            try:  # the cut probes the machine once, before it changes anything
                entry.update(self.cut(rng.choice(self.live(STORAGE)), fault.duration_s))
            except PartitionUnavailable as why:  # said in the timeline and on stderr: the soak runs without its cut
                entry["skipped"] = f"no network partition on this machine: {why}"
                self.say(entry["skipped"])
        self.timeline.append(entry)
        self.say(f"fault at {entry['at_s']:.1f} s: {fault.kind} {entry.get('host', '')}".rstrip())
        return entry

    def _repaired_first(self) -> dict:
        """Before a fault that may take a unit: :meth:`wait_repaired`, as timeline fields."""
        waited, unsettled = self.wait_repaired()
        return {"waited_for_repair_s": waited, **({"repair_unsettled": unsettled} if unsettled else {})}

    def live(self, roles: tuple[str, ...]) -> list[str]:
        assert self.hosts is not None
        return sorted(n for n, h in self.hosts.hosts.items() if not h.killed and h.spec.roles == roles)

    def replace(self, name: str, roles: tuple[str, ...]) -> dict:
        """SIGKILL host ``name``; a new host of ``roles`` joins."""
        assert self.hosts is not None
        address = self.hosts.hosts[name].address
        self.hosts.kill_host(name)
        new = self.hosts.add_host(roles)
        return {"host": name, "address": address, "replacement": new.name, "joined_s": self.now()}

    def stall(self, name: str, roles: tuple[str, ...], duration_s: float) -> dict:
        """Stop host ``name``'s processes for ``duration_s``, continue them; replace the
        host if its workers are no longer registered (removed by the worker TTL)."""
        assert self.hosts is not None
        host = self.hosts.hosts[name]
        pids = [pid for pid in host.pids() if _alive(pid)]
        try:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(duration_s)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        entry: dict = {"host": name, "address": host.address, "stalled_s": duration_s, "resumed_s": self.now()}
        return {**entry, **self._replace_if_gone(name, roles)}

    def _replace_if_gone(self, name: str, roles: tuple[str, ...]) -> dict:
        """After a stall or a cut: watch host ``name`` for the worker TTL and a margin (the
        scheduler may remove its workers a few seconds after they are back, and a removed
        worker then closes itself); replace it as soon as none of its workers is
        registered or its processes are gone, else keep it."""
        assert self.hosts is not None
        host = self.hosts.hosts[name]
        names = set(host.spec.worker_names)
        end = time.monotonic() + WORKER_TTL_S + 2.0
        while True:
            time.sleep(0.5)
            registered = names & set(self.hosts.registered(self.hosts.client()))
            alive = [pid for pid in host.pids() if _alive(pid)]
            if not registered or not alive or time.monotonic() >= end:
                break
        entry: dict = {"workers_after": len(registered), "watched_s": self.now()}
        if not registered or not alive:
            self.hosts.kill_host(name)
            new = self.hosts.add_host(roles)
            entry.update({"replacement": new.name, "joined_s": self.now()})
        return entry

    def cut(self, name: str, duration_s: float) -> dict:
        """Cut storage host ``name`` off for ``duration_s``; heal; replace it if its workers
        closed meanwhile."""
        from ..testing.partition import partition_host

        assert self.hosts is not None
        host = self.hosts.hosts[name]
        with partition_host(self.hosts, name) as p:
            time.sleep(max(0.0, duration_s - p.duration_s()))
        entry: dict = {"host": name, "address": host.address, "cut_s": round(p.duration_s(), 2),
                       "connections_cut": p.connections, "healed_s": self.now()}
        return {**entry, **self._replace_if_gone(name, STORAGE)}

    def wait_repaired(self) -> tuple[float, str | None]:
        """Until the store is repaired and complete (:meth:`unsettled` says nothing), at
        most :data:`REPAIR_WAIT_S`: the seconds waited and what was still unsettled then."""
        assert self.hosts is not None
        client = self.hosts.client()
        t = time.monotonic()
        while True:
            why = self.unsettled(client)
            if why is None or time.monotonic() - t >= REPAIR_WAIT_S:
                return round(time.monotonic() - t, 2), why
            time.sleep(0.5)

    def unsettled(self, client: Client) -> str | None:
        """Why the store is not repaired and complete yet: a unit on a worker the
        scheduler no longer has, a storage worker without a unit, a move interrupted or a
        change waiting; None when there is nothing."""
        from ..store.hosted import hosted_stores

        assert self.hosts is not None
        registered = self.hosts.registered(client)  # one round trip: worker name -> address
        info = next((i for i in hosted_stores(client) if i["name"] == STORE_NAME), None)
        if info is None:
            return "the store host lists no store"
        gone = sorted(set(info["workers"]) - set(registered.values()))
        names = {w for n in self.live(STORAGE) for w in self.hosts.hosts[n].spec.worker_names}
        without = sorted({a for w, a in registered.items() if w in names} - set(info["workers"]))
        for what, value in (("units on workers gone", gone), ("storage workers without a unit", without),
                            ("a move interrupted", info.get("interrupted")), ("changes waiting", info.get("waiting"))):
            if value:
                return f"{what}: {value}"
        return None

    def store_figures(self) -> dict:
        """The store's own counters at the end: rows and keys held, lost keys and reads."""
        from ..client.discovery import lookup_store
        from ..store.hosted import hosted_stores

        assert self.hosts is not None
        client = self.hosts.client()
        waited, unsettled = self.wait_repaired()
        with client.as_current():  # the handle's actors bind to the current client
            stats = lookup_store(client, STORE_NAME).stats()
        info = next(i for i in hosted_stores(client) if i["name"] == STORE_NAME)
        return {"units": len(stats), "rows_left_staged": sum(s["rows"] for s in stats),
                "lost_keys": sum(int(s.get("lost_keys", 0)) for s in stats),
                "lost_reads": sum(int(s.get("lost_reads", 0)) for s in stats),
                "repairs": len(info["repaired"]), "lost_units_replicas1": len(info["lost_units"]),
                "repair_wait_s": waited, "repair_unsettled": unsettled}


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def warm() -> None:
    """Run on every worker once: import what generation, staging and finalization run (the
    first task on a fresh worker otherwise holds its event loop for seconds)."""
    import torch  # noqa: F401

    import pipeline.finalize.worker_tasks  # noqa: F401
    import pipeline.store.unit  # noqa: F401
    from pipeline.capture import policy_from_config

    policy_from_config()
