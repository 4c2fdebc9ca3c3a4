"""How the GPUs of one host are joined to each other: the link of every pair, and each GPU's
NUMA node.

Pure data: no I/O. The node agent reads it from NVML (:mod:`nodeagent.interconnect_nvml`) or
its simulated inventory describes it, and sends it in a full heartbeat to an allocator that
reads it; :mod:`allocator.placement.gpu_sets` chooses GPUs with it, and :func:`matrix_lines` prints
it as ``nvidia-smi topo -m`` does. (Not to be confused with :mod:`allocator.wire.topology`, the
broker's exchanges and queues.)

The levels mirror NVML's ``nvmlDeviceGetTopologyCommonAncestor`` (``NVML_TOPOLOGY_INTERNAL``,
``SINGLE``, ``MULTIPLE``, ``HOSTBRIDGE``, ``NODE``, ``SYSTEM``), with NVLink (direct or
through an NVSwitch) above them all: the columns of ``nvidia-smi topo -m`` (``NV#``, ``PIX``,
``PXB``, ``PHB``, ``NODE``, ``SYS``). A lower level is a better link.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, model_validator

MAX_GPUS_PER_HOST = 64
"""More GPUs than any host has; bounds a report (64 GPUs are 2,016 pairs)."""

MAX_NVLINKS = 64
"""More NVLink links between two GPUs than any GPU has (an H100 has 18 in all)."""

Uuid = Annotated[str, Field(min_length=1, max_length=128)]


def _list_as_tuple(value: Any) -> Any:
    # The models are strict, and a strict tuple takes no list: but data read as Python
    # (JSON loaded first, a document's example) carries lists.
    return tuple(value) if type(value) is list else value


def _int_as_level(value: Any) -> Any:
    # Likewise an integer for the level, which strict mode takes off JSON only.
    return LinkLevel(value) if type(value) is int and value in _LEVELS else value


class LinkLevel(IntEnum):
    """The link between two GPUs, best first (NVML's common-ancestor levels under NVLink)."""

    NVLINK = 0
    """Joined by NVLink, directly or through an NVSwitch (``NV#``)."""
    INTERNAL = 1
    """On the same board (``NVML_TOPOLOGY_INTERNAL``, e.g. the two GPUs of a K80)."""
    SINGLE = 2
    """Behind one PCIe switch (``NVML_TOPOLOGY_SINGLE``, ``PIX``)."""
    MULTIPLE = 3
    """Behind several PCIe switches, no host bridge between (``NVML_TOPOLOGY_MULTIPLE``,
    ``PXB``)."""
    HOSTBRIDGE = 4
    """Through one PCIe host bridge (``NVML_TOPOLOGY_HOSTBRIDGE``, ``PHB``)."""
    NODE = 5
    """Across host bridges of one CPU socket, one NUMA node (``NVML_TOPOLOGY_NODE``)."""
    SYSTEM = 6
    """Across CPU sockets, over the sockets' interconnect (``NVML_TOPOLOGY_SYSTEM``, ``SYS``)."""

    @property
    def words(self) -> str:
        """What a person reads in a message."""
        return _WORDS[self]

    @property
    def wire_name(self) -> str:
        """Its stable lowercase name in messages (``Lease.link``): :data:`LINK_NAMES`."""
        return LINK_NAMES[self]


LINK_NAMES: dict[LinkLevel, str] = {
    LinkLevel.NVLINK: "nvlink",
    LinkLevel.INTERNAL: "board",
    LinkLevel.SINGLE: "pcie-switch",
    LinkLevel.MULTIPLE: "pcie-switches",
    LinkLevel.HOSTBRIDGE: "host-bridge",
    LinkLevel.NODE: "socket",
    LinkLevel.SYSTEM: "system",
}
"""Each level's name on the wire, once: a reader shows an unknown name as it is (a later
release may add a level)."""

_LEVELS = frozenset(level.value for level in LinkLevel)

_WORDS = {
    LinkLevel.NVLINK: "NVLink",
    LinkLevel.INTERNAL: "the same board",
    LinkLevel.SINGLE: "one PCIe switch",
    LinkLevel.MULTIPLE: "several PCIe switches",
    LinkLevel.HOSTBRIDGE: "a PCIe host bridge",
    LinkLevel.NODE: "one CPU socket",
    LinkLevel.SYSTEM: "across CPU sockets",
}


class GpuLink(BaseModel):
    """The link between two GPUs of one host (an unordered pair)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    a: Uuid
    b: Uuid
    level: Annotated[LinkLevel, BeforeValidator(_int_as_level)]
    nvlinks: int = Field(default=0, ge=0, le=MAX_NVLINKS)
    """NVLink links between the two (at :attr:`LinkLevel.NVLINK` only; more is faster)."""

    @model_validator(mode="after")
    def _consistent(self) -> GpuLink:
        if self.a == self.b:
            raise ValueError(f"a GPU has no link to itself ({self.a})")
        if (self.level is LinkLevel.NVLINK) != (self.nvlinks > 0):
            raise ValueError(f"{self.a}-{self.b}: NVLink links are counted at level NVLINK "
                             f"only, and that level has at least one")
        return self


MAX_CPULIST = 1024
"""The longest CPU list a GPU may carry: a two-socket host of 256 threads numbered every
other one (``0,2,4,...``) fits; 64 GPUs of it stay well inside a heartbeat."""

MAX_CPU = 65535
"""The largest CPU number a CPU list may name."""

CPULIST_PATTERN = r"^[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?)*$"
"""Linux's cpulist form (``0-15,32-47``, ``3``): numbers and ranges, comma separated."""


def cpulist_ranges(cpulist: str) -> list[tuple[int, int]]:
    """``"0-3,8"`` → ``[(0, 3), (8, 8)]``; ValueError unless the ranges are in Linux's
    form: each first <= last <= :data:`MAX_CPU`, in increasing order, none overlapping."""
    ranges: list[tuple[int, int]] = []
    for part in cpulist.split(","):
        first, _, last = part.partition("-")
        low = int(first)
        high = int(last) if last else low
        if not low <= high <= MAX_CPU:
            raise ValueError(f"CPU list {cpulist!r}: {part} is not a range of CPU numbers "
                             f"up to {MAX_CPU}")
        if ranges and low <= ranges[-1][1]:
            raise ValueError(f"CPU list {cpulist!r}: ranges must increase and not overlap")
        ranges.append((low, high))
    return ranges


class HostGpu(BaseModel):
    """One GPU of a host, where it sits: its NUMA node and the CPUs near it."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    uuid: Uuid
    numa_node: int | None = Field(default=None, ge=0, le=1023)
    """The NUMA node (CPU socket) closest to it; None where the host does not say (NVML's -1)."""
    cpus: str | None = Field(default=None, max_length=MAX_CPULIST, pattern=CPULIST_PATTERN)
    """The CPUs near it, in Linux's cpulist form (``"0-15,32-47"``): NVML's
    ``nvmlDeviceGetCpuAffinity`` bitmask (else the kernel's ``local_cpulist`` of its PCI
    device), at most :data:`MAX_CPULIST` characters, ranges increasing and apart; None where
    the host does not say (or the list would be longer)."""

    @model_validator(mode="after")
    def _cpus_in_order(self) -> HostGpu:
        if self.cpus is not None:
            cpulist_ranges(self.cpus)
        return self


class HostInterconnect(BaseModel):
    """Every GPU of one host, in index order, and the link of every pair of them."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    gpus: Annotated[tuple[HostGpu, ...], BeforeValidator(_list_as_tuple)] = Field(
        min_length=1, max_length=MAX_GPUS_PER_HOST)
    links: Annotated[tuple[GpuLink, ...], BeforeValidator(_list_as_tuple)] = Field(
        max_length=MAX_GPUS_PER_HOST * (MAX_GPUS_PER_HOST - 1) // 2)

    _position: dict[str, int] = PrivateAttr(default_factory=dict)
    _pairs: dict[tuple[int, int], GpuLink] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _every_pair_once(self) -> HostInterconnect:
        position: dict[str, int] = {}
        for index, gpu in enumerate(self.gpus):
            if gpu.uuid in position:
                raise ValueError(f"GPU {gpu.uuid} is listed twice")
            position[gpu.uuid] = index
        pairs: dict[tuple[int, int], GpuLink] = {}
        for link in self.links:
            unknown = [uuid for uuid in (link.a, link.b) if uuid not in position]
            if unknown:
                raise ValueError(f"a link names GPUs the host does not list: {', '.join(unknown)}")
            key = _pair(position[link.a], position[link.b])
            if key in pairs:
                raise ValueError(f"the link {link.a}-{link.b} is given twice")
            pairs[key] = link
        expected = len(self.gpus) * (len(self.gpus) - 1) // 2
        if len(pairs) != expected:
            missing = next(
                (self.gpus[i].uuid, self.gpus[j].uuid)
                for i in range(len(self.gpus)) for j in range(i + 1, len(self.gpus))
                if (i, j) not in pairs
            )
            raise ValueError(f"every pair of GPUs needs its link: {missing[0]}-{missing[1]} "
                             f"has none ({len(pairs)} of {expected} pairs given)")
        self._position = position
        self._pairs = pairs
        return self

    @property
    def uuids(self) -> tuple[str, ...]:
        """The GPUs' uuids in index order."""
        return tuple(gpu.uuid for gpu in self.gpus)

    def index_of(self, uuid: str) -> int:
        """The GPU's index on the host; KeyError naming it when the host has no such GPU."""
        try:
            return self._position[uuid]
        except KeyError:
            raise KeyError(f"the host has no GPU {uuid}") from None

    def link(self, a: str, b: str) -> GpuLink:
        """The link between two different GPUs of the host."""
        return self.link_at(self.index_of(a), self.index_of(b))

    def link_at(self, i: int, j: int) -> GpuLink:
        """The link between the GPUs at indices ``i`` and ``j`` (``i != j``)."""
        return self._pairs[_pair(i, j)]

    def numa_node(self, uuid: str) -> int | None:
        """The GPU's NUMA node, None when unknown."""
        return self.gpus[self.index_of(uuid)].numa_node


def _pair(i: int, j: int) -> tuple[int, int]:
    if i == j:
        raise ValueError("a GPU has no link to itself")
    return (i, j) if i < j else (j, i)


def build_interconnect(
    uuids: list[str],
    numa_nodes: list[int | None],
    link_of: dict[tuple[int, int], tuple[LinkLevel, int]],
) -> HostInterconnect:
    """A host from its GPUs (index order), their NUMA nodes, and the ``(level, nvlinks)`` of
    each index pair ``(i, j)``, ``i < j``."""
    return HostInterconnect(
        gpus=tuple(HostGpu(uuid=u, numa_node=n) for u, n in zip(uuids, numa_nodes, strict=True)),
        links=tuple(
            GpuLink(a=uuids[i], b=uuids[j], level=level, nvlinks=nvlinks)
            for (i, j), (level, nvlinks) in sorted(link_of.items())
        ),
    )


def hgx_host(prefix: str = "GPU-hgx", *, nvlinks: int = 18) -> HostInterconnect:
    """An 8-GPU HGX board: every pair joined by NVLink through the NVSwitches (H100: 18
    links each); GPUs 0-3 on NUMA node 0, 4-7 on node 1."""
    uuids = [f"{prefix}-{i}" for i in range(8)]
    return build_interconnect(
        uuids, [i // 4 for i in range(8)],
        {(i, j): (LinkLevel.NVLINK, nvlinks) for i in range(8) for j in range(i + 1, 8)},
    )


def pcie_two_socket_host(prefix: str = "GPU-pcie") -> HostInterconnect:
    """An 8-GPU PCIe server with two sockets: GPUs 0-3 on socket (NUMA node) 0, 4-7 on 1; on
    each socket two PCIe switches of two GPUs each (0-1, 2-3, 4-5, 6-7). Same switch:
    :attr:`LinkLevel.SINGLE`; other switch of the socket: :attr:`LinkLevel.NODE`; other
    socket: :attr:`LinkLevel.SYSTEM`."""
    uuids = [f"{prefix}-{i}" for i in range(8)]
    links: dict[tuple[int, int], tuple[LinkLevel, int]] = {}
    for i in range(8):
        for j in range(i + 1, 8):
            if i // 2 == j // 2:
                links[(i, j)] = (LinkLevel.SINGLE, 0)
            elif i // 4 == j // 4:
                links[(i, j)] = (LinkLevel.NODE, 0)
            else:
                links[(i, j)] = (LinkLevel.SYSTEM, 0)
    return build_interconnect(uuids, [i // 4 for i in range(8)], links)


def nvlink_pairs_host(prefix: str = "GPU-pairs", *, nvlinks: int = 4) -> HostInterconnect:
    """A 4-GPU workstation: GPUs 0-1 and 2-3 joined by NVLink bridges, every other pair
    through the one PCIe host bridge (:attr:`LinkLevel.HOSTBRIDGE`); one NUMA node."""
    uuids = [f"{prefix}-{i}" for i in range(4)]
    links: dict[tuple[int, int], tuple[LinkLevel, int]] = {
        (i, j): (LinkLevel.HOSTBRIDGE, 0) for i in range(4) for j in range(i + 1, 4)
    }
    links[(0, 1)] = (LinkLevel.NVLINK, nvlinks)
    links[(2, 3)] = (LinkLevel.NVLINK, nvlinks)
    return build_interconnect(uuids, [0, 0, 0, 0], links)


# --------------------------------------------------------------------------- the matrix

_CODES = {
    LinkLevel.INTERNAL: "INT",
    LinkLevel.SINGLE: "PIX",
    LinkLevel.MULTIPLE: "PXB",
    LinkLevel.HOSTBRIDGE: "PHB",
    LinkLevel.NODE: "NODE",
    LinkLevel.SYSTEM: "SYS",
}

LEGEND = (
    "  X    = the GPU itself",
    "  NV#  = NVLink, # links (directly or through NVSwitches)",
    "  INT  = on the same board",
    "  PIX  = through one PCIe switch",
    "  PXB  = through several PCIe switches, no host bridge",
    "  PHB  = through a PCIe host bridge (the CPU)",
    "  NODE = across host bridges within one NUMA node",
    "  SYS  = across NUMA nodes (the sockets' interconnect)",
)
"""What each cell of :func:`matrix_lines` means, in ``nvidia-smi topo -m``'s words."""


def link_code(link: GpuLink) -> str:
    """A link as ``nvidia-smi topo -m`` writes it: ``NV18``, ``PIX``, ``PXB``, ``PHB``,
    ``NODE``, ``SYS`` (``INT`` for two GPUs of one board)."""
    if link.level is LinkLevel.NVLINK:
        return f"NV{link.nvlinks}"
    return _CODES[link.level]


def matrix_lines(interconnect: HostInterconnect, *, legend: bool = True) -> list[str]:
    """The host's links as ``nvidia-smi topo -m`` prints them: a row and a column per GPU
    (``GPU0``... in index order), each cell the pair's :func:`link_code` (``X`` on the
    diagonal), then each GPU's CPU affinity and NUMA node (``N/A`` where unknown); with
    ``legend``, a blank line and what the codes mean. Columns are padded with spaces."""
    names = [f"GPU{i}" for i in range(len(interconnect.gpus))]
    rows = [
        [name,
         *("X" if i == j else link_code(interconnect.link_at(i, j)) for j in range(len(names))),
         gpu.cpus or "N/A",
         "N/A" if gpu.numa_node is None else str(gpu.numa_node)]
        for i, (name, gpu) in enumerate(zip(names, interconnect.gpus, strict=True))
    ]
    header = ["", *names, "CPU Affinity", "NUMA Affinity"]
    widths = [max(len(row[c]) for row in (header, *rows)) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)
                       ).rstrip() for row in (header, *rows)]
    if legend:
        lines += ["", "Legend:", *LEGEND]
    return lines
