"""The allocator's commands to node agents on the real broker: what is sent arrives, and the
hosts whose hello did not go out are told to the caller (the engine greets them again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aio_pika
import aio_pika.abc

from allocator.amqp.declare import declare_exchange
from allocator.config import AllocatorSettings
from allocator.metrics.counters import Count, ServiceStats
from allocator.service.commands import Commands
from allocator.service.declare import declare_agents_exchange
from allocator.wire.protocol import AllocatorHello, StopContainer, StopReason
from allocator.wire.topology import AGENTS_EXCHANGE, AGENTS_EXCHANGE_SPEC, command_routing_key
from tests.support.services import AmqpVhost


def hello(host: str) -> AllocatorHello:
    return AllocatorHello(host=host, reads=["gpu_processes"])


def stop(host: str) -> StopContainer:
    return StopContainer(host=host, lease_id="l-1", container_id="c-1",
                         reason=StopReason.RELEASED)


def commands_of(tmp_path: Path) -> tuple[Commands, ServiceStats]:
    stats = ServiceStats()
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", request_timeout_s=5.0)
    return Commands(settings, stats, "guest"), stats


async def received(queue: aio_pika.abc.AbstractQueue, count: int,
                   within: float = 10.0) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """The first ``count`` messages of ``queue``, waiting for them: a publish without confirms
    returns before the broker has routed it."""
    messages: list[aio_pika.abc.AbstractIncomingMessage] = []
    deadline = time.monotonic() + within
    while len(messages) < count:
        message = await queue.get(timeout=10, fail=False)
        if message is not None:
            await message.ack()
            messages.append(message)
            continue
        assert time.monotonic() < deadline, f"{len(messages)} of {count} messages arrived"
        await asyncio.sleep(0.05)
    return messages


async def test_what_is_sent_arrives_and_nothing_is_left_to_greet_again(
        amqp_vhost: AmqpVhost, tmp_path: Path) -> None:
    commands, stats = commands_of(tmp_path)
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as connection:
        exchange = await declare_agents_exchange(connection)
        assert exchange is not None
        listener = await connection.channel()
        inbox = await listener.declare_queue("", exclusive=True)
        await inbox.bind(AGENTS_EXCHANGE, command_routing_key("a"))
        commands.attach(exchange)
        assert await commands.send([hello("a"), stop("a")]) == []
        messages = await received(inbox, 2)
        assert [m.type for m in messages] == ["hello", "stop_container"]
        assert [m.user_id for m in messages] == ["guest", "guest"]
    counters = stats.counters
    assert (counters.get(Count.HELLOS_SENT), counters.get(Count.COMMANDS_SENT),
            counters.get(Count.COMMAND_FAILURES)) == (1, 1, 0)


async def test_the_hosts_whose_hello_did_not_go_out_are_returned(
        amqp_vhost: AmqpVhost, tmp_path: Path) -> None:
    commands, stats = commands_of(tmp_path)
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as connection:
        declared = await declare_exchange(connection.channel, AGENTS_EXCHANGE_SPEC)
        assert declared.value is not None and declared.channel is not None
        commands.attach(declared.value)
        await declared.channel.close()  # as a broker that closed the command channel
        assert await commands.send([hello("a"), stop("a"), hello("b")]) == ["a", "b"]
    assert stats.counters.get(Count.COMMAND_FAILURES) == 3
    assert stats.counters.get(Count.HELLOS_SENT) == 0


async def test_with_stop_commands_off_hellos_are_dropped_not_retried(tmp_path: Path) -> None:
    commands, stats = commands_of(tmp_path)
    commands.attach(None)  # the broker refused the agents exchange at start
    assert await commands.send([hello("a")]) == []
    assert await commands.send([hello("a"), stop("a")]) == []
    assert stats.counters.get(Count.COMMAND_FAILURES) == 1  # the stop, not the hellos
