"""The allocator's state machine: applies one inbound message at a time to memory.

No I/O and no clock: each call gets ``now`` and a :class:`~allocator.ledger.Changes` to
fill, and returns the reply (or ``None`` for fire-and-forget node messages). The service
commits the changes, then sends the replies. If a commit fails, the service throws this
engine away and rebuilds it from the ledger, so memory never runs ahead of the disk.

Lease life (DESIGN.md, flows): ``queued`` → ``granted`` (GPUs claimed) → ``bound`` (the node
saw the container start) → ``releasing`` (the hub stopped it) → ``released`` (the container
is gone). Every release records its reason.

The engine decides, the service acts: commands to node agents (stop a lease's container) go
into the outbox :attr:`Engine.commands`, which the service sends once the batch that decided
them is committed, and forgets when the commit fails.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from allocator import policy
from allocator.cluster import GPU, Claim, Cluster, Node
from allocator.config import AllocatorSettings
from allocator.lease import LeaseRecord
from allocator.ledger import Changes, LoadedState
from allocator.placement_index import PlacementIndex
from allocator.protocol import (
    AllocateRequest,
    AnyInbound,
    ContainerAction,
    ContainerEvent,
    DrainReply,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    GPUView,
    Health,
    Heartbeat,
    InventoryReply,
    InventoryRequest,
    Lease,
    LeaseReply,
    LeaseState,
    NodeView,
    QueueReply,
    QueueRequest,
    ReleaseReason,
    ReleaseRequest,
    StatusRequest,
    StopContainer,
    StopReason,
    error_reply,
)

log = logging.getLogger(__name__)

CLOCK_SKEW_WARN_S = 30.0
"""A heartbeat stamped further than this from the allocator's clock is logged (once a host)."""

RECENT_FINAL_LEASES = 10_000
"""Finished leases kept in memory so a repeated release or status is answered without I/O."""


@dataclass(frozen=True)
class Sender:
    """Who sent a message, as the broker vouches for it."""

    user_id: str | None
    """The AMQP ``user_id`` property (RabbitMQ refuses a publish whose user_id is not the
    connection's user), or None when the publisher did not set it."""
    via_nodes_exchange: bool
    """True when it came through the nodes exchange (agents), False for the RPC exchange."""


