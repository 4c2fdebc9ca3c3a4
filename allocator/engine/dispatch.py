"""The engine's front door: :class:`Engine` builds the parts, applies one inbound message at a
time (:meth:`Engine.handle`) by calling the parts that message concerns, in order, and runs the
timers (:meth:`Engine.tick`)."""

from __future__ import annotations

import functools
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable

from pydantic import BaseModel

from allocator.config import AllocatorSettings
from allocator.engine.booking_alerts import BookingShortWatch
from allocator.engine.booking_windows import BookingWindows
from allocator.engine.bookings import BookingBook
from allocator.engine.containers import GRACE_ENDS, NodeReconciliation, listing_order
from allocator.engine.fence import StartFence
from allocator.engine.gpus import GpuInventory
from allocator.engine.idle import IdleWatch
from allocator.engine.lease_use import UseBook
from allocator.engine.leases import LeaseBook, may_act_on
from allocator.engine.node_truth import NodeTruth
from allocator.engine.nodes import NodeReports
from allocator.engine.outbox import CommandOutbox
from allocator.engine.placement import Placer
from allocator.engine.processes import ProcessWatch
from allocator.engine.reclaim import Reclaimer
from allocator.engine.requests import LeaseRequests
from allocator.engine.state import Sender, count_anomaly, log
from allocator.engine.usage import UsageBook
from allocator.engine.views import Views
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.loaded import LoadedState
from allocator.metrics.counters import Count, Counters
from allocator.metrics.figures import EngineFigures
from allocator.placement.cluster import Cluster, Node
from allocator.placement.demand import share_slots_for
from allocator.placement.index import PlacementIndex
from allocator.wire.heartbeat_delta import apply_delta
from allocator.wire.protocol import (
    AgentCommand,
    AllocateRequest,
    AnyInbound,
    BookingRequest,
    ContainerEvent,
    DrainReply,
    DrainRequest,
    ErrorCode,
    Heartbeat,
    HeartbeatDelta,
    InventoryReply,
    InventoryRequest,
    LeaseReply,
    LeasesRequest,
    LeaseState,
    QueueRequest,
    QuotaRequest,
    ReleaseRequest,
    StatusRequest,
    StopContainer,
    error_reply,
)
from allocator.wire.topology import RPC_EXCHANGE


