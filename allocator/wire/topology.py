"""The broker topology every part agrees on: exchange, queue and routing-key names and arguments.

All traffic into the allocator lands on **one** quorum queue with single-active-consumer:
requests from hubs (through :data:`RPC_EXCHANGE`) and node messages from agents (through
:data:`NODES_EXCHANGE`). One queue, not two, because single-active-consumer elects the active
consumer per queue: with two queues a standby could become active on one and not the other,
and two allocators would then both write. Separate exchanges keep the broker permissions
narrow: a hub may write only to the RPC exchange, an agent only to the nodes exchange.

The other way, the allocator sends commands to node agents (stop a lease container) through
:data:`AGENTS_EXCHANGE`, routing key ``stop.<host>``; each agent consumes a queue of its own,
:func:`agent_queue_spec`, bound with its own host's key only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

RPC_EXCHANGE = "swarm-gpu.rpc"
"""Direct exchange for requests to the allocator (hubs, admins)."""
RPC_ROUTING_KEY = "request"

NODES_EXCHANGE = "swarm-gpu.nodes"
"""Topic exchange for node agents: ``heartbeat.<host>`` and ``event.<host>``."""

ALLOCATOR_QUEUE = "swarm-gpu.allocator"
"""The allocator's inbound queue (quorum, single-active-consumer)."""

DEAD_LETTER_EXCHANGE = "swarm-gpu.dead"
"""Fanout exchange that receives messages the allocator could not decode."""
DEAD_LETTER_QUEUE = "swarm-gpu.dead-letters"

AGENTS_EXCHANGE = "swarm-gpu.agents"
"""Topic exchange for commands from the allocator to node agents: ``stop.<host>``."""

AGENT_QUEUE_PREFIX = "swarm-gpu.agent."
"""An agent's command queue is this followed by its host name."""

AGENT_QUEUE_EXPIRES_MS = 300_000
"""An agent's command queue is deleted by the broker after this long without a consumer (a
dead or renamed agent leaves nothing behind); an agent that reconnects within it finds the
commands sent meanwhile."""

AGENT_QUEUE_MAX_LENGTH = 10_000
"""Commands kept for an agent that does not consume; beyond this the oldest are dropped."""

DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
"""RabbitMQ's pseudo-queue for replies without a reply queue per client."""

DEAD_LETTER_MAX_LENGTH = 100_000
"""Messages the dead-letter queue keeps; beyond this the oldest are dropped."""

DEAD_LETTER_MAX_BYTES = 64 * 1024 * 1024
"""Bytes of message bodies the dead-letter queue keeps (64 MiB: 256 bodies at the body limit);
beyond this the oldest are dropped, so a flood of large refused messages cannot fill the
broker's disk."""

ALLOCATOR_QUEUE_POLICY = "swarm-gpu-allocator-bounded"
"""The broker policy that bounds the inbound queue (in ``compose/rabbitmq-definitions.json``):
a policy, not a queue argument, because RabbitMQ refuses to redeclare a queue with arguments
other than those it was declared with, so a new argument would stop every allocator of an
existing cluster at start (PRECONDITION_FAILED); a policy applies to the queue as it is."""

ALLOCATOR_QUEUE_MAX_LENGTH = 100_000
"""Messages ready in the inbound queue (those handed to the allocator not counted) beyond
which the broker refuses publishes (``overflow: reject-publish``: a nack to the publisher,
which says so): far more than a cluster sends while the allocator restarts, since heartbeats
expire after two intervals."""

ALLOCATOR_QUEUE_MAX_BYTES = 512 * 1024 * 1024
"""Bytes of message bodies ready in the inbound queue beyond which publishes are refused."""


def allocator_queue_policy() -> dict[str, Any]:
    """The definition of :data:`ALLOCATOR_QUEUE_POLICY`: the inbound queue's bounds, past
    which the broker refuses publishes rather than fill its disk (keys quorum queues take)."""
    return {"max-length": ALLOCATOR_QUEUE_MAX_LENGTH,
            "max-length-bytes": ALLOCATOR_QUEUE_MAX_BYTES,
            "overflow": "reject-publish"}


DELIVERY_LIMIT = 5
"""A message redelivered this often (it crashed the allocator each time) is dead-lettered."""

LEDGER_LOG_STREAM = "swarm-gpu.ledger-log"
"""The stream of the replicated ledger log (the allocator's ``ledger_log_stream`` default)."""

RABBITMQ_SEGMENT_BYTES = 500_000_000
"""RabbitMQ's default ``x-stream-max-segment-size-bytes`` (the allocator's
``ledger_log_segment_bytes`` default)."""

SNAPSHOT_BYTES = 256 << 20
"""How much the log stream grows between two snapshots of the ledger unless configured (the
allocator's ``ledger_log_snapshot_bytes`` default)."""


