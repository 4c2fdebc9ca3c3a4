"""The allocator's counters, typed: every counter is declared here, once.

The engine and the service count what happens (:class:`Count` for plain counters,
:class:`Family` for counters with a label such as a release reason). Each counter is declared
with how it is exported (:class:`Exported`: its Prometheus name, type and help text, in
:data:`COUNT_EXPORTED` and :data:`FAMILY_EXPORTED`, right below each enum), and
:mod:`allocator.metrics.exporter` exports every declared counter from there, reading them back by
:class:`Count` and by :class:`Family`, never by taking string keys apart. A counter declared
without its export is an error at import.

A :class:`Counters` also answers a plain name (``counters["zombie_container"]``,
``counters["released_admin"]``): the name in logs and tests, made by :meth:`Family.key`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import ClassVar, Final


@dataclass(frozen=True)
class Exported:
    """How a counter appears on the allocator's ``/metrics``: one Prometheus counter family.

    Its samples are named ``<name>_total`` (the Prometheus convention for counters; the client
    library adds the suffix). A :class:`Family`'s counter has a ``label``, whose values are the
    family's labels. Plain :class:`Count` members declared with one and the same labelled
    :class:`Exported` share its family, each as the sample labelled with its own name (the
    anomalies); a plain one without a label is a family of its own.
    """

    name: str
    """The family's name, ``swarm_gpu_...`` without ``_total``."""
    help: str
    """The ``# HELP`` text."""
    label: str | None = None
    """The label's name (``reason``, ``code``...); None for a single, unlabelled sample."""
    type: ClassVar[str] = "counter"
    """The Prometheus type: counters only go up, so every one is a ``counter``."""