class Engine:
    """Nodes, GPUs and leases in memory, and the rules that change them."""

    def __init__(self, settings: AllocatorSettings, started_at: float, *,
                 new_lease_id: Callable[[], str] = lambda: uuid.uuid4().hex):
        self.settings = settings
        self.new_lease_id = new_lease_id
        """Makes lease ids: random by default; tests pass a counter to replay runs exactly."""
        self.started_at = started_at
        self.cluster = Cluster()
        self.leases: dict[str, LeaseRecord] = {}
        """Leases not yet final, by id."""
        self.by_key: dict[str, str] = {}
        """request_key -> id of its active (queued, granted, bound) lease."""
        self._by_host: dict[str, dict[str, LeaseRecord]] = {}
        """host -> the leases of :attr:`leases` placed there, so that a heartbeat reconciles
        its own host's leases instead of scanning every lease of the cluster."""
        self.recent: OrderedDict[str, LeaseRecord] = OrderedDict()
        self._queue: list[tuple[tuple[Any, ...], str]] = []
        self.agent_users: dict[str, str] = {}
        self.counters: Counter[str] = Counter()
        self._last_seq: dict[str, tuple[str, int]] = {}
        self._telemetry_saved: dict[str, float] = {}
        self._node_clock_bound: dict[str, float] = {}
        """lease id -> node-clock time its container was known to run (start event or listing)."""
        self._down: set[str] = set()
        self._over_budget: set[str] = set()
        self._skewed: set[str] = set()
        self.index = PlacementIndex()
        self._catalog: Cluster | None = None
        self.commands: list[StopContainer] = []
        """Outbox: commands to node agents decided since the last :meth:`take_commands`. The
        service sends them after the batch is committed; a reload empties it."""
        self._stops_asked: OrderedDict[tuple[str, str], float] = OrderedDict()
        """(lease id, container id) -> when its stop was last asked, so that a container that
        heartbeats keep listing is not asked again every heartbeat (see :meth:`_ask_stop`)."""

    # ------------------------------------------------------------------ loading

    def load(self, state: LoadedState, now: float) -> None:
        """Rebuild memory from the ledger (at start, after a failed commit, on takeover)."""
        self.started_at = now
        self.cluster = Cluster()
        for node in state.nodes:
            self.cluster.nodes[node.host] = Node(
                host=node.host, last_heartbeat=node.last_heartbeat, drained=node.drained,
                agent_id=node.agent_id, gpu_uuids=[],
            )
        for gpu in state.gpus:
            gpu.share_slots = policy.share_slots_for(gpu.model, self.settings)
            self.cluster.gpus[gpu.uuid] = gpu
            owner = self.cluster.nodes.get(gpu.host)
            if owner is not None:
                owner.gpu_uuids.append(gpu.uuid)
        self.agent_users = dict(state.agent_users)
        self.leases, self.by_key, self._queue, self._by_host = {}, {}, [], {}
        for record in state.leases:
            self._track(record)
            if record.state.holds_gpus:
                self._claim(record)
        # A node whose last heartbeat (as the ledger saw it) is recent stays placeable, so a
        # standby that takes over serves requests at once. The silence timer of leases being
        # released starts no earlier than this start (see _silent_for).
        self._down = {host for host, node in self.cluster.nodes.items()
                      if not node.is_up(now, self.settings.node_down_after_s)}
        self._last_seq.clear()
        self.index.rebuild(self.cluster)
        self._catalog = None
        # Commands of a batch that was not committed must not go out; containers still
        # running are asked again when the next heartbeat lists them.
        self.commands = []
        self._stops_asked.clear()

    def _track(self, record: LeaseRecord) -> None:
        self.leases[record.lease_id] = record
        if record.host is not None:
            self._by_host.setdefault(record.host, {})[record.lease_id] = record
        if record.state.active:
            self.by_key[record.request_key] = record.lease_id
        if record.state is LeaseState.QUEUED:
            key = policy.queue_order_key(record.priority, record.enqueued_at or record.created_at,
                                         record.lease_id)
            bisect.insort(self._queue, (key, record.lease_id))

    def _claim(self, record: LeaseRecord) -> None:
        exclusive = not record.shared
        for gpu_uuid in record.gpu_uuids:
            gpu = self.cluster.gpus.get(gpu_uuid)
            memory = record.memory_mib if record.shared else (gpu.memory_total_mib if gpu else 0)
            units = record.units / len(record.gpu_uuids) if record.gpu_uuids else record.units
            self.cluster.add_claim(gpu_uuid, Claim(
                lease_id=record.lease_id, user=record.user, groups=record.groups,
                exclusive=exclusive, memory_mib=memory or 0, units=units,
            ))

    # ------------------------------------------------------------------ dispatch

    def handle(self, message: AnyInbound, sender: Sender, now: float,
               changes: Changes) -> BaseModel | None:
        """Apply one message; return its reply (None for node messages)."""
        if isinstance(message, Heartbeat | ContainerEvent):
            if not sender.via_nodes_exchange:
                self.counters["node_message_wrong_exchange"] += 1
                return error_reply(ErrorCode.FORBIDDEN,
                                   "node messages must be published to the nodes exchange")
            if not self._node_may_report(message.host, sender, now, changes, message.kind):
                return None
            if isinstance(message, Heartbeat):
                self._heartbeat(message, sender, now, changes)
            else:
                self._container_event(message, now, changes)
            return None
        if sender.via_nodes_exchange:
            self.counters["request_from_node_exchange"] += 1
            changes.event(now, "request_refused", reason="request on the nodes exchange",
                          user=sender.user_id)
            return None
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
        raise TypeError(f"unhandled message kind {type(message).__name__}")

    # ------------------------------------------------------------------ views

    def queue_position(self, lease_id: str) -> int | None:
        """1-based position of a queued lease, or None."""
        for position, (_, queued_id) in enumerate(self._queue, start=1):
            if queued_id == lease_id:
                return position
        return None

    def _view(self, record: LeaseRecord) -> Lease:
        lease = record.to_protocol(
            self.queue_position(record.lease_id) if record.state is LeaseState.QUEUED else None
        )
        lease.gpu_indices = [
            self.cluster.gpus[u].index for u in record.gpu_uuids if u in self.cluster.gpus
        ]
        return lease

    def lease_reply(self, record: LeaseRecord) -> LeaseReply:
        """A reply carrying one lease."""
        return LeaseReply(lease=self._view(record))

    def find(self, lease_id: str | None, request_key: str | None) -> LeaseRecord | None:
        """An in-memory lease by id or request key (active first, then recently finished)."""
        if lease_id is not None:
            return self.leases.get(lease_id) or self.recent.get(lease_id)
        assert request_key is not None
        active = self.by_key.get(request_key)
        if active is not None:
            return self.leases[active]
        newest: LeaseRecord | None = None
        for record in (*self.leases.values(), *self.recent.values()):
            if record.request_key == request_key and (
                newest is None or record.created_at >= newest.created_at
            ):
                newest = record
        return newest

    def inventory(self, now: float, include_leases: bool = False) -> InventoryReply:
        """The cluster as the inventory reply shows it."""
        down_after = self.settings.node_down_after_s
        nodes = [
            NodeView(host=n.host, up=self._up(n, now), drained=n.drained,
                     last_heartbeat=n.last_heartbeat, gpus=len(n.gpu_uuids))
            for n in sorted(self.cluster.nodes.values(), key=lambda n: n.host)
        ]
        gpus = [
            GPUView(
                uuid=g.uuid, host=g.host, index=g.index, model=g.model,
                memory_total_mib=g.memory_total_mib, memory_used_mib=g.memory_used_mib,
                utilization_pct=g.utilization_pct, temperature_c=g.temperature_c,
                health=g.health, health_reasons=list(g.health_reasons), drained=g.drained,
                share_slots=g.share_slots,
                holders=[c.lease_id for c in self.cluster.claims_on(g.uuid)],
                free_slots=self.cluster.free_slots(g),
                free_memory_mib=self.cluster.free_memory_mib(g),
            )
            for g in sorted(self.cluster.gpus.values(), key=lambda g: (g.host, g.index))
            if g.present
        ]
        models = policy.summarize_models(self.cluster, self.settings, now, down_after)
        leases = None
        if include_leases:
            leases = [self._view(r) for r in self.leases.values()]
        return InventoryReply(at=now, nodes=nodes, gpus=gpus, models=models,
                              queued=len(self._queue), leases=leases)

    def _up(self, node: Node, now: float) -> bool:
        return node.host not in self._down and node.is_up(now, self.settings.node_down_after_s)

    # ------------------------------------------------------------------ allocate

    def _allocate(self, request: AllocateRequest, now: float, changes: Changes) -> BaseModel:
        existing_id = self.by_key.get(request.request_key)
        if existing_id is not None:
            existing = self.leases[existing_id]
            if existing.user != request.user:
                return error_reply(
                    ErrorCode.CONFLICT,
                    f"request key {request.request_key!r} belongs to user {existing.user!r}",
                )
            self.counters["allocate_retry"] += 1
            return self.lease_reply(existing)
        demand = policy.make_demand(request, self._model_catalog(), self.settings)
        if isinstance(demand, policy.Refusal):
            return self._refuse(demand)
        placement = self._place(demand, now)
        record = LeaseRecord(
            lease_id=self.new_lease_id(), request_key=request.request_key, user=request.user,
            groups=tuple(request.groups), state=LeaseState.QUEUED, created_at=now,
            request=request.model_dump(mode="json", exclude={"deadline"}),
            priority=request.priority,
        )
        if isinstance(placement, policy.Placement):
            self._grant(record, placement, demand, now, changes, old=None)
            self._track(record)
            return self.lease_reply(record)
        if placement.code is ErrorCode.NO_CAPACITY and request.wait_s > 0:
            record.enqueued_at = now
            record.wait_until = now + request.wait_s
            self._track(record)
            changes.transition(record, None, now, "no GPU free; waiting", by=request.user)
            self.counters["queued"] += 1
            return self.lease_reply(record)
        return self._refuse(placement)

    def _model_catalog(self) -> Cluster:
        """The cluster as model resolution needs it: every node, one GPU per model and size.

        :func:`policy.make_demand` only asks which models, sizes and hosts exist; a catalog of
        a few GPUs answers that in microseconds where the whole cluster takes milliseconds.
        It is rebuilt after an inventory change.
        """
        if self._catalog is None:
            representatives: dict[tuple[str, int, bool], GPU] = {}
            for gpu in self.cluster.gpus.values():
                representatives.setdefault((gpu.model, gpu.memory_total_mib, gpu.present), gpu)
            self._catalog = Cluster(nodes=self.cluster.nodes,
                                    gpus={g.uuid: g for g in representatives.values()})
        return self._catalog

    def _place(self, demand: policy.Demand, now: float) -> policy.Placement | policy.Refusal:
        """Best-fit placement (narrowed by the index when it can be), then the quota."""
        down_after = self.settings.node_down_after_s
        view = self._placement_view(now)
        placement: policy.Placement | policy.Refusal | None = None
        narrowed = self.index.narrow(
            demand, view,
            lambda node: node.host not in self._down and not node.drained
            and node.is_up(now, down_after))
        if narrowed is not None:
            placement = policy.place(demand, narrowed, now, down_after)
        if not isinstance(placement, policy.Placement):
            # Nothing among the candidates (or no narrowing possible): the exact answer, with
            # the refusal's full explanation, from the whole cluster.
            placement = policy.place(demand, view, now, down_after)
        # Quotas need a placement's units; a slice's units depend on the GPU it lands on, so
        # place first and check the quota of the actual placement.
        if isinstance(placement, policy.Refusal):
            return placement
        refusal = policy.check_quota(placement.units, demand.user, demand.groups,
                                     self.cluster, self.settings)
        return refusal if refusal is not None else placement

    def _placement_view(self, now: float) -> Cluster:
        """The cluster as placement sees it: nodes not yet heard from since a restart are down."""
        if not self._down:
            return self.cluster
        view = Cluster(nodes=dict(self.cluster.nodes), gpus=self.cluster.gpus,
                       claims=self.cluster.claims)
        for host in self._down:
            node = view.nodes.get(host)
            if node is not None:
                view.nodes[host] = Node(host=node.host, last_heartbeat=None,
                                        drained=node.drained, agent_id=node.agent_id,
                                        gpu_uuids=node.gpu_uuids)
        return view

    def _grant(self, record: LeaseRecord, placement: policy.Placement, demand: policy.Demand,
               now: float, changes: Changes, old: LeaseState | None) -> None:
        models = {self.cluster.gpus[u].model for u in placement.gpu_uuids}
        record.state = LeaseState.GRANTED
        record.host = placement.host
        self._by_host.setdefault(record.host, {})[record.lease_id] = record
        record.gpu_uuids = tuple(placement.gpu_uuids)
        record.model = models.pop() if len(models) == 1 else None
        record.shared = placement.shared
        record.memory_mib = placement.memory_mib
        record.units = placement.units
        record.env = policy.lease_env(placement, self.cluster, record.lease_id)
        record.granted_at = now
        record.bind_deadline = now + self.settings.bind_timeout_s
        policy.apply_placement(self.cluster, placement, record.lease_id, demand)
        self.index.refresh(self.cluster, placement.host)
        self.by_key[record.request_key] = record.lease_id
        changes.transition(record, old, now, "granted", by=record.user)
        self.counters["granted"] += 1

    def _refuse(self, refusal: policy.Refusal) -> ErrorReply:
        self.counters[f"refused_{refusal.code.value}"] += 1
        return error_reply(refusal.code, refusal.message, **refusal.details)

    def _serve_queue(self, now: float, changes: Changes) -> None:
        """Grant queued requests that fit now, in queue order (a freed GPU goes to the head)."""
        for _, lease_id in list(self._queue):
            record = self.leases[lease_id]
            try:
                request = AllocateRequest.model_validate(record.request)
            except ValidationError:  # cannot happen for a request we accepted; never wedge
                self._finish(record, LeaseState.EXPIRED, ReleaseReason.CANCELLED, now, changes,
                             by="allocator", note="stored request no longer valid")
                continue
            demand = policy.make_demand(request, self._model_catalog(), self.settings)
            if isinstance(demand, policy.Refusal):
                continue
            placement = self._place(demand, now)
            if isinstance(placement, policy.Placement):
                self._dequeue(lease_id)
                self._grant(record, placement, demand, now, changes, old=LeaseState.QUEUED)

    def _dequeue(self, lease_id: str) -> None:
        self._queue = [entry for entry in self._queue if entry[1] != lease_id]

    # ------------------------------------------------------------------ release

    def _release_request(self, request: ReleaseRequest, sender: Sender, now: float,
                         changes: Changes) -> BaseModel:
        record = self.find(request.lease_id, request.request_key)
        if record is None:
            what = (f"lease {request.lease_id!r}" if request.lease_id
                    else f"request key {request.request_key!r}")
            return error_reply(ErrorCode.NOT_FOUND, f"no {what} in the ledger")
        if request.force and sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"force-release is for admins; broker user {sender.user_id!r} "
                               "is not in admin_users")
        by = request.by if sender.user_id is None else f"{request.by} ({sender.user_id})"
        note = request.reason or None
        if record.state.final:
            return self.lease_reply(record)
        if record.state is LeaseState.QUEUED:
            self._finish(record, LeaseState.RELEASED, ReleaseReason.CANCELLED, now, changes,
                         by=by, note=note)
        elif request.force:
            self._finish(record, LeaseState.RELEASED, ReleaseReason.ADMIN, now, changes,
                         by=by, note=note)
            changes.event(now, "force_release", lease_id=record.lease_id, user=record.user,
                          by=by, reason=request.reason)
            # The GPUs go to someone else now: the old container must not keep using them.
            self._ask_stop(record.host, record.lease_id, record.container_id,
                           StopReason.FORCE_RELEASED, now, changes)
            self._serve_queue(now, changes)
        elif record.state in (LeaseState.GRANTED, LeaseState.BOUND):
            # The GPU is free when the container is gone, not when someone asks (DESIGN flow 3):
            # the node agent's event or heartbeat finishes this.
            old = record.state
            record.state = LeaseState.RELEASING
            record.releasing_at = now
            record.released_by = by
            record.release_note = note
            self.by_key.pop(record.request_key, None)
            changes.transition(record, old, now, "stop requested", by=by)
            # Swarm stops a removed service's task only seconds later (a 2 s gossip delay
            # comes first); the node agent stops it at once, so the GPU is free in
            # milliseconds. A lease never bound has no container to stop yet: if one starts,
            # its start is answered with a stop (_container_event).
            self._ask_stop(record.host, record.lease_id, record.container_id,
                           StopReason.RELEASED, now, changes)
        return self.lease_reply(record)

    def _finish(self, record: LeaseRecord, state: LeaseState, reason: ReleaseReason, now: float,
                changes: Changes, *, by: str, note: str | None = None) -> None:
        """End a lease for good and free what it held."""
        old = record.state
        if old.holds_gpus:
            self.cluster.drop_claims(record.lease_id, list(record.gpu_uuids))
            if record.host is not None:
                self.index.refresh(self.cluster, record.host)
        if old is LeaseState.QUEUED:
            self._dequeue(record.lease_id)
        record.state = state
        record.released_at = now
        record.release_reason = reason
        record.released_by = record.released_by or by
        if note:
            record.release_note = note
        if self.by_key.get(record.request_key) == record.lease_id:
            del self.by_key[record.request_key]
        self.leases.pop(record.lease_id, None)
        if record.host is not None:
            self._by_host.get(record.host, {}).pop(record.lease_id, None)
        self._node_clock_bound.pop(record.lease_id, None)
        self._over_budget.discard(record.lease_id)
        self.recent[record.lease_id] = record
        while len(self.recent) > RECENT_FINAL_LEASES:
            self.recent.popitem(last=False)
        changes.transition(record, old, now, reason.value, by=by)
        self.counters[f"released_{reason.value}"] += 1

    # ------------------------------------------------------------------ status / drain

    def _status(self, request: StatusRequest) -> BaseModel:
        record = self.find(request.lease_id, request.request_key)
        if record is None:
            what = (f"lease {request.lease_id!r}" if request.lease_id
                    else f"request key {request.request_key!r}")
            return error_reply(ErrorCode.NOT_FOUND, f"no {what} in the ledger")
        return self.lease_reply(record)

    def _drain(self, request: DrainRequest, sender: Sender, now: float,
               changes: Changes) -> BaseModel:
        if sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"drain is for admins; broker user {sender.user_id!r} is not "
                               "in admin_users")
        node = self.cluster.nodes.get(request.host)
        if node is None:
            return error_reply(ErrorCode.UNKNOWN_HOST, f"no node {request.host!r}; known: "
                               + (", ".join(sorted(self.cluster.nodes)) or "none"),
                               known=sorted(self.cluster.nodes))
        by = f"{request.by} ({sender.user_id})"
        if request.gpu_uuid is not None:
            gpu = self.cluster.gpus.get(request.gpu_uuid)
            if gpu is None or gpu.host != request.host:
                return error_reply(ErrorCode.NOT_FOUND,
                                   f"no GPU {request.gpu_uuid!r} on {request.host!r}")
            gpu.drained = request.drained
            changes.gpu(gpu, now)
            self.index.refresh(self.cluster, request.host)
        else:
            node.drained = request.drained
            changes.node(node, drain_reason=request.reason, drained_by=by, drained_at=now)
        changes.event(now, "drain" if request.drained else "undrain", host=request.host,
                      gpu_uuid=request.gpu_uuid, by=by, reason=request.reason)
        if not request.drained:
            self._serve_queue(now, changes)
        return DrainReply(host=request.host, gpu_uuid=request.gpu_uuid, drained=request.drained)

    # ------------------------------------------------------------------ nodes

    def _node_may_report(self, host: str, sender: Sender, now: float, changes: Changes,
                         kind: str) -> bool:
        if self.settings.allow_any_node_user:
            return True
        expected = self.settings.node_users.get(host) or self.settings.node_user_template.format(
            host=host)
        if sender.user_id == expected:
            return True
        self.counters[f"{kind}_rejected"] += 1
        log.warning("refused %s for host %r from broker user %r (expected %r)",
                    kind, host, sender.user_id, expected)
        changes.event(now, f"{kind}_rejected", host=host, from_user=sender.user_id,
                      expected_user=expected)
        return False

    def _heartbeat(self, beat: Heartbeat, sender: Sender, now: float, changes: Changes) -> None:
        last = self._last_seq.get(beat.host)
        if last is not None and last[0] == beat.agent_id and beat.seq <= last[1]:
            self.counters["heartbeat_stale"] += 1  # replayed or reordered: older news
            return
        self._last_seq[beat.host] = (beat.agent_id, beat.seq)
        self.counters["heartbeats"] += 1
        skew = beat.sent_at - now
        if abs(skew) > CLOCK_SKEW_WARN_S:
            # Liveness uses receipt time, so a skewed node clock harms nothing here; but the
            # agent's event times feed the container checks, so an admin should know.
            self.counters["heartbeat_clock_skew"] += 1
            if beat.host not in self._skewed:
                self._skewed.add(beat.host)
                log.warning("node %s's clock is %+.1f s off the allocator's", beat.host, skew)
                changes.event(now, "clock_skew", host=beat.host, skew_s=round(skew, 1))
        else:
            self._skewed.discard(beat.host)
        node = self.cluster.nodes.get(beat.host)
        new_node = node is None
        if node is None:
            node = Node(host=beat.host)
            self.cluster.nodes[beat.host] = node
            changes.event(now, "node_joined", host=beat.host, agent_id=beat.agent_id)
        agent_changed = node.agent_id != beat.agent_id
        node.agent_id = beat.agent_id
        # Receipt time, not the node's clock: a node whose clock runs ahead must not look alive
        # longer than it is.
        node.last_heartbeat = now
        if beat.host in self._down:
            self._down.discard(beat.host)
            if not new_node:
                changes.event(now, "node_up", host=beat.host)
        inventory_changed = self._update_gpus(node, beat, now, changes)
        if inventory_changed:
            self.index.refresh(self.cluster, beat.host)
            self._catalog = None
        persist = (new_node or agent_changed or inventory_changed or
                   now - self._telemetry_saved.get(beat.host, 0.0)
                   >= self.settings.telemetry_persist_s)
        # The node row (last heartbeat) is written every time so that a standby taking over
        # knows which nodes are alive; GPU telemetry only when it matters or now and then.
        changes.node(node, agent_user=sender.user_id, first_seen=now if new_node else None)
        if persist:
            self._telemetry_saved[beat.host] = now
            for gpu in self.cluster.gpus_of(beat.host):
                changes.gpu(gpu, now)
        freed = self._reconcile_containers(beat, now, changes)
        if inventory_changed or freed:
            self._serve_queue(now, changes)

    def _update_gpus(self, node: Node, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Upsert the node's GPUs; True when anything placement depends on changed."""
        changed = False
        listed: list[str] = []
        for info in sorted(beat.gpus, key=lambda g: g.index):
            gpu = self.cluster.gpus.get(info.uuid)
            if gpu is not None and gpu.host != node.host:
                owner = self.cluster.nodes.get(gpu.host)
                if owner is not None and gpu.present and self._up(owner, now):
                    self.counters["duplicate_gpu"] += 1
                    changes.event(now, "duplicate_gpu", host=node.host, gpu_uuid=info.uuid,
                                  owner=gpu.host)
                    continue
                # The GPU moved to another host while its old one is down: follow it.
                old_node = self.cluster.nodes.get(gpu.host)
                if old_node is not None and info.uuid in old_node.gpu_uuids:
                    old_node.gpu_uuids.remove(info.uuid)
                    self.index.refresh(self.cluster, old_node.host)
                changes.event(now, "gpu_moved", host=node.host, gpu_uuid=info.uuid,
                              old_host=gpu.host)
                gpu = None
            if gpu is None:
                gpu = GPU(uuid=info.uuid, host=node.host, index=info.index, model=info.model,
                          memory_total_mib=info.memory_total_mib,
                          share_slots=policy.share_slots_for(info.model, self.settings))
                self.cluster.gpus[info.uuid] = gpu
                changes.gpu(gpu, now, first_seen=now)
                changed = True
            identity = (info.index, info.model, info.memory_total_mib)
            if (gpu.index, gpu.model, gpu.memory_total_mib) != identity or not gpu.present:
                gpu.index, gpu.model, gpu.memory_total_mib = identity
                gpu.share_slots = policy.share_slots_for(info.model, self.settings)
                gpu.present = True
                changed = True
            if gpu.health != info.health or gpu.health_reasons != list(info.health_reasons):
                if gpu.health != info.health:
                    changed = True
                    changes.event(now, f"gpu_{info.health.value}", host=node.host,
                                  gpu_uuid=gpu.uuid, reasons=list(info.health_reasons))
                gpu.health = info.health
                gpu.health_reasons = list(info.health_reasons)
            gpu.memory_used_mib = info.memory_used_mib
            gpu.utilization_pct = info.utilization_pct
            gpu.temperature_c = info.temperature_c
            gpu.power_w = info.power_w
            listed.append(gpu.uuid)
        for gpu_uuid in node.gpu_uuids:
            if gpu_uuid not in listed:
                gpu = self.cluster.gpus.get(gpu_uuid)
                if gpu is not None and gpu.present and gpu.host == node.host:
                    gpu.present = False
                    changed = True
                    changes.event(now, "gpu_missing", host=node.host, gpu_uuid=gpu_uuid)
                    changes.gpu(gpu, now)
                    if gpu_uuid not in listed:
                        listed.append(gpu_uuid)
        if changed or set(node.gpu_uuids) != set(listed):
            ordered = sorted(set(listed) | {u for u in node.gpu_uuids
                                           if self.cluster.gpus.get(u) is not None
                                           and self.cluster.gpus[u].host == node.host},
                             key=lambda u: self.cluster.gpus[u].index)
            node.gpu_uuids = ordered
        return changed

    def _reconcile_containers(self, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Bind leases whose containers run; release those whose containers are gone.

        Returns whether any GPU was freed.
        """
        running = {c.lease_id: c for c in beat.containers}
        for info in beat.containers:
            record = self.leases.get(info.lease_id)
            if record is None or record.host != beat.host:
                self._unexpected_container(info.lease_id, info.container_id, beat.host, now,
                                           changes)
                continue
            if record.state is LeaseState.GRANTED:
                self._bind(record, info.container_id, beat.sent_at, now, changes, "heartbeat")
            elif record.container_id is None:
                record.container_id = info.container_id
                changes.lease(record)
            if record.state is LeaseState.RELEASING:
                self._ask_stop(record.host, record.lease_id, info.container_id,
                               StopReason.RELEASED, now, changes, observed=True)
            self._node_clock_bound.setdefault(record.lease_id, beat.sent_at)
            self._check_budget(record, info, now, changes)
        if not beat.containers_complete:
            return False
        freed = False
        grace = self.settings.container_gone_grace_s
        for record in list(self._by_host.get(beat.host, {}).values()):
            if record.lease_id in running:
                continue
            if record.state is LeaseState.BOUND:
                seen = self._node_clock_bound.get(record.lease_id, 0.0)
                if beat.sent_at - seen > grace:
                    self._finish(record, LeaseState.RELEASED, ReleaseReason.CONTAINER_GONE, now,
                                 changes, by=f"node {beat.host}")
                    freed = True
            elif record.state is LeaseState.RELEASING:
                # Stopped by the hub: the node no longer runs it (or never did: a failed spawn).
                seen = self._node_clock_bound.get(record.lease_id, 0.0)
                if beat.sent_at - seen > grace:
                    self._finish(record, LeaseState.RELEASED,
                                 ReleaseReason.CONTAINER_GONE if record.bound_at
                                 else ReleaseReason.STOPPED,
                                 now, changes, by=f"node {beat.host}")
                    freed = True
        return freed

    def _unexpected_container(self, lease_id: str, container_id: str, host: str, now: float,
                              changes: Changes) -> None:
        finished = self.recent.get(lease_id)
        kind = "zombie_container" if finished is not None else "unknown_lease_container"
        self.counters[kind] += 1
        changes.event(now, kind, host=host, lease_id=lease_id, container_id=container_id)
        if finished is not None and finished.host in (None, host):
            # A container of a lease this allocator finished (e.g. a start after the bind
            # deadline reclaimed it): it would use GPUs the ledger gave away. A lease the
            # allocator does not know is left alone: it may be another cluster's.
            self._ask_stop(host, lease_id, container_id, StopReason.LEASE_FINISHED, now,
                           changes, observed=True)

    def _check_budget(self, record: LeaseRecord, info: Any, now: float, changes: Changes) -> None:
        if not record.shared or record.memory_mib is None:
            return
        used = sum(use.memory_used_mib for use in info.gpu_use)
        if used > record.memory_mib and record.lease_id not in self._over_budget:
            self._over_budget.add(record.lease_id)
            self.counters["over_budget"] += 1
            changes.event(now, "over_budget", host=record.host, lease_id=record.lease_id,
                          user=record.user, used_mib=used, budget_mib=record.memory_mib)
        elif used <= record.memory_mib:
            self._over_budget.discard(record.lease_id)

    def _bind(self, record: LeaseRecord, container_id: str, node_time: float, now: float,
              changes: Changes, via: str) -> None:
        old = record.state
        record.state = LeaseState.BOUND
        record.container_id = container_id
        record.bound_at = now
        self._node_clock_bound[record.lease_id] = node_time
        changes.transition(record, old, now, f"container {container_id[:12]} running ({via})",
                           by=f"node {record.host}")
        self.counters["bound"] += 1

    def _container_event(self, event: ContainerEvent, now: float, changes: Changes) -> None:
        self.counters[f"event_{event.action.value}"] += 1
        record = self.leases.get(event.lease_id)
        if record is None or record.host != event.host or not record.state.holds_gpus:
            if event.action is ContainerAction.START:
                self._unexpected_container(event.lease_id, event.container_id, event.host, now,
                                           changes)
            return
        if event.action is ContainerAction.START:
            if record.state is LeaseState.GRANTED:
                self._bind(record, event.container_id, event.at, now, changes, "start event")
            elif record.container_id is None:
                record.container_id = event.container_id
                self._node_clock_bound[record.lease_id] = event.at
                changes.lease(record)
            if record.state is LeaseState.RELEASING:
                # The hub stopped the server before its container started (or a replaced
                # task started): stop it too.
                self._ask_stop(record.host, record.lease_id, event.container_id,
                               StopReason.RELEASED, now, changes, observed=True)
            return
        if record.container_id not in (None, event.container_id):
            return  # an older container of the same lease (a replaced task); not the holder
        exit_note = f"{event.action.value}" + (
            f", exit code {event.exit_code}" if event.exit_code is not None else "")
        self._finish(record, LeaseState.RELEASED, ReleaseReason.CONTAINER_EXITED, now, changes,
                     by=f"node {event.host}", note=exit_note)
        self._serve_queue(now, changes)

    # ------------------------------------------------------------------ agent commands

    def take_commands(self) -> list[StopContainer]:
        """Empty the outbox and return what was in it (the service, after a commit)."""
        commands, self.commands = self.commands, []
        return commands

    def _ask_stop(self, host: str | None, lease_id: str, container_id: str | None,
                  reason: StopReason, now: float, changes: Changes, *,
                  observed: bool = False) -> None:
        """Put a :class:`StopContainer` for the node agent of ``host`` into the outbox.

        ``observed``: asked because a listing or a start event showed the container running,
        not because of a decision just taken. Those come with every heartbeat, so the stop
        is asked again only once ``container_stop_grace_s + container_stop_retry_s`` passed
        since the last ask (the first command may have been lost; stopping is idempotent).
        """
        if not self.settings.stop_containers or host is None or container_id is None:
            return
        key = (lease_id, container_id)
        last = self._stops_asked.get(key)
        if observed and last is not None and now - last < (
                self.settings.container_stop_grace_s + self.settings.container_stop_retry_s):
            return
        self._stops_asked[key] = now
        self._stops_asked.move_to_end(key)
        while len(self._stops_asked) > RECENT_FINAL_LEASES:
            self._stops_asked.popitem(last=False)
        self.commands.append(StopContainer(
            host=host, lease_id=lease_id, container_id=container_id,
            grace_s=self.settings.container_stop_grace_s, reason=reason))
        self.counters[f"stop_asked_{reason.value}"] += 1
        changes.event(now, "stop_container", host=host, lease_id=lease_id,
                      container_id=container_id, reason=reason.value,
                      repeat=last is not None)

    # ------------------------------------------------------------------ timers

    def tick(self, now: float, changes: Changes) -> None:
        """Run the timers: queue waits, bind deadlines, node silence."""
        freed = False
        for record in list(self.leases.values()):
            if record.state is LeaseState.QUEUED and record.wait_until is not None \
                    and now >= record.wait_until:
                self._finish(record, LeaseState.EXPIRED, ReleaseReason.WAIT_EXPIRED, now,
                             changes, by="allocator")
            elif record.state is LeaseState.GRANTED and record.bind_deadline is not None \
                    and now >= record.bind_deadline:
                self._finish(record, LeaseState.RELEASED, ReleaseReason.BIND_TIMEOUT, now,
                             changes, by="allocator")
                freed = True
            elif (record.state is LeaseState.RELEASING and record.host is not None
                  and self._silent_for(record.host, now) > self.settings.stop_grace_s):
                self._finish(record, LeaseState.RELEASED, ReleaseReason.NODE_SILENT, now,
                             changes, by="allocator")
                freed = True
        for node in self.cluster.nodes.values():
            if node.host not in self._down and not node.is_up(now, self.settings.node_down_after_s):
                self._down.add(node.host)
                changes.event(now, "node_down", host=node.host,
                              last_heartbeat=node.last_heartbeat)
                self.counters["node_down"] += 1
        if freed:
            self._serve_queue(now, changes)

    def _silent_for(self, host: str, now: float) -> float:
        node = self.cluster.nodes.get(host)
        last = max(node.last_heartbeat or 0.0 if node else 0.0, self.started_at)
        return now - last

    # ------------------------------------------------------------------ accounting

    def held_gpus(self) -> int:
        """GPUs with at least one claim."""
        return sum(1 for claims in self.cluster.claims.values() if claims)

    def healthy_gpus(self) -> int:
        """GPUs present and healthy."""
        return sum(1 for g in self.cluster.gpus.values()
                   if g.present and g.health is Health.HEALTHY)