HEARTBEAT_ROUTING_PREFIX = "heartbeat."
"""What every heartbeat's routing key starts with (full reports and deltas alike)."""


def heartbeat_routing_key(host: str) -> str:
    """Routing key of a node's heartbeats."""
    return f"{HEARTBEAT_ROUTING_PREFIX}{host}"


def event_routing_key(host: str) -> str:
    """Routing key of a node's container events."""
    return f"event.{host}"


def command_routing_key(host: str) -> str:
    """Routing key of the commands for one node's agent."""
    return f"stop.{host}"


def agent_queue_name(host: str) -> str:
    """The command queue of one node's agent."""
    return f"{AGENT_QUEUE_PREFIX}{host}"


@dataclass(frozen=True)
class ExchangeSpec:
    """An exchange's name, type and durability, so every declarer declares it the same way
    (RabbitMQ refuses a redeclaration of another type or durability)."""

    name: str
    type: Literal["direct", "topic", "fanout"]
    durable: bool = True


RPC_EXCHANGE_SPEC: Final = ExchangeSpec(RPC_EXCHANGE, "direct")
"""Requests to the allocator, routed by :data:`RPC_ROUTING_KEY`."""
NODES_EXCHANGE_SPEC: Final = ExchangeSpec(NODES_EXCHANGE, "topic")
"""The node agents' heartbeats and container events, routed by host."""
DEAD_LETTER_EXCHANGE_SPEC: Final = ExchangeSpec(DEAD_LETTER_EXCHANGE, "fanout")
"""Where the inbound queue dead-letters a message past its delivery limit."""
AGENTS_EXCHANGE_SPEC: Final = ExchangeSpec(AGENTS_EXCHANGE, "topic")
"""The allocator's commands to node agents, routed by :func:`command_routing_key`."""


@dataclass(frozen=True)
class QueueSpec:
    """A queue's name and declaration arguments, so every declarer uses the same ones.

    RabbitMQ refuses a redeclaration with different arguments (PRECONDITION_FAILED), so the
    allocator, the definitions file in ``compose/`` and the benchmarks all take them from here.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    durable: bool = True


def allocator_queue_spec(name: str = ALLOCATOR_QUEUE) -> QueueSpec:
    """The inbound queue: quorum, single-active-consumer, dead-lettering after the limit."""
    return QueueSpec(
        name=name,
        arguments={
            "x-queue-type": "quorum",
            "x-single-active-consumer": True,
            "x-delivery-limit": DELIVERY_LIMIT,
            "x-dead-letter-exchange": DEAD_LETTER_EXCHANGE,
        },
    )


def stream_arguments(max_bytes: int, segment_bytes: int) -> dict[str, Any]:
    """The ledger log's queue arguments: a stream, its retention and its segment size."""
    arguments: dict[str, Any] = {"x-queue-type": "stream", "x-max-length-bytes": max_bytes}
    if segment_bytes != RABBITMQ_SEGMENT_BYTES:
        # Left out at RabbitMQ's default: a stream declared before this setting existed has
        # no such argument, and declaring it with one would be refused as inequivalent.
        arguments["x-stream-max-segment-size-bytes"] = segment_bytes
    return arguments


def is_direct_reply_to(address: str) -> bool:
    """Whether ``address`` is a RabbitMQ direct reply-to address.

    A caller publishes with ``reply_to: amq.rabbitmq.reply-to``; the broker rewrites it to
    ``amq.rabbitmq.reply-to.<the caller's channel>`` before delivery, and a reply to that name
    reaches only that channel's consumer, never a queue.
    """
    return address.startswith(DIRECT_REPLY_TO + ".")


def dead_letter_queue_spec() -> QueueSpec:
    """Where undecodable messages wait for a person to look at them: bounded by count and by
    bytes, the oldest dropped first (``drop-head``) when either bound is reached."""
    return QueueSpec(name=DEAD_LETTER_QUEUE, arguments={
        "x-queue-type": "quorum",
        "x-max-length": DEAD_LETTER_MAX_LENGTH,
        "x-max-length-bytes": DEAD_LETTER_MAX_BYTES,
        "x-overflow": "drop-head",
    })


def agent_queue_spec(host: str) -> QueueSpec:
    """An agent's command queue: classic, not durable, expiring when its agent is gone.

    Not durable because a command is only worth anything while its container runs, and a
    broker restart ends every connection anyway (the agent declares the queue again). Not
    ``auto_delete`` or exclusive, so that commands sent while the agent reconnects wait for it.
    """
    return QueueSpec(
        name=agent_queue_name(host),
        arguments={
            "x-queue-type": "classic",
            "x-expires": AGENT_QUEUE_EXPIRES_MS,
            "x-max-length": AGENT_QUEUE_MAX_LENGTH,
        },
        durable=False,
    )
