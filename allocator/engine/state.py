"""The engine's memory: nodes, GPUs, leases and the queue, and how they are rebuilt from the ledger.

Every other room of the engine (:mod:`~allocator.engine.views`, :mod:`~allocator.engine.outbox`,
:mod:`~allocator.engine.leases`, :mod:`~allocator.engine.nodes`) reads and changes this memory;
only :meth:`EngineState.load` replaces it wholesale.
"""

from __future__ import annotations

import bisect
import logging
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from allocator import policy
from allocator.adoption import Conflict
from allocator.cluster import Cluster, Node
from allocator.config import AllocatorSettings
from allocator.counters import Counters
from allocator.lease import LeaseRecord
from allocator.lease_use import UseBook
from allocator.ledger import LoadedState
from allocator.placement_index import PlacementIndex
from allocator.protocol import (
    Heartbeat,
    LeaseState,
    StopContainer,
)

log = logging.getLogger("allocator.engine")

CLOCK_SKEW_WARN_S = 30.0
"""A heartbeat stamped further than this from the allocator's clock is logged (once a host)."""

RECENT_FINAL_LEASES = 10_000
"""Finished leases kept in memory so a repeated release or status is answered without I/O."""

TIMED_STATES = frozenset({LeaseState.QUEUED, LeaseState.GRANTED, LeaseState.RELEASING})
"""The states with a timer: a queued request's wait, a grant's bind deadline, a release's
wait for a silent node."""


@dataclass(frozen=True)
class Sender:
    """Who sent a message, as the broker vouches for it."""

    user_id: str | None
    """The AMQP ``user_id`` property (RabbitMQ refuses a publish whose user_id is not the
    connection's user), or None when the publisher did not set it."""
    via_nodes_exchange: bool
    """True when it came through the nodes exchange (agents), False for the RPC exchange."""


