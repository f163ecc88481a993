"""A network partition on loopback: one host of a local cluster cut off, then healed.

:func:`partition` cuts ONE host (a loopback address and the host's processes) off from
everything else, both ways, and heals it in ``finally``, on error too. A rule on the
address alone is not enough: on ``lo`` an outgoing connection leaves from 127.0.0.1, not
from the address its process listens on. So the processes are moved into a net_cls cgroup
(:mod:`.netcls`), which tags their sockets, old and new, with a class id, and one iptables
chain of its own (``tc-part-<address>``, jumped to from the top of ``OUTPUT``, which every
loopback packet passes) drops every packet those sockets send, every packet to or from the
address, and every packet coming back on the connections the host had opened before the
cut (one rule per connection, from its 4-tuple). Dropped TCP segments are retransmitted as
over a real network: connections stall, new ones time out. Healing deletes the jump and
the chain, then puts the processes back in their cgroup; stalled segments flow at the next
retransmission. Only the chain of the address cut is touched (one of that name left by a
killed run is replaced). Traffic among the host's own processes is cut too. Needs root,
``iptables`` with the cgroup match and the net_cls controller: :func:`unavailable` says
what is missing. docs/reliability.md, "Network partitions".
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from tasks.errors import InvalidInput, PartitionUnavailable

from .netcls import NetClsGroup, net_cls_enabled

logger = logging.getLogger(__name__)

CHAIN_PREFIX = "tc-part-"
IPTABLES_WAIT_S = 10  # how long an iptables call waits for the xtables lock (s)
SOURCE_OF_EVERYTHING = "127.0.0.1"  # the source address of every outgoing loopback connection
Connection = tuple[str, int, str, int]  # local ip, local port, remote ip, remote port


@dataclass
class Partition:
    """A cut in progress (or healed): the address, the processes cut with it, the
    chain and class id, and when it was made and healed (``time.monotonic()`` seconds)."""

    address: str
    pids: list[int]
    chain: str
    classid: int
    started_s: float
    connections: int = 0  # connections the host had opened, cut by their 4-tuples
    healed_s: float | None = None
    group: NetClsGroup | None = field(default=None, repr=False)

    @property
    def healed(self) -> bool:
        return self.healed_s is not None

    def duration_s(self) -> float:
        """Seconds cut (so far, while it lasts)."""
        return (self.healed_s if self.healed_s is not None else time.monotonic()) - self.started_s

    def heal(self) -> None:
        """End the cut now (idempotent): the chain deleted, the processes back in their cgroup."""
        if self.healed_s is not None:
            return
        try:
            _delete_chain(self.chain)
        finally:
            self.healed_s = time.monotonic()
            if self.group is not None:
                self.group.remove()


def chain_name(address: str) -> str:
    """The chain that cuts ``address``: ``tc-part-127.0.0.4``."""
    return CHAIN_PREFIX + address


def classid_of(address: str) -> int:
    """The net_cls class id of ``address``'s cut: the address as a 32-bit number (unique
    per address, never 0)."""
    return int(ipaddress.ip_address(address))


def unavailable() -> str | None:
    """Why a partition cannot be made on this machine, with the fix (None: it can)."""
    if shutil.which("iptables") is None:
        return "no iptables on PATH: install it (apt-get install -y iptables)"
    if not net_cls_enabled():
        return "the kernel has no net_cls cgroup controller (/proc/cgroups), which tags a host's sockets"
    probe = f"{CHAIN_PREFIX}probe-{os.getpid()}"
    try:
        NetClsGroup(f"probe-{os.getpid()}", 1).create().remove()
        _delete_chain(probe)
        _iptables("-N", probe)
        _iptables("-A", probe, "-m", "cgroup", "--cgroup", "1", "-j", "RETURN")
    except PartitionUnavailable as e:
        return str(e)
    except OSError as e:  # the cgroup's files
        return f"cannot make a net_cls cgroup: {e} (a partition needs root)"
    finally:
        with contextlib.suppress(PartitionUnavailable):
            _delete_chain(probe)
    return None


def check_address(address: str) -> str:
    """``address`` if a host can be cut there: a loopback address other than 127.0.0.1
    (every outgoing loopback connection leaves from that one); else :class:`InvalidInput`."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        ip = None
    if ip is None or ip.version != 4 or not ip.is_loopback:
        raise InvalidInput(f"partition address {address!r} is not an IPv4 loopback address; cut a local host's own "
                           "address, e.g. 127.0.0.4 (LocalHosts.hosts[name].address)")
    if address == SOURCE_OF_EVERYTHING:
        raise InvalidInput("partition address 127.0.0.1 is the source of every outgoing loopback connection: cutting it "
                           "cuts every host; cut one host's own address instead (127.0.0.2 and up)")
    return address


