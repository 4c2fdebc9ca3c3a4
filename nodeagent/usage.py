"""What each lease container used, measured from the GPU readings of successive heartbeats.

Pure bookkeeping, no I/O and no clock (times are passed in): the agent calls
:meth:`UsageMeter.measure` once per heartbeat with that heartbeat's readings, and reports
:meth:`UsageMeter.usage` per container (``ContainerInfo.usage``). Every counter only grows
within one measurement (``since``); a container seen for the first time, or after the agent
restarted, starts a new one, and the allocator adds measurements up.

Per interval between two readings (at most ``max_gap_s``, so a stalled agent does not count
a long gap at one reading's rate):

- **SM-seconds** and **memory-seconds**: the container's processes' SM and memory utilization
  on each of its GPUs (NVML's per-process samples, a fraction of the GPU) times the interval;
- **energy**: each physical GPU's energy-counter delta (millijoules). A GPU held by one lease
  container whole gives it all; a GPU shared by several (slices of it, or containers on its
  MIG instances) gives each the share of its processes in the SM utilization of every
  process on the GPU (and its instances), as NVML last sampled it: what non-lease processes
  used is nobody's. When no process on it reports utilization, or all report 0, the delta is
  split evenly among the containers holding it (an idle GPU's standing draw is the cost of
  holding it). A counter that went back (the driver reloaded) gives no delta;
- **peak memory**: the most memory its processes held at once on one GPU, at any reading.

The limits (sampling, apportioning by SM share) are in docs/operations.md, Usage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from allocator.wire.protocol import LeaseUsage
from nodeagent.inventory import GPUSample

DEFAULT_MAX_GAP_S = 60.0
"""The longest interval counted between two readings (the agent passes three heartbeat
intervals)."""


@dataclass(frozen=True)
class GpuUse:
    """One container's use of one GPU (or MIG instance) at one reading."""

    sm_pct: float | None = None
    memory_pct: float | None = None
    memory_mib: int = 0


@dataclass(frozen=True)
class Holder:
    """A running lease container and the GPUs (or MIG instances) it holds: its grant's, or
    (without one) those it was measured on."""

    container_id: str
    gpu_uuids: tuple[str, ...]
    groups: tuple[str, ...] = ()
    """The groups its grant was asked with (the metrics count it for each)."""


@dataclass
class _Measured:
    """One container's counters in the current measurement."""

    since: float
    energy_mj: float = 0.0
    sm_s: float = 0.0
    memory_s: float = 0.0
    peak_memory_mib: int = 0
    energy_known: bool = True


HOST = ""
"""The key of the host's own processes (in no container) in :func:`use_by_container`."""


def use_by_container(samples: Sequence[GPUSample], pid_containers: Mapping[int, str]
                     ) -> dict[str, dict[str, GpuUse]]:
    """Per container id (:data:`HOST` for processes in none), per GPU uuid: what its
    processes use there (their utilizations and memory added up; a utilization is None when
    none of them reports one)."""
    result: dict[str, dict[str, GpuUse]] = {}
    for sample in samples:
        for proc in sample.processes or ():
            container_id = pid_containers.get(proc.pid, HOST)
            held = result.setdefault(container_id, {})
            old = held.get(sample.uuid, GpuUse())
            held[sample.uuid] = GpuUse(
                sm_pct=_added(old.sm_pct, proc.utilization_pct),
                memory_pct=_added(old.memory_pct, proc.memory_utilization_pct),
                memory_mib=old.memory_mib + (proc.used_memory_mib or 0))
    return result


def _added(total: float | None, value: float | None) -> float | None:
    if value is None:
        return total
    return min(100.0, (total or 0.0) + value)


