"""Bad input gets a clear answer and loses nothing: every kind, against the live consumer."""

from __future__ import annotations

import asyncio
import json
import time

import aio_pika
import pytest

from allocator.wire.protocol import (
    MAX_BODY_BYTES,
    AllocateRequest,
    ErrorCode,
    Lease,
    LeaseState,
    encode,
)
from allocator.wire.topology import DEAD_LETTER_MAX_BYTES, DEAD_LETTER_QUEUE
from tests.support.common import (
    GTX1070,
    RawRPC,
    drain_queue,
    gpus,
    settled_dead_letters,
    wait_until,
)


@pytest.fixture
async def raw(allocator, amqp_vhost, nodes, client):
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))

    async def known():
        return (await client.inventory()).nodes
    await wait_until(known)
    async with RawRPC(amqp_vhost.url) as rpc:
        yield rpc


def allocate_body(**fields) -> bytes:
    body = {"v": 1, "kind": "allocate", "request_key": "k/alice/", "user": "alice"}
    body.update(fields)
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"not json", "bad_request", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "bad_request", "not valid JSON"),
        (b"[1, 2, 3]", "bad_request", "JSON object"),
        (b"[" * 5000 + b"]" * 5000, "bad_request", "JSON"),
        (b'{"v": 2, "kind": "allocate"}', "unsupported_version", "version 2"),
        (b'{"kind": "allocate", "user": "a"}', "unsupported_version", 'no "v"'),
        # "v" is required and exactly the integer 1, even when the rest is a valid request.
        (b'{"kind": "allocate", "request_key": "k/alice/", "user": "alice"}',
         "unsupported_version", 'no "v"'),
        (allocate_body(v=True), "unsupported_version", "version true"),
        (allocate_body(v=1.0), "unsupported_version", "version 1.0"),
        (allocate_body(v="1"), "unsupported_version", 'version "1"'),
        (b'{"v": null, "kind": "queue"}', "unsupported_version", "version null"),
        # Strict types: a number in a string is not a number, "yes" is not a boolean.
        (allocate_body(wait_s="60"), "bad_request", "wait_s"),
        (allocate_body(deadline=str(time.time() + 600)), "bad_request", "deadline"),
        (allocate_body(priority="5"), "bad_request", "priority"),
        (allocate_body(count=1.0), "bad_request", "count"),
        (allocate_body(min_memory_mib="1024"), "bad_request", "min_memory_mib"),
        (allocate_body(share={"memory_mib": "1024"}), "bad_request", "memory_mib"),
        (b'{"v": 1, "kind": "inventory", "include_leases": "yes"}', "bad_request",
         "include_leases"),
        (b'{"v": 1, "kind": "inventory", "include_leases": 1}', "bad_request", "include_leases"),
        (b'{"v": 1, "kind": "release", "request_key": "k/alice/", "force": "true"}',
         "bad_request", "force"),
        (b'{"v": 1, "kind": "drain", "host": "gpu-a", "drained": 0}', "bad_request", "drained"),
        (b'{"v": 1, "kind": "teleport"}', "bad_request", "teleport"),
        (b'{"v": 1, "kind": "allocate", "user": "alice"}', "bad_request", "request_key"),
        (allocate_body(count=0), "bad_request", "count"),
        (allocate_body(count=10**6), "bad_request", "count"),
        (allocate_body(count=-3), "bad_request", "count"),
        (allocate_body(count=True), "bad_request", "count"),
        (allocate_body(count="lots"), "bad_request", "count"),
        (allocate_body(wait_s=-1), "bad_request", "wait_s"),
        (allocate_body(wait_s=10**300), "bad_request", "wait_s"),
        (allocate_body(min_memory_mib=2**70), "bad_request", "min_memory_mib"),
        (allocate_body(user=""), "bad_request", "user"),
        (allocate_body(user=123), "bad_request", "user"),
        (allocate_body(share={"memory_mib": 1024}, count=2), "bad_request", "count must be 1"),
        (allocate_body(model="a", models=["b"]), "bad_request", "either"),
        # An unknown field is ignored (a newer hub's added field: docs/protocol.md,
        # "Compatibility"; tests/wire/test_compatibility.py); the known ones are checked all the
        # same.
        (allocate_body(colour="blue", count="2"), "bad_request", "count"),
        (allocate_body(model="H100"), "unknown_model", GTX1070),
        (allocate_body(host="nowhere"), "unknown_host", "gpu-a"),
        (allocate_body(count=3), "unsatisfiable", "2"),
        (allocate_body(share={"memory_mib": 100_000}), "unsatisfiable", ""),
        (b"x" * (MAX_BODY_BYTES + 1), "too_large", str(MAX_BODY_BYTES)),
    ],
    ids=lambda value: value[:40].decode("utf-8", "replace") if isinstance(value, bytes) else None,
)
async def test_each_bad_request_gets_a_coded_reply(raw, client, body, code, words):
    await raw.send(body)
    reply = await raw.reply()
    assert reply["ok"] is False
    assert reply["error"]["code"] == code, reply
    assert words in reply["error"]["message"]
    inventory = await client.inventory(include_leases=True)
    assert inventory.leases == [], "bad input must not create a lease"