class Count(StrEnum):
    """Plain counters (no label)."""

    # the engine
    GRANTED = "granted"
    QUEUED = "queued"
    BOUND = "bound"
    ALLOCATE_RETRY = "allocate_retry"
    HEARTBEATS = "heartbeats"
    HEARTBEAT_STALE = "heartbeat_stale"
    HEARTBEAT_CLOCK_SKEW = "heartbeat_clock_skew"
    HEARTBEAT_DELTAS = "heartbeat_deltas"
    """Heartbeat deltas applied (each also counts in ``heartbeats``)."""
    HEARTBEAT_DELTA_GAPS = "heartbeat_delta_gaps"
    """Deltas that did not fit the report held for their host (a lost message, an allocator
    start): the report is dropped until the next full one."""
    HEARTBEAT_DELTAS_UNAPPLIED = "heartbeat_deltas_unapplied"
    """Deltas taken as liveness only, their host awaiting its next full report."""
    HEARTBEATS_UNREADABLE = "heartbeats_unreadable"
    """Heartbeats (full or delta) that did not decode but named a host its sender reports
    for: refused, yet taken as a sign of life (an agent of a newer protocol, say), so the
    host does not go down for it."""
    NODE_DOWN = "node_down"
    DUPLICATE_GPU = "duplicate_gpu"
    OVER_BUDGET = "over_budget"
    ZOMBIE_CONTAINER = "zombie_container"
    UNKNOWN_LEASE_CONTAINER = "unknown_lease_container"
    NODE_MESSAGE_WRONG_EXCHANGE = "node_message_wrong_exchange"
    REQUEST_FROM_NODE_EXCHANGE = "request_from_node_exchange"
    REQUEST_KEY_CONFLICT = "request_key_conflict"
    FOREIGN_LEASE = "foreign_lease"
    """Requests refused ``forbidden`` because they named another broker user's lease."""
    HOST_LIMIT = "host_limit"
    GPU_LIMIT = "gpu_limit"
    ADOPTED = "adopted"
    """A lease the ledger did not know, taken back from a running container's grant labels."""
    ADOPTION_CONFLICT = "adoption_conflict"
    """A running container's grant that contradicts the ledger (not adopted)."""
    GPU_MOVE_CONFLICT = "gpu_move_conflict"
    """A host reports a GPU on record for another host that does not hold it: the GPU is
    placed on neither until it moves (``gpu_move_after_s``) or the claim ends."""
    INTERCONNECT_MISMATCH = "interconnect_mismatch"
    """A full report's interconnect that does not name exactly its GPUs: ignored, the node
    keeps the one it had."""
    STUCK_PROCESS = "stuck_process"
    """A GPU still used by an ended lease's container ``release_verify_s`` after the end."""
    OUTSIDE_USE = "outside_use"
    """A GPU used by a process that no lease on it accounts for (one per episode)."""
    OUTSIDE_GRANT = "outside_grant"
    """A lease's container found using a GPU it was not granted."""
    UNDECLARED_GPU = "undeclared_gpu"
    """A GPU its host reports beyond what the site declared for it (``declared_gpus``)."""
    QUEUED_BEHIND_FENCE = "queued_behind_fence"
    """A request that waited for the nodes' first reports after a start (the start fence)."""
    NODE_EVENTS_UNRECORDED = "node_events_unrecorded"
    """Ledger events of node messages not written: refusals (and requests through the nodes
    exchange) past ``refused_events_per_minute`` for their sender, events of a host's
    accepted reports past ``node_events_per_minute`` for its sender and host."""
    # the service
    RECEIVED = "received"
    BATCHES = "batches"
    """Batches of messages applied and committed (one transaction each; timer ticks alone
    are not counted): messages received over batches is how many each commit carried."""
    REPLIES = "replies"
    REPLY_FAILURES = "reply_failures"
    PUSHES = "pushes"
    """Outcomes of queued requests published to their waiting clients."""
    PUSH_FAILURES = "push_failures"
    """Outcomes that could not be published (the status call of the client finds them)."""
    COMMANDS_SENT = "commands_sent"
    HELLOS_SENT = "hellos_sent"
    """Hellos published to node agents (what this allocator reads): one per agent and load."""
    COMMAND_FAILURES = "command_failures"
    DEAD_LETTERED = "dead_lettered"
    REPLY_TO_REFUSED = "reply_to_refused"
    EXPIRED_DROPPED = "expired_dropped"
    COMMIT_FAILURES = "commit_failures"
    BATCH_FAILURES = "batch_failures"
    TAKEOVERS = "takeovers"
    POISONED = "poisoned"
    FENCED_BATCHES = "fenced_batches"
    """Batches a newer writer of the ledger log fenced: applied nowhere, given back."""
    STALE_DELIVERIES = "stale_deliveries"
    """Messages dropped unapplied because the channel they came on has closed since: the
    broker has given them to the active allocator (this one was stopped or cut off)."""
    REDELIVERED_DECIDED = "redelivered_decided"
    """Redeliveries of requests this allocator had decided and committed already (their
    acknowledgement was lost with a broker node): dropped, not decided twice."""
    LEDGER_ROWS_PRUNED = "ledger_rows_pruned"
    """Events, finished leases and lease history rows deleted by retention
    (``history_retention_days``)."""


    @property
    def exported(self) -> Exported:
        """How this counter is exported (its entry in :data:`COUNT_EXPORTED`)."""
        return COUNT_EXPORTED[self]


_ANOMALY = Exported("swarm_gpu_anomalies", "Things a node or client did that should not happen",
                    label="kind")