@dataclass
class UsageMeter:
    """Counters per running lease container, one measurement each (see the module)."""

    max_gap_s: float = DEFAULT_MAX_GAP_S
    _measured: dict[str, _Measured] = field(default_factory=dict)
    _energy: dict[str, int] = field(default_factory=dict)
    """Per physical GPU uuid: its energy counter at the last reading."""
    _last_at: float | None = None
    counted: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    """Since the agent started, per (group, GPU or MIG instance uuid): joules and SM-seconds
    counted for lease containers (a container of no group under ``""``; one of several
    groups for each): the metrics' counters, which never go back when a container ends."""

    def measure(self, now: float, samples: Sequence[GPUSample], holders: Iterable[Holder],
                use: Mapping[str, Mapping[str, GpuUse]]) -> None:
        """Count the interval since the last reading, with ``samples`` (this reading),
        ``holders`` (the running lease containers) and ``use`` (per container and GPU: every
        container's and the host's processes, as the shares of a GPU's energy are of all)."""
        interval = 0.0 if self._last_at is None else min(max(now - self._last_at, 0.0),
                                                         self.max_gap_s)
        self._last_at = now
        holders = list(holders)
        running = {holder.container_id for holder in holders}
        for gone in set(self._measured) - running:
            del self._measured[gone]
        parent_of = {s.uuid: (s.mig_parent_uuid or s.uuid) for s in samples}
        deltas = self._energy_deltas(samples)
        sm_on: dict[str, float] = {}  # physical GPU -> SM % of every process on it
        for gpus in use.values():
            for uuid, gpu_use in gpus.items():
                physical = parent_of.get(uuid, uuid)
                sm_on[physical] = sm_on.get(physical, 0.0) + (gpu_use.sm_pct or 0.0)
        holding: dict[str, list[str]] = {}  # physical GPU -> containers holding it
        for holder in holders:
            for physical in {parent_of.get(uuid, uuid) for uuid in holder.gpu_uuids}:
                holding.setdefault(physical, []).append(holder.container_id)
        for holder in holders:
            entry = self._measured.get(holder.container_id)
            if entry is None:  # a new measurement: it counts from the next interval on
                entry = self._measured[holder.container_id] = _Measured(since=now)
                first = True
            else:
                first = False
            mine = use.get(holder.container_id, {})
            for gpu_use in mine.values():
                entry.peak_memory_mib = max(entry.peak_memory_mib, gpu_use.memory_mib)
            if first or interval <= 0:
                continue
            groups = holder.groups or ("",)
            for uuid, gpu_use in mine.items():
                sm_s = (gpu_use.sm_pct or 0.0) / 100.0 * interval
                entry.sm_s += sm_s
                entry.memory_s += (gpu_use.memory_pct or 0.0) / 100.0 * interval
                self._count(groups, uuid, 0.0, sm_s)
            physical_mine: dict[str, float] = {}
            for uuid, gpu_use in mine.items():
                physical = parent_of.get(uuid, uuid)
                physical_mine[physical] = physical_mine.get(physical, 0.0) + (
                    gpu_use.sm_pct or 0.0)
            for physical in {parent_of.get(uuid, uuid) for uuid in holder.gpu_uuids}:
                delta = deltas.get(physical)
                if delta is None:
                    entry.energy_known = False
                    continue
                sharers = holding.get(physical, [])
                total = sm_on.get(physical, 0.0)
                if len(sharers) <= 1:
                    share = 1.0
                elif total > 0:
                    share = min(physical_mine.get(physical, 0.0) / total, 1.0)
                else:
                    share = 1.0 / len(sharers)
                entry.energy_mj += delta * share
                self._count(groups, physical, delta * share / 1000.0, 0.0)

    def _count(self, groups: Sequence[str], uuid: str, energy_j: float, sm_s: float) -> None:
        if energy_j <= 0 and sm_s <= 0:
            return
        for group in groups:
            before = self.counted.get((group, uuid), (0.0, 0.0))
            # A new tuple, never one changed in place: a scrape copies the dict from its thread.
            self.counted[group, uuid] = (before[0] + energy_j, before[1] + sm_s)

    def _energy_deltas(self, samples: Sequence[GPUSample]) -> dict[str, float]:
        """Per physical GPU with a counter now and at the last reading: the counter's delta
        (mJ); a counter that went back gives none."""
        deltas: dict[str, float] = {}
        for sample in samples:
            if sample.is_mig_instance or sample.energy_mj is None:
                continue
            before = self._energy.get(sample.uuid)
            self._energy[sample.uuid] = sample.energy_mj
            if before is not None and sample.energy_mj >= before:
                deltas[sample.uuid] = float(sample.energy_mj - before)
            elif before is not None:
                deltas[sample.uuid] = 0.0  # reset: known, but nothing to count this time
        return deltas

    def usage(self, container_id: str) -> LeaseUsage | None:
        """The container's counters as reported; None before it was measured."""
        entry = self._measured.get(container_id)
        if entry is None:
            return None
        return LeaseUsage(since=entry.since, energy_j=entry.energy_mj / 1000.0,
                          sm_s=entry.sm_s, memory_s=entry.memory_s,
                          peak_memory_mib=entry.peak_memory_mib,
                          energy_known=entry.energy_known)
