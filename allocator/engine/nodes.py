"""What the engine knows of each node beyond the cluster's data: its newest report, whether it
is up, who may report for it, and admin drains.

A heartbeat is news only if it is newer than the newest one accepted for its host; the report
it stands for is held, so that the host's next delta applies onto it. A node is up while its
heartbeats come within ``node_down_after_s`` (receipt time, never the node's clock).
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel

from allocator.config import AllocatorSettings
from allocator.engine.state import CLOCK_SKEW_WARN_S, Sender, count_anomaly, log
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import LoadedState
from allocator.metrics.counters import Count, Counters, Family
from allocator.placement.cluster import Cluster, Node
from allocator.placement.index import PlacementIndex
from allocator.wire.interconnect import HostInterconnect
from allocator.wire.protocol import (
    DrainReply,
    DrainRequest,
    ErrorCode,
    Heartbeat,
    HeartbeatDelta,
    error_reply,
)

REFUSAL_WINDOW_S = 60.0
"""The window of ``refused_events_per_minute`` and ``node_events_per_minute``: whole minutes
of the allocator's clock."""


class EventBudget:
    """Pure: how many ledger events each key (a sender and a host) may still write in the
    current minute; no clock of its own (the time is passed in).

    The minute is the allocator's clock's (``now // 60``), the same for every key; a new
    minute forgets the last one's keys, so memory holds only the keys of one minute.
    """

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._minute: int | None = None
        self._used: Counter[tuple[str | None, str | None]] = Counter()

    def take(self, key: tuple[str | None, str | None], now: float) -> bool:
        """Use one of ``key``'s events of the minute of ``now``; False when none is left."""
        minute = int(now // REFUSAL_WINDOW_S)
        if minute != self._minute:
            self._minute = minute
            self._used.clear()
        if self._used[key] >= self.per_minute:
            return False
        self._used[key] += 1
        return True

    def __eq__(self, other: object) -> bool:
        # Two budgets are the same state when they allow the same events from now on (the
        # heartbeat fast path is checked against the full path by comparing engine state).
        if not isinstance(other, EventBudget):
            return NotImplemented
        return (self.per_minute, self._minute, self._used) == (
            other.per_minute, other._minute, other._used)

    __hash__ = None  # type: ignore[assignment]  # mutable: compared by value, never hashed


class NodeReports:
    """Per host: the newest report, liveness, the broker users reporting, clock skew.

    Invariants: ``down`` is the one set of hosts known down (the same object for the engine's
    life: placement reads it); a host in ``reported`` has its newest accepted heartbeat in
    ``newest_beat``.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, cluster: Cluster,
                 index: PlacementIndex, started_at: float) -> None:
        self.settings = settings
        self.counters = counters
        self.cluster = cluster
        self.index = index
        self.started_at = started_at
        """The silence of a node is counted from no earlier than this (the last load)."""
        self.agent_users: dict[str, str] = {}
        """host -> the broker user its agent reports as (from the ledger)."""
        self.newest_beat: dict[str, tuple[str, int, float]] = {}
        """host -> (agent_id, seq, sent_at) of the newest heartbeat accepted for it (see
        :meth:`stale`)."""
        self.reported: dict[str, Heartbeat] = {}
        """host -> the full report its newest applied heartbeat stands for (a delta applied
        onto the one before): what the host's next delta applies onto. Missing: the next
        delta is taken as liveness only, until a full report."""
        self.telemetry_saved: dict[str, float] = {}
        """host -> when its GPU telemetry rows were last written (memory only)."""
        self.down: set[str] = set()
        self.availability_version = 0
        """Goes up whenever a node goes down or comes back, or a node or GPU is drained or
        undrained: what bookings may count on may have changed (memory only; compared, never
        read as a number)."""
        self.hosts_of_user: Counter[str] = Counter()
        """broker user -> hosts its heartbeats brought in (``max_hosts_per_node_user``)."""
        self.cannot_list: set[str] = set()
        """Hosts whose newest heartbeat could not list containers (``containers_complete``
        false: no Docker engine): no heartbeat of theirs will ever free a lease."""
        self.skewed: set[str] = set()
        """Hosts whose clock skew was logged (once until it is back within bounds)."""
        self.refusal_budget = EventBudget(settings.refused_events_per_minute)
        """The ledger events refused node messages may still write this minute."""
        self.report_budget = EventBudget(settings.node_events_per_minute)
        """The ledger events each host's accepted reports may still write this minute."""
        self.interconnect_judged: dict[str, HostInterconnect] = {}
        """host -> the interconnect its reports last carried, taken or ignored: the reports a
        delta stands for carry it again, and it is judged once (memory only)."""

    def load(self, state: LoadedState, now: float) -> None:
        """A rebuild from the ledger (the cluster's nodes already loaded). A node whose last
        heartbeat (as the ledger saw it) is recent stays placeable, so a standby that takes
        over serves requests at once; the silence timer starts no earlier than now."""
        self.started_at = now
        self.agent_users = dict(state.agent_users)
        self.hosts_of_user = Counter(self.agent_users.values())
        self.down.clear()
        self.down.update(host for host, node in self.cluster.nodes.items()
                         if not node.is_up(now, self.settings.node_down_after_s))
        self.availability_version += 1
        self.newest_beat.clear()
        self.reported.clear()
        self.cannot_list.clear()
        self.interconnect_judged.clear()

    # ------------------------------------------------------------------ who may report

    def may_report(self, host: str, sender: Sender, now: float, changes: Changes,
                   kind: str) -> bool:
        """Whether ``sender`` is the broker user that reports for ``host``; a refusal is
        counted, logged and recorded."""
        if self.owns(host, sender):
            return True
        expected = self.settings.node_users.get(host) or self.settings.node_user_template.format(
            host=host)
        self.counters.add_to(Family.NODE_MESSAGE_REJECTED, kind)
        # The host named is the sender's claim: its refusals share the sender's budget for
        # hosts it does not report for, whatever host each names.
        if self.may_record(sender, None, now):
            log.warning("refused %s for host %r from broker user %r (expected %r)",
                        kind, host, sender.user_id, expected)
            changes.event(now, f"{kind}_rejected", host=host, from_user=sender.user_id,
                          expected_user=expected)
        return False

    def may_record(self, sender: Sender, host: str | None, now: float) -> bool:
        """Whether a refusal of ``sender``'s message may write a ledger event (and a log
        line): within ``refused_events_per_minute`` for the sender and ``host`` (None: any
        host it does not report for). Else it is counted as unrecorded."""
        if self.refusal_budget.take((sender.user_id, host), now):
            return True
        self.counters.add(Count.NODE_EVENTS_UNRECORDED)
        return False

    def keep_within_budget(self, host: str, sender: Sender, since: int, now: float,
                           changes: Changes) -> None:
        """The one budget of what an accepted report writes as events: of the events from
        ``since`` on (those one node message about ``host`` wrote), keep the first ones
        within ``node_events_per_minute`` for the sender and the host; drop the rest and
        count them as unrecorded.

        Whatever a report says, its events are the sender's to multiply (GPU health that
        flaps, containers that come and go, an anomaly repeated in every heartbeat): one
        agent credential could otherwise fill the ledger's disk. The decisions stand, only
        their events are dropped; lease rows and their state history are always written.
        """
        written = len(changes.events) - since
        if written <= 0:
            return
        key = (sender.user_id, host)
        kept = 0
        while kept < written and self.report_budget.take(key, now):
            kept += 1
        if kept < written:
            del changes.events[since + kept:]
            self.counters.add(Count.NODE_EVENTS_UNRECORDED, written - kept)

    def owns(self, host: str, sender: Sender) -> bool:
        """Whether ``sender`` is the broker user that reports for ``host`` (no side effect)."""
        if self.settings.allow_any_node_user:
            return True
        expected = self.settings.node_users.get(host) or self.settings.node_user_template.format(
            host=host)
        return sender.user_id == expected

    def stale(self, beat: Heartbeat | HeartbeatDelta) -> bool:
        """Whether ``beat`` is older news than the newest heartbeat accepted for its host.

        The same agent counts in ``seq`` (its clock may step back; its counter does not). A
        heartbeat under another ``agent_id`` is news only if sent after the newest accepted
        one: a restarted agent's first heartbeat is, a replayed capture (whatever agent id it
        carries) is not.
        """
        newest = self.newest_beat.get(beat.host)
        if newest is None:
            return False
        agent_id, seq, sent_at = newest
        return beat.seq <= seq if beat.agent_id == agent_id else beat.sent_at <= sent_at

    def may_add_host(self, host: str, sender: Sender, now: float, changes: Changes) -> bool:
        """Whether the sender may bring one more host in (``max_hosts_per_node_user``): else a
        user who may report for any host could fill memory, the ledger and every inventory
        reply with invented hosts."""
        if self.hosts_of_user[sender.user_id or ""] < self.settings.max_hosts_per_node_user:
            return True
        if count_anomaly(self.counters, Count.HOST_LIMIT):
            log.warning("refused new host %r: broker user %r reports for %d hosts already "
                        "(max_hosts_per_node_user)", host, sender.user_id,
                        self.hosts_of_user[sender.user_id or ""])
            changes.event(now, "host_limit", host=host, from_user=sender.user_id)
        return False

    def join(self, beat: Heartbeat, sender: Sender, now: float, changes: Changes) -> Node:
        """A host the cluster does not know reported: add its node."""
        node = Node(host=beat.host)
        self.cluster.nodes[beat.host] = node
        self.hosts_of_user[sender.user_id or ""] += 1
        changes.event(now, "node_joined", host=beat.host, agent_id=beat.agent_id)
        return node

    # ------------------------------------------------------------------ reports and liveness

    def hold(self, beat: Heartbeat, now: float, changes: Changes) -> None:
        """``beat`` is the host's newest report: hold it (what the next delta applies onto)
        and note its listing and its clock."""
        self.newest_beat[beat.host] = (beat.agent_id, beat.seq, beat.sent_at)
        self.reported[beat.host] = beat
        if beat.containers_complete:
            self.cannot_list.discard(beat.host)
        else:
            self.cannot_list.add(beat.host)
        self.counters.add(Count.HEARTBEATS)
        skew = beat.sent_at - now
        if abs(skew) > CLOCK_SKEW_WARN_S:
            # Liveness uses receipt time, so a skewed node clock harms nothing here; but the
            # agent's event times feed the container checks, so an admin should know.
            self.counters.add(Count.HEARTBEAT_CLOCK_SKEW)
            if beat.host not in self.skewed:
                self.skewed.add(beat.host)
                log.warning("node %s's clock is %+.1f s off the allocator's", beat.host, skew)
                changes.event(now, "clock_skew", host=beat.host, skew_s=round(skew, 1))
        else:
            self.skewed.discard(beat.host)

    def take_interconnect(self, node: Node, beat: Heartbeat) -> bool:
        """The interconnect ``beat`` carries, kept on ``node`` when it names exactly the GPUs
        (MIG instances aside) the report lists; True when the node's interconnect changed.

        One that names other GPUs is ignored (counted, logged), the heartbeat is not: the
        node keeps the interconnect it had. A report without one keeps it too. Judged once
        per interconnect received: the reports its host's deltas stand for carry the same
        object, and cost nothing here.
        """
        interconnect = beat.interconnect
        if interconnect is None or self.interconnect_judged.get(node.host) is interconnect:
            return False
        self.interconnect_judged[node.host] = interconnect
        listed = {gpu.uuid for gpu in beat.gpus if not gpu.is_mig_instance}
        if set(interconnect.uuids) != listed:
            if count_anomaly(self.counters, Count.INTERCONNECT_MISMATCH):
                log.warning("ignored the interconnect of %s: it names GPUs %s, its report "
                            "lists %s", node.host, sorted(interconnect.uuids), sorted(listed))
            return False
        if node.interconnect == interconnect:
            return False
        node.interconnect = interconnect
        return True

    def delta_unapplied(self, delta: HeartbeatDelta, base: Heartbeat | None, sender: Sender,
                        now: float, changes: Changes) -> None:
        """A delta that does not follow the report held (a gap in ``seq``: a message was lost,
        or this allocator started since): a sign of life only; the host's next full report
        is awaited."""
        node = self.cluster.nodes.get(delta.host)
        if base is not None:
            del self.reported[delta.host]
            if count_anomaly(self.counters, Count.HEARTBEAT_DELTA_GAPS):
                log.info("heartbeat delta %d of %s does not follow the report held (seq %d "
                         "of agent %s); awaiting its next full report", delta.seq, delta.host,
                         base.seq, base.agent_id[:8])
        else:
            self.counters.add(Count.HEARTBEAT_DELTAS_UNAPPLIED)
        if node is None:
            return  # a delta cannot bring a host in: only a full report says what it has
        self.newest_beat[delta.host] = (delta.agent_id, delta.seq, delta.sent_at)
        self.counters.add(Count.HEARTBEATS)
        self.alive(node, sender, now, changes)

    def alive_and_telemetry(self, node: Node, sender: Sender, now: float, changes: Changes,
                            *, due: bool, new_node: bool) -> None:
        """Liveness, then the GPU telemetry rows when ``due`` or ``telemetry_persist_s``
        passed since they were last written."""
        persist = due or (now - self.telemetry_saved.get(node.host, 0.0)
                          >= self.settings.telemetry_persist_s)
        self.alive(node, sender, now, changes, new_node=new_node)
        # GPU telemetry is written only when it matters or now and then.
        if persist:
            self.telemetry_saved[node.host] = now
            for gpu in self.cluster.gpus_of(node.host):
                changes.gpu(gpu, now)

    def alive(self, node: Node, sender: Sender, now: float, changes: Changes,
              *, new_node: bool = False) -> None:
        """The node was heard from now: it is up, and the ledger says so."""
        # Receipt time, not the node's clock: a node whose clock runs ahead must not look alive
        # longer than it is.
        node.last_heartbeat = now
        if node.host in self.down:
            self.down.discard(node.host)
            self.availability_version += 1
            if not new_node:
                changes.event(now, "node_up", host=node.host)
        # The node row (last heartbeat) is written every time so that a standby taking over
        # knows which nodes are alive.
        changes.node(node, agent_user=sender.user_id, first_seen=now if new_node else None)

    def up(self, node: Node, now: float) -> bool:
        return node.host not in self.down and node.is_up(now, self.settings.node_down_after_s)

    def silent_for(self, host: str, now: float) -> float:
        """Seconds since the host was last heard from (counted from the last load at most)."""
        node = self.cluster.nodes.get(host)
        last = max(node.last_heartbeat or 0.0 if node else 0.0, self.started_at)
        return now - last

    def mark_down(self, now: float, changes: Changes) -> None:
        """The tick: nodes silent for ``node_down_after_s`` are down from now."""
        for node in self.cluster.nodes.values():
            if node.host not in self.down and not node.is_up(now,
                                                             self.settings.node_down_after_s):
                self.down.add(node.host)
                self.availability_version += 1
                changes.event(now, "node_down", host=node.host,
                              last_heartbeat=node.last_heartbeat)
                self.counters.add(Count.NODE_DOWN)

    # ------------------------------------------------------------------ drains

    def drain(self, request: DrainRequest, sender: Sender, now: float,
              changes: Changes) -> BaseModel:
        """An admin drains (or undrains) a node or one GPU; a :class:`DrainReply` when done."""
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
        self.availability_version += 1
        changes.event(now, "drain" if request.drained else "undrain", host=request.host,
                      gpu_uuid=request.gpu_uuid, by=by, reason=request.reason)
        return DrainReply(host=request.host, gpu_uuid=request.gpu_uuid, drained=request.drained)
