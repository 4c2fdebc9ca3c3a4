"""What a lease's containers use, measured on the GPU: each heartbeat's per-container use of a
lease updates its ``idle_since`` (persisted only when it changes), its measured usage
(energy, SM- and memory-seconds, peak memory; written at most every ``USAGE_WRITE_S``), its
in-memory use history, and whether a shared slice is over its memory budget (warned, or
stopped, after ``over_budget_grace_s``)."""

from __future__ import annotations

from allocator.config import AllocatorSettings
from allocator.engine.lease_use import UseBook, fold_usage, is_idle, sample_of
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.metrics.counters import Count, Counters
from allocator.wire.protocol import ContainerInfo, LeaseState, UsageSample

USAGE_WRITE_S = 60.0
"""A lease's measured usage is written at most this often while it runs (and with its end):
a write per lease per full report would be most of the ledger's writes. What a restart loses
of it is not lost: the next report adds its growth over the counters last written
(:func:`~allocator.engine.lease_use.fold_usage`)."""


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
        self.over_budget: dict[str, float] = {}
        """Shared leases whose processes use more memory than their budget -> since when
        (allocator time) without a break: one warning each time a lease goes over and stays
        over for ``over_budget_grace_s``."""
        self.warned: set[str] = set()
        self.usage_written: dict[str, float] = {}
        """Per lease: when its measured usage was last written (allocator time)."""
        """Leases of ``over_budget`` warned in their current spell (shown on the lease)."""

    def observe(self, record: LeaseRecord, info: ContainerInfo, now: float,
                changes: Changes) -> None:
        """One heartbeat's listing of the lease's container: its sample, and the start or end
        of an idle spell. Only bound leases are measured (a granted one has no container)."""
        if record.state is not LeaseState.BOUND:
            return
        if info.usage is not None and fold_usage(record, info.usage):
            written = self.usage_written.get(record.lease_id)
            if written is None or now - written >= USAGE_WRITE_S:
                self.usage_written[record.lease_id] = now
                changes.lease(record)
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
                     changes: Changes) -> bool:
        """A shared lease's processes over its memory budget: its spell starts; once it has
        lasted ``over_budget_grace_s``, the warning (an event, ``over_budget_since`` on the
        lease), once a spell. True when the lease is to be stopped now (``over_budget_action
        = "stop"``, a bound lease warned this very call): the caller stops it."""
        if not record.shared or record.memory_mib is None:
            return False
        lease_id = record.lease_id
        used = sum(use.memory_used_mib for use in info.gpu_use)
        if used <= record.memory_mib:
            self.over_budget.pop(lease_id, None)
            self.warned.discard(lease_id)
            return False
        since = self.over_budget.setdefault(lease_id, now)
        if lease_id in self.warned or now - since < self.settings.over_budget_grace_s:
            return False
        self.warned.add(lease_id)
        self.counters.add(Count.OVER_BUDGET)
        stop = self.settings.over_budget_action == "stop" and record.state is LeaseState.BOUND
        changes.event(now, "over_budget", host=record.host, lease_id=lease_id,
                      user=record.user, used_mib=used, budget_mib=record.memory_mib,
                      since=since, action="stop" if stop else "warn")
        return stop

    def over_budget_since(self, lease_id: str) -> float | None:
        """Since when a warned lease is over its budget; None: within it, or not warned
        yet."""
        return self.over_budget.get(lease_id) if lease_id in self.warned else None

    def close_spell(self, record: LeaseRecord, now: float) -> None:
        """Account an idle spell that ends now (busy again, or the lease ends)."""
        if record.idle_since is not None:
            record.idle_gpu_s += float(record.units) * max(now - record.idle_since, 0.0)
            record.idle_since = None

    def lease_ended(self, record: LeaseRecord, now: float) -> None:
        """The lease ends now: close its idle spell and forget its use."""
        self.close_spell(record, now)
        self.use.forget(record.lease_id)
        self.usage_written.pop(record.lease_id, None)
        self.over_budget.pop(record.lease_id, None)
        self.warned.discard(record.lease_id)

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
