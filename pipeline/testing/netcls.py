"""A net_cls cgroup (cgroup v1) that tags every socket of chosen processes with a class id.

A firewall rule can then match the packets those processes send, whatever source address
the kernel gave them (on ``lo`` an outgoing connection leaves from 127.0.0.1, not from the
address its process listens on). Moving a process into the group re-tags the sockets it
already has, not only new ones: net_cls walks the process's file descriptors, which a
cgroup v2 path match (set once, when a socket is made) does not. Leaving puts every
process back into the group it came from (which re-tags its sockets again), removes the
group and unmounts the hierarchy if this object mounted it. Linux only; needs root.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterable

from tasks.errors import PartitionUnavailable

CGROUP_PREFIX = "token-capture-partition-"


def mounted_net_cls() -> str | None:
    """Where the net_cls hierarchy is mounted now (None: nowhere)."""
    try:
        with open("/proc/self/mounts") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "cgroup" and "net_cls" in parts[3].split(","):
            return parts[1]
    return None


def net_cls_enabled() -> bool:
    """Whether this kernel has the net_cls controller (``/proc/cgroups``)."""
    try:
        with open("/proc/cgroups") as f:
            return any(line.split()[:1] == ["net_cls"] and line.split()[-1] == "1" for line in f if not line.startswith("#"))
    except OSError:
        return False


class NetClsGroup:
    """One net_cls group named after ``label``, tagging its processes' sockets ``classid``.

    :meth:`create` mounts the hierarchy when it is not (in a temporary directory) and makes
    the group; :meth:`add` moves processes in; :meth:`remove` puts them back and removes
    what :meth:`create` made. Idempotent; a process that exited meanwhile is skipped."""

    def __init__(self, label: str, classid: int) -> None:
        self.label = label
        self.classid = int(classid)
        self.root: str | None = None  # the hierarchy's mount point
        self.path: str | None = None  # this group's directory
        self._mounted_here = False
        self.origins: dict[int, str] = {}  # pid -> its net_cls group before add (relative path)

    def create(self) -> NetClsGroup:
        if not net_cls_enabled():
            raise PartitionUnavailable("this kernel has no net_cls cgroup controller (/proc/cgroups); a partition "
                                       "needs it to tag a host's sockets (CONFIG_CGROUP_NET_CLASSID)")
        root = mounted_net_cls()
        if root is None:
            root = tempfile.mkdtemp(prefix="token-capture-net-cls-")
            done = subprocess.run(["mount", "-t", "cgroup", "-o", "net_cls", "net_cls", root], capture_output=True, text=True)
            if done.returncode != 0:
                os.rmdir(root)
                raise PartitionUnavailable(f"cannot mount the net_cls cgroup: {done.stderr.strip() or done.returncode} "
                                           "(a partition needs root, or CAP_SYS_ADMIN)")
            self._mounted_here = True
        self.root = root
        self.path = os.path.join(root, CGROUP_PREFIX + self.label)
        if os.path.isdir(self.path):  # left by a process killed mid-partition: its own name, reclaimed
            self._empty(self.path)
        else:
            os.mkdir(self.path)
        _write(os.path.join(self.path, "net_cls.classid"), str(self.classid))
        return self

    def add(self, pids: Iterable[int]) -> list[int]:
        """Move ``pids`` (whole processes, every thread) into the group; the pids moved."""
        assert self.path is not None, "create() first"
        moved = []
        for pid in pids:
            origin = _group_of(pid)
            if origin is None:
                continue
            try:
                _write(os.path.join(self.path, "cgroup.procs"), str(pid))
            except ProcessLookupError:
                continue
            self.origins[pid] = origin
            moved.append(pid)
        return moved

    def pids(self) -> list[int]:
        """The processes in the group now (children forked inside it included)."""
        return _procs(self.path) if self.path else []

    def remove(self) -> None:
        """Every process back where it came from (root for one forked inside), the group
        removed, the hierarchy unmounted if :meth:`create` mounted it."""
        if self.path is not None and os.path.isdir(self.path):
            self._empty(self.path)
            os.rmdir(self.path)
        self.path = None
        if self._mounted_here and self.root is not None:
            subprocess.run(["umount", self.root], capture_output=True)
            try:
                os.rmdir(self.root)
            except OSError:
                pass
            self._mounted_here = False

    def _empty(self, path: str) -> None:
        assert self.root is not None
        for pid in _procs(path):
            back = os.path.join(self.root, self.origins.get(pid, "").lstrip("/"), "cgroup.procs")
            try:
                _write(back, str(pid))
            except ProcessLookupError:
                pass


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _procs(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _group_of(pid: int) -> str | None:
    """``pid``'s net_cls group (``/`` for the root), or None if it has exited."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if "net_cls" in controllers.split(","):
                    return path
    except (OSError, ValueError):
        return None
    return "/"