@contextlib.contextmanager
def partition(address: str, pids: Sequence[int]) -> Iterator[Partition]:
    """Cut ``address`` and the processes ``pids`` (a host's: ``LocalHosts.hosts[name].pids()``)
    off from everything else until the block ends, then heal (also on error; call
    :meth:`Partition.heal` to end it sooner). :class:`PartitionUnavailable` names what is
    missing when the machine cannot cut; :class:`InvalidInput` for a bad address."""
    check_address(address)
    why = unavailable()
    if why is not None:
        raise PartitionUnavailable(why)
    cut = Partition(address, list(pids), chain_name(address), classid_of(address), time.monotonic())
    try:
        cut.group = NetClsGroup(address, cut.classid).create()
        before = outgoing_connections(pids, address)
        _install_chain(cut.chain, address, cut.classid, before)
        cut.pids = cut.group.add(pids)
        # Opened between the listing and the move: cut too (from now on, no new one opens).
        later = [c for c in outgoing_connections(cut.group.pids(), address) if c not in before]
        _restore([_drop_coming_back(cut.chain, c) for c in later])
        cut.connections = len(before) + len(later)
        cut.started_s = time.monotonic()
        logger.info("partition: %s cut off (%d process(es), %d outgoing connection(s), chain %s)",
                    address, len(cut.pids), cut.connections, cut.chain)
        yield cut
    finally:
        cut.heal()
        logger.info("partition: %s healed after %.1f s", address, cut.duration_s())


def outgoing_connections(pids: Sequence[int], address: str) -> list[Connection]:
    """The TCP connections of ``pids`` whose local end is not on ``address`` (ones they
    opened: from 127.0.0.1), as (local ip, local port, remote ip, remote port)."""
    import psutil

    out: set[Connection] = set()
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp4")
        except psutil.Error:
            continue
        out.update((c.laddr.ip, c.laddr.port, c.raddr.ip, c.raddr.port) for c in conns
                   if c.raddr and c.laddr and c.laddr.ip != address)
    return sorted(out)


def partition_host(hosts: object, name: str) -> contextlib.AbstractContextManager[Partition]:
    """:func:`partition` of host ``name`` of a :class:`~pipeline.deploy.LocalHosts`: its
    address and every process it runs now."""
    host = hosts.hosts[name]  # type: ignore[attr-defined]
    return partition(host.address, host.pids())


# ---- the chain -------------------------------------------------------------------------


def _install_chain(chain: str, address: str, classid: int, connections: Sequence[Connection]) -> None:
    """The chain (a stale one of that name replaced) and the jump to it atop ``OUTPUT``, in
    one ``iptables-restore`` (all or nothing)."""
    if _delete_chain(chain):
        logger.warning("partition: replaced chain %s left by an earlier run", chain)
    _restore([
        f":{chain} - [0:0]",
        f"-A {chain} -m cgroup --cgroup {classid} -j DROP",  # sent by the host's sockets
        f"-A {chain} -d {address} -j DROP",  # sent to the host
        f"-A {chain} -s {address} -j DROP",  # sent from its address (kernel replies of half-open sockets)
        *(_drop_coming_back(chain, c) for c in connections),
        f"-I OUTPUT 1 -j {chain}",
    ])


def _drop_coming_back(chain: str, conn: Connection) -> str:
    """The rule dropping what comes back to the host on a connection it opened."""
    lip, lport, rip, rport = conn
    return f"-A {chain} -p tcp -s {rip} --sport {rport} -d {lip} --dport {lport} -j DROP"


def _restore(lines: Sequence[str]) -> None:
    """Apply ``lines`` to the filter table at once (``iptables-restore --noflush``)."""
    if not lines:
        return
    text = "\n".join(["*filter", *lines, "COMMIT", ""])
    try:
        done = subprocess.run(["iptables-restore", "-w", str(IPTABLES_WAIT_S), "--noflush"], input=text,
                              capture_output=True, text=True, timeout=IPTABLES_WAIT_S + 20)
    except FileNotFoundError as e:
        raise PartitionUnavailable("no iptables-restore on PATH: install iptables (apt-get install -y iptables)") from e
    if done.returncode != 0:
        raise PartitionUnavailable(f"iptables-restore failed: {done.stderr.strip() or done.returncode} "
                                   "(a partition needs root and iptables' cgroup match)")


def _delete_chain(chain: str) -> bool:
    """Remove every jump to ``chain`` from ``OUTPUT``, then the chain; False if it did not exist."""
    if _iptables_ok("-S", chain) is None:
        return False
    while _iptables_ok("-D", "OUTPUT", "-j", chain) is not None:
        pass
    _iptables("-F", chain)
    _iptables("-X", chain)
    return True


def _iptables(*args: str) -> str:
    """Run ``iptables -w N args``; its output, or :class:`PartitionUnavailable` with its error."""
    done = _run(args)
    if done.returncode != 0:
        raise PartitionUnavailable(f"iptables {' '.join(args)} failed: {done.stderr.strip() or done.returncode} "
                                   "(a partition needs root and iptables' cgroup match)")
    return done.stdout


def _iptables_ok(*args: str) -> str | None:
    done = _run(args)
    return done.stdout if done.returncode == 0 else None


def _run(args: Sequence[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["iptables", "-w", str(IPTABLES_WAIT_S), *args], capture_output=True, text=True,
                              timeout=IPTABLES_WAIT_S + 20)
    except FileNotFoundError as e:
        raise PartitionUnavailable("no iptables on PATH: install it (apt-get install -y iptables)") from e
