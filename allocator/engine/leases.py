"""The lease book: every lease not yet final, the queue, and the transitions of a lease's life.

Lease life (docs/design.md, flows): ``queued`` -> ``granted`` (GPUs claimed) -> ``bound`` (the
node saw the container start) -> ``releasing`` (the hub stopped it) -> ``released`` (the
container is gone). Every release records its reason. Requests that create and end leases are
:mod:`~allocator.engine.requests`; what the nodes report is held against the book by
:mod:`~allocator.engine.containers`.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any

from pydantic import ValidationError

from allocator.config import AllocatorSettings
from allocator.engine.booking_windows import BookingWindows
from allocator.engine.idle import IdleWatch
from allocator.engine.nodes import NodeReports
from allocator.engine.outbox import CommandOutbox
from allocator.engine.placement import Placer
from allocator.engine.processes import ProcessWatch
from allocator.engine.state import RECENT_FINAL_LEASES, TIMED_STATES, Sender
from allocator.engine.usage import UsageBook
from allocator.ledger.changes import Changes
from allocator.ledger.lease import ADOPTED_OWNER, LeaseRecord
from allocator.ledger.loaded import LoadedState
from allocator.metrics.counters import Count, Counters, Family
from allocator.placement import gpu_sets
from allocator.placement.claims import apply_placement, claim_gpus
from allocator.placement.cluster import Cluster
from allocator.placement.container_env import lease_env
from allocator.placement.demand import Demand, Placement, Refusal, make_demand, placement_model
from allocator.placement.index import PlacementIndex
from allocator.placement.queue_order import queue_order_key
from allocator.placement.quota import quota_standings, would_borrow
from allocator.wire.protocol import (
    AllocateRequest,
    Lease,
    LeaseReply,
    LeaseState,
    ReleaseReason,
    StopReason,
)


def may_act_on(record: LeaseRecord, sender: Sender, admin_users: Collection[str]) -> bool:
    """Whether ``sender`` may release ``record``, ask for it, or see it in a listing: the
    broker user that asked for it (its hub), an admin, or anyone when its owner is not known
    (a lease from before owners were recorded: an upgrade strands no lease). A lease adopted
    from its container's labels (:data:`ADOPTED_OWNER`) is the admins' alone: its labels
    may be forged, and its container ends it anyway when it stops. The one rule of lease
    ownership."""
    if sender.user_id in admin_users or record.owner is None:
        return True
    return (record.owner != ADOPTED_OWNER and sender.user_id is not None
            and sender.user_id == record.owner)


def key_space(owner: str | None) -> str | None:
    """The space of request keys a lease of ``owner`` holds its key in: its owner's own.
    Request keys are free text, so two hubs (two broker users, which RabbitMQ verifies)
    may use the same one; each is then a key of its own hub and neither takes it from the
    other. A lease adopted from its container's labels (:data:`ADOPTED_OWNER`) holds its
    key apart from every hub's, so a label naming someone's key takes it from nobody; the
    leases whose owner is not known (None) share one space, which every asker also looks
    in (:meth:`LeaseBook.active_for`)."""
    return owner


class LeaseBook:
    """Leases by id, key and host, the queue in order, and the timers; the transitions.

    Invariants: a lease is in ``leases`` until it is final, then in ``recent`` (the newest
    ``RECENT_FINAL_LEASES``); ``by_key`` maps the key of every queued, granted or bound lease
    to it; ``by_host`` holds every lease of ``leases`` placed on that host; ``queue`` holds
    exactly the queued leases, in queue order; ``timed`` holds every lease whose state has a
    timer (and some that left those states since, dropped by the next :meth:`run_timers`); a
    lease holding GPUs has its claims in the cluster.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, cluster: Cluster,
                 index: PlacementIndex, idle: IdleWatch, outbox: CommandOutbox,
                 placer: Placer, processes: ProcessWatch, windows: BookingWindows,
                 usage: UsageBook, new_lease_id: Callable[[], str]) -> None:
        self.settings = settings
        self.usage = usage
        self.windows = windows
        self.counters = counters
        self.cluster = cluster
        self.index = index
        self.idle = idle
        self.outbox = outbox
        self.placer = placer
        self.processes = processes
        self.new_lease_id = new_lease_id
        """Makes lease ids: random by default; tests pass a counter to replay runs exactly."""
        self.leases: dict[str, LeaseRecord] = {}
        """Leases not yet final, by id."""
        self.by_key: dict[tuple[str | None, str], str] = {}
        """(key space, request_key) -> id of its active (queued, granted, bound) lease (see
        :func:`key_space`)."""
        self.by_host: dict[str, dict[str, LeaseRecord]] = {}
        """host -> the leases of :attr:`leases` placed there, so that a heartbeat reconciles
        its own host's leases instead of scanning every lease of the cluster."""
        self.recent: OrderedDict[str, LeaseRecord] = OrderedDict()
        self.timed: dict[str, LeaseRecord] = {}
        """What a tick looks at instead of every lease: most leases are bound and have no
        timer, and a tick runs twice a second."""
        self.queue: list[tuple[tuple[Any, ...], str]] = []
        self.demands: dict[str, tuple[Cluster, Demand | Refusal]] = {}
        """Queued lease -> (the model catalog it was resolved on, its demand): see
        :meth:`queued_demand`."""
        self.node_clock_bound: dict[str, float] = {}
        """lease id -> node-clock time its container was known to run (start event or
        listing). Memory only: a reload keeps it."""

    def load(self, state: LoadedState) -> None:
        """A rebuild from the ledger (the cluster's GPUs already loaded): its active leases,
        their claims, and its finished leases (a container still running for one is a zombie
        to stop, never a lease the ledger forgot)."""
        self.leases, self.by_key, self.queue, self.by_host = {}, {}, [], {}
        self.timed = {}
        self.demands = {}
        self.recent = OrderedDict((r.lease_id, r) for r in state.finished[-RECENT_FINAL_LEASES:])
        for record in state.leases:
            self.track(record)
            if record.state.holds_gpus:
                self.claim_gpus(record)

    # ------------------------------------------------------------------ indexes

    def track(self, record: LeaseRecord) -> None:
        """Enter a lease that is not final into the book's indexes."""
        self.leases[record.lease_id] = record
        self.time(record)
        if record.host is not None:
            self.by_host.setdefault(record.host, {})[record.lease_id] = record
        if record.state.active:
            self.by_key[self.key_of(record)] = record.lease_id
        if record.state is LeaseState.QUEUED:
            key = queue_order_key(record.priority, record.enqueued_at or record.created_at,
                                  record.lease_id)
            bisect.insort(self.queue, (key, record.lease_id))

    def time(self, record: LeaseRecord) -> None:
        """Let the tick look at ``record`` if its state has a timer; called wherever a lease
        enters such a state (it leaves them only for states without one)."""
        if record.state in TIMED_STATES:
            self.timed[record.lease_id] = record

    @staticmethod
    def key_of(record: LeaseRecord) -> tuple[str | None, str]:
        """The lease's entry in :attr:`by_key`."""
        return (key_space(record.owner), record.request_key)

    def claim_gpus(self, record: LeaseRecord) -> None:
        """Claim the lease's GPUs in the cluster, counted against its user and groups if it
        is :attr:`~LeaseRecord.charged`."""
        charged = record.charged
        claim_gpus(self.cluster, record.lease_id, record.user if charged else None,
                   record.groups if charged else (), record.gpu_uuids,
                   shared=record.shared, memory_mib=record.memory_mib,
                   units=record.units)

    def dequeue(self, lease_id: str) -> None:
        self.queue = [entry for entry in self.queue if entry[1] != lease_id]
        self.demands.pop(lease_id, None)

    def serving_order(self, now: float | None = None) -> list[str]:
        """The queued leases in the order they are served: the queue's, waiters of equal
        priority least recent use first (:meth:`UsageBook.order`, as of ``now``), with the
        requests of members of a booking in effect (with room for them) ahead of the others."""
        ids = self.usage.order([lease_id for _, lease_id in self.queue], self.leases,
                               self.charged_holding, now)
        if not self.windows.rooms:
            return ids
        ahead: list[str] = []
        behind: list[str] = []
        for lease_id in ids:
            demand = self.queued_demand(self.leases[lease_id])
            member = isinstance(demand, Demand) and self.windows.booked_share(
                demand.user, demand.groups, demand.models, demand.host) is not None
            (ahead if member else behind).append(lease_id)
        return ahead + behind

    def holding(self) -> list[LeaseRecord]:
        """The leases that hold GPUs (granted, bound, releasing)."""
        return [r for r in self.leases.values() if r.state.holds_gpus]

    def charged_holding(self) -> list[LeaseRecord]:
        """The leases that hold GPUs and count against their users' and groups' guarantees
        and bookings (:attr:`~LeaseRecord.charged`)."""
        return [r for r in self.leases.values() if r.state.holds_gpus and r.charged]

    def queued_demand(self, record: LeaseRecord) -> Demand | Refusal | None:
        """What a queued request asks, resolved against the current models; None when its
        stored request no longer validates (cannot happen for one that was accepted).

        Kept per lease until the models change (the catalog is then another object): the
        queue is tried again at every change that could let a request fit, and validating
        and resolving a waiting request costs far more than trying to place it.
        """
        catalog = self.placer.model_catalog()
        known = self.demands.get(record.lease_id)
        if known is not None and known[0] is catalog:
            return known[1]
        try:
            request = AllocateRequest.model_validate(record.request)
        except ValidationError:
            return None
        demand = make_demand(request, catalog, self.settings)
        self.demands[record.lease_id] = (catalog, demand)
        return demand

    # ------------------------------------------------------------------ transitions

    def new_record(self, request: AllocateRequest, sender: Sender, now: float) -> LeaseRecord:
        """A queued lease for ``request``, owned by its sender's broker user, not yet
        tracked."""
        return LeaseRecord(
            lease_id=self.new_lease_id(), request_key=request.request_key, user=request.user,
            groups=tuple(request.groups), state=LeaseState.QUEUED, created_at=now,
            request=request.model_dump(mode="json", exclude={"deadline"}),
            priority=request.priority, owner=sender.user_id,
        )

    def grant(self, record: LeaseRecord, placement: Placement, demand: Demand,
              now: float, changes: Changes, old: LeaseState | None) -> None:
        """Give the lease its placement: claim the GPUs, start the bind deadline."""
        record.state = LeaseState.GRANTED
        self.time(record)
        record.host = placement.host
        self.by_host.setdefault(record.host, {})[record.lease_id] = record
        record.gpu_uuids = tuple(placement.gpu_uuids)
        record.model = placement_model(placement, self.cluster)
        record.shared = placement.shared
        record.memory_mib = placement.memory_mib
        record.units = placement.units
        record.env = lease_env(placement, self.cluster, record.lease_id)
        record.granted_at = now
        record.bind_deadline = now + self.settings.bind_timeout_s
        share = self.windows.booked_share(record.user, record.groups, demand.models,
                                          demand.host)
        if share is not None and self.windows.in_room(share, record.model, record.host,
                                                      record.units):
            self.windows.take(share, record.units)  # within a booking: not borrowed
            self.windows.booking_of[record.lease_id] = share.name
            record.borrowed = False
        else:
            record.borrowed = would_borrow(placement.units, quota_standings(
                record.user, record.groups, self.cluster, self.settings, limited_only=True,
                model=record.model))
        apply_placement(self.cluster, placement, record.lease_id, demand)
        self.index.refresh(self.cluster, placement.host)
        self.by_key[self.key_of(record)] = record.lease_id
        changes.transition(record, old, now, "granted", by=record.user)
        self.counters.add(Count.GRANTED)

    def bind(self, record: LeaseRecord, container_id: str, node_time: float, now: float,
             changes: Changes, via: str) -> None:
        """The node saw the granted lease's container running."""
        old = record.state
        record.state = LeaseState.BOUND
        record.container_id = container_id
        record.bound_at = now
        self.node_clock_bound[record.lease_id] = node_time
        changes.transition(record, old, now, f"container {container_id[:12]} running ({via})",
                           by=f"node {record.host}")
        self.counters.add(Count.BOUND)

    def stop_and_release(self, record: LeaseRecord, stop: StopReason, now: float,
                         changes: Changes, *, by: str, note: str | None, why: str) -> None:
        """Make a granted or bound lease ``releasing`` and ask its node to stop the container.

        The GPU is free when the container is gone, not when someone asks (docs/design.md,
        flow 3): the node agent's event or heartbeat finishes this.
        """
        old = record.state
        record.state = LeaseState.RELEASING
        self.time(record)
        record.releasing_at = now
        record.released_by = by
        record.release_note = note
        self.by_key.pop(self.key_of(record), None)
        changes.transition(record, old, now, why, by=by)
        # Swarm stops a removed service's task only seconds later (a 2 s gossip delay
        # comes first); the node agent stops it at once, so the GPU is free in
        # milliseconds. A lease never bound has no container to stop yet: if one starts,
        # its start is answered with a stop (a start event of a releasing lease).
        self.outbox.ask_stop(record.host, record.lease_id, record.container_id, stop, now,
                             changes)

    def end(self, record: LeaseRecord, state: LeaseState, reason: ReleaseReason, now: float,
            changes: Changes, *, by: str, note: str | None = None) -> None:
        """End a lease for good and free what it held."""
        old = record.state
        if record.reclaim_stopped_at is not None and record.reclaim_reason is not None \
                and reason is not ReleaseReason.ADMIN:
            # Its container was stopped to reclaim it: however the end is noticed (die event,
            # missing from a listing, silent node), that is why it ended.
            reason = ReleaseReason(record.reclaim_reason.value)
        elif record.reclaim_at is not None:
            # Ended otherwise during a warning's grace: the warning did not happen.
            record.reclaim_at = record.reclaim_reason = record.reclaim_for = None
        self.idle.lease_ended(record, now)
        self.windows.reclaim_for_booking.pop(record.lease_id, None)
        self.windows.booking_of.pop(record.lease_id, None)
        if old.holds_gpus:
            # Its GPUs drain (before the index sees them free): placed again once a report
            # shows its container's processes gone from them.
            self.processes.lease_ended(record, now)
            self.usage.lease_ended(record, now)
            self.cluster.drop_claims(record.lease_id, list(record.gpu_uuids))
            if record.host is not None:
                self.index.refresh(self.cluster, record.host)
        if old is LeaseState.QUEUED:
            self.dequeue(record.lease_id)
        record.state = state
        record.released_at = now
        record.release_reason = reason
        record.released_by = record.released_by or by
        if note:
            record.release_note = note
        if self.by_key.get(self.key_of(record)) == record.lease_id:
            del self.by_key[self.key_of(record)]
        self.leases.pop(record.lease_id, None)
        if record.host is not None:
            self.by_host.get(record.host, {}).pop(record.lease_id, None)
        self.node_clock_bound.pop(record.lease_id, None)
        self.recent[record.lease_id] = record
        while len(self.recent) > RECENT_FINAL_LEASES:
            self.recent.popitem(last=False)
        changes.transition(record, old, now, reason.value, by=by)
        self.counters.add_to(Family.RELEASED, reason.value)

    # ------------------------------------------------------------------ timers

    def run_timers(self, now: float, changes: Changes, nodes: NodeReports) -> bool:
        """End the leases whose timer ran out: a queued request's wait, a grant's bind
        deadline, a release on a node silent past ``stop_grace_s`` (or one that cannot list
        containers, for a lease never bound). True when GPUs were freed."""
        freed = False
        # Only queued, granted and releasing leases have timers: look at those alone, in the
        # order they entered such a state, and forget the ones that have left them since
        # (bound, or final: a lease leaves self.leases only as final).
        timed = []
        for lease_id, record in list(self.timed.items()):
            if record.state in TIMED_STATES:
                timed.append(record)
            else:
                del self.timed[lease_id]
        stop_grace_s = self.settings.stop_grace_s
        for record in timed:
            if record.state is LeaseState.QUEUED and record.wait_until is not None \
                    and now >= record.wait_until:
                self.end(record, LeaseState.EXPIRED, ReleaseReason.WAIT_EXPIRED, now,
                         changes, by="allocator")
            elif record.state is LeaseState.GRANTED and record.bind_deadline is not None \
                    and now >= record.bind_deadline:
                self.end(record, LeaseState.RELEASED, ReleaseReason.BIND_TIMEOUT, now,
                         changes, by="allocator")
                freed = True
            elif (record.state is LeaseState.RELEASING and record.host is not None
                  and nodes.silent_for(record.host, now) > stop_grace_s):
                self.end(record, LeaseState.RELEASED, ReleaseReason.NODE_SILENT, now,
                         changes, by="allocator")
                freed = True
            elif self._unbound_release_no_listing_can_end(record, now, nodes):
                self.end(record, LeaseState.RELEASED, ReleaseReason.STOPPED, now,
                         changes, by="allocator",
                         note="never bound; its node cannot list containers")
                freed = True
        return freed

    def _unbound_release_no_listing_can_end(self, record: LeaseRecord, now: float,
                                       nodes: NodeReports) -> bool:
        """A lease released before any container ran, on a node whose heartbeats cannot list
        containers: its node will never report it gone, so it ends ``stop_grace_s`` after
        the release, as a lease of a silent node does."""
        return (record.state is LeaseState.RELEASING and record.bound_at is None
                and record.container_id is None and record.host in nodes.cannot_list
                and record.releasing_at is not None
                and now - record.releasing_at > self.settings.stop_grace_s)

    # ------------------------------------------------------------------ lookups

    def active_for(self, request_key: str, asker: str | None) -> LeaseRecord | None:
        """The active lease ``request_key`` names for the broker user ``asker``: the one in
        its own key space, else one whose owner is not known (anyone's, as before owners
        were recorded, so that an upgrade strands no request key)."""
        for space in dict.fromkeys((key_space(asker), None)):
            lease_id = self.by_key.get((space, request_key))
            if lease_id is not None:
                return self.leases[lease_id]
        return None

    def find(self, lease_id: str | None, request_key: str | None, asker: str | None = None,
             *, every_owner: bool = True) -> LeaseRecord | None:
        """An in-memory lease by id, or by request key as the broker user ``asker`` names it
        (:meth:`active_for`, then its newest recently finished one); ``every_owner``: any
        owner's under that key, active first (an admin's lookup, the service's own)."""
        if lease_id is not None:
            return self.leases.get(lease_id) or self.recent.get(lease_id)
        assert request_key is not None
        active = self.active_for(request_key, asker)
        if active is not None:
            return active
        spaces = {key_space(asker), None}
        newest: LeaseRecord | None = None
        for record in (*self.leases.values(), *self.recent.values()):
            if record.request_key != request_key or not (
                    every_owner or key_space(record.owner) in spaces):
                continue
            if newest is None or (record.state.active, record.created_at) >= (
                    newest.state.active, newest.created_at):
                newest = record
        return newest

    def queue_position(self, lease_id: str) -> int | None:
        """1-based position of a queued lease in the order it is served, or None."""
        for position, queued_id in enumerate(self.serving_order(), start=1):
            if queued_id == lease_id:
                return position
        return None

    def view(self, record: LeaseRecord) -> Lease:
        """A lease as the protocol shows it: its queue position, GPU indices and use now."""
        lease = record.to_protocol(
            self.queue_position(record.lease_id) if record.state is LeaseState.QUEUED else None
        )
        lease.gpu_indices = [
            self.cluster.gpus[u].index for u in record.gpu_uuids if u in self.cluster.gpus
        ]
        latest = self.idle.use_now(record.lease_id)
        if latest is not None:
            lease.utilization_pct, lease.gpu_memory_used_mib = latest
        lease.outside_grant = list(self.processes.outside_grant.get(record.lease_id, ()))
        lease.over_budget_since = self.idle.over_budget_since(record.lease_id)
        lease.booking = self.windows.booking_of.get(record.lease_id)
        if record.reclaim_at is not None:
            lease.reclaim_booking = self.windows.reclaim_for_booking.get(record.lease_id)
        lease.link = self.link(record)
        return lease

    def link(self, record: LeaseRecord) -> str | None:
        """The worst link between the lease's GPUs, by its host's links as last reported:
        worked out at each reply (links are in memory, the ledger keeps only the GPUs), so
        None for one GPU and while the host has not reported them (as after a restart, until
        its agent answers the ``hello``)."""
        node = self.cluster.nodes.get(record.host or "")
        if node is None or node.interconnect is None or len(record.gpu_uuids) < 2:
            return None
        try:
            worst = gpu_sets.worst_link(node.interconnect, record.gpu_uuids)
        except ValueError:  # GPUs the report of links does not list (MIG instances)
            return None
        return None if worst is None else worst.wire_name

    def reply(self, record: LeaseRecord) -> LeaseReply:
        """A reply carrying one lease."""
        return LeaseReply(lease=self.view(record))
