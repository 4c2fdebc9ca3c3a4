"""The hub's and admins' requests on leases: allocate (grant, queue or refuse), release, status,
and the queue served again whenever GPUs may have come free.

A lease belongs to the broker user that asked for it (:func:`~allocator.engine.leases.may_act_on`):
a request that names another's lease by its id (a release, a status) is answered
``forbidden`` and changes nothing. Request keys are each broker user's own
(:func:`~allocator.engine.leases.key_space`): the same key from two hubs names two leases.

Planning a reclaim for a request that queues is the dispatcher's
(:class:`~allocator.engine.dispatch.Engine`), after :meth:`LeaseRequests.allocate`.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ValidationError

from allocator.config import AllocatorSettings
from allocator.engine.fence import StartFence
from allocator.engine.leases import LeaseBook, may_act_on
from allocator.engine.outbox import CommandOutbox
from allocator.engine.placement import Placer
from allocator.engine.state import Sender, count_anomaly, log
from allocator.ledger.changes import Changes
from allocator.ledger.lease import ADOPTED_OWNER, LeaseRecord
from allocator.logs import lease_context
from allocator.metrics.counters import Count, Counters, Family
from allocator.placement.demand import Placement, Refusal, make_demand
from allocator.wire.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    LeaseState,
    ReleaseReason,
    ReleaseRequest,
    StatusRequest,
    StopReason,
    error_reply,
)

START_FENCE_WAITS_FOR = frozenset({ErrorCode.NO_CAPACITY, ErrorCode.UNKNOWN_MODEL,
                             ErrorCode.UNKNOWN_HOST, ErrorCode.UNSATISFIABLE})
"""Refusals that nodes not yet heard from since a fenced start could turn into a grant."""


class LeaseRequests:
    """Answers allocate and release requests against the lease book; serves the queue.

    Invariant: a request key has at most one active lease, and a retry under it that asks the
    same is answered with that lease, never a second one.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, book: LeaseBook,
                 placer: Placer, start_fence: StartFence, outbox: CommandOutbox) -> None:
        self.settings = settings
        self.counters = counters
        self.book = book
        self.placer = placer
        self.start_fence = start_fence
        self.outbox = outbox

    def allocate(self, request: AllocateRequest, sender: Sender, now: float,
                 changes: Changes) -> BaseModel:
        """Grant now, queue (``wait_s``, or behind the start fence), or refuse. The lease
        belongs to ``sender``'s broker user."""
        existing = self.book.active_for(request.request_key, sender.user_id)
        if existing is not None:
            return self._retry(request, sender, existing)
        demand = make_demand(request, self.placer.model_catalog(), self.settings)
        if isinstance(demand, Refusal):
            if self.start_fence.holds(now) and demand.code in START_FENCE_WAITS_FOR:
                return self._wait_behind_start_fence(self.book.new_record(request, sender, now),
                                                     request, now, changes)
            return self._refuse(demand)
        placement = self.placer.place(demand, now)
        record = self.book.new_record(request, sender, now)
        if isinstance(placement, Placement):
            self.book.grant(record, placement, demand, now, changes, old=None)
            self.book.track(record)
            return self.book.reply(record)
        if self.start_fence.holds(now) and placement.code in START_FENCE_WAITS_FOR:
            return self._wait_behind_start_fence(record, request, now, changes)
        if placement.code is ErrorCode.NO_CAPACITY and request.wait_s > 0:
            record.enqueued_at = now
            record.wait_until = now + request.wait_s
            self.book.track(record)
            changes.transition(record, None, now, "no GPU free; waiting", by=request.user)
            self.counters.add(Count.QUEUED)
            return self.book.reply(record)
        return self._refuse(placement)

    def _retry(self, request: AllocateRequest, sender: Sender,
               existing: LeaseRecord) -> BaseModel:
        """A request under a key that has an active lease: that lease if it asks the same
        and the lease is the sender's."""
        foreign = self.refuse_foreign(existing, sender, "retry an allocate under the key of")
        if foreign is not None:
            return foreign
        if existing.user != request.user:
            return error_reply(
                ErrorCode.CONFLICT,
                f"request key {request.request_key!r} belongs to user {existing.user!r}",
            )
        asked, held = request.what_is_asked(), self._what_was_asked(existing)
        if held is not None and asked != held:
            self.counters.add(Count.REQUEST_KEY_CONFLICT)
            differs = sorted(name for name in asked if asked[name] != held.get(name))
            return error_reply(
                ErrorCode.CONFLICT,
                f"request key {request.request_key!r} is in use by lease "
                f"{existing.lease_id} ({existing.state.value}), which asked for other GPUs "
                f"({', '.join(differs)} differ). A retry repeats its request exactly; for "
                "another request, release that lease first or use another key.",
                lease_id=existing.lease_id, state=existing.state.value, differs=differs,
                held=held, asked=asked)
        self.counters.add(Count.ALLOCATE_RETRY)
        return self.book.reply(existing)

    @staticmethod
    def _what_was_asked(record: LeaseRecord) -> dict[str, Any] | None:
        """What the lease's request asked for (see ``AllocateRequest.what_is_asked``), or None
        for a lease whose stored request does not say (recorded by another writer)."""
        if not record.request:
            return None
        try:
            return AllocateRequest.model_validate(record.request).what_is_asked()
        except ValidationError:
            return None

    def refuse_foreign(self, record: LeaseRecord, sender: Sender, doing: str) -> ErrorReply | None:
        """``forbidden`` when ``record`` is another broker user's lease (``doing``: what the
        sender tried, in words: "release", "see"...); None when the sender may act on it."""
        if may_act_on(record, sender, self.settings.admin_users):
            return None
        if count_anomaly(self.counters, Count.FOREIGN_LEASE):
            log.warning("refused broker user %r: it tried to %s lease %s of broker user %r",
                        sender.user_id, doing, record.lease_id, record.owner,
                        extra=lease_context(record.lease_id, record.host, record.user))
        asker = (f"broker user {sender.user_id!r}" if sender.user_id is not None
                 else "a request without a broker user (AMQP user_id)")
        if record.owner == ADOPTED_OWNER:
            return error_reply(
                ErrorCode.FORBIDDEN,
                f"lease {record.lease_id} was adopted from the grant labels of a running "
                f"container, which name no hub: {asker} may not {doing} it; admins "
                "(admin_users) may, and it ends when its container does.",
                owner=record.owner)
        return error_reply(
            ErrorCode.FORBIDDEN,
            f"lease {record.lease_id} (request key {record.request_key!r}) belongs to another "
            f"hub, broker user {record.owner!r}: {asker} may not {doing} it. A hub acts only "
            "on the leases it asked for; admins (admin_users) act on any.",
            owner=record.owner)

    def status(self, request: StatusRequest, sender: Sender) -> BaseModel:
        """One lease, by id or request key (the newest of that key), if the sender may see
        it."""
        record = self.find(request.lease_id, request.request_key, sender)
        if record is None:
            return not_found(request.lease_id, request.request_key)
        return self.refuse_foreign(record, sender, "see") or self.book.reply(record)

    def find(self, lease_id: str | None, request_key: str | None,
             sender: Sender) -> LeaseRecord | None:
        """The lease a request names: by id, or by request key in the sender's key space
        (an admin's: any owner's)."""
        return self.book.find(lease_id, request_key, sender.user_id,
                              every_owner=sender.user_id in self.settings.admin_users)

    def _refuse(self, refusal: Refusal) -> ErrorReply:
        self.counters.add_to(Family.REFUSED, refusal.code.value)
        return error_reply(refusal.code, refusal.message, **refusal.details)

    # ------------------------------------------------------------------ the start fence

    def _wait_behind_start_fence(self, record: LeaseRecord, request: AllocateRequest, now: float,
                           changes: Changes) -> BaseModel:
        """Queue a request that may fit once the nodes not heard from yet have reported; a
        request that asked not to wait waits only for the start fence."""
        record.enqueued_at = now
        record.wait_until = self.start_fence.wait_until(now, request.wait_s)
        self.book.track(record)
        changes.transition(record, None, now, "waiting for the nodes' first reports",
                           by=request.user)
        self.counters.add(Count.QUEUED)
        self.counters.add(Count.QUEUED_BEHIND_FENCE)
        return self.book.reply(record)

    def end_start_fence_waits(self, now: float, changes: Changes) -> None:
        """The start fence closed early (every node has reported): requests queued only by it
        that still do not fit get the answer they asked for (no waiting beyond their
        wait_s)."""
        for _, lease_id in list(self.book.queue):
            record = self.book.leases[lease_id]
            wait_s = float(record.request.get("wait_s") or 0.0)
            own_end = (record.enqueued_at or record.created_at) + wait_s
            if own_end <= now:
                self.book.end(record, LeaseState.EXPIRED, ReleaseReason.WAIT_EXPIRED, now,
                              changes, by="allocator",
                              note="nothing fits now that every node has reported")
            elif record.wait_until is not None and record.wait_until > own_end:
                record.wait_until = own_end
                changes.lease(record)

    # ------------------------------------------------------------------ the queue

    def serve_queue(self, now: float, changes: Changes) -> None:
        """Grant queued requests that fit now, in queue order (a freed GPU goes to the head)."""
        book = self.book
        if not book.queue:
            return
        # Nodes do not change during the pass, only claims (which the view shares): one view
        # for the whole pass, built if a request needs it.
        view = functools.cache(lambda: self.placer.view(now))
        for lease_id in book.serving_order(now):
            record = book.leases[lease_id]
            demand = book.queued_demand(record)
            if demand is None:  # never wedge the queue
                book.end(record, LeaseState.EXPIRED, ReleaseReason.CANCELLED, now, changes,
                         by="allocator", note="stored request no longer valid")
                continue
            if isinstance(demand, Refusal):
                continue
            placement = self.placer.place(demand, now, explain=False, view=view)
            if isinstance(placement, Placement):
                book.dequeue(lease_id)
                book.grant(record, placement, demand, now, changes, old=LeaseState.QUEUED)

    # ------------------------------------------------------------------ releases

    def release(self, request: ReleaseRequest, sender: Sender, now: float,
                changes: Changes) -> BaseModel:
        """Cancel a queued lease, stop a granted or bound one (it ends when its container is
        gone), or, forced by an admin, end it at once and give its GPUs to the queue."""
        record = self.find(request.lease_id, request.request_key, sender)
        if record is None:
            return not_found(request.lease_id, request.request_key)
        foreign = self.refuse_foreign(record, sender, "release")
        if foreign is not None:
            return foreign
        if request.force and sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"force-release is for admins; broker user {sender.user_id!r} "
                               "is not in admin_users")
        by = request.by if sender.user_id is None else f"{request.by} ({sender.user_id})"
        note = request.reason or None
        if record.state.final:
            return self.book.reply(record)
        if record.state is LeaseState.QUEUED:
            self.book.end(record, LeaseState.RELEASED, ReleaseReason.CANCELLED, now, changes,
                          by=by, note=note)
        elif request.force:
            self.book.end(record, LeaseState.RELEASED, ReleaseReason.ADMIN, now, changes,
                          by=by, note=note)
            changes.event(now, "force_release", lease_id=record.lease_id, user=record.user,
                          by=by, reason=request.reason)
            # The GPUs go to someone else now: the old container must not keep using them.
            self.outbox.ask_stop(record.host, record.lease_id, record.container_id,
                                 StopReason.FORCE_RELEASED, now, changes)
            self.serve_queue(now, changes)
        elif record.state in (LeaseState.GRANTED, LeaseState.BOUND):
            self.book.stop_and_release(record, StopReason.RELEASED, now, changes, by=by,
                                       note=note, why="stop requested")
        return self.book.reply(record)


def not_found(lease_id: str | None, request_key: str | None) -> ErrorReply:
    """``not_found`` for a release or status of a lease the engine does not hold (the
    service then looks in the ledger for one that finished long ago)."""
    what = f"lease {lease_id!r}" if lease_id else f"request key {request_key!r}"
    return error_reply(ErrorCode.NOT_FOUND, f"no {what} in the ledger")
