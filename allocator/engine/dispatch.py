"""The engine's front door: :class:`Engine` applies one inbound message at a time
(:meth:`Engine.handle`) and runs the timers (:meth:`Engine.tick`)."""

from __future__ import annotations

from pydantic import BaseModel

from allocator.counters import Count
from allocator.engine.reclaim import Reclaimer
from allocator.engine.state import TIMED_STATES, Sender
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import (
    AllocateRequest,
    AnyInbound,
    ContainerEvent,
    DrainRequest,
    ErrorCode,
    Heartbeat,
    HeartbeatDelta,
    InventoryRequest,
    LeasesRequest,
    LeaseState,
    QueueReply,
    QueueRequest,
    QuotaRequest,
    ReleaseReason,
    ReleaseRequest,
    StatusRequest,
    error_reply,
)
from allocator.topology import RPC_EXCHANGE


class Engine(Reclaimer):
    """Nodes, GPUs and leases in memory, and the rules that change them.

    Each room it is built from (see :mod:`allocator.engine`) holds one concept; this class
    only routes a message to the room that handles it and runs the timers.
    """

    def handle(self, message: AnyInbound, sender: Sender, now: float,
               changes: Changes) -> BaseModel | None:
        """Apply one message; return its reply (None for node messages)."""
        if isinstance(message, Heartbeat | HeartbeatDelta | ContainerEvent):
            if not sender.via_nodes_exchange:
                self.counters.add(Count.NODE_MESSAGE_WRONG_EXCHANGE)
                return error_reply(ErrorCode.FORBIDDEN,
                                   "node messages must be published to the nodes exchange")
            if not self._node_may_report(message.host, sender, now, changes, message.kind):
                return None
            if isinstance(message, Heartbeat):
                self._heartbeat(message, sender, now, changes)
            elif isinstance(message, HeartbeatDelta):
                self._heartbeat_delta(message, sender, now, changes)
            else:
                self._container_event(message, now, changes)
            return None
        if sender.via_nodes_exchange:
            self.counters.add(Count.REQUEST_FROM_NODE_EXCHANGE)
            changes.event(now, "request_refused", reason="request on the nodes exchange",
                          user=sender.user_id)
            return error_reply(ErrorCode.FORBIDDEN,
                               "requests must be published to the RPC exchange "
                               f"{RPC_EXCHANGE!r}, not to the nodes exchange")
        if isinstance(message, AllocateRequest):
            return self._allocate(message, now, changes)
        if isinstance(message, ReleaseRequest):
            return self._release_request(message, sender, now, changes)
        if isinstance(message, StatusRequest):
            return self._status(message)
        if isinstance(message, InventoryRequest):
            return self.inventory(now, include_leases=message.include_leases)
        if isinstance(message, QueueRequest):
            return QueueReply(leases=[self._view(self.leases[i]) for _, i in self._queue])
        if isinstance(message, DrainRequest):
            return self._drain(message, sender, now, changes)
        if isinstance(message, QuotaRequest):
            return self.quota(message)
        if isinstance(message, LeasesRequest):
            return self.leases_reply(message, now)
        raise TypeError(f"unhandled message kind {type(message).__name__}")

    def _never_ran_and_nobody_will_say(self, record: LeaseRecord, now: float) -> bool:
        """A lease released before any container ran, on a node whose heartbeats cannot list
        containers: its node will never report it gone, so it ends ``stop_grace_s`` after
        the release, as a lease of a silent node does."""
        return (record.state is LeaseState.RELEASING and record.bound_at is None
                and record.container_id is None and record.host in self._cannot_list
                and record.releasing_at is not None
                and now - record.releasing_at > self.settings.stop_grace_s)

    def tick(self, now: float, changes: Changes) -> None:
        """Run the timers: the start fence, queue waits, bind deadlines, node silence, and
        fair share's reclaim warnings and their deadlines."""
        if (self._fenced or self._fence_awaits_first_report) and now >= self._fence_until:
            # start_fence_s ran out with nodes that never reported in full (an agent that
            # cannot list its containers): they are placed as usual from now on, before the
            # requests that waited only for the fence expire.
            changes.event(now, "start_fence_expired", unreported=sorted(self._fenced))
            self._fenced.clear()
            self._fence_awaits_first_report = False
            self._serve_queue(now, changes)
        freed = False
        # Only queued, granted and releasing leases have timers: the tick looks at those
        # alone (_timed), in the order they entered such a state, and forgets the ones that
        # have left them since (bound, or final: a lease leaves self.leases only as final).
        timed = []
        for lease_id, record in list(self._timed.items()):
            if record.state in TIMED_STATES:
                timed.append(record)
            else:
                del self._timed[lease_id]
        for record in timed:
            if record.state is LeaseState.QUEUED and record.wait_until is not None \
                    and now >= record.wait_until:
                self._end_lease(record, LeaseState.EXPIRED, ReleaseReason.WAIT_EXPIRED, now,
                             changes, by="allocator")
            elif record.state is LeaseState.GRANTED and record.bind_deadline is not None \
                    and now >= record.bind_deadline:
                self._end_lease(record, LeaseState.RELEASED, ReleaseReason.BIND_TIMEOUT, now,
                             changes, by="allocator")
                freed = True
            elif (record.state is LeaseState.RELEASING and record.host is not None
                  and self._silent_for(record.host, now) > self.settings.stop_grace_s):
                self._end_lease(record, LeaseState.RELEASED, ReleaseReason.NODE_SILENT, now,
                             changes, by="allocator")
                freed = True
            elif self._never_ran_and_nobody_will_say(record, now):
                self._end_lease(record, LeaseState.RELEASED, ReleaseReason.STOPPED, now,
                                changes, by="allocator",
                                note="never bound; its node cannot list containers")
                freed = True
        for node in self.cluster.nodes.values():
            if node.host not in self._down and not node.is_up(now, self.settings.node_down_after_s):
                self._down.add(node.host)
                changes.event(now, "node_down", host=node.host,
                              last_heartbeat=node.last_heartbeat)
                self.counters.add(Count.NODE_DOWN)
        if freed:
            self._serve_queue(now, changes)
        self._reclaim(now, changes)
