"""What the allocator declares on the broker: the exchanges, its two inbound queues (requests,
node messages), the dead-letter queue and their bindings, and the agents exchange its stop
commands go to.

The names and arguments are :mod:`allocator.wire.topology`'s, shared with every other declarer;
this module only declares them, and copes with a broker that refuses a declaration an older
release or its definitions left different.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import aio_pika
import aio_pika.abc
import aiormq.exceptions

from allocator.amqp.declare import (
    OnRefusal,
    Refusal,
    Tolerate,
    declare_exchange,
    declare_queue,
)
from allocator.wire.topology import (
    AGENTS_EXCHANGE,
    AGENTS_EXCHANGE_SPEC,
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_EXCHANGE_SPEC,
    NODES_EXCHANGE_SPEC,
    RPC_EXCHANGE_SPEC,
    RPC_ROUTING_KEY,
    allocator_queue_spec,
    dead_letter_queue_spec,
    nodes_queue_name,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inbound:
    """The allocator's inbound queues, both on the channel replies go out on."""

    requests: aio_pika.abc.AbstractQueue
    nodes: aio_pika.abc.AbstractQueue | None
    """The node queue; None when the broker user may not declare it (definitions rendered
    by an older release): node messages then come on the request queue, as before."""


async def declare_topology(
    connection: aio_pika.abc.AbstractConnection, queue_name: str, *,
    channel: aio_pika.abc.AbstractChannel | None = None,
) -> Inbound:
    """Declare exchanges, the inbound queues, the dead-letter queue and their bindings, on
    ``channel`` (or a fresh one; the dead-letter queue on one of its own).

    The node queue is bound to the nodes exchange first and only then the request queue's
    binding to it (left by an older release or its definitions) removed, so no node message
    finds no queue meanwhile; those already in the request queue are consumed there. When the
    broker user may not declare the node queue, the request queue stays bound to the nodes
    exchange, with an error in the log: node messages go on arriving as before (the same
    when it may declare it but not bind it).

    The agents exchange, where the allocator sends its commands, is declared apart on a channel
    of its own (:func:`declare_agents_exchange`); the agents' queues are declared by the agents.
    """
    channel = channel if channel is not None else await connection.channel()
    rpc = (await declare_exchange(connection.channel, RPC_EXCHANGE_SPEC, channel=channel)).value
    nodes = (await declare_exchange(connection.channel, NODES_EXCHANGE_SPEC,
                                    channel=channel)).value
    await declare_exchange(connection.channel, DEAD_LETTER_EXCHANGE_SPEC, channel=channel)
    await declare_dead_letter_queue(connection)
    queue = (await declare_queue(connection.channel, allocator_queue_spec(queue_name),
                                 channel=channel)).value
    assert rpc is not None and nodes is not None and queue is not None  # nothing tolerated
    await queue.bind(rpc, routing_key=RPC_ROUTING_KEY)
    node_queue = await _declare_nodes_queue(connection, channel, queue_name)
    if node_queue is None:
        await queue.bind(nodes, routing_key="#")
        return Inbound(queue, None)
    await queue.unbind(nodes, routing_key="#")
    return Inbound(queue, node_queue)


async def _declare_nodes_queue(connection: aio_pika.abc.AbstractConnection,
                               channel: aio_pika.abc.AbstractChannel, queue_name: str,
                               ) -> aio_pika.abc.AbstractQueue | None:
    """The node queue, declared and bound to the nodes exchange on a channel of its own (a
    refusal closes the channel that asked), then declared again on ``channel`` (a robust
    channel restores only what was declared on it); None when the broker user may not
    declare or bind it (older definitions, or permissions set by hand without it)."""
    spec = allocator_queue_spec(nodes_queue_name(queue_name))
    trial = await connection.channel()
    try:
        queue = await trial.declare_queue(spec.name, durable=spec.durable,
                                          arguments=spec.arguments)
        await queue.bind(NODES_EXCHANGE_SPEC.name, routing_key="#")
    except aiormq.exceptions.ChannelAccessRefused as exc:
        log.error("node messages share the request queue %s: the broker refused %s to this "
                  "user (%s), so a flood of node messages can delay or refuse hub requests. "
                  "Render the broker definitions again (compose/render_definitions.py): the "
                  "allocator's user needs configure, write and read on it", queue_name,
                  spec.name, exc)
        return None
    finally:
        with contextlib.suppress(Exception):
            await trial.close()
    return (await declare_queue(connection.channel, spec, channel=channel)).value


async def declare_dead_letter_queue(connection: aio_pika.abc.AbstractConnection) -> None:
    """Declare the dead-letter queue with its bounds, on a channel of its own, and bind it.

    A queue declared by a version without the byte bound (or by hand) has other arguments,
    and RabbitMQ refuses to redeclare it (PRECONDITION_FAILED, which closes the channel): it
    is then used as it is, with a warning, instead of the allocator not starting.
    """
    spec = dead_letter_queue_spec()
    declared = await declare_queue(
        connection.channel, spec, tolerate=[Tolerate(Refusal.PRECONDITION, OnRefusal.PASSIVE)])
    if declared.refusal is not None:
        log.warning("the dead-letter queue %s exists with other arguments (%s); it is used as "
                    "it is. It stays unbounded by bytes unless the broker policy bounds it "
                    "(compose/rabbitmq-definitions.json) or it is deleted, once read, for the "
                    "allocator to declare it again", spec.name, declared.reason)
    queue, channel = declared.value, declared.channel
    assert queue is not None and channel is not None
    try:
        await queue.bind(DEAD_LETTER_EXCHANGE, routing_key="")
    finally:
        with contextlib.suppress(Exception):
            await channel.close()


async def declare_agents_exchange(
    connection: aio_pika.abc.AbstractConnection,
) -> aio_pika.abc.AbstractExchange | None:
    """Declare the agents exchange on a channel of its own (the allocator's command channel,
    without publisher confirms); None when the broker user may not (definitions from before
    stop commands existed).

    A refusal closes the channel, which is why commands have a channel of their own: the
    allocator then runs on without stop commands instead of not starting at all, and a
    refused command can never close the channel its replies go out on.
    """
    declared = await declare_exchange(
        lambda: connection.channel(publisher_confirms=False), AGENTS_EXCHANGE_SPEC,
        tolerate=[Tolerate(Refusal.ACCESS, OnRefusal.REPORT)])
    if declared.refusal is not None:
        log.error("stop commands are off: the broker refused to declare %s (%s). Render the "
                  "broker definitions again (compose/render_definitions.py): the allocator's "
                  "user needs configure and write on it", AGENTS_EXCHANGE, declared.reason)
    return declared.value