COUNT_EXPORTED: Final[Mapping[Count, Exported]] = MappingProxyType({
    Count.GRANTED: Exported("swarm_gpu_grants", "Leases granted (now or from the queue)"),
    Count.QUEUED: Exported("swarm_gpu_queued", "Requests that had to wait"),
    Count.BOUND: Exported("swarm_gpu_binds", "Leases bound to a running container"),
    Count.ALLOCATE_RETRY: Exported("swarm_gpu_allocate_retries", "Allocate retries answered "
                                   "with the existing lease"),
    Count.HEARTBEATS: Exported("swarm_gpu_heartbeats", "Heartbeats applied, full or delta"),
    Count.HEARTBEAT_STALE: Exported("swarm_gpu_heartbeats_stale", "Heartbeats ignored as "
                                    "replayed or reordered"),
    # The threshold is CLOCK_SKEW_WARN_S of allocator.engine.state (which imports this module).
    Count.HEARTBEAT_CLOCK_SKEW: Exported("swarm_gpu_heartbeat_clock_skew", "Heartbeats from a "
                                         "node whose clock was more than 30 s off the "
                                         "allocator's (its container event times are off "
                                         "too)"),
    Count.HEARTBEAT_DELTAS: Exported("swarm_gpu_heartbeat_deltas", "Heartbeat deltas applied"),
    Count.HEARTBEAT_DELTA_GAPS: Exported("swarm_gpu_heartbeat_delta_gaps", "Heartbeat deltas "
                                         "that did not fit the report held (a lost message): "
                                         "the host awaits its next full report"),
    Count.HEARTBEAT_DELTAS_UNAPPLIED: Exported("swarm_gpu_heartbeat_deltas_unapplied",
                                               "Heartbeat deltas taken as liveness only while "
                                               "their host awaited a full report"),
    Count.HEARTBEATS_UNREADABLE: Exported("swarm_gpu_heartbeats_unreadable", "Heartbeats that "
                                          "did not decode (refused) but whose host and sender "
                                          "could be read: taken as liveness only"),
    Count.NODE_DOWN: Exported("swarm_gpu_node_down_events", "Times a node was marked down"),
    Count.DUPLICATE_GPU: _ANOMALY,
    Count.OVER_BUDGET: _ANOMALY,
    Count.ZOMBIE_CONTAINER: _ANOMALY,
    Count.UNKNOWN_LEASE_CONTAINER: _ANOMALY,
    Count.NODE_MESSAGE_WRONG_EXCHANGE: _ANOMALY,
    Count.REQUEST_FROM_NODE_EXCHANGE: _ANOMALY,
    Count.REQUEST_KEY_CONFLICT: _ANOMALY,
    Count.FOREIGN_LEASE: _ANOMALY,
    Count.HOST_LIMIT: _ANOMALY,
    Count.GPU_LIMIT: _ANOMALY,
    Count.ADOPTED: Exported("swarm_gpu_adoptions", "Leases the ledger did not know, taken back "
                            "from a running container's grant labels"),
    Count.ADOPTION_CONFLICT: _ANOMALY,
    Count.GPU_MOVE_CONFLICT: _ANOMALY,
    Count.INTERCONNECT_MISMATCH: _ANOMALY,
    Count.STUCK_PROCESS: _ANOMALY,
    Count.OUTSIDE_USE: _ANOMALY,
    Count.OUTSIDE_GRANT: _ANOMALY,
    Count.UNDECLARED_GPU: _ANOMALY,
    Count.QUEUED_BEHIND_FENCE: Exported("swarm_gpu_queued_behind_fence", "Requests that waited "
                                        "for the nodes' first reports after an allocator "
                                        "start (the start fence); each also counts in "
                                        "swarm_gpu_queued"),
    Count.NODE_EVENTS_UNRECORDED: Exported("swarm_gpu_node_events_unrecorded", "Ledger "
                                           "events of node messages not written: refusals "
                                           "past refused_events_per_minute for their sender, "
                                           "events of a host's accepted reports past "
                                           "node_events_per_minute for its sender and host "
                                           "(each still counted in its own counter)"),
    Count.RECEIVED: Exported("swarm_gpu_messages_received", "Messages taken off the inbound "
                             "queue"),
    Count.BATCHES: Exported("swarm_gpu_batches", "Batches of messages applied and committed to "
                            "the ledger, one transaction each"),
    Count.REPLIES: Exported("swarm_gpu_replies", "Replies sent"),
    Count.REPLY_FAILURES: Exported("swarm_gpu_reply_failures", "Replies that could not be sent"),
    Count.PUSHES: Exported("swarm_gpu_pushes", "Outcomes of queued requests (grant, expiry, "
                           "withdrawal) published to the waiting client"),
    Count.PUSH_FAILURES: Exported("swarm_gpu_push_failures", "Outcomes of queued requests that "
                                  "could not be published"),
    Count.COMMANDS_SENT: Exported("swarm_gpu_commands_sent", "Stop commands published to "
                                  "node agents"),
    Count.HELLOS_SENT: Exported("swarm_gpu_hellos_sent", "Hellos published to node agents "
                                "(what this allocator reads), one per agent after each load"),
    Count.COMMAND_FAILURES: Exported("swarm_gpu_command_failures", "Commands to node agents "
                                     "that could not be published"),
    Count.DEAD_LETTERED: Exported("swarm_gpu_dead_lettered", "Messages sent to the dead-letter "
                                  "queue"),
    Count.REPLY_TO_REFUSED: Exported("swarm_gpu_reply_to_refused", "Messages refused "
                                     "unanswered because their reply_to was not a direct "
                                     "reply-to address"),
    Count.EXPIRED_DROPPED: Exported("swarm_gpu_expired_requests_dropped", "Requests dropped "
                                    "because their sender had given up"),
    Count.COMMIT_FAILURES: Exported("swarm_gpu_commit_failures", "Ledger commits that failed "
                                    "(nothing was granted)"),
    Count.BATCH_FAILURES: Exported("swarm_gpu_batch_failures", "Batches that hit an internal "
                                   "error"),
    Count.TAKEOVERS: Exported("swarm_gpu_takeovers", "Times this allocator found the ledger "
                              "written by another (a standby taking over)"),
    Count.POISONED: Exported("swarm_gpu_poisoned_messages", "Messages that made the engine "
                             "fail while their batch was applied: each refused alone "
                             "(internal_error), the rest of its batch applied again"),
    Count.FENCED_BATCHES: Exported("swarm_gpu_fenced_batches", "Batches the replicated ledger "
                                   "log refused from this allocator (a newer writer fenced "
                                   "it): applied nowhere, given back to the queue"),
    Count.STALE_DELIVERIES: Exported("swarm_gpu_stale_deliveries", "Messages dropped unapplied "
                                     "because their channel closed before (the broker gave "
                                     "them to the active allocator)"),
    Count.REDELIVERED_DECIDED: Exported("swarm_gpu_redelivered_decided", "Redeliveries of "
                                        "requests decided already (their acknowledgement was "
                                        "lost with a broker node), dropped"),
    Count.LEDGER_ROWS_PRUNED: Exported("swarm_gpu_ledger_rows_pruned", "Ledger rows (events, "
                                       "finished leases, lease history) deleted as older "
                                       "than history_retention_days"),
})
"""How each :class:`Count` is exported; every member has its entry."""

