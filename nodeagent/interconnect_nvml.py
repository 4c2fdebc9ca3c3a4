"""How the host's GPUs are joined, read from NVML: the link of every pair, each GPU's NUMA node
and the CPUs near it (an :class:`~allocator.wire.interconnect.HostInterconnect`).

Per pair of GPUs (never MIG instances): NVLink links first, from each GPU's links
``0 .. NVML_NVLINK_MAX_LINKS - 1`` (``nvmlDeviceGetNvLinkState``; an active link's far end by
``nvmlDeviceGetNvLinkRemoteDeviceType`` and ``nvmlDeviceGetNvLinkRemotePciInfo_v2``): a link
whose far end is another GPU of the host counts for that pair; one whose far end is an
NVSwitch (or no GPU of the host) counts towards every other GPU that reaches NVSwitches too,
``min`` of the two GPUs' switch links (an HGX H100: 18). A pair without NVLink takes its PCIe
level from ``nvmlDeviceGetTopologyCommonAncestor``. Per GPU: its NUMA node
(``nvmlDeviceGetNumaNodeId`` where the library has it, else the kernel's
``/sys/bus/pci/devices/<bus id>/numa_node``; -1 is unknown) and its CPUs
(``nvmlDeviceGetCpuAffinity``'s bitmask, else the kernel's ``local_cpulist``).

Every NVML call may raise ``NotSupported`` (or ``NoPermission`` in some containers): a GPU
whose NVLink cannot be read has none; a NUMA node or CPU list that cannot be read is None.
Only a pair whose level cannot be read at all (no NVLink, no common ancestor) leaves the
host's interconnect unknown: :func:`read_interconnect` then returns None, and the agent
reports none. The counting (:func:`nvlink_counts`) and the conversions (:func:`pci_address`,
:func:`cpulist_of`) are pure.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from allocator.wire.interconnect import (
    CPULIST_PATTERN,
    MAX_CPULIST,
    MAX_GPUS_PER_HOST,
    MAX_NVLINKS,
    GpuLink,
    HostGpu,
    HostInterconnect,
    LinkLevel,
    cpulist_ranges,
)

log = logging.getLogger(__name__)

SWITCH = -1
"""The far end of an NVLink that is no GPU of this host: an NVSwitch."""

COMMON_ANCESTOR_LEVELS = {
    0: LinkLevel.INTERNAL,
    10: LinkLevel.SINGLE,
    20: LinkLevel.MULTIPLE,
    30: LinkLevel.HOSTBRIDGE,
    40: LinkLevel.NODE,
    50: LinkLevel.SYSTEM,
}
"""``NVML_TOPOLOGY_*`` → :class:`LinkLevel` (a value NVML adds later reads as SYSTEM, the
level nothing is promised of)."""

AFFINITY_WORDS_MAX = 64
"""The most 64-bit words of a CPU affinity asked of NVML: 4,096 CPUs."""


def pci_address(bus_id: str | bytes) -> str | None:
    """NVML's PCI bus id (``00000000:18:00.0``, any case) as the kernel names the device under
    ``/sys/bus/pci/devices`` (``0000:18:00.0``); None for anything else."""
    text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else bus_id
    match = re.fullmatch(r"(?:([0-9a-f]{1,8}):)?([0-9a-f]{1,2}):([0-9a-f]{1,2})\.([0-7])",
                         text.strip().rstrip("\x00").lower())
    if match is None:
        return None
    domain, bus, device, function = (int(part or "0", 16) for part in match.groups())
    return f"{domain:04x}:{bus:02x}:{device:02x}.{function:x}"


def cpulist_of(words: Sequence[int], word_bits: int = 64) -> str | None:
    """A CPU bitmask (NVML's array of words, lowest CPUs in the first word) in Linux's cpulist
    form (``0-15,32-47``); None when no bit is set or the list would be longer than
    :data:`~allocator.wire.interconnect.MAX_CPULIST`."""
    ranges: list[tuple[int, int]] = []
    for position, word in enumerate(words):
        value = int(word)
        bit = 0
        while value:
            if value & 1:
                cpu = position * word_bits + bit
                if ranges and ranges[-1][1] == cpu - 1:
                    ranges[-1] = (ranges[-1][0], cpu)
                else:
                    ranges.append((cpu, cpu))
            value >>= 1
            bit += 1
    if not ranges:
        return None
    text = ",".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)
    return text if len(text) <= MAX_CPULIST else None


def nvlink_counts(far_ends: Sequence[Sequence[int]]) -> dict[tuple[int, int], int]:
    """Per pair of GPUs ``(i, j)``, ``i < j``: its NVLink links, from each GPU's active links'
    far ends (another GPU's index, or :data:`SWITCH`). A direct link is seen from
    both ends and counted once (the larger count of the two, should they differ); GPUs that
    both reach NVSwitches are joined by as many links as the one with fewer switch links has.
    Pairs without NVLink are left out."""
    switch_links = [sum(1 for end in ends if end == SWITCH) for ends in far_ends]
    direct: dict[tuple[int, int], int] = {}
    for i, ends in enumerate(far_ends):
        seen: dict[int, int] = {}
        for end in ends:
            if 0 <= end < len(far_ends) and end != i:
                seen[end] = seen.get(end, 0) + 1
        for j, count in seen.items():
            pair = (min(i, j), max(i, j))
            direct[pair] = max(direct.get(pair, 0), count)
    counts: dict[tuple[int, int], int] = {}
    for i in range(len(far_ends)):
        for j in range(i + 1, len(far_ends)):
            through_switches = min(switch_links[i], switch_links[j])
            total = direct.get((i, j), 0) + through_switches
            if total:
                counts[(i, j)] = min(total, MAX_NVLINKS)
    return counts


@dataclass(frozen=True)
class _Gpu:
    uuid: str
    handle: Any
    address: str | None
    """Its PCI address as the kernel names it; None where NVML did not say."""


class InterconnectReader:
    """Reads the interconnect through an initialised ``pynvml`` module (the caller holds
    whatever lock its NVML calls need)."""

    def __init__(self, nvml: Any, *, sys_root: Path = Path("/sys")) -> None:
        self.nvml = nvml
        self.sys_root = sys_root

    def read(self) -> HostInterconnect | None:
        """Every GPU of the host and the link of every pair; None where it cannot be read."""
        nvml = self.nvml
        try:
            gpus = [self._gpu(index) for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            log.warning("the GPUs' interconnect cannot be read: %s", exc)
            return None
        if not gpus or len(gpus) > MAX_GPUS_PER_HOST:
            return None
        by_address = {gpu.address: index for index, gpu in enumerate(gpus)
                      if gpu.address is not None}
        counts = nvlink_counts([self._far_ends(gpu, by_address) for gpu in gpus])
        links = []
        for i in range(len(gpus)):
            for j in range(i + 1, len(gpus)):
                nvlinks = counts.get((i, j), 0)
                level = LinkLevel.NVLINK if nvlinks else self._pcie_level(gpus[i], gpus[j])
                if level is None:
                    return None
                links.append(GpuLink(a=gpus[i].uuid, b=gpus[j].uuid, level=level,
                                     nvlinks=nvlinks))
        return HostInterconnect(
            gpus=tuple(HostGpu(uuid=gpu.uuid, numa_node=self._numa_node(gpu),
                               cpus=self._cpus(gpu)) for gpu in gpus),
            links=tuple(links))

    def _gpu(self, index: int) -> _Gpu:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        try:
            address = pci_address(nvml.nvmlDeviceGetPciInfo(handle).busId)
        except nvml.NVMLError:
            address = None
        return _Gpu(uuid, handle, address)

    def _far_ends(self, gpu: _Gpu, by_address: dict[str, int]) -> list[int]:
        """The far end of each of the GPU's active NVLink links: another GPU's index, or
        :data:`SWITCH`. None at all where the GPU has no NVLink (``NotSupported``)."""
        nvml = self.nvml
        ends: list[int] = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(gpu.handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound):
                break  # no NVLink on this GPU (or this driver)
            except nvml.NVMLError:
                continue  # a link number past this GPU's links (InvalidArgument)
            end = self._far_end(gpu, link, by_address)
            if end is not None:
                ends.append(end)
        return ends

    def _far_end(self, gpu: _Gpu, link: int, by_address: dict[str, int]) -> int | None:
        nvml = self.nvml
        try:
            kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(gpu.handle, link)
            if kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                return SWITCH
        except (nvml.NVMLError, AttributeError):
            pass  # an older driver or library: the far end's PCI address tells
        try:
            remote = pci_address(nvml.nvmlDeviceGetNvLinkRemotePciInfo(gpu.handle, link).busId)
        except nvml.NVMLError:
            return None
        if remote is None:
            return None
        return by_address.get(remote, SWITCH)

    def _pcie_level(self, a: _Gpu, b: _Gpu) -> LinkLevel | None:
        nvml = self.nvml
        try:
            value = int(nvml.nvmlDeviceGetTopologyCommonAncestor(a.handle, b.handle))
        except nvml.NVMLError as exc:
            log.warning("the link of GPUs %s and %s cannot be read (%s): no interconnect "
                        "is reported", a.uuid, b.uuid, exc)
            return None
        return COMMON_ANCESTOR_LEVELS.get(value, LinkLevel.SYSTEM)

    def _numa_node(self, gpu: _Gpu) -> int | None:
        nvml = self.nvml
        node: int | None = None
        read = getattr(nvml, "nvmlDeviceGetNumaNodeId", None)
        if read is not None:
            try:
                node = int(read(gpu.handle))
            except nvml.NVMLError:
                node = None
        if node is None and gpu.address is not None:
            node = _read_int(self.sys_root / "bus/pci/devices" / gpu.address / "numa_node")
        return node if node is not None and 0 <= node <= 1023 else None

    def _cpus(self, gpu: _Gpu) -> str | None:
        nvml = self.nvml
        words = min(AFFINITY_WORDS_MAX, (os.cpu_count() or 1) // 64 + 1)
        try:
            cpus = cpulist_of(list(nvml.nvmlDeviceGetCpuAffinity(gpu.handle, words)))
        except nvml.NVMLError:
            cpus = None
        if cpus is None and gpu.address is not None:
            cpus = _read_cpulist(self.sys_root / "bus/pci/devices" / gpu.address
                                 / "local_cpulist")
        return cpus


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_cpulist(path: Path) -> str | None:
    """The kernel's cpulist of a PCI device, when it is one the interconnect can carry."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if len(text) > MAX_CPULIST or re.fullmatch(CPULIST_PATTERN, text) is None:
        return None
    try:
        cpulist_ranges(text)
    except ValueError:
        return None
    return text
