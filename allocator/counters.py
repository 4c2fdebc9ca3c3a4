"""The allocator's counters, typed: every name is declared here, once.

The engine and the service count what happens (:class:`Count` for plain counters,
:class:`Family` for counters with a label such as a release reason); :mod:`allocator.metrics`
reads them back by name and by family, never by taking string keys apart.

A :class:`Counters` also answers a plain name (``counters["zombie_container"]``,
``counters["released_admin"]``): the name in logs and tests, made by :meth:`Family.key`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum, StrEnum


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
    NODE_DOWN = "node_down"
    DUPLICATE_GPU = "duplicate_gpu"
    OVER_BUDGET = "over_budget"
    ZOMBIE_CONTAINER = "zombie_container"
    UNKNOWN_LEASE_CONTAINER = "unknown_lease_container"
    NODE_MESSAGE_WRONG_EXCHANGE = "node_message_wrong_exchange"
    REQUEST_FROM_NODE_EXCHANGE = "request_from_node_exchange"
    REQUEST_KEY_CONFLICT = "request_key_conflict"
    HOST_LIMIT = "host_limit"
    GPU_LIMIT = "gpu_limit"
    ADOPTED = "adopted"
    """A lease the ledger did not know, taken back from a running container's grant labels."""
    ADOPTION_CONFLICT = "adoption_conflict"
    """A running container's grant that contradicts the ledger (not adopted)."""
    QUEUED_BEHIND_FENCE = "queued_behind_fence"
    """A request that waited for the nodes' first reports after a start (the start fence)."""
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


ANOMALIES = (
    Count.ZOMBIE_CONTAINER, Count.UNKNOWN_LEASE_CONTAINER, Count.OVER_BUDGET,
    Count.DUPLICATE_GPU, Count.NODE_MESSAGE_WRONG_EXCHANGE, Count.REQUEST_FROM_NODE_EXCHANGE,
    Count.REQUEST_KEY_CONFLICT, Count.HOST_LIMIT, Count.GPU_LIMIT,
    Count.ADOPTION_CONFLICT,
)
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