ANOMALIES: Final = tuple(count for count, exported in COUNT_EXPORTED.items()
                         if exported is _ANOMALY)
"""Things a node or client did that should not happen (one metric, labelled by kind)."""


class Family(Enum):
    """Counters with one label; the value is the plain name's pattern."""

    RELEASED = "released_{}"
    """Leases ended, by release reason."""
    REFUSED = "refused_{}"
    """Allocate requests refused, by error code."""
    CONTAINER_EVENT = "event_{}"
    """Container events from node agents, by action."""
    NODE_MESSAGE_REJECTED = "{}_rejected"
    """Node messages whose broker user does not own the host, by message kind."""
    STOP_ASKED = "stop_asked_{}"
    """Stop commands decided, by reason."""
    INVALID_MESSAGE = "invalid_{}"
    """Messages that did not decode, by error code."""
    RECLAIM_WARNED = "reclaim_warned_{}"
    """Reclaim warnings given, by reason (``reclaimed``, ``idle``)."""

    def key(self, label: str) -> str:
        """The plain name of this family's counter for ``label``."""
        return str(self.value).format(label)

    @property
    def exported(self) -> Exported:
        """How this family is exported (its entry in :data:`FAMILY_EXPORTED`)."""
        return FAMILY_EXPORTED[self]


