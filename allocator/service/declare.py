"""What the allocator declares on the broker: the exchanges, its inbound queue, the dead-letter
queue and their bindings, and the agents exchange its stop commands go to.

The names and arguments are :mod:`allocator.wire.topology`'s, shared with every other declarer;
this module only declares them, and copes with a broker that refuses a declaration an older
release or its definitions left different.
"""

from __future__ import annotations

import contextlib
import logging

import aio_pika
import aio_pika.abc

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
)

log = logging.getLogger(__name__)


async def declare_topology(
    connection: aio_pika.abc.AbstractConnection, queue_name: str, *,
    channel: aio_pika.abc.AbstractChannel | None = None,
) -> aio_pika.abc.AbstractQueue:
    """Declare exchanges, the inbound queue, the dead-letter queue and their bindings, on
    ``channel`` (or a fresh one; the dead-letter queue on one of its own).

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
    await queue.bind(nodes, routing_key="#")
    return queue


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
