"""Reclaim and idle release: the engine acts on :func:`allocator.fairshare.plan_reclaims`.

On every tick while requests wait, and when a request queues: leases the plan names are warned
(``reclaim_at``, an event ``reclaim_warning``), warnings the plan no longer needs are withdrawn,
and a warned lease whose grace is over has its container stopped with the command the agents
already obey; the lease then ends with its reason (``reclaimed`` or ``idle``) however its end
is noticed.
"""

from __future__ import annotations

from pydantic import BaseModel

from allocator import fairshare, policy
from allocator.counters import Family
from allocator.engine.nodes import NodeReconciliation
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import (
    AllocateRequest,
    LeaseReply,
    LeaseState,
    ReclaimReason,
    ReleaseReason,
    StopReason,
)


class Reclaimer(NodeReconciliation):
    """Warns, withdraws and carries out reclaims of borrowed and idle leases."""

    def _fair_share_active(self) -> bool:
        """Whether anything could ever be reclaimed: a borrow limit above a guarantee, or
        idle release on. Otherwise the tick skips fair share entirely."""
        s = self.settings
        return bool(s.user_borrow_limit or s.group_borrow_limit
                    or s.user_model_borrow_limit or s.group_model_borrow_limit
                    or s.default_user_borrow_limit is not None
                    or s.idle_release_after_s is not None)

    def _holding(self) -> list[LeaseRecord]:
        return [r for r in self.leases.values() if r.state.holds_gpus]

    def _restand_borrowed(self, now: float, changes: Changes) -> None:
        """Recompute which holding leases are borrowed (an older lease of the same scope may
        have ended); a lease moved within its guarantee loses a pending reclaim warning."""
        holding = self._holding()
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
        for _, lease_id in self._queue:
            demand = self._queued_demand(self.leases[lease_id])
            if isinstance(demand, policy.Demand):
                waiters.append(fairshare.Waiter(lease_id, demand))
        return waiters

    def _candidates(self, now: float) -> list[fairshare.Candidate]:
        release_after = self.settings.idle_release_after_s
        candidates = []
        for record in self._holding():
            if record.state is LeaseState.RELEASING or record.reclaim_stopped_at is not None:
                continue
            idle_s = self.idle_for(record, now)
            releasable = release_after is not None and idle_s >= release_after
            if record.borrowed or releasable:
                candidates.append(fairshare.Candidate(
                    lease_id=record.lease_id, gpu_uuids=record.gpu_uuids,
                    granted_at=record.granted_at or 0.0, idle_s=idle_s,
                    warned=record.reclaim_at is not None, borrowed=record.borrowed,
                    idle_releasable=releasable))
        return candidates

    def _allocate(self, request: AllocateRequest, now: float, changes: Changes) -> BaseModel:
        """Allocate as the lease book does; a request that queues is planned for at once,
        not at the next tick, so a reclaim's warning (or, without a grace, its stop) goes
        out with the reply."""
        reply = super()._allocate(request, now, changes)
        if isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.QUEUED:
            self._reclaim(now, changes)
        return reply

    def _reclaim(self, now: float, changes: Changes) -> None:
        """Plan, warn, withdraw and stop (see the module)."""
        if not self._fair_share_active() or self._fence_holds(now):
            return
        self._restand_borrowed(now, changes)
        warned = [r for r in self._holding() if r.reclaim_at is not None
                  and r.reclaim_stopped_at is None]
        if not self._queue and not warned:
            return
        candidates = self._candidates(now)
        if not candidates and not warned:
            return  # nothing could go: no need to simulate the queue
        leaving = {r.lease_id: r.gpu_uuids for r in self._holding()
                   if r.state is LeaseState.RELEASING or r.reclaim_stopped_at is not None}
        plan = fairshare.plan_reclaims(
            self._waiters() if self._queue else [], candidates,
            self._placement_view(now), self.settings, now=now,
            down_after_s=self.settings.node_down_after_s,
            idle_window_s=self.settings.idle_window_s, leaving=leaving)
        for record in warned:
            if record.lease_id not in plan:
                self._withdraw(record, now, changes)
        freed = False
        for lease_id, reclaim in plan.items():
            record = self.leases[lease_id]
            if record.reclaim_at is None or record.reclaim_reason is not reclaim.reason:
                self._warn(record, reclaim, now, changes)
            if record.reclaim_at is not None and now >= record.reclaim_at:
                freed = self._carry_out(record, now, changes) or freed
        if freed:
            self._serve_queue(now, changes)

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
            self._end_lease(record, LeaseState.RELEASED, ReleaseReason(reason.value), now,
                            changes, by=by, note=note)
            return True
        self._stop_and_release(record, StopReason(reason.value), now, changes, by=by, note=note,
                               why=f"{reason.value}: stop requested")
        return False
