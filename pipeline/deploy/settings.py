"""The ``token-capture.hosts`` knobs, read once when a :class:`~pipeline.deploy.hosts.LocalHosts` is built."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from tasks.errors import ClusterMisconfigured

from .. import config

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
ATTACH_CHECKS = ("warn", "error", "off")


@dataclass(frozen=True)
class HostSettings:
    """How local hosts are started (``hosts.*``; ``cluster.host`` for the scheduler)."""

    scheduler_host: str  # cluster.host: the scheduler binds there
    first_address: str  # hosts.first-address: host k gets first + k - 1
    scheduler_port: int  # hosts.scheduler-port (0: a free one)
    dashboard_address: str  # cluster.dashboard-address: the scheduler's dashboard
    workers_per_host: int  # hosts.workers-per-host
    threads_per_worker: int  # hosts.threads-per-worker
    nanny: bool  # hosts.nanny
    finalize_slots: float  # finalize.slots-per-worker
    start_timeout_s: float  # hosts.start-timeout-s (s)
    stop_timeout_s: float  # hosts.stop-timeout-s (s)

    @classmethod
    def from_config(cls) -> HostSettings:
        """The current configuration's values (addresses checked: loopback only)."""
        settings = cls(
            scheduler_host=str(config.get("cluster.host")),
            first_address=str(config.get("hosts.first-address")),
            scheduler_port=int(config.get("hosts.scheduler-port")),
            dashboard_address=str(config.get("cluster.dashboard-address")),
            workers_per_host=int(config.get("hosts.workers-per-host")),
            threads_per_worker=int(config.get("hosts.threads-per-worker")),
            nanny=bool(config.get("hosts.nanny")),
            finalize_slots=float(config.get("finalize.slots-per-worker")),
            start_timeout_s=float(config.get("hosts.start-timeout-s")),
            stop_timeout_s=float(config.get("hosts.stop-timeout-s")),
        )
        loopback(settings.first_address, "token-capture.hosts.first-address")
        return settings

    def host_address(self, index: int) -> str:
        """The loopback address of host ``index`` (0-based): ``first_address + index``;
        :class:`ClusterMisconfigured` past the end of 127.0.0.0/8."""
        address = ipaddress.ip_address(self.first_address) + index
        return loopback(str(address), f"host {index + 1}'s address")


def loopback(address: str, what: str) -> str:
    """``address`` if it is in 127.0.0.0/8, else :class:`ClusterMisconfigured` naming ``what``:
    local hosts never bind any other address."""
    try:
        ok = ipaddress.ip_address(address) in LOOPBACK
    except ValueError:
        ok = False
    if not ok or address == "127.0.0.0" or address == "127.255.255.255":
        raise ClusterMisconfigured(f"{what} {address!r} is not a loopback host address; local hosts bind only 127.0.0.1-127.255.255.254 "
                           "(set token-capture.hosts.first-address to e.g. 127.0.0.2)")
    return address


def attach_check_mode() -> str:
    """``hosts.attach-check`` (warn, error or off), checked."""
    mode = str(config.get("hosts.attach-check")).strip().lower()
    if mode not in ATTACH_CHECKS:
        raise ClusterMisconfigured(f"token-capture.hosts.attach-check must be one of {', '.join(ATTACH_CHECKS)}, got {mode!r}")
    return mode
