"""The one declarer (allocator.amqp.declare) on the real broker: declarations from the specs, and
each refusal a caller lives with (used as it exists, or gone on without), or not."""

from __future__ import annotations

import contextlib
import secrets
import urllib.parse
from collections.abc import Iterator

import aio_pika
import aiormq.exceptions
import pytest

from allocator.amqp.declare import (
    OnRefusal,
    Refusal,
    Tolerate,
    declare_exchange,
    declare_queue,
)
from allocator.wire.topology import ExchangeSpec, QueueSpec
from tests.support.services import AmqpVhost

EXCHANGE = ExchangeSpec("test.declare.exchange", "topic")
QUEUE = QueueSpec("test.declare.queue", {"x-queue-type": "quorum", "x-max-length": 10})


@contextlib.contextmanager
def user_who_may_not_configure(vhost: AmqpVhost) -> Iterator[str]:
    """The AMQP URL of a user of ``vhost`` who may read and write but configure nothing (as
    the stack's least-privilege users may not configure the names they use)."""
    name, password = f"declare-{secrets.token_hex(4)}", secrets.token_hex(8)
    broker = vhost.broker
    broker.api("PUT", f"/api/users/{name}", {"password": password, "tags": ""})
    try:
        broker.api("PUT", f"/api/permissions/{urllib.parse.quote(vhost.name, safe='')}/{name}",
                   {"configure": "^$", "write": ".*", "read": ".*"})
        yield (f"amqp://{name}:{password}@{broker.host}:{broker.port}/"
               f"{urllib.parse.quote(vhost.name, safe='')}")
    finally:
        broker.api("DELETE", f"/api/users/{name}")


async def test_an_exchange_and_a_queue_are_declared_from_their_specs(
        amqp_vhost: AmqpVhost) -> None:
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as connection:
        exchange = await declare_exchange(connection.channel, EXCHANGE)
        queue = await declare_queue(connection.channel, QUEUE)
        assert exchange.value is not None and queue.value is not None
        assert (exchange.refusal, queue.refusal) == (None, None)
        await queue.value.bind(exchange.value, "k")
        await exchange.value.publish(aio_pika.Message(b"x"), "k", timeout=10)
    found = amqp_vhost.broker.api(
        "GET", f"/api/queues/{urllib.parse.quote(amqp_vhost.name, safe='')}/{QUEUE.name}")
    assert found["arguments"] == QUEUE.arguments and found["durable"]
    declared = amqp_vhost.broker.api(
        "GET", f"/api/exchanges/{urllib.parse.quote(amqp_vhost.name, safe='')}/{EXCHANGE.name}")
    assert (declared["type"], declared["durable"]) == ("topic", True)


async def test_a_queue_with_other_arguments_is_used_as_it_is_when_tolerated(
        amqp_vhost: AmqpVhost) -> None:
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as connection:
        await declare_queue(connection.channel, QueueSpec(QUEUE.name, {
            "x-queue-type": "quorum", "x-max-length": 20}))
        declared = await declare_queue(
            connection.channel, QUEUE,
            tolerate=[Tolerate(Refusal.PRECONDITION, OnRefusal.PASSIVE)])
        assert declared.refusal is Refusal.PRECONDITION
        assert "x-max-length" in declared.reason
        assert declared.value is not None and declared.channel is not None
        assert not declared.channel.is_closed  # a fresh channel, not the refused one
        await declared.channel.default_exchange.publish(
            aio_pika.Message(b"x"), QUEUE.name, timeout=10)
        assert (await declared.value.declare()).message_count is not None


async def test_a_refusal_not_tolerated_or_for_another_reason_is_raised(
        amqp_vhost: AmqpVhost) -> None:
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as connection:
        await declare_queue(connection.channel, QueueSpec(QUEUE.name, {
            "x-queue-type": "quorum", "x-max-length": 20}))
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await declare_queue(connection.channel, QUEUE)
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await declare_queue(connection.channel, QUEUE, tolerate=[
                Tolerate(Refusal.PRECONDITION, OnRefusal.PASSIVE,
                         only_if=("x-max-length-bytes",))])
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await declare_queue(connection.channel, QUEUE, tolerate=[
                Tolerate(Refusal.ACCESS, OnRefusal.PASSIVE)])
        named = await declare_queue(connection.channel, QUEUE, tolerate=[
            Tolerate(Refusal.PRECONDITION, OnRefusal.PASSIVE, only_if=("x-max-length",))])
        assert named.refusal is Refusal.PRECONDITION and named.value is not None


async def test_a_user_who_may_not_configure_uses_what_exists_or_goes_on_without(
        amqp_vhost: AmqpVhost) -> None:
    async with await aio_pika.connect(amqp_vhost.url, timeout=10) as admin:
        await declare_exchange(admin.channel, EXCHANGE)
    with user_who_may_not_configure(amqp_vhost) as url:
        async with await aio_pika.connect(url, timeout=10) as connection:
            used = await declare_exchange(connection.channel, EXCHANGE, tolerate=[
                Tolerate(Refusal.ACCESS, OnRefusal.PASSIVE)])
            assert used.refusal is Refusal.ACCESS and "ACCESS_REFUSED" in used.reason
            assert used.value is not None
            await used.value.publish(aio_pika.Message(b"x"), "k", timeout=10)
            missing = ExchangeSpec("test.declare.missing", "topic")
            without = await declare_exchange(connection.channel, missing, tolerate=[
                Tolerate(Refusal.ACCESS, OnRefusal.REPORT)])
            assert (without.value, without.channel, without.refusal) == (
                None, None, Refusal.ACCESS)
            with pytest.raises(aiormq.exceptions.ChannelNotFoundEntity):
                # Used as it exists, when it does not: the passive declaration says so.
                await declare_exchange(connection.channel, missing, tolerate=[
                    Tolerate(Refusal.ACCESS, OnRefusal.PASSIVE)])
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await declare_exchange(connection.channel, EXCHANGE)