async def test_consumer_survives_a_flood_of_garbage(raw, client):
    for i in range(200):
        await raw.send(bytes([i % 256]) * (i + 1))
    for _ in range(200):
        assert (await raw.reply())["ok"] is False
    lease = await client.allocate(AllocateRequest(request_key="k/bob/", user="bob"))
    assert lease.host == "gpu-a"


async def test_undecodable_message_without_reply_to_is_dead_lettered(raw, amqp_vhost, allocator):
    await raw.send(b"\x00\x01 not a message", reply=False)
    async with await aio_pika.connect(amqp_vhost.url) as connection:
        channel = await connection.channel()
        queue = await channel.get_queue(DEAD_LETTER_QUEUE)

        async def dead_letter():
            async with queue.iterator(timeout=0.5) as messages:
                async for message in messages:
                    await message.ack()
                    return message.body
            return None
        try:
            body = await wait_until(dead_letter, within=10)
        except TimeoutError:
            body = None
    assert body == b"\x00\x01 not a message"
    assert allocator.stats.counters["dead_lettered"] == 1


async def test_request_whose_caller_gave_up_is_dropped_and_never_granted(raw, client):
    stale = AllocateRequest(request_key="k/late/", user="late", deadline=time.time() - 1)
    await raw.send(encode(stale))
    assert await raw.no_reply(within=1.0)
    inventory = await client.inventory(include_leases=True)
    assert inventory.leases == []
    assert inventory.models[0].free == 2


async def test_broker_drops_request_expired_in_the_queue(raw, allocator, client):
    # The broker drops it if it expires while queued; if the consumer already holds it, the
    # allocator's own deadline check drops it. Either way: no reply, no lease.
    body = encode(AllocateRequest(request_key="k/exp/", user="exp", deadline=time.time() - 0.5))
    await raw.send(body, expiration=0.001)
    assert await raw.no_reply(within=1.0)
    assert (await client.inventory(include_leases=True)).leases == []


async def test_heartbeat_sent_to_the_rpc_exchange_is_refused(raw):
    beat = {"v": 1, "kind": "heartbeat", "host": "gpu-x", "agent_id": "a", "seq": 1,
            "sent_at": time.time(), "interval_s": 2, "gpus": []}
    await raw.send(json.dumps(beat).encode())
    reply = await raw.reply()
    assert reply["error"]["code"] == "forbidden"


async def test_allocate_sent_to_the_nodes_exchange_is_forbidden(raw, client, allocator):
    """Every message that asks for a reply gets one: the wrong exchange is ``forbidden``."""
    await raw.send(allocate_body(), exchange="swarm-gpu.nodes", routing_key="heartbeat.gpu-a")
    reply = await raw.reply()
    assert reply["error"]["code"] == "forbidden"
    assert "swarm-gpu.rpc" in reply["error"]["message"]
    await raw.send(allocate_body(), exchange="swarm-gpu.nodes", routing_key="event.gpu-a",
                   reply=False)
    assert (await client.inventory(include_leases=True)).leases == []
    assert allocator.engine.counters["request_from_node_exchange"] == 2