class Engine:
    """Nodes, GPUs and leases in memory, and the rules that change them.

    The state lives in the parts (see :mod:`allocator.engine`); the engine shares with them
    only ``settings``, ``counters``, ``cluster`` and ``index`` (the same objects for its life:
    :meth:`load` refills them in place). Each handler below calls the parts a message
    concerns, in order; a part calls only the parts it was given at construction.
    """

    def __init__(self, settings: AllocatorSettings, started_at: float, *,
                 new_lease_id: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self.settings = settings
        self.counters = Counters()
        self.cluster = Cluster()
        self.index = PlacementIndex()
        counters, cluster, index = self.counters, self.cluster, self.index
        self.outbox = CommandOutbox(settings, counters)
        self.idle = IdleWatch(settings, counters)
        self.start_fence = StartFence(started_at)
        self.nodes = NodeReports(settings, counters, cluster, index, started_at)
        self.gpus = GpuInventory(settings, counters, cluster, index, self.nodes)
        self.bookings = BookingBook(settings, cluster, self.nodes)
        self.windows = BookingWindows(settings, self.bookings)
        self.short_watch = BookingShortWatch(self.bookings, self.nodes, self.start_fence)
        self.placer = Placer(settings, cluster, index, self.nodes, self.start_fence,
                             self.windows)
        self.processes = ProcessWatch(settings, counters, cluster, index, self.nodes)
        self.decayed = UsageBook(settings, cluster, self.placer)
        self.book = LeaseBook(settings, counters, cluster, index, self.idle, self.outbox,
                              self.placer, self.processes, self.windows, self.decayed,
                              new_lease_id)
        self.requests = LeaseRequests(settings, counters, self.book, self.placer, self.start_fence,
                                      self.outbox)
        self.truth = NodeTruth(settings, counters, cluster, index, self.book)
        self.containers = NodeReconciliation(settings, counters, self.book, self.truth,
                                             self.idle, self.outbox, self.requests, self.nodes)
        self.reclaim = Reclaimer(settings, counters, self.book, self.idle, self.placer,
                                 self.start_fence, self.windows, self.processes)
        self.views = Views(settings, cluster, self.book, self.idle, self.nodes, self.processes)

    def load(self, state: LoadedState, now: float, *, fenced: bool = False,
             usage_history: Iterable[LeaseRecord] = ()) -> None:
        """Rebuild memory from the ledger (at start, after a failed commit, on takeover).

        ``fenced``: the ledger may be behind the nodes (a process start: the file may be
        deleted, restored or another node's): the start fence (:mod:`allocator.engine.fence`)
        holds every node the ledger knows. A reload of a ledger this process or the active one
        kept current needs none. What is memory only is kept: counters, lease use and budgets,
        when containers were seen running, telemetry times, clock skew. ``usage_history``:
        the ledger's leases that ended since :meth:`usage_history_since` (decayed usage is
        rebuilt from them).
        """
        cluster = self.cluster
        refill_cluster(cluster, state, self.settings)
        self.nodes.load(state, now)
        self.start_fence.load(cluster.nodes, now, self.settings.start_fence_s, fenced=fenced)
        self.truth.load()
        self.processes.load()
        self.book.load(state)
        self.gpus.load(now)
        self.index.rebuild(cluster)
        self.placer.inventory_changed()
        self.decayed.load(usage_history, (r.lease_id for r in state.leases), now)
        self.bookings.load(state)
        self.short_watch.load(state.booking_alerts)
        self.outbox.load()

    def usage_history_since(self, now: float) -> float | None:
        """From when :meth:`load` needs the ended leases for decayed usage
        (:func:`allocator.ledger.usage_history.ended_since`); None: it needs none."""
        return self.decayed.history_since(now)

    # ------------------------------------------------------------------ messages

    def handle(self, message: AnyInbound, sender: Sender, now: float,
               changes: Changes) -> BaseModel | None:
        """Apply one message; return its reply (None for node messages)."""
        self.decayed.seen(now)  # queue positions in replies are as of now
        if isinstance(message, Heartbeat | HeartbeatDelta | ContainerEvent):
            if not sender.via_nodes_exchange:
                self.counters.add(Count.NODE_MESSAGE_WRONG_EXCHANGE)
                return error_reply(ErrorCode.FORBIDDEN,
                                   "node messages must be published to the nodes exchange")
            if not self.nodes.may_report(message.host, sender, now, changes, message.kind):
                return None
            since = len(changes.events)
            if isinstance(message, Heartbeat):
                self._heartbeat(message, sender, now, changes)
            elif isinstance(message, HeartbeatDelta):
                self._heartbeat_delta(message, sender, now, changes)
            else:
                self.containers.container_event(message, now, changes)
            self.nodes.keep_within_budget(message.host, sender, since, now, changes)
            if not isinstance(message, ContainerEvent) and message.host in self.cluster.nodes:
                self.outbox.greet(message.host, message.agent_id)  # taken, not refused
            return None
        if sender.via_nodes_exchange:
            self.counters.add(Count.REQUEST_FROM_NODE_EXCHANGE)
            if self.nodes.may_record(sender, None, now):  # an agent's credential: bounded
                changes.event(now, "request_refused", reason="request on the nodes exchange",
                              user=sender.user_id)
            return error_reply(ErrorCode.FORBIDDEN,
                               "requests must be published to the RPC exchange "
                               f"{RPC_EXCHANGE!r}, not to the nodes exchange")
        if isinstance(message, AllocateRequest):
            return self._allocate(message, sender, now, changes)
        if isinstance(message, ReleaseRequest):
            return self.requests.release(message, sender, now, changes)
        if isinstance(message, StatusRequest):
            return self.requests.status(message, sender)
        visible = functools.partial(may_act_on, sender=sender,
                                    admin_users=self.settings.admin_users)
        if isinstance(message, InventoryRequest):
            return self.views.inventory(now, include_leases=message.include_leases,
                                        visible=visible)
        if isinstance(message, QueueRequest):
            return self.views.queue(visible)
        if isinstance(message, DrainRequest):
            return self._drain(message, sender, now, changes)
        if isinstance(message, QuotaRequest):
            return self.views.quota(message, visible)
        if isinstance(message, LeasesRequest):
            return self.views.leases_reply(message, now, visible)
        if isinstance(message, BookingRequest):
            return self._booking(message, sender, now, changes)
        raise TypeError(f"unhandled message kind {type(message).__name__}")

    def unreadable_heartbeat(self, host: str, sender: Sender, now: float,
                             changes: Changes) -> bool:
        """A heartbeat for ``host`` that did not decode (its host and sender could be read):
        True when it was taken as a sign of life.

        An agent of a newer protocol may send what this allocator cannot read; its node is
        still alive, and marking it down would stop placements there and, after the stop
        grace, release leases whose containers run. Only liveness is taken: nothing it says
        about GPUs or containers is believed, it cannot bring a host in, and only the broker
        user that reports for the host may send it, as for any heartbeat.
        """
        node = self.cluster.nodes.get(host)
        # An unreadable message from another user is refused only as undecodable (counted and
        # dead-lettered by the caller), not also as a report for a host it does not own.
        if node is None or not self.nodes.owns(host, sender):
            return False
        if count_anomaly(self.counters, Count.HEARTBEATS_UNREADABLE):
            log.warning("heartbeat of %s does not decode; taken as liveness only (an agent "
                        "of a newer protocol? docs/protocol.md#compatibility)", host)
        self.nodes.alive(node, sender, now, changes)
        return True

    def _allocate(self, request: AllocateRequest, sender: Sender, now: float,
                  changes: Changes) -> BaseModel:
        """Grant, queue or refuse; a request that queues is planned for at once, not at the
        next tick, so a reclaim's warning (or, without a grace, its stop) goes out with the
        reply."""
        reply = self.requests.allocate(request, sender, now, changes)
        if isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.QUEUED:
            self._reclaim(now, changes)
        return reply

    def _booking(self, request: BookingRequest, sender: Sender, now: float,
                 changes: Changes) -> BaseModel:
        """An admin's booking request; a booking added (or removed) short, or that makes
        another short (or whole), is told at once."""
        version = self.bookings.version
        reply = self.bookings.handle(request, sender, now, changes)
        if self.bookings.version != version:
            self.short_watch.check(now, changes)
        return reply

    def _drain(self, request: DrainRequest, sender: Sender, now: float,
               changes: Changes) -> BaseModel:
        """An admin's drain; an undrain may let queued requests fit."""
        reply = self.nodes.drain(request, sender, now, changes)
        if isinstance(reply, DrainReply) and not reply.drained:
            self.requests.serve_queue(now, changes)
        return reply

    def _heartbeat(self, beat: Heartbeat, sender: Sender, now: float, changes: Changes) -> None:
        """A full report: hold it, upsert the GPUs, liveness and telemetry, reconcile the
        containers (adoptions first), lift the host's start fence, serve the queue when
        anything may fit now, and close the start fence once every node has reported."""
        nodes = self.nodes
        if nodes.stale(beat):
            self.counters.add(Count.HEARTBEAT_STALE)  # replayed or reordered: older news
            return
        host = beat.host
        if host not in self.cluster.nodes and not nodes.may_add_host(host, sender, now,
                                                                     changes):
            return
        nodes.hold(beat, now, changes)
        node = self.cluster.nodes.get(host)
        new_node = node is None
        if node is None:
            node = nodes.join(beat, sender, now, changes)
            self.start_fence.node_joined(host, now)
        agent_changed = node.agent_id != beat.agent_id
        node.agent_id = beat.agent_id
        inventory_changed = self.gpus.upsert(node, beat, now, changes)
        # A new interconnect may let a request wait no longer (its links now known).
        inventory_changed = self.nodes.take_interconnect(node, beat) or inventory_changed
        if inventory_changed:
            self.index.refresh(self.cluster, host)
            self.placer.inventory_changed()
            self.bookings.inventory_changed()
        nodes.alive_and_telemetry(node, sender, now, changes,
                                  due=new_node or agent_changed or inventory_changed,
                                  new_node=new_node)
        freed = self.containers.reconcile(beat, now, changes)
        # The processes after the containers: a lease this report ended drains, and this
        # report (taken after the end) already verifies it.
        verified = self.processes.observe(beat, self.book.by_host.get(host, {}).values(), now,
                                          changes)
        # Adoptions first (above), then the node is placeable.
        reported = beat.containers_complete and self.start_fence.report_applied(host, now, changes)
        if inventory_changed or freed or verified or reported:
            self.requests.serve_queue(now, changes)
        if reported and self.start_fence.all_reported(now):
            self.start_fence.close(now, changes)
            self.requests.end_start_fence_waits(now, changes)

    def _heartbeat_delta(self, delta: HeartbeatDelta, sender: Sender, now: float,
                         changes: Changes) -> None:
        """Apply the full report ``delta`` stands for (by :meth:`_liveness_only` when it
        changes nothing and may); if it does not fit the report held, a sign of life only."""
        nodes = self.nodes
        if nodes.stale(delta):
            self.counters.add(Count.HEARTBEAT_STALE)
            return
        base = nodes.reported.get(delta.host)
        beat = apply_delta(base, delta) if base is not None else None
        if beat is not None and base is not None:
            self.counters.add(Count.HEARTBEAT_DELTAS)
            if not (delta.gpus or delta.containers) and self._liveness_only(base, beat, sender,
                                                                             now, changes):
                return
            self._heartbeat(beat, sender, now, changes)
            return
        nodes.delta_unapplied(delta, base, sender, now, changes)

    def _liveness_only(self, base: Heartbeat, beat: Heartbeat, sender: Sender, now: float,
                       changes: Changes) -> bool:
        """Apply ``beat``, the report an empty delta onto ``base`` stands for, without the
        passes that would change nothing; False, having changed nothing, when they might.

        The full path (:meth:`_heartbeat`) would find the GPUs as ``base`` left them (the
        upsert of ``base`` changed and skipped nothing, and no other report took one since:
        ``GpuInventory.steady``), every listed container that of a lease bound here, no lease
        of the host missing from the listing that a grace could end, no conflict to lift
        (a container event may have recorded one since), no GPU of the host draining (a lease
        ended since: this report may verify it) and no start fence to lift (implied
        today: a complete report held has lifted it; checked so that a change to the start
        fence cannot make this path skip it). What it still does then, this does in the same
        order: hold the report, liveness, telemetry when it is due, and each listed lease's
        budget check and use sample (those depend on the time, not on change).
        ``tests/engine/test_heartbeat_fast_path.py`` holds the two paths equal.
        """
        host = beat.host
        node = self.cluster.nodes.get(host)
        if (node is None or node.agent_id != beat.agent_id
                or self.gpus.steady.get(host) is not base or host in self.truth.conflicts
                or (beat.containers_complete and host in self.start_fence.hosts)
                or self.processes.draining_on(host)):
            return False
        listed = sorted(beat.containers, key=listing_order)
        leases = self.book.leases
        records: list[LeaseRecord] = []
        for info in listed:
            # Bound here: neither adopted nor unexpected, nothing to bind or to stop. (Two
            # containers of one lease are two samples, as in the full path.)
            record = leases.get(info.lease_id)
            if record is None or record.host != host or record.state is not LeaseState.BOUND:
                return False
            records.append(record)
        running = {record.lease_id for record in records}
        if beat.containers_complete and any(
                record.lease_id not in running and record.state in GRACE_ENDS
                for record in self.book.by_host.get(host, {}).values()):
            return False
        self.nodes.hold(beat, now, changes)
        self.gpus.steady[host] = beat
        self.nodes.alive_and_telemetry(node, sender, now, changes, due=False, new_node=False)
        clock_bound, idle = self.book.node_clock_bound, self.idle
        for record, info in zip(records, listed, strict=True):
            clock_bound.setdefault(record.lease_id, beat.sent_at)
            self.containers.check_budget(record, info, now, changes)
            idle.observe(record, info, now, changes)
        return True

    # ------------------------------------------------------------------ timers

    def tick(self, now: float, changes: Changes) -> None:
        """Run the timers: the start fence, queue waits, bind deadlines, release
        verification (``release_verify_s``), node silence, fair share's reclaim warnings
        and their deadlines, and bookings become short or whole again."""
        if self.start_fence.expired(now):
            # start_fence_s ran out with nodes that never reported in full: they are placed
            # as usual from now on, before the requests that waited only for it expire.
            self.start_fence.expire(now, changes)
            self.requests.serve_queue(now, changes)
        freed = self.book.run_timers(now, changes, self.nodes)
        freed = self.processes.tick(now, changes) or freed
        self.nodes.mark_down(now, changes)
        if freed:
            self.requests.serve_queue(now, changes)
        self._reclaim(now, changes)
        self.short_watch.tick(now, changes)

    def _reclaim(self, now: float, changes: Changes) -> None:
        """Plan reclaims; GPUs a reclaim freed go to the queue at once."""
        if self.reclaim.run(now, changes):
            self.requests.serve_queue(now, changes)

    # ------------------------------------------------------------------ for the service

    def take_commands(self) -> list[StopContainer]:
        """Empty the outbox's stop commands and return them."""
        return self.outbox.take()

    def take_agent_commands(self) -> list[AgentCommand]:
        """Empty the outbox and return what was in it, hellos first (the service, after a
        commit)."""
        return self.outbox.take_all()

    def hellos_not_sent(self, hosts: list[str]) -> None:
        """The service could not send the hellos to these hosts' agents: each is greeted again
        at its next message."""
        self.outbox.not_greeted(hosts)

    def find(self, lease_id: str | None, request_key: str | None) -> LeaseRecord | None:
        """An in-memory lease by id or request key, any owner's (active first, then recently
        finished)."""
        return self.book.find(lease_id, request_key)

    def lease_reply(self, record: LeaseRecord) -> LeaseReply:
        """A reply carrying one lease."""
        return self.book.reply(record)

    def lease_reply_for(self, record: LeaseRecord, sender: Sender, doing: str) -> BaseModel:
        """The reply to ``sender``'s request about ``record`` (a lease finished long ago,
        read from the ledger): the lease, or ``forbidden`` if it is another's."""
        return self.requests.refuse_foreign(record, sender, doing) or self.book.reply(record)

    def inventory(self, now: float, include_leases: bool = False) -> InventoryReply:
        """The cluster as the inventory reply shows it."""
        return self.views.inventory(now, include_leases)

    def figures(self, now: float) -> EngineFigures:
        """What a metrics scrape reads of the engine (:mod:`allocator.metrics.figures`), in
        one walk of its GPUs and leases; call between two messages."""
        figures = self.views.figures(now)
        figures.booking_short = self.short_watch.missing()
        figures.engine_counters = self.counters.copy()
        return figures

    def conflicted_gpus(self) -> dict[str, str]:
        """GPU uuid -> why it is out of placement (a running container's grant contradicts
        the ledger on it)."""
        return self.truth.conflicted_gpus()

    # The parts' state under the names the service, reports, tests and benchmarks read.

    @property
    def leases(self) -> dict[str, LeaseRecord]:
        """Leases not yet final, by id."""
        return self.book.leases

    @property
    def by_key(self) -> dict[tuple[str | None, str], str]:
        """(key space, request_key) -> id of its active (queued, granted, bound) lease."""
        return self.book.by_key

    @property
    def recent(self) -> OrderedDict[str, LeaseRecord]:
        """The newest finished leases, by id."""
        return self.book.recent

    @property
    def _queue(self) -> list[tuple[tuple[object, ...], str]]:
        """The queue, in order: (order key, lease id)."""
        return self.book.queue

    @property
    def commands(self) -> list[StopContainer]:
        """The outbox: stop commands decided since the last :meth:`take_commands`."""
        return self.outbox.commands

    @property
    def use(self) -> UseBook:
        """Per lease: its processes' GPU use from heartbeats."""
        return self.idle.use

    @property
    def new_lease_id(self) -> Callable[[], str]:
        """Makes lease ids: random by default; tests pass a counter to replay runs exactly."""
        return self.book.new_lease_id

    @new_lease_id.setter
    def new_lease_id(self, make: Callable[[], str]) -> None:
        self.book.new_lease_id = make


def refill_cluster(cluster: Cluster, state: LoadedState, settings: AllocatorSettings) -> None:
    """Replace the cluster's nodes, GPUs and claims, in place, by the ledger's nodes and GPUs
    (no claims: the lease book claims its leases' GPUs)."""
    cluster.nodes.clear()
    cluster.gpus.clear()
    cluster.claims.clear()
    for node in state.nodes:
        cluster.nodes[node.host] = Node(
            host=node.host, last_heartbeat=node.last_heartbeat, drained=node.drained,
            agent_id=node.agent_id, gpu_uuids=[],
        )
    for gpu in state.gpus:
        gpu.share_slots = share_slots_for(gpu.model, settings)
        cluster.gpus[gpu.uuid] = gpu
        owner = cluster.nodes.get(gpu.host)
        if owner is not None:
            owner.gpu_uuids.append(gpu.uuid)
