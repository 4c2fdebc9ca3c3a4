"""What a lease's containers use, measured on the GPU: each heartbeat's per-container use of a
lease updates its ``idle_since`` (persisted only when it changes), its in-memory use history,
and whether a shared slice is over its memory budget."""

from __future__ import annotations

from allocator.config import AllocatorSettings
from allocator.counters import Count, Counters
from allocator.lease import LeaseRecord
from allocator.lease_use import UseBook, is_idle, sample_of
from allocator.ledger import Changes
from allocator.protocol import ContainerInfo, LeaseState, UsageSample


class IdleWatch:
    """Turns the agents' per-process accounting into idle spells and budget warnings.

    Its state is memory only (not in the ledger): a reload keeps it. Invariant: it holds
    nothing about a lease after :meth:`lease_ended`.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters) -> None:
        self.settings = settings
        self.counters = counters
        self.use = UseBook(settings.usage_history_s)
        """Per lease: its processes' GPU use from heartbeats."""
        self.over_budget: set[str] = set()
        """Shared leases whose processes use more memory than their budget (one event each
        time a lease goes over)."""

    def observe(self, record: LeaseRecord, info: ContainerInfo, now: float,
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
            self.close_spell(record, now)
            changes.lease(record)

    def check_budget(self, record: LeaseRecord, info: ContainerInfo, now: float,
                     changes: Changes) -> None:
        """A shared lease's processes over its memory budget: an event when it goes over."""
        if not record.shared or record.memory_mib is None:
            return
        used = sum(use.memory_used_mib for use in info.gpu_use)
        if used > record.memory_mib and record.lease_id not in self.over_budget:
            self.over_budget.add(record.lease_id)
            self.counters.add(Count.OVER_BUDGET)
            changes.event(now, "over_budget", host=record.host, lease_id=record.lease_id,
                          user=record.user, used_mib=used, budget_mib=record.memory_mib)
        elif used <= record.memory_mib:
            self.over_budget.discard(record.lease_id)

    def close_spell(self, record: LeaseRecord, now: float) -> None:
        """Account an idle spell that ends now (busy again, or the lease ends)."""
        if record.idle_since is not None:
            record.idle_gpu_s += float(record.units) * max(now - record.idle_since, 0.0)
            record.idle_since = None

    def lease_ended(self, record: LeaseRecord, now: float) -> None:
        """The lease ends now: close its idle spell and forget its use."""
        self.close_spell(record, now)
        self.use.forget(record.lease_id)
        self.over_budget.discard(record.lease_id)

    @staticmethod
    def idle_for(record: LeaseRecord, now: float) -> float:
        """How long the lease has been idle without a break (0: busy or not measured)."""
        return 0.0 if record.idle_since is None else max(now - record.idle_since, 0.0)

    def use_now(self, lease_id: str) -> tuple[float | None, int] | None:
        """(utilization %, memory MiB) of the lease's processes at the newest heartbeat."""
        sample = self.use.latest(lease_id)
        return None if sample is None else (sample.utilization_pct, sample.memory_used_mib)

    def usage_of(self, lease_id: str) -> list[UsageSample]:
        """Per-minute use of the lease, oldest first (in memory since this process started)."""
        return self.use.history(lease_id)
