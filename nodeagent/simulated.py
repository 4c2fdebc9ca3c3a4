"""The SIMULATED inventory source: GPUs read from a JSON file instead of NVML.

This is a documented feature, not a test double: hosts without GPUs (demos, tests, scale
runs with hundreds of agents) run the real agent with ``--inventory simulated`` and every
heartbeat says ``"source": "simulated"`` so nobody mistakes it for hardware. One file can
describe many hosts; each agent takes its own host's list::

    {"hosts": {"gpu-a": [
        {"uuid": "GPU-...", "index": 0, "model": "NVIDIA GeForce GTX 1070",
         "memory_total_mib": 8192, "memory_used_mib": 0, "utilization_pct": 0,
         "temperature_c": 40, "power_w": 30, "ecc_uncorrected": 0,
         "xids": [], "lost": false,
         "processes": [{"pid": 1234, "used_memory_mib": 512}]}
    ]}}

A process may also say which container it runs in (``"container_id"``, 64 hex digits, taken
over its ``/proc/<pid>/cgroup``: so a test keeps a dead container's process listed) and its
command name (``"name"``, taken over ``/proc/<pid>/comm``). A GPU (or MIG instance) with
``"processes_error": true`` has a process listing that fails, as NVML's call can: its
processes are reported as not known. A lost GPU's are never known.

Each GPU has an energy counter (``energy_mj``, millijoules, as NVML's total energy
consumption): a test that sets it drives it; without it the source counts one from
``power_w`` times the time between reads. A process may give its SM and memory utilization
(``utilization_pct``, ``memory_utilization_pct``), as NVML's per-process utilization samples
do: the agent measures each lease's use from them (:mod:`nodeagent.usage`).

``processes``, ``processes_error``, ``retired_pages``, ``remap_pending``, ``remap_failed``,
``mig_mode``, ``compute_capability`` (``"8.0"``), ``architecture`` (``"ampere"``) and
``mig_instances`` are optional. A GPU with ``"mig_mode": true`` lists its MIG instances, each
reported as a unit of its own under NVML's name for it (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``)
with the parent's compute capability, architecture and health::

    {"uuid": "GPU-...", "index": 0, "model": "NVIDIA A100-SXM4-40GB",
     "memory_total_mib": 40960, "mig_mode": true,
     "compute_capability": "8.0", "architecture": "ampere",
     "mig_instances": [
        {"uuid": "MIG-...", "profile": "3g.20gb", "memory_total_mib": 19968},
        {"uuid": "MIG-...", "profile": "1g.5gb", "memory_total_mib": 4864}]}

Rewriting ``mig_instances`` while the agent runs is how a test re-partitions a GPU.

A top-level ``leases`` object sets what a lease's container uses, by lease id, as if NVML's
per-process accounting attributed it to that container: on each GPU of its grant (from its
labels; a container without grant labels: on every GPU of the host, of which the allocator
keeps the lease's own)::

    {"hosts": {...}, "leases": {"5d80169b...": {"utilization_pct": 0, "memory_used_mib": 800}}}

This is how tests and the demo make one notebook idle and another busy.

A top-level ``topology`` object says how a host's GPUs are joined (what NVML's topology calls
tell on a real host), by host: a preset, applied to the host's GPUs in index order (MIG
instances aside), or the interconnect itself
(:class:`~allocator.wire.interconnect.HostInterconnect`: ``gpus`` with ``uuid``, ``numa_node``,
``cpus``, and ``links`` with ``a``, ``b``, ``level``
0-6, ``nvlinks``), naming exactly the host's GPUs::

    {"hosts": {...}, "topology": {"gpu-a": "hgx", "gpu-b": "pcie-two-socket"}}

The presets (:data:`TOPOLOGY_PRESETS`): ``hgx``, every pair joined by 18 NVLink links through
NVSwitches, the first half of the GPUs on NUMA node 0 (CPUs ``0-31``) and the rest on node 1
(``32-63``); ``pcie-two-socket``, the same two sockets, each pair of GPUs (0-1, 2-3, ...)
behind one PCIe switch (``PIX``), other pairs of a socket across its host bridges (``NODE``),
pairs of two sockets ``SYS``; ``nvlink-pairs``, GPUs 0-1, 2-3, ... joined by 4 NVLink links,
every other pair through the one host bridge (``PHB``), one NUMA node (CPUs ``0-31``). A host
the object does not name reports no interconnect.

The file is re-read whenever it changes (inode, mtime or size), so a test or a demo changes
load and health while the agent runs. Every entry appended to a GPU's ``xids`` list is
delivered once as an XID event (entries present at the first read too); shortening the list
delivers nothing. A file that does not parse while the agent runs is logged and the last
good content kept, since an editor may be halfway through saving it.

:func:`make_hosts` and :func:`write_inventory` write such files (demos and benchmarks);
``python -m nodeagent.simulated --hosts 8 --out inventory.json`` does it from a shell.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
import uuid as uuid_module
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from allocator.settings_files import model_problems
from allocator.wire.interconnect import GpuLink, HostGpu, HostInterconnect, LinkLevel
from allocator.wire.model_names import mig_model_name
from allocator.wire.protocol import MAX_MIB
from nodeagent.inventory import (
    GPUSample,
    InventoryUnavailable,
    ProcessSample,
    SourceKind,
    XidEvent,
)

log = logging.getLogger(__name__)

RELOAD_POLL_S = 0.05
"""How often ``wait_xids`` looks at the file while it waits: a changed file's XIDs reach the
agent within this, so tests stay fast without busy-waiting."""


class SimulatedProcess(BaseModel):
    """A process using a simulated GPU. ``pid`` is a real host PID when the container
    mapping is to be exercised (its ``/proc/<pid>/cgroup`` is read like NVML's PIDs)."""

    model_config = ConfigDict(extra="forbid")

    pid: int = Field(ge=1, le=(1 << 31) - 1)
    used_memory_mib: int | None = Field(default=None, ge=0, le=MAX_MIB)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    memory_utilization_pct: float | None = Field(default=None, ge=0, le=100)
    container_id: str | None = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="The container it runs in, taken over its /proc/<pid>/cgroup: so a "
        "process can stay listed after its container died, as a process the driver still "
        "holds would.")
    name: str | None = Field(
        default=None, max_length=64,
        description="Its command name, taken over /proc/<pid>/comm.")