FAMILY_EXPORTED: Final[Mapping[Family, Exported]] = MappingProxyType({
    Family.RELEASED: Exported("swarm_gpu_releases", "Leases ended, by release reason",
                              label="reason"),
    Family.REFUSED: Exported("swarm_gpu_refusals", "Allocate requests refused, by error code",
                             label="code"),
    Family.CONTAINER_EVENT: Exported("swarm_gpu_container_events", "Container events from node "
                                     "agents", label="action"),
    Family.NODE_MESSAGE_REJECTED: Exported("swarm_gpu_node_messages_rejected", "Node messages "
                                           "refused because their broker user does not own "
                                           "the host", label="kind"),
    Family.STOP_ASKED: Exported("swarm_gpu_container_stops_asked", "Stop commands to node "
                                "agents decided, by reason", label="reason"),
    Family.INVALID_MESSAGE: Exported("swarm_gpu_invalid_messages", "Messages that did not "
                                     "decode, by error code", label="code"),
    Family.RECLAIM_WARNED: Exported("swarm_gpu_reclaim_warnings", "Warnings that a borrowed or "
                                    "idle lease will be stopped, by reason", label="reason"),
})
"""How each :class:`Family` is exported; every member has its entry, with a label."""


def _check_exports() -> None:
    """Refuse, at import, a counter declared without its export or two exports of one name:
    either would be a counter missing from (or garbled on) ``/metrics``."""
    missing = [*(c.name for c in Count if c not in COUNT_EXPORTED),
               *(f.name for f in Family if f not in FAMILY_EXPORTED)]
    if missing:
        raise TypeError(f"counters declared without their export: {', '.join(missing)}")
    unlabelled = [f.name for f, exported in FAMILY_EXPORTED.items() if exported.label is None]
    if unlabelled:
        raise TypeError(f"families exported without a label: {', '.join(unlabelled)}")
    exports = [*COUNT_EXPORTED.values(), *FAMILY_EXPORTED.values()]
    shared = [exported for exported in set(exports)
              if exported.label is None and exports.count(exported) > 1]
    names = Counter(exported.name for exported in set(exports))
    clashes = sorted({*(e.name for e in shared), *(n for n, k in names.items() if k > 1)})
    if clashes:
        raise TypeError(f"metric names exported twice: {', '.join(clashes)}")


_check_exports()


class Counters:
    """Counts by :class:`Count` and by :class:`Family` and label."""

    def __init__(self) -> None:
        self._plain: Counter[str] = Counter()
        self._families: dict[Family, Counter[str]] = {family: Counter() for family in Family}

    def add(self, what: Count, n: int = 1) -> None:
        """Count ``n`` more of ``what``."""
        self._plain[what.value] += n

    def add_to(self, family: Family, label: str, n: int = 1) -> None:
        """Count ``n`` more of ``family`` with ``label``."""
        self._families[family][label] += n
        self._plain[family.key(label)] += n

    def of(self, family: Family) -> dict[str, int]:
        """Label -> count of one family."""
        return dict(self._families[family])

    def __getitem__(self, name: str) -> int:
        """The count of a plain name (0 when nothing was counted)."""
        return self._plain[name]

    def get(self, name: str, default: int = 0) -> int:
        return self._plain.get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._plain)

    def copy(self) -> Counters:
        """An independent copy (a metrics snapshot)."""
        other = Counters()
        other._plain = Counter(self._plain)
        other._families = {family: Counter(c) for family, c in self._families.items()}
        return other


@dataclass
class ServiceStats:
    """Counters of the service loop (the engine keeps its own)."""

    counters: Counters = field(default_factory=Counters)
