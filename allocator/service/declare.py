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
import aiormq.exceptions

from allocator.wire.topology import (
    AGENTS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    NODES_EXCHANGE,
    RPC_EXCHANGE,
    RPC_ROUTING_KEY,
    allocator_queue_spec,
    dead_letter_queue_spec,
)

log = logging.getLogger(__name__)


async def declare_topology(
    channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> aio_pika.abc.AbstractQueue:
    """Declare exchanges, the inbound queue, the dead-letter queue and their bindings.

    The agents exchange, where the allocator sends its commands, is declared apart on a channel
    of its own (:func:`declare_agents_exchange`); the agents' queues are declared by the agents.
    """
    rpc = await channel.declare_exchange(RPC_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
    nodes = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                           durable=True)
    await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT,
                                          durable=True)
    await declare_dead_letter_queue(channel)
    spec = allocator_queue_spec(queue_name)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments)
    await queue.bind(rpc, routing_key=RPC_ROUTING_KEY)
    await queue.bind(nodes, routing_key="#")
    return queue


async def declare_dead_letter_queue(channel: aio_pika.abc.AbstractChannel) -> None:
    """Declare the dead-letter queue with its bounds, on a channel of its own, and bind it.

    A queue declared by a version without the byte bound (or by hand) has other arguments,
    and RabbitMQ refuses to redeclare it (PRECONDITION_FAILED, which closes the channel): it
    is then used as it is, with a warning, instead of the allocator not starting.
    """
    spec = dead_letter_queue_spec()
    connection = (await channel.get_underlay_channel()).connection
    own = await connection.channel()
    try:
        await own.queue_declare(spec.name, durable=True, arguments=spec.arguments)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        log.warning("the dead-letter queue %s exists with other arguments (%s); it is used as "
                    "it is. It stays unbounded by bytes unless the broker policy bounds it "
                    "(compose/rabbitmq-definitions.json) or it is deleted, once read, for the "
                    "allocator to declare it again", spec.name, exc)
        own = await connection.channel()
    try:
        await own.queue_bind(spec.name, DEAD_LETTER_EXCHANGE, routing_key="")
    finally:
        with contextlib.suppress(Exception):
            await own.close()


async def declare_agents_exchange(
    channel: aio_pika.abc.AbstractChannel,
) -> aio_pika.abc.AbstractExchange | None:
    """Declare the agents exchange on ``channel`` (the allocator's command channel); None when
    the broker user may not (definitions from before stop commands existed).

    A refusal closes the channel, which is why commands have a channel of their own: the
    allocator then runs on without stop commands instead of not starting at all, and a
    refused command can never close the channel its replies go out on.
    """
    try:
        return await channel.declare_exchange(AGENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                              durable=True)
    except aiormq.exceptions.ChannelAccessRefused as exc:
        with contextlib.suppress(Exception):
            await channel.close()
        log.error("stop commands are off: the broker refused to declare %s (%s). Render the "
                  "broker definitions again (compose/render_definitions.py): the allocator's "
                  "user needs configure and write on it", AGENTS_EXCHANGE, exc)
        return None
