"""Reclaim and idle release: the engine acts on :func:`allocator.placement.fairshare.plan_reclaims`.

On every tick while requests wait, and when a request queues (the dispatcher calls
:meth:`Reclaimer.run` then): leases the plan names are warned (``reclaim_at``, an event
``reclaim_warning``), warnings the plan no longer needs are withdrawn, and a warned lease whose
grace is over has its container stopped with the command the agents already obey; the lease
then ends with its reason (``reclaimed`` or ``idle``) however its end is noticed.

Bookings (:mod:`allocator.engine.booking_windows`): from a booking's lead until its window
ends, the leases of non-members standing on the GPUs it lacks (beyond those free) are warned,
for the window's start (``reclaim_at``; the warning's event names the booking); they are
stopped only when a member's request needs them, as any reclaim. Members' leases it covers
are never borrowed, and members' requests that fit in its room may reclaim.
"""

from __future__ import annotations

from collections.abc import Collection

from allocator.bookings.in_effect import Occupant, Shares, on_its_gpus, to_clear
from allocator.config import AllocatorSettings
from allocator.engine.booking_windows import BookingWindows
from allocator.engine.fence import StartFence
from allocator.engine.idle import IdleWatch
from allocator.engine.leases import LeaseBook
from allocator.engine.placement import Placer
from allocator.engine.processes import ProcessWatch
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.metrics.counters import Counters, Family
from allocator.placement import fairshare
from allocator.placement.cluster import Cluster
from allocator.placement.demand import Demand
from allocator.wire.protocol import (
    Health,
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
                 idle: IdleWatch, placer: Placer, start_fence: StartFence,
                 windows: BookingWindows, processes: ProcessWatch) -> None:
        self.settings = settings
        self.windows = windows
        self.counters = counters
        self.book = book
        self.idle = idle
        self.placer = placer
        self.start_fence = start_fence
        self.processes = processes

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
        # Without bookings this costs one call that finds none (bench/engine.py's tick).
        booked = bool(self.windows.now(now))
        boundary = self.windows.take_changed()
        if (not booked and not self._fair_share_active()) or self.start_fence.holds(now):
            return boundary  # a window that just ended: the queue's order changed
        book = self.book
        shares = self.windows.shares(now, book.charged_holding()) if booked else Shares()
        # Covered by a window that runs: before it starts a member's lease is ordinary.
        self._recompute_borrowed(changes, self.windows.booking_of)
        warned = [r for r in book.holding() if r.reclaim_at is not None
                  and r.reclaim_stopped_at is None]
        if not book.queue and not warned and not shares.shares:
            return boundary
        candidates = self._candidates(now, shares)
        if not candidates and not warned:
            return boundary  # nothing could go: no need to simulate the queue
        leaving = {r.lease_id: r.gpu_uuids for r in book.holding()
                   if r.state is LeaseState.RELEASING or r.reclaim_stopped_at is not None}
        view = self.placer.view(now)
        plan = fairshare.plan_reclaims(
            self._waiters(now) if book.queue else [], candidates,
            view, self.settings, now=now,
            down_after_s=self.settings.node_down_after_s,
            idle_window_s=self.settings.idle_window_s, leaving=leaving,
            draining=self.processes.draining(), rooms=dict(self.windows.rooms))
        ahead = self._before_windows(now, view, shares, candidates, leaving, plan)
        for record in warned:
            if record.lease_id not in plan and record.lease_id not in ahead:
                self._withdraw(record, now, changes)
        freed = False
        for lease_id, reclaim in plan.items():
            record = book.leases[lease_id]
            if record.reclaim_at is None or record.reclaim_reason is not reclaim.reason:
                self._warn(record, reclaim, now, changes)
            elif record.reclaim_for is None and reclaim.for_lease is not None:
                # Warned before a booking's window: now a member waits for it.
                record.reclaim_for = reclaim.for_lease
                changes.lease(record)
            if record.reclaim_at is not None and now >= record.reclaim_at:
                freed = self._carry_out(record, now, changes) or freed
        for lease_id, (reclaim, at) in ahead.items():
            record = book.leases[lease_id]
            if record.reclaim_at is None or record.reclaim_reason is not reclaim.reason:
                self._warn(record, reclaim, now, changes, at=at)
            elif reclaim.booking is not None:
                # Warned already (before a restart, which keeps no booking names): name it.
                self.windows.reclaim_for_booking.setdefault(lease_id, reclaim.booking)
        return freed or boundary

    def _before_windows(self, now: float, usable: Cluster, shares: Shares,
                        candidates: list[fairshare.Candidate],
                        leaving: dict[str, tuple[str, ...]],
                        plan: dict[str, fairshare.Reclaim]
                        ) -> dict[str, tuple[fairshare.Reclaim, float]]:
        """Warnings only, none carried out here: for each booking from its lead to its
        window's end, the fewest non-members' leases standing on the GPUs it lacks beyond
        those free (:func:`allocator.bookings.in_effect.to_clear`), each with its deadline
        (the window's start, or a grace from now once it runs). A free GPU counts for one
        booking only, the earliest admitted; ``usable`` is the cluster as placement sees it."""
        found: dict[str, tuple[fairshare.Reclaim, float]] = {}
        if not shares.shares:
            return found
        claimed_by: dict[str, frozenset[str]] = {
            uuid: frozenset(c.lease_id for c in claims if c.lease_id not in leaving)
            for uuid, claims in self.book.cluster.claims.items()}
        down_after = self.settings.node_down_after_s
        grace_end = now + self.settings.reclaim_grace_s
        counted: set[str] = set()  # free GPUs an earlier booking counts on
        for share in shares.shares:
            g = share.guarantee
            free = [gpu.uuid for gpu in usable.gpus.values()
                    if on_its_gpus(g, gpu.model, gpu.host) and gpu.uuid not in counted
                    and gpu.present and gpu.health is Health.HEALTHY
                    and not gpu.mig_enabled and not gpu.drained
                    and not claimed_by.get(gpu.uuid)
                    and gpu.host in usable.nodes
                    and not usable.nodes[gpu.host].drained
                    and usable.nodes[gpu.host].is_up(now, down_after)]
            free = sorted(free)[:max(int(share.room), 0)]
            counted.update(free)
            occupants = [
                Occupant(c.lease_id, frozenset(c.gpu_uuids), c.idle_s, c.granted_at, c.warned)
                for c in candidates if share.name in c.displaceable_by
                and c.lease_id not in plan and c.lease_id not in found]
            at = float(g.starts_at) if g.starts_at > now else grace_end
            for lease_id in to_clear(share, len(free), occupants, claimed_by,
                                     self.settings.idle_window_s):
                found[lease_id] = (fairshare.Reclaim(
                    ReclaimReason.RECLAIMED, None, share.name), at)
        return found

    def _recompute_borrowed(self, changes: Changes, covered: Collection[str]) -> None:
        """Recompute which holding leases are borrowed (an older lease of the same scope may
        have ended, a booking's window begun or ended); a lease moved within its guarantee
        loses a pending reclaim warning. ``covered``: leases a booking in effect covers."""
        holding = self.book.holding()
        borrowed = fairshare.borrowed_leases(
            [fairshare.Holding(r.lease_id, r.user, r.groups, r.units, r.granted_at or 0.0,
                               r.borrowed, r.model) for r in holding if r.charged],
            self.settings, covered)
        for record in holding:
            now_borrowed = record.lease_id in borrowed
            if record.borrowed != now_borrowed:
                record.borrowed = now_borrowed
                changes.lease(record)

    def _waiters(self, now: float) -> list[fairshare.Waiter]:
        """The queued requests in the order they are served (members of a booking in
        effect first), each with the booking it may be placed in."""
        waiters = []
        for lease_id in self.book.serving_order(now):
            demand = self.book.queued_demand(self.book.leases[lease_id])
            if isinstance(demand, Demand):
                share = self.windows.booked_share(demand.user, demand.groups, demand.models,
                                                  demand.host)
                waiters.append(fairshare.Waiter(lease_id, demand, None if share is None else
                                                share.guarantee))
        return waiters

    def _candidates(self, now: float, shares: Shares) -> list[fairshare.Candidate]:
        release_after = self.settings.idle_release_after_s
        covered = self.windows.booking_of
        holding = self.book.holding()
        # The owners' recent use orders busy victims (heaviest first); empty when it is off.
        recent = self.book.usage.standings(holding, self.book.charged_holding, now)
        candidates = []
        for record in holding:
            if record.state is LeaseState.RELEASING or record.reclaim_stopped_at is not None \
                    or record.lease_id in covered:
                continue
            idle_s = self.idle.idle_for(record, now)
            releasable = release_after is not None and idle_s >= release_after
            displaceable = frozenset(
                s.name for s in shares.shares
                if on_its_gpus(s.guarantee, record.model, record.host)
                and not s.guarantee.covers(record.user, record.groups))
            if record.borrowed or releasable or displaceable:
                candidates.append(fairshare.Candidate(
                    lease_id=record.lease_id, gpu_uuids=record.gpu_uuids,
                    granted_at=record.granted_at or 0.0, idle_s=idle_s,
                    warned=record.reclaim_at is not None, borrowed=record.borrowed,
                    idle_releasable=releasable, displaceable_by=displaceable,
                    recent_use=recent.get(record.lease_id, (0.0, 0.0))))
        return candidates

    def _warn(self, record: LeaseRecord, reclaim: fairshare.Reclaim, now: float,
              changes: Changes, *, at: float | None = None) -> None:
        if record.reclaim_at is None:
            record.reclaim_at = at if at is not None else now + self.settings.reclaim_grace_s
        record.reclaim_reason = reclaim.reason
        record.reclaim_for = reclaim.for_lease
        changes.lease(record)
        extra: dict[str, object] = {}
        if reclaim.booking is not None:
            self.windows.reclaim_for_booking[record.lease_id] = reclaim.booking
            extra = {"booking": reclaim.booking,
                     "note": self.windows.reclaim_text(reclaim.booking, record.reclaim_at)}
        else:
            self.windows.reclaim_for_booking.pop(record.lease_id, None)
        changes.event(now, "reclaim_warning", host=record.host, lease_id=record.lease_id,
                      user=record.user, reason=reclaim.reason.value,
                      reclaim_at=record.reclaim_at, for_lease=reclaim.for_lease, **extra)
        self.counters.add_to(Family.RECLAIM_WARNED, reclaim.reason.value)

    def _withdraw(self, record: LeaseRecord, now: float, changes: Changes) -> None:
        self.windows.reclaim_for_booking.pop(record.lease_id, None)
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