class SimulatedMigInstance(BaseModel):
    """One MIG instance of a simulated GPU in MIG mode."""

    model_config = ConfigDict(extra="forbid")

    uuid: str = Field(min_length=1, pattern=r"^MIG-")
    profile: str = Field(min_length=1, pattern=r"^[0-9a-z.+]+$", examples=["1g.5gb"])
    memory_total_mib: int = Field(ge=0)
    memory_used_mib: int = Field(default=0, ge=0)
    mig_index: int | None = Field(
        default=None, ge=0, description="Default: its position in the list.")
    processes: list[SimulatedProcess] = Field(default_factory=list)
    processes_error: bool = Field(
        default=False, description="Its process listing fails (NVML's call raised): what "
        "runs on it is not known.")


class SimulatedGPU(BaseModel):
    """One GPU entry of the file."""

    model_config = ConfigDict(extra="forbid")

    uuid: str = Field(min_length=1)
    index: int = Field(ge=0)
    model: str = Field(min_length=1)
    memory_total_mib: int = Field(ge=0)
    memory_used_mib: int = Field(default=0, ge=0)
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    temperature_c: float | None = None
    power_w: float | None = Field(default=None, ge=0)
    energy_mj: int | None = Field(
        default=None, ge=0, description="The energy counter (mJ) as the test sets it. "
        "Absent: the source counts one itself from ``power_w`` over time, as a real GPU's "
        "counter grows with its power draw.")
    ecc_uncorrected: int | None = Field(default=None, ge=0)
    retired_pages: int | None = Field(default=None, ge=0)
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    mig_mode: bool | None = None
    compute_capability: str | None = Field(default=None, pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")
    architecture: str | None = Field(default=None, pattern=r"^[a-z0-9]{1,32}$")
    mig_instances: list[SimulatedMigInstance] = Field(default_factory=list)
    xids: list[int] = Field(default_factory=list)
    lost: bool = False
    processes: list[SimulatedProcess] = Field(default_factory=list)
    processes_error: bool = Field(
        default=False, description="Its process listing fails (NVML's call raised): what "
        "runs on it is not known.")

    @model_validator(mode="after")
    def _instances_need_mig_mode(self) -> SimulatedGPU:
        if self.mig_instances and self.mig_mode is not True:
            raise ValueError("mig_instances are listed but mig_mode is not true")
        return self

    def sample(self) -> GPUSample:
        """This entry as an inventory sample (the physical GPU only)."""
        return GPUSample(
            uuid=self.uuid,
            index=self.index,
            model=self.model,
            memory_total_mib=self.memory_total_mib,
            memory_used_mib=self.memory_used_mib,
            utilization_pct=self.utilization_pct,
            temperature_c=self.temperature_c,
            power_w=self.power_w,
            ecc_uncorrected=self.ecc_uncorrected,
            retired_pages=self.retired_pages,
            remap_pending=self.remap_pending,
            remap_failed=self.remap_failed,
            mig_mode=self.mig_mode,
            lost=self.lost,
            processes=_processes(self.processes, failed=self.processes_error or self.lost),
            compute_capability=self.compute_capability,
            architecture=self.architecture,
        )

    def samples(self) -> list[GPUSample]:
        """The GPU, then (in MIG mode) each of its instances as NVML would report them."""
        result = [self.sample()]
        if self.mig_mode:
            for position, instance in enumerate(self.mig_instances):
                result.append(
                    GPUSample(
                        uuid=instance.uuid,
                        index=self.index,
                        model=mig_model_name(self.model, instance.profile),
                        memory_total_mib=instance.memory_total_mib,
                        memory_used_mib=instance.memory_used_mib,
                        lost=self.lost,
                        processes=_processes(instance.processes,
                                             failed=instance.processes_error or self.lost),
                        compute_capability=self.compute_capability,
                        architecture=self.architecture,
                        mig_parent_uuid=self.uuid,
                        mig_profile=instance.profile,
                        mig_index=position if instance.mig_index is None else instance.mig_index,
                    )
                )
        return result


def _processes(processes: list[SimulatedProcess], *, failed: bool
               ) -> tuple[ProcessSample, ...] | None:
    """The listed processes as samples; None (not known) where the listing fails, as NVML's
    does for a lost GPU too."""
    if failed:
        return None
    return tuple(ProcessSample(p.pid, p.used_memory_mib, p.utilization_pct, p.container_id,
                               p.name, p.memory_utilization_pct) for p in processes)


class SimulatedLeaseUse(BaseModel):
    """What a lease's container uses on each of its GPUs, as if NVML attributed it."""

    model_config = ConfigDict(extra="forbid")

    utilization_pct: float = Field(ge=0, le=100)
    memory_used_mib: int = Field(default=0, ge=0)
    memory_utilization_pct: float | None = Field(default=None, ge=0, le=100)


TopologyPreset = Literal["hgx", "pcie-two-socket", "nvlink-pairs"]
"""The interconnects a simulated host may name instead of writing one out."""

TOPOLOGY_PRESETS: tuple[TopologyPreset, ...] = get_args(TopologyPreset)

_SOCKET_CPUS = ("0-31", "32-63")
"""The CPUs of each NUMA node of a preset host."""


def preset_interconnect(preset: TopologyPreset, uuids: Sequence[str]) -> HostInterconnect:
    """The interconnect of ``preset`` (see the module's documentation) over GPUs ``uuids``,
    in index order."""
    count = len(uuids)
    two_sockets = preset != "nvlink-pairs"

    def node(i: int) -> int:
        return i * 2 // count if two_sockets else 0

    def link(i: int, j: int) -> tuple[LinkLevel, int]:
        if preset == "hgx":
            return LinkLevel.NVLINK, 18
        same_pair = i // 2 == j // 2
        if preset == "nvlink-pairs":
            return (LinkLevel.NVLINK, 4) if same_pair else (LinkLevel.HOSTBRIDGE, 0)
        if node(i) != node(j):
            return LinkLevel.SYSTEM, 0
        return (LinkLevel.SINGLE if same_pair else LinkLevel.NODE), 0

    return HostInterconnect(
        gpus=tuple(HostGpu(uuid=uuid, numa_node=node(i), cpus=_SOCKET_CPUS[node(i)])
                   for i, uuid in enumerate(uuids)),
        links=tuple(GpuLink(a=uuids[i], b=uuids[j], level=level, nvlinks=nvlinks)
                    for i in range(count) for j in range(i + 1, count)
                    for level, nvlinks in [link(i, j)]))


class SimulatedInventory(BaseModel):
    """The whole file: host name → its GPUs, per-lease use (lease id → use), and how hosts'
    GPUs are joined (host name → a preset or the interconnect)."""

    model_config = ConfigDict(extra="forbid")

    hosts: dict[str, list[SimulatedGPU]] = Field(default_factory=dict)
    leases: dict[str, SimulatedLeaseUse] = Field(default_factory=dict)
    topology: dict[str, TopologyPreset | HostInterconnect] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _topology_of_listed_gpus(self) -> SimulatedInventory:
        for host in self.topology:
            self.interconnect_of(host)  # raises for a host it cannot describe
        return self

    def interconnect_of(self, host: str) -> HostInterconnect | None:
        """The interconnect of ``host``'s GPUs; None where ``topology`` does not name it.
        ValueError when it names a host without GPUs, or other GPUs than the host's."""
        described = self.topology.get(host)
        if described is None:
            return None
        uuids = [gpu.uuid for gpu in sorted(self.hosts.get(host, []), key=lambda g: g.index)]
        if not uuids:
            raise ValueError(f"topology of {host!r}: the host lists no GPUs")
        if isinstance(described, str):
            return preset_interconnect(described, uuids)
        if set(described.uuids) != set(uuids):
            raise ValueError(f"topology of {host!r} names GPUs {sorted(described.uuids)}, "
                             f"the host lists {sorted(uuids)}")
        return described


def parse_inventory(text: str) -> SimulatedInventory:
    """Parse the file's content; raises ``ValueError`` with one line naming each bad key (an
    unknown one with the nearest it could be: ``hosts.gpu-a.0.modle: unknown key; did you
    mean model?``)."""
    try:
        return SimulatedInventory.model_validate_json(text)
    except ValidationError as exc:
        problems = "; ".join(model_problems(SimulatedInventory, exc))
        raise ValueError(f"not a simulated inventory: {problems}") from exc


class SimulatedSource:
    """An :class:`~nodeagent.inventory.InventorySource` over a simulated inventory file."""

    kind: SourceKind = "simulated"

    def __init__(
        self, path: Path | str, host: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(path)
        self.host = host
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._signature: tuple[int, int, int] | None = None
        self._gpus: list[SimulatedGPU] = []
        self._lease_use: dict[str, SimulatedLeaseUse] = {}
        self._interconnect: HostInterconnect | None = None
        self._xids_seen: dict[str, int] = {}
        self._energy: dict[str, tuple[float, float]] = {}
        """Per GPU uuid without ``energy_mj`` in the file: (clock at the last read, mJ
        counted)."""
        self._pending: list[XidEvent] = []
        self._closed = False
        self.reloads = 0
        """How often the file was (re)read successfully."""
        with self._lock:
            try:
                self._refresh_locked(strict=True)
            except (OSError, ValueError) as exc:
                raise InventoryUnavailable(
                    f"simulated inventory {self.path}: {exc}"
                ) from exc
        if not self._gpus:
            log.warning("simulated inventory %s lists no GPUs for host %r", self.path, host)

    def read_gpus(self) -> list[GPUSample]:
        """This host's GPUs as the file says now, each physical GPU with its energy counter:
        the file's ``energy_mj``, or else the one this source counts from ``power_w``."""
        with self._lock:
            self._refresh_locked(strict=False)
            now = self._clock()
            samples = []
            for gpu in self._gpus:
                for sample in gpu.samples():
                    if not sample.is_mig_instance and not sample.lost:
                        energy = gpu.energy_mj
                        if energy is None:
                            energy = self._counted_energy(gpu.uuid, gpu.power_w, now)
                        sample = dataclasses.replace(sample, energy_mj=energy)
                    samples.append(sample)
            return samples

    def _counted_energy(self, uuid: str, power_w: float | None, now: float) -> int | None:
        # Power (as the file says now) times the time since the last read, added up: the
        # counter a GPU of that draw would show. None without a power reading.
        if power_w is None:
            return None
        last_at, total = self._energy.get(uuid, (now, 0.0))
        total += power_w * max(now - last_at, 0.0) * 1000.0
        self._energy[uuid] = (now, total)
        return int(total)

    def read_interconnect(self) -> HostInterconnect | None:
        """How this host's GPUs are joined as the file's ``topology`` says now; None where it
        does not name this host."""
        with self._lock:
            self._refresh_locked(strict=False)
            return self._interconnect

    def lease_use(self) -> dict[str, SimulatedLeaseUse]:
        """Per lease id: the use the file sets for that lease's container (``leases``)."""
        with self._lock:
            self._refresh_locked(strict=False)
            return dict(self._lease_use)

    def wait_xids(self, timeout_s: float) -> list[XidEvent]:
        """XIDs appended to the file since the last call, waiting at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._refresh_locked(strict=False)
                if self._pending or self._closed:
                    events, self._pending = self._pending, []
                    return events
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._changed.wait(min(remaining, RELOAD_POLL_S))

    def close(self) -> None:
        """Wake a waiting ``wait_xids`` so the XID thread can end at once."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def _refresh_locked(self, *, strict: bool) -> None:
        # Re-read only when the file changed: an atomic replace changes the inode, an
        # in-place edit the mtime or size.
        try:
            stat = self.path.stat()
        except OSError:
            if strict:
                raise
            log.warning("simulated inventory %s is unreadable; keeping the last one", self.path)
            return
        signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if signature == self._signature:
            return
        try:
            inventory = parse_inventory(self.path.read_text())
        except (OSError, ValueError) as exc:
            if strict:
                raise
            log.warning("simulated inventory %s: %s; keeping the last good one", self.path, exc)
            self._signature = signature  # do not re-parse a broken file on every call
            return
        self._signature = signature
        self._gpus = sorted(inventory.hosts.get(self.host, []), key=lambda gpu: gpu.index)
        self._lease_use = dict(inventory.leases)
        self._interconnect = inventory.interconnect_of(self.host)
        self.reloads += 1
        now = self._clock()
        for gpu in self._gpus:
            seen = self._xids_seen.get(gpu.uuid, 0)
            if len(gpu.xids) > seen:
                self._pending.extend(XidEvent(gpu.uuid, xid, now) for xid in gpu.xids[seen:])
            self._xids_seen[gpu.uuid] = len(gpu.xids)
        if self._pending:
            self._changed.notify_all()


# --------------------------------------------------------------------------- writing files

MODELS: dict[str, tuple[int, float]] = {
    "NVIDIA GeForce GTX 1070": (8192, 150.0),
    "NVIDIA GeForce RTX 3090": (24576, 350.0),
    "Tesla V100-SXM2-16GB": (16384, 300.0),
    "NVIDIA A100-SXM4-40GB": (40960, 400.0),
    "NVIDIA H100 80GB HBM3": (81559, 700.0),
}
"""Models the generator mixes: NVML name → (memory MiB, power limit W)."""

CAPABILITIES: dict[str, tuple[str, str]] = {
    "NVIDIA GeForce GTX 1070": ("6.1", "pascal"),
    "NVIDIA GeForce RTX 3090": ("8.6", "ampere"),
    "Tesla V100-SXM2-16GB": ("7.0", "volta"),
    "NVIDIA A100-SXM4-40GB": ("8.0", "ampere"),
    "NVIDIA H100 80GB HBM3": ("9.0", "hopper"),
}
"""NVML name → (CUDA compute capability, architecture), as the real boards report them."""

MIG_PROFILE_MIB: dict[str, int] = {
    "1g.5gb": 4864, "2g.10gb": 9856, "3g.20gb": 19968, "4g.20gb": 19968, "7g.40gb": 40192,
    "1g.10gb": 9984, "1g.20gb": 19968, "2g.20gb": 20096, "3g.40gb": 40320, "4g.40gb": 40320,
    "7g.80gb": 80896,
}
"""Memory of the A100 40GB and H100 80GB GPU instance profiles as NVML reports them (MiB)."""


def simulated_mig_uuid(host: str, index: int, mig_index: int) -> str:
    """A stable, NVML-shaped MIG device UUID (same input, same UUID)."""
    name = f"{host}/gpu{index}/mig{mig_index}"
    return "MIG-" + str(uuid_module.uuid5(uuid_module.NAMESPACE_DNS, name))


def make_mig_instances(
    host: str, index: int, profiles: Sequence[str], *, first: int = 0
) -> list[dict[str, Any]]:
    """MIG instance entries of the given profiles (``["3g.20gb", "1g.5gb"]``); their uuids are
    stable per position, counted from ``first`` (a re-partition passes fresh positions)."""
    return [
        {
            "uuid": simulated_mig_uuid(host, index, first + position),
            "profile": profile,
            "memory_total_mib": MIG_PROFILE_MIB.get(profile, 4864),
            "mig_index": position,
        }
        for position, profile in enumerate(profiles)
    ]


def simulated_uuid(host: str, index: int) -> str:
    """A stable, NVML-shaped UUID for GPU ``index`` of ``host`` (same input, same UUID)."""
    return "GPU-" + str(uuid_module.uuid5(uuid_module.NAMESPACE_DNS, f"{host}/gpu{index}"))


def make_gpu(host: str, index: int, model: str, **fields: Any) -> dict[str, Any]:
    """One idle, healthy GPU entry; ``fields`` override any key."""
    memory, _power = MODELS.get(model, (16384, 250.0))
    capability = CAPABILITIES.get(model)
    entry: dict[str, Any] = {
        "uuid": simulated_uuid(host, index),
        "index": index,
        "model": model,
        "memory_total_mib": memory,
        "memory_used_mib": 0,
        "utilization_pct": 0.0,
        "temperature_c": 35.0,
        "power_w": 25.0,
        "ecc_uncorrected": 0,
        "xids": [],
        "lost": False,
    }
    if capability is not None:
        entry["compute_capability"], entry["architecture"] = capability
    entry.update(fields)
    return entry


def make_mig_gpu(
    host: str, index: int, model: str, profiles: Sequence[str], **fields: Any
) -> dict[str, Any]:
    """A GPU in MIG mode carved into instances of ``profiles``; ``fields`` override any key."""
    entry = make_gpu(host, index, model, mig_mode=True,
                     mig_instances=make_mig_instances(host, index, profiles))
    entry.update(fields)
    return entry


def make_hosts(
    n_hosts: int,
    gpus_per_host: int | Sequence[int] = 4,
    models: Sequence[str] | None = None,
    prefix: str = "gpu-node",
) -> dict[str, list[dict[str, Any]]]:
    """``n_hosts`` hosts of mixed models: host *i* has only ``models[i % len(models)]`` GPUs
    (real clusters are mostly homogeneous per host) and ``gpus_per_host`` of them (an int,
    or a sequence cycled over the hosts)."""
    model_list = list(models or MODELS)
    counts = [gpus_per_host] if isinstance(gpus_per_host, int) else list(gpus_per_host)
    hosts: dict[str, list[dict[str, Any]]] = {}
    for i in range(n_hosts):
        host = f"{prefix}-{i:03d}"
        model = model_list[i % len(model_list)]
        hosts[host] = [make_gpu(host, j, model) for j in range(counts[i % len(counts)])]
    return hosts


def write_inventory(path: Path | str, hosts: dict[str, list[dict[str, Any]]],
                    leases: dict[str, dict[str, Any]] | None = None,
                    topology: dict[str, str | dict[str, Any]] | None = None) -> None:
    """Write (atomically: temp file + rename) a simulated inventory file, with per-lease use
    (``leases``: lease id -> ``{"utilization_pct": ..., "memory_used_mib": ...}``) and how
    hosts' GPUs are joined (``topology``: host -> a preset name or an interconnect) if given.

    Atomic so a running agent never reads half a file, and so every write changes the
    inode and is noticed even when it lands in the same mtime tick as the last one.
    """
    target = Path(path)
    content: dict[str, Any] = {"hosts": hosts}
    if leases:
        content["leases"] = leases
    if topology:
        content["topology"] = topology
    parse_inventory(json.dumps(content))  # refuse to write what the agent would refuse
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(content, handle, indent=1)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_inventory(path: Path | str) -> dict[str, list[dict[str, Any]]]:
    """The file's hosts as plain dicts, for editing and writing back."""
    data: dict[str, list[dict[str, Any]]] = json.loads(Path(path).read_text())["hosts"]
    return data


def update_gpu(path: Path | str, host: str, index: int, **changes: Any) -> dict[str, Any]:
    """Change fields of one GPU in the file (e.g. ``temperature_c=95``); returns the entry.
    The file's ``topology`` is kept.

    ``xid=N`` is a shorthand that appends N to the GPU's ``xids``.
    """
    hosts = read_inventory(path)
    topology = json.loads(Path(path).read_text()).get("topology")
    for entry in hosts.get(host, []):
        if entry["index"] == index:
            if "xid" in changes:
                entry.setdefault("xids", []).append(int(changes.pop("xid")))
            entry.update(changes)
            write_inventory(path, hosts, topology=topology)
            return entry
    raise KeyError(f"no GPU {index} on host {host!r} in {path}")


def main(argv: Sequence[str] | None = None) -> None:
    """Write a simulated inventory file for demos and benchmarks."""
    parser = argparse.ArgumentParser(
        prog="python -m nodeagent.simulated", description=main.__doc__
    )
    parser.add_argument("--hosts", type=int, default=4, help="number of hosts")
    parser.add_argument("--gpus", type=int, default=4, help="GPUs per host")
    parser.add_argument("--prefix", default="gpu-node", help="host name prefix")
    parser.add_argument("--host", action="append", default=[],
                        help="also add this host name (e.g. this machine's), repeatable")
    parser.add_argument("--model", action="append", default=None,
                        help="model to mix in (repeatable); default: all known models")
    parser.add_argument("--topology", choices=TOPOLOGY_PRESETS, default=None,
                        help="how every host's GPUs are joined (default: not described)")
    parser.add_argument("--out", required=True, help="file to write")
    args = parser.parse_args(argv)
    hosts = make_hosts(args.hosts, args.gpus, args.model, args.prefix)
    models = list(args.model or MODELS)
    for i, name in enumerate(args.host):
        hosts[name] = [make_gpu(name, j, models[i % len(models)]) for j in range(args.gpus)]
    topology: dict[str, str | dict[str, Any]] = {
        name: args.topology for name, gpus in hosts.items() if gpus and args.topology}
    write_inventory(args.out, hosts, topology=topology)
    print(json.dumps({"path": str(args.out), "hosts": len(hosts),
                      "gpus": sum(len(g) for g in hosts.values())}))


if __name__ == "__main__":
    main()
