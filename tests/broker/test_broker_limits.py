"""The broker's bounds in ``compose/rabbitmq-definitions.json``: per-user connection and
channel limits for the hub and every agent, and a policy bounding the allocator's inbound
queue (``reject-publish``), proved on the real broker, with the hub's client and the agent's
publisher saying clearly what happened."""

from __future__ import annotations

import copy
import logging
import re
import time
from collections.abc import Iterator

import aio_pika
import aiormq.exceptions
import pytest

from allocator.amqp.client import AllocatorClient, AllocatorQueueFull
from allocator.wire.protocol import ErrorCode
from allocator.wire.topology import (
    ALLOCATOR_QUEUE,
    ALLOCATOR_QUEUE_POLICY,
    allocator_queue_policy,
    allocator_queue_spec,
)
from nodeagent.publisher import Publisher
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, Broker, loaded_broker, render_definitions
from tests.support.common import GTX1070, gpus, heartbeat

BOUND = 20
"""The queue's bound in these tests (the definitions' own is 100,000)."""


def test_rendered_definitions_carry_the_limits_and_the_queue_policy() -> None:
    rendered = render_definitions.render(TEMPLATE, passwords={}, agents=["n1", "n2"],
                                         vhost="v", user_prefix="p-")
    limits = {user["name"]: user["limits"] for user in rendered["users"]}
    for user in ("p-hub", "p-agent-n1", "p-agent-n2"):
        assert 0 < limits[user]["max-connections"] < limits[user]["max-channels"], user
    assert limits["p-agent-n1"] == limits["p-agent-n2"]
    (policy,) = [p for p in rendered["policies"] if p["name"] == ALLOCATOR_QUEUE_POLICY]
    assert policy["vhost"] == "v" and policy["apply-to"] == "queues"
    assert policy["definition"] == allocator_queue_policy()
    assert policy["definition"]["overflow"] == "reject-publish"
    matching = [q["name"] for q in rendered["queues"] if re.search(policy["pattern"], q["name"])]
    assert matching == [ALLOCATOR_QUEUE]
    # A policy, not a queue argument: an existing queue is redeclared unchanged.
    assert not set(allocator_queue_spec().arguments) & {"x-max-length", "x-overflow"}


@pytest.fixture
def bounded(rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    """The committed definitions with the queue's bound lowered to :data:`BOUND`."""
    template = copy.deepcopy(TEMPLATE)
    for policy in template["policies"]:
        if policy["name"] == ALLOCATOR_QUEUE_POLICY:
            policy["definition"]["max-length"] = BOUND
    with loaded_broker(rabbitmq, template, "bound") as loaded:
        yield loaded


async def fill(broker: Broker) -> int:
    """Publish as the hub until the broker refuses; how many it took."""
    connection = await aio_pika.connect(broker.url("hub"), timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange("swarm-gpu.rpc", ensure=False)
        for taken in range(BOUND * 3):
            try:
                await exchange.publish(aio_pika.Message(b"{}", user_id=broker.prefix + "hub"),
                                       routing_key="request", timeout=10)
            except aiormq.exceptions.DeliveryError:
                return taken
    raise AssertionError(f"the broker took {BOUND * 3} messages into a queue bound at {BOUND}")


async def test_a_full_queue_refuses_publishes_and_the_client_says_so(
        bounded: Broker, caplog: pytest.LogCaptureFixture) -> None:
    # No allocator consumes: the queue (declared by the definitions) only fills.
    taken = await fill(bounded)
    assert BOUND <= taken <= BOUND + 1  # RabbitMQ refuses once the count is over the bound

    async with AllocatorClient(bounded.url("hub"), timeout_s=10) as hub:
        began = time.monotonic()
        with pytest.raises(AllocatorQueueFull) as full:
            await hub.inventory()
    assert full.value.code is ErrorCode.UNAVAILABLE
    assert f"queue {ALLOCATOR_QUEUE} is full ({taken} messages wait" in str(full.value)
    assert time.monotonic() - began < 5, "told at once, not after the call's whole timeout"

    caplog.set_level(logging.INFO, logger="nodeagent.publisher")
    agent = Publisher(bounded.url("agent-gpu-a"), "gpu-a", timeout_s=5)
    await agent.start()
    try:
        assert agent.connected
        for _ in range(4):
            beat = heartbeat("gpu-a", gpus("gpu-a", GTX1070, 1))
            assert not await agent.publish_heartbeat(beat)
    finally:
        await agent.stop()
    assert agent.publishes_refused == agent.heartbeat_failures == 4
    refused_lines = [r for r in caplog.records
                     if r.name == "nodeagent.publisher" and "refused" in r.getMessage()]
    assert len(refused_lines) == 1, [r.getMessage() for r in refused_lines]
    assert "queue is full" in refused_lines[0].getMessage()


async def test_an_agent_user_is_held_to_its_connection_and_channel_limits(
        bounded: Broker) -> None:
    limits = {u["name"]: u["limits"] for u in TEMPLATE["users"]}["agent-gpu-a"]
    connections = []
    try:
        for _ in range(limits["max-connections"]):
            connections.append(await aio_pika.connect(bounded.url("agent-gpu-a"), timeout=10))
        with pytest.raises(Exception):  # noqa: B017 - the broker closes it during the handshake
            connections.append(await aio_pika.connect(bounded.url("agent-gpu-a"), timeout=10))
        first = connections[0]
        per_connection = limits["max-channels"] // limits["max-connections"]
        for connection in connections:
            for _ in range(per_connection):
                await connection.channel()
        with pytest.raises(aiormq.exceptions.ConnectionNotAllowed, match="max"):
            await first.channel()
    finally:
        for connection in connections:
            if not connection.is_closed:
                await connection.close()