class EngineState:
    """Nodes, GPUs and leases in memory (what the ledger holds, plus what need not be saved)."""

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
        self._timed: dict[str, LeaseRecord] = {}
        """Every lease of :attr:`leases` whose state has a timer (queued, granted, releasing),
        and some that have left those states (dropped by the next tick): what a tick looks
        at, instead of every lease (most are bound and have none; 10,000 bound leases made
        each tick milliseconds of CPU, twice a second)."""
        self._queue: list[tuple[tuple[Any, ...], str]] = []
        self._demands: dict[str, tuple[Cluster, policy.Demand | policy.Refusal]] = {}
        """Queued lease -> (the model catalog it was resolved on, its demand): see
        :meth:`~allocator.engine.leases.LeaseBook._queued_demand`."""
        self.agent_users: dict[str, str] = {}
        self.counters = Counters()
        self._newest_beat: dict[str, tuple[str, int, float]] = {}
        """host -> (agent_id, seq, sent_at) of the newest heartbeat accepted for it (see
        :meth:`~allocator.engine.nodes.NodeReconciliation._stale`)."""
        self._reported: dict[str, Heartbeat] = {}
        """host -> the full report its newest applied heartbeat stands for (a delta applied
        onto the one before): what the host's next delta applies onto. Missing: the next
        delta is taken as liveness only, until a full report."""
        self._gpus_steady: dict[str, Heartbeat] = {}
        """host -> the report whose GPU upsert last changed nothing and skipped nothing (it
        found the GPUs as the report has them): upserting it again would change nothing, so
        a delta that changes nothing skips it (see
        :meth:`~allocator.engine.nodes.NodeReconciliation._liveness_only`). Dropped when
        another host's report takes one of the host's GPUs."""
        self._telemetry_saved: dict[str, float] = {}
        self._node_clock_bound: dict[str, float] = {}
        """lease id -> node-clock time its container was known to run (start event or listing)."""
        self._down: set[str] = set()
        self._hosts_of_user: Counter[str] = Counter()
        """broker user -> hosts its heartbeats brought in (``max_hosts_per_node_user``)."""
        self._cannot_list: set[str] = set()
        """Hosts whose newest heartbeat could not list containers (``containers_complete``
        false: no Docker engine): no heartbeat of theirs will ever free a lease."""
        self._over_budget: set[str] = set()
        self._skewed: set[str] = set()
        self.index = PlacementIndex()
        self._catalog: Cluster | None = None
        self.use = UseBook(settings.usage_history_s)
        """Per lease: its processes' GPU use from heartbeats (memory only: it is not in the
        ledger, and a reload keeps it)."""
        self.commands: list[StopContainer] = []
        """Outbox: commands to node agents decided since the last :meth:`take_commands`. The
        service sends them after the batch is committed; a reload empties it."""
        self._stops_asked: OrderedDict[tuple[str, str], float] = OrderedDict()
        """(lease id, container id) -> when its stop was last asked, so that a container that
        heartbeats keep listing is not asked again every heartbeat (see :meth:`_ask_stop`)."""
        self._fenced: set[str] = set()
        """Hosts nothing is granted on until their first complete report since the start is
        applied: the ledger may be behind what runs there (see :meth:`load`)."""
        self._fence_until = started_at
        """Until then, a request that does not fit waits in the queue instead of being
        refused, since nodes not heard from yet may hold what it needs."""
        self._fence_awaits_first_report = False
        """A fenced load of a ledger that knew no node: it cannot know which nodes will report,
        so requests wait until the first one has (the window closes then)."""
        self._conflicts: dict[str, dict[str, list[Conflict]]] = {}
        """host -> container id -> why its grant cannot be adopted (see :mod:`allocator.adoption`);
        the GPUs named stay out of placement while the node lists the container."""

    def load(self, state: LoadedState, now: float, *, fenced: bool = False) -> None:
        """Rebuild memory from the ledger (at start, after a failed commit, on takeover).

        ``fenced``: the ledger may be behind the nodes (a process start: the file may be
        deleted, restored or another node's). Nothing is then granted on a node before its
        first complete report has been applied, which adopts the containers the ledger does
        not know (see :mod:`allocator.engine.node_truth`). A reload of a ledger this process
        or the active one kept current needs no fence.
        """
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
        self._hosts_of_user = Counter(self.agent_users.values())
        self.leases, self.by_key, self._queue, self._by_host = {}, {}, [], {}
        self._timed = {}
        self._demands = {}
        # Finished leases of the ledger: a container still running for one is a zombie to
        # stop, never a lease the ledger forgot.
        self.recent = OrderedDict((r.lease_id, r) for r in state.finished[-RECENT_FINAL_LEASES:])
        self._fenced = set(self.cluster.nodes) if fenced else set()
        self._fence_awaits_first_report = fenced and not self._fenced
        self._fence_until = now + self.settings.start_fence_s if fenced else now
        self._conflicts = {}
        for record in state.leases:
            self._track(record)
            if record.state.holds_gpus:
                self._claim(record)
        # A node whose last heartbeat (as the ledger saw it) is recent stays placeable, so a
        # standby that takes over serves requests at once. The silence timer of leases being
        # released starts no earlier than this start (see _silent_for).
        self._down = {host for host, node in self.cluster.nodes.items()
                      if not node.is_up(now, self.settings.node_down_after_s)}
        self._newest_beat.clear()
        self._reported.clear()
        self._gpus_steady.clear()
        self._cannot_list.clear()
        self.index.rebuild(self.cluster)
        self._catalog = None
        # Commands of a batch that was not committed must not go out; containers still
        # running are asked again when the next heartbeat lists them.
        self.commands = []
        self._stops_asked.clear()

    def _track(self, record: LeaseRecord) -> None:
        self.leases[record.lease_id] = record
        self._time(record)
        if record.host is not None:
            self._by_host.setdefault(record.host, {})[record.lease_id] = record
        if record.state.active:
            self.by_key[record.request_key] = record.lease_id
        if record.state is LeaseState.QUEUED:
            key = policy.queue_order_key(record.priority, record.enqueued_at or record.created_at,
                                         record.lease_id)
            bisect.insort(self._queue, (key, record.lease_id))

    def _time(self, record: LeaseRecord) -> None:
        """Let the tick look at ``record`` if its state has a timer; called wherever a lease
        enters such a state (it leaves them only for states without one)."""
        if record.state in TIMED_STATES:
            self._timed[record.lease_id] = record

    def _claim(self, record: LeaseRecord) -> None:
        policy.claim_gpus(self.cluster, record.lease_id, record.user, record.groups,
                          record.gpu_uuids, shared=record.shared,
                          memory_mib=record.memory_mib, units=record.units)