async def test_a_message_the_engine_fails_on_is_refused_alone(allocator, client, nodes,
                                                              monkeypatch):
    """Fault injection in our own engine: the other requests of the same batch go through."""
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))

    async def known():
        return (await client.inventory()).nodes
    await wait_until(known)
    real_handle = allocator.engine.handle

    def failing_for_mallory(message, sender, now, changes):
        if getattr(message, "user", None) == "mallory":
            raise RuntimeError("injected failure")
        return real_handle(message, sender, now, changes)

    monkeypatch.setattr(allocator.engine, "handle", failing_for_mallory)
    results = await asyncio.gather(
        *(client.allocate(AllocateRequest(request_key=f"k/{user}/", user=user))
          for user in ("ann", "mallory", "bob")),
        return_exceptions=True)
    ann, mallory, bob = results
    assert getattr(mallory, "code", None) == ErrorCode.INTERNAL_ERROR
    assert isinstance(ann, Lease) and isinstance(bob, Lease), results
    assert ann.state == bob.state == LeaseState.GRANTED
    leases = (await client.inventory(include_leases=True)).leases
    assert sorted(lease.user for lease in leases) == ["ann", "bob"]


async def test_reply_to_that_is_not_a_direct_reply_to_address_is_refused(
        raw, amqp_vhost, allocator, client):
    """Otherwise any sender could make the allocator publish into a queue of its choosing
    (its own inbound queue included): refused unanswered, dead-lettered, counted."""
    async with await aio_pika.connect(amqp_vhost.url) as connection:
        channel = await connection.channel()
        await channel.declare_queue("victim", auto_delete=False)
        rpc = await channel.get_exchange("swarm-gpu.rpc", ensure=False)
        targets = ["victim", "swarm-gpu.allocator", "swarm-gpu.dead-letters", "amq.rabbitmq"]
        replies_before = allocator.stats.counters["replies"]
        for target in targets:
            await rpc.publish(aio_pika.Message(allocate_body(request_key=f"k/{target}/"),
                                               correlation_id=target, reply_to=target),
                              routing_key="request", timeout=10)
        await client.inventory()  # one queue, applied in order: the four were handled
        dead: list[bytes] = []

        async def all_dead_lettered():  # a batch's rejections follow its replies
            dead.extend(await drain_queue(channel, DEAD_LETTER_QUEUE))
            return len(dead) >= len(targets)
        await wait_until(all_dead_lettered)
        assert await drain_queue(channel, "victim") == []
    assert sorted(json.loads(body)["request_key"] for body in dead) == sorted(
        f"k/{target}/" for target in targets)
    assert allocator.stats.counters["reply_to_refused"] == len(targets)
    assert allocator.stats.counters["replies"] == replies_before + 1  # the inventory call's
    assert (await client.inventory(include_leases=True)).leases == []
    # A direct reply-to address that no channel owns is accepted (nobody can tell it from a
    # real one) and harms nothing: the reply goes nowhere, the allocator answers on.
    await raw.channel.default_exchange.publish(
        aio_pika.Message(allocate_body(request_key="k/forged/"), correlation_id="f",
                         reply_to="amq.rabbitmq.reply-to.g2dkABNyYWJiaXRAbm9ib2R5AAAAAAAA"),
        routing_key="swarm-gpu.allocator", timeout=10)
    lease = await client.allocate(AllocateRequest(request_key="k/bob/", user="bob"))
    assert lease.state is LeaseState.GRANTED


