"""Which container a process belongs to, from ``/proc/<pid>/cgroup``.

NVML reports the processes that use a GPU by PID (in the host's PID namespace). The
container a PID runs in shows in its cgroup path, in one of these shapes::

    cgroup v1, cgroupfs driver:   4:memory:/docker/<64 hex>
    cgroup v1, systemd driver:    4:memory:/system.slice/docker-<64 hex>.scope
    cgroup v2, systemd driver:    0::/system.slice/docker-<64 hex>.scope
    cgroup v2, cgroupfs driver:   0::/docker/<64 hex>
    nested (docker in docker):    0::/docker/<outer id>/docker/<inner id>

The innermost id is the container the process really runs in. Parsing is pure
(:func:`container_id_from_cgroup`); :class:`CgroupReader` reads the files, with a small
cache because a GPU process lives long and heartbeats come every few seconds, and a process's
command name (``/proc/<pid>/comm``) alongside.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

_CONTAINER_COMPONENT = re.compile(
    r"^(?:(?:docker|cri-containerd|crio|libpod)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$"
)
"""One path component that names a container: a bare id (cgroupfs driver) or a systemd
scope (``docker-<id>.scope``). Other runtimes' prefixes are accepted too, since a process
in a container of another runtime still deserves to be attributed to something."""


def container_id_from_cgroup(content: str) -> str | None:
    """The 64-hex container id in ``/proc/<pid>/cgroup`` content, or None (a host process).

    Lines are ``hierarchy-id:controllers:path``; v2 has a single ``0::path`` line. Every
    line is looked at (a v1 host may leave some controllers at the root), and within a path
    the innermost container component wins.
    """
    for line in content.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        found = _innermost_id(parts[2])
        if found is not None:
            return found
    return None


def _innermost_id(path: str) -> str | None:
    for component in reversed(path.split("/")):
        # systemd may nest a cgroup inside the scope (".../docker-<id>.scope/init").
        match = _CONTAINER_COMPONENT.match(component)
        if match:
            return match.group("id")
    return None


class CgroupReader:
    """Maps PIDs to container ids by reading ``<proc_root>/<pid>/cgroup``.

    A PID that no longer exists maps to None. Results are cached for a bounded number of
    PIDs; a reused PID is caught by keying on the process's start time as well.
    """

    def __init__(self, proc_root: Path | str = "/proc", cache_size: int = 4096) -> None:
        self.proc_root = Path(proc_root)
        self._cache: OrderedDict[tuple[int, str], str | None] = OrderedDict()
        self._cache_size = cache_size

    def container_of(self, pid: int) -> str | None:
        """The container id of ``pid``, or None (host process, gone, or unreadable)."""
        start = self._start_time(pid)
        if start is None:
            return None
        key = (pid, start)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            content = (self.proc_root / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        found = container_id_from_cgroup(content)
        self._cache[key] = found
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return found

    def containers_of(self, pids: Iterable[int]) -> dict[int, str]:
        """``{pid: container id}`` for the PIDs that run in a container."""
        result = {}
        for pid in pids:
            found = self.container_of(pid)
            if found is not None:
                result[pid] = found
        return result

    def command_name(self, pid: int) -> str:
        """The command name of ``pid`` (``<proc_root>/<pid>/comm``: the kernel keeps its first
        15 bytes); empty when the process is gone or unreadable."""
        try:
            raw = (self.proc_root / str(pid) / "comm").read_bytes()
        except OSError:
            return ""
        return raw.decode(errors="replace").rstrip("\n")

    def _start_time(self, pid: int) -> str | None:
        # Field 22 of /proc/<pid>/stat is the start time in clock ticks; the command name
        # (field 2) may hold spaces and parentheses, so split after its closing ")".
        try:
            stat = (self.proc_root / str(pid) / "stat").read_text()
        except OSError:
            return None
        _, _, rest = stat.rpartition(")")
        fields = rest.split()
        return fields[19] if len(fields) > 19 else ""
