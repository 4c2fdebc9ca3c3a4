"""Idle, measured on the GPU: each heartbeat's per-container use of a bound lease updates the
lease's ``idle_since`` (persisted only when it changes) and its in-memory use history."""

from __future__ import annotations

from allocator.engine.state import EngineState
from allocator.lease import LeaseRecord
from allocator.lease_use import is_idle, sample_of
from allocator.ledger import Changes
from allocator.protocol import ContainerInfo, LeaseState, UsageSample


class IdleWatch(EngineState):
    """Turns the agents' per-process accounting into idle spells of leases."""

    def _observe_use(self, record: LeaseRecord, info: ContainerInfo, now: float,
                     changes: Changes) -> None:
        """One heartbeat's listing of the lease's container: its sample, and the start or end
        of an idle spell. Only bound leases are measured (a granted one has no container)."""
        if record.state is not LeaseState.BOUND:
            return
        sample = sample_of(record.gpu_uuids, info.gpu_use)
        self.use.observe(record.lease_id, now, sample)
        idle = is_idle(sample, self.settings.idle_utilization_pct, self.settings.idle_memory_mib)
        if idle and record.idle_since is None:
            record.idle_since = now
            changes.lease(record)
        elif not idle and record.idle_since is not None:
            self._close_idle_spell(record, now)
            changes.lease(record)

    def _close_idle_spell(self, record: LeaseRecord, now: float) -> None:
        """Account an idle spell that ends now (busy again, or the lease ends)."""
        if record.idle_since is not None:
            record.idle_gpu_s += float(record.units) * max(now - record.idle_since, 0.0)
            record.idle_since = None

    def idle_for(self, record: LeaseRecord, now: float) -> float:
        """How long the lease has been idle without a break (0: busy or not measured)."""
        return 0.0 if record.idle_since is None else max(now - record.idle_since, 0.0)

    def use_now(self, lease_id: str) -> tuple[float | None, int] | None:
        """(utilization %, memory MiB) of the lease's processes at the newest heartbeat."""
        sample = self.use.latest(lease_id)
        return None if sample is None else (sample.utilization_pct, sample.memory_used_mib)

    def usage_of(self, lease_id: str) -> list[UsageSample]:
        """Per-minute use of the lease, oldest first (in memory since this process started)."""
        return self.use.history(lease_id)
