"""Reclaim and idle release: the engine acts on :func:`allocator.fairshare.plan_reclaims`.

On every tick while requests wait, and when a request queues (the dispatcher calls
:meth:`Reclaimer.run` then): leases the plan names are warned (``reclaim_at``, an event
``reclaim_warning``), warnings the plan no longer needs are withdrawn, and a warned lease whose
grace is over has its container stopped with the command the agents already obey; the lease
then ends with its reason (``reclaimed`` or ``idle``) however its end is noticed.
"""

from __future__ import annotations

from allocator import fairshare, policy
from allocator.config import AllocatorSettings
from allocator.counters import Counters, Family
from allocator.engine.fence import StartFence
from allocator.engine.idle import IdleWatch
from allocator.engine.leases import LeaseBook
from allocator.engine.placement import Placer
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import (
    LeaseState,
    ReclaimReason,
    ReleaseReason,
    StopReason,
)


class Reclaimer:
    """Warns, withdraws and carries out reclaims of borrowed and idle leases.

    Its state is on the leases (``borrowed``, ``reclaim_at``, ``reclaim_reason``,
    ``reclaim_for``, ``reclaim_stopped_at``: in the ledger, so a warning survives a restart).
    Invariant: a lease within its owner's guarantee is never warned; nothing is planned while
    the start fence holds.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, book: LeaseBook,
                 idle: IdleWatch, placer: Placer, start_fence: StartFence) -> None:
        self.settings = settings
        self.counters = counters
        self.book = book
        self.idle = idle
        self.placer = placer
        self.start_fence = start_fence

    def _fair_share_active(self) -> bool:
        """Whether anything could ever be reclaimed: a borrow limit above a guarantee, or
        idle release on. Otherwise the tick skips fair share entirely."""
        s = self.settings
        return bool(s.user_borrow_limit or s.group_borrow_limit
                    or s.user_model_borrow_limit or s.group_model_borrow_limit
                    or s.default_user_borrow_limit is not None
                    or s.idle_release_after_s is not None)

    def run(self, now: float, changes: Changes) -> bool:
        """Plan, warn, withdraw and stop (see the module). True when GPUs were freed (the
        caller serves the queue)."""
        if not self._fair_share_active() or self.start_fence.holds(now):
            return False
        self._recompute_borrowed(changes)
        book = self.book
        warned = [r for r in book.holding() if r.reclaim_at is not None
                  and r.reclaim_stopped_at is None]
        if not book.queue and not warned:
            return False
        candidates = self._candidates(now)
        if not candidates and not warned:
            return False  # nothing could go: no need to simulate the queue
        leaving = {r.lease_id: r.gpu_uuids for r in book.holding()
                   if r.state is LeaseState.RELEASING or r.reclaim_stopped_at is not None}
        plan = fairshare.plan_reclaims(
            self._waiters() if book.queue else [], candidates,
            self.placer.view(now), self.settings, now=now,
            down_after_s=self.settings.node_down_after_s,
            idle_window_s=self.settings.idle_window_s, leaving=leaving)
        for record in warned:
            if record.lease_id not in plan:
                self._withdraw(record, now, changes)
        freed = False
        for lease_id, reclaim in plan.items():
            record = book.leases[lease_id]
            if record.reclaim_at is None or record.reclaim_reason is not reclaim.reason:
                self._warn(record, reclaim, now, changes)
            if record.reclaim_at is not None and now >= record.reclaim_at:
                freed = self._carry_out(record, now, changes) or freed
        return freed

    def _recompute_borrowed(self, changes: Changes) -> None:
        """Recompute which holding leases are borrowed (an older lease of the same scope may
        have ended); a lease moved within its guarantee loses a pending reclaim warning."""
        holding = self.book.holding()
        borrowed = fairshare.borrowed_leases(
            [fairshare.Holding(r.lease_id, r.user, r.groups, r.units, r.granted_at or 0.0,
                               r.borrowed, r.model) for r in holding], self.settings)
        for record in holding:
            now_borrowed = record.lease_id in borrowed
            if record.borrowed != now_borrowed:
                record.borrowed = now_borrowed
                changes.lease(record)

    def _waiters(self) -> list[fairshare.Waiter]:
        waiters = []
        for _, lease_id in self.book.queue:
            demand = self.book.queued_demand(self.book.leases[lease_id])
            if isinstance(demand, policy.Demand):
                waiters.append(fairshare.Waiter(lease_id, demand))
        return waiters

    def _candidates(self, now: float) -> list[fairshare.Candidate]:
        release_after = self.settings.idle_release_after_s
        candidates = []
        for record in self.book.holding():
            if record.state is LeaseState.RELEASING or record.reclaim_stopped_at is not None:
                continue
            idle_s = self.idle.idle_for(record, now)
            releasable = release_after is not None and idle_s >= release_after
            if record.borrowed or releasable:
                candidates.append(fairshare.Candidate(
                    lease_id=record.lease_id, gpu_uuids=record.gpu_uuids,
                    granted_at=record.granted_at or 0.0, idle_s=idle_s,
                    warned=record.reclaim_at is not None, borrowed=record.borrowed,
                    idle_releasable=releasable))
        return candidates

    def _warn(self, record: LeaseRecord, reclaim: fairshare.Reclaim, now: float,
              changes: Changes) -> None:
        if record.reclaim_at is None:
            record.reclaim_at = now + self.settings.reclaim_grace_s
        record.reclaim_reason = reclaim.reason
        record.reclaim_for = reclaim.for_lease
        changes.lease(record)
        changes.event(now, "reclaim_warning", host=record.host, lease_id=record.lease_id,
                      user=record.user, reason=reclaim.reason.value,
                      reclaim_at=record.reclaim_at, for_lease=reclaim.for_lease)
        self.counters.add_to(Family.RECLAIM_WARNED, reclaim.reason.value)

    def _withdraw(self, record: LeaseRecord, now: float, changes: Changes) -> None:
        changes.event(now, "reclaim_withdrawn", host=record.host, lease_id=record.lease_id,
                      user=record.user, reason=(record.reclaim_reason.value
                                                if record.reclaim_reason else None))
        record.reclaim_at = record.reclaim_reason = record.reclaim_for = None
        changes.lease(record)

    def _carry_out(self, record: LeaseRecord, now: float, changes: Changes) -> bool:
        """The grace is over and the GPUs are still needed: stop the container (the lease ends
        when it is gone), or end a lease that has none at once. Returns whether GPUs are free."""
        reason = record.reclaim_reason or ReclaimReason.RECLAIMED
        record.reclaim_stopped_at = now
        by = "allocator"
        note = f"{reason.value} for lease {record.reclaim_for}"
        changes.event(now, "reclaim_stop", host=record.host, lease_id=record.lease_id,
                      user=record.user, reason=reason.value, for_lease=record.reclaim_for)
        if record.container_id is None:
            # Granted, never bound: nothing runs to stop; a container starting later is a
            # zombie and is stopped as one.
            self.book.end(record, LeaseState.RELEASED, ReleaseReason(reason.value), now,
                          changes, by=by, note=note)
            return True
        self.book.stop_and_release(record, StopReason(reason.value), now, changes, by=by,
                                   note=note, why=f"{reason.value}: stop requested")
        return False