async def test_a_configured_reply_to_prefix_is_accepted(amqp_vhost, ledger_path):
    from tests.support.faults import running_allocator

    async with (running_allocator(amqp_vhost.url, ledger_path, reply_to_prefix="replies.")
                as allocator,
                await aio_pika.connect(amqp_vhost.url) as connection):
        channel = await connection.channel()
        for name in ("replies.hub1", "victim"):
            await channel.declare_queue(name, auto_delete=False)
        rpc = await channel.get_exchange("swarm-gpu.rpc", ensure=False)
        for target in ("replies.hub1", "victim"):
            await rpc.publish(aio_pika.Message(b'{"v": 1, "kind": "queue"}',
                                               correlation_id=target, reply_to=target),
                              routing_key="request", timeout=10)

        async def answered():
            return await drain_queue(channel, "replies.hub1")
        replies = await wait_until(answered)
        assert [json.loads(body)["kind"] for body in replies] == ["queue"]
        assert await drain_queue(channel, "victim") == []
        assert allocator.stats.counters["reply_to_refused"] == 1


async def test_dead_letter_queue_is_bounded_by_bytes(raw, amqp_vhost, allocator):
    """A flood of large unreadable messages keeps the dead-letter queue within
    DEAD_LETTER_MAX_BYTES: the oldest are dropped (drop-head)."""
    body = b"\x00" * (MAX_BODY_BYTES - 16)
    flood = DEAD_LETTER_MAX_BYTES // len(body) + 40
    for _ in range(flood):
        await raw.send(body, reply=False)
    await raw.send(b'{"v": 1, "kind": "queue"}')
    assert (await raw.reply())["kind"] == "queue"

    async def all_rejected():  # a batch's rejections follow its replies
        return allocator.stats.counters["dead_lettered"] == flood
    await wait_until(all_rejected)
    async with await aio_pika.connect(amqp_vhost.url) as connection:
        channel = await connection.channel()
        await settled_dead_letters(channel)
        kept = await drain_queue(channel, DEAD_LETTER_QUEUE)
    assert 0 < len(kept) < flood
    assert sum(len(b) for b in kept) <= DEAD_LETTER_MAX_BYTES


async def test_an_unbounded_dead_letter_queue_of_an_older_version_does_not_stop_the_start(
        amqp_vhost, ledger_path, caplog):
    """RabbitMQ refuses to redeclare a queue with other arguments; the allocator uses the
    existing dead-letter queue as it is, says so, and serves."""
    from tests.support.faults import running_allocator

    async with await aio_pika.connect(amqp_vhost.url) as connection:
        channel = await connection.channel()
        await channel.declare_queue(DEAD_LETTER_QUEUE, durable=True,
                                    arguments={"x-queue-type": "quorum"})
    async with (running_allocator(amqp_vhost.url, ledger_path) as allocator,
                RawRPC(amqp_vhost.url) as rpc):
        await rpc.send(b"not json", reply=False)
        await rpc.send(b'{"v": 1, "kind": "queue"}')
        assert (await rpc.reply())["kind"] == "queue"
        assert allocator.stats.counters["dead_lettered"] == 1
    assert "exists with other arguments" in caplog.text


async def test_a_request_that_expires_in_the_queue_is_dead_lettered_with_x_death(amqp_vhost):
    """What docs/protocol.md says the dead-letter queue holds: the broker moves a request
    whose AMQP expiration passed while it waited there, with an ``x-death`` header."""
    from allocator.service import declare_topology

    async with await aio_pika.connect(amqp_vhost.url) as connection:
        channel = await connection.channel()
        await declare_topology(connection, "swarm-gpu.allocator", channel=channel)  # unconsumed
        rpc = await channel.get_exchange("swarm-gpu.rpc", ensure=False)
        await rpc.publish(aio_pika.Message(allocate_body(), expiration=0.05),
                          routing_key="request", timeout=10)
        queue = await channel.get_queue(DEAD_LETTER_QUEUE)

        async def dead_letter():
            return await queue.get(no_ack=True, fail=False, timeout=5)
        message = await wait_until(dead_letter, within=20)
    assert json.loads(message.body)["request_key"] == "k/alice/"
    death = message.headers["x-death"][0]
    assert death["reason"] == "expired"
    assert death["queue"] == "swarm-gpu.allocator"
    assert death["exchange"] == "swarm-gpu.rpc"
