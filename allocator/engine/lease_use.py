"""A lease's own GPU use as heartbeats report it: the newest sample, per-minute history,
whether a sample is idle, and the measured usage folded into the lease (:func:`fold_usage`).
Pure data, no I/O and no clock (times are passed in).

The node agent attributes NVML's per-process accounting to containers
(``ContainerInfo.gpu_use``); a shared slice's use is that of its own container's processes,
never the whole GPU's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from allocator.ledger.lease import LeaseRecord
from allocator.wire.protocol import LeaseUsage, ProcessUse, UsageSample

MINUTE_S = 60.0


@dataclass(frozen=True)
class UseSample:
    """What a lease's processes used on its GPUs at one heartbeat."""

    utilization_pct: float | None
    """Mean over the lease's GPUs (a GPU its processes do not appear on counts 0); None when
    the agent could not read the utilization of a process that uses one of them."""
    memory_used_mib: int
    """Summed over the lease's GPUs."""


def sample_of(gpu_uuids: Sequence[str], uses: Sequence[ProcessUse]) -> UseSample:
    """The lease's sample from its container's per-GPU use (other GPUs' entries ignored)."""
    mine = [use for use in uses if use.gpu_uuid in gpu_uuids]
    memory = sum(use.memory_used_mib for use in mine)
    if any(use.utilization_pct is None for use in mine) or not gpu_uuids:
        return UseSample(None, memory)
    total = sum(use.utilization_pct or 0.0 for use in mine)
    return UseSample(total / len(gpu_uuids), memory)


def is_idle(sample: UseSample, utilization_below: float, memory_below_mib: int | None) -> bool:
    """Whether one sample is under the idle thresholds. Unknown utilization is not idle: idle
    must be measured, never assumed."""
    if sample.utilization_pct is None or sample.utilization_pct >= utilization_below:
        return False
    return memory_below_mib is None or sample.memory_used_mib < memory_below_mib


@dataclass
class _Minute:
    start: float
    utilization_sum: float = 0.0
    utilization_count: int = 0
    memory_max_mib: int = 0


@dataclass
class _LeaseUse:
    latest: UseSample
    minutes: deque[_Minute] = field(default_factory=deque)


class UseBook:
    """Per lease: the newest sample and per-minute aggregates over ``history_s``."""

    def __init__(self, history_s: float):
        self.history_s = history_s
        self._leases: dict[str, _LeaseUse] = {}

    def observe(self, lease_id: str, at: float, sample: UseSample) -> None:
        """Record one heartbeat's sample of a lease."""
        entry = self._leases.get(lease_id)
        if entry is None:
            entry = self._leases[lease_id] = _LeaseUse(sample)
        entry.latest = sample
        start = at - at % MINUTE_S
        if not entry.minutes or entry.minutes[-1].start < start:
            entry.minutes.append(_Minute(start))
        minute = entry.minutes[-1]
        if sample.utilization_pct is not None:
            minute.utilization_sum += sample.utilization_pct
            minute.utilization_count += 1
        minute.memory_max_mib = max(minute.memory_max_mib, sample.memory_used_mib)
        while entry.minutes and entry.minutes[0].start < at - self.history_s:
            entry.minutes.popleft()

    def latest(self, lease_id: str) -> UseSample | None:
        """The newest sample of a lease, or None if none was reported."""
        entry = self._leases.get(lease_id)
        return None if entry is None else entry.latest

    def history(self, lease_id: str) -> list[UsageSample]:
        """Per-minute use of a lease, oldest first."""
        entry = self._leases.get(lease_id)
        if entry is None:
            return []
        return [UsageSample(
            at=m.start, memory_used_mib=m.memory_max_mib,
            utilization_pct=(m.utilization_sum / m.utilization_count
                             if m.utilization_count else None))
            for m in entry.minutes]

    def forget(self, lease_id: str) -> None:
        """Drop a lease's samples (it ended)."""
        self._leases.pop(lease_id, None)

    def clear(self) -> None:
        """Drop everything (a reload from the ledger: the history is not in it)."""
        self._leases.clear()


def fold_usage(record: LeaseRecord, usage: LeaseUsage) -> bool:
    """Add what ``usage`` counted since the lease last took a report of its measurement; True
    when the record changed.

    A report of the measurement folded in last (the same ``since``) adds its growth over the
    counters taken then (``usage_run_*``, kept with the lease, so a restart or takeover that
    lost memory still adds only the growth); one of a newer measurement (the agent restarted,
    or the lease was adopted) adds all it counted; one of an older measurement (a late
    report) adds nothing. A counter that went back adds nothing. Peak memory is the highest
    of all.
    """
    if record.usage_since is not None and usage.since < record.usage_since:
        return False
    same = record.usage_since is not None and usage.since == record.usage_since
    before = ((record.usage_run_energy_j or 0.0, record.usage_run_sm_s or 0.0,
               record.usage_run_memory_s or 0.0) if same else (0.0, 0.0, 0.0))
    now = (usage.energy_j, usage.sm_s, usage.memory_s)
    peak = max(record.peak_memory_mib or 0, usage.peak_memory_mib)
    if same and now == before and peak == record.peak_memory_mib:
        return False
    grown = [max(new - old, 0.0) for new, old in zip(now, before, strict=True)]
    record.energy_j = (record.energy_j or 0.0) + grown[0]
    record.sm_s = (record.sm_s or 0.0) + grown[1]
    record.memory_s = (record.memory_s or 0.0) + grown[2]
    record.peak_memory_mib = peak
    record.usage_since = usage.since
    record.usage_run_energy_j, record.usage_run_sm_s, record.usage_run_memory_s = now
    return True
