"""One agent credential flooding its heartbeats fills only the node queue: hub requests are
still taken and answered, on the real broker with the shipped definitions.

The node queue's bound refuses publishes (``reject-publish``) once it is full: the flooding
agent's, and, while it stays full, every other agent's too (each is told "queue is full" and
sends its next heartbeat as usual). What is promised, and proved here: a hub's request is
never refused or held behind node messages; a host whose heartbeat was refused meanwhile is
seen again with its next heartbeat once the allocator has read the backlog.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.service import AllocatorService
from allocator.wire.protocol import Heartbeat
from allocator.wire.topology import (
    ALLOCATOR_NODES_QUEUE,
    ALLOCATOR_QUEUE,
    ALLOCATOR_QUEUE_POLICY,
    NODES_EXCHANGE,
    NODES_QUEUE_POLICY,
    allocator_queue_spec,
    nodes_queue_policy,
)
from nodeagent.publisher import Publisher
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, Broker, loaded_broker, render_definitions
from tests.support.common import GTX1070, gpus, heartbeat, started, wait_until

BOUND = 20
"""Both inbound queues' bound in these tests (the definitions' own are far larger)."""


def test_the_definitions_give_node_messages_a_bounded_queue_of_their_own() -> None:
    rendered = render_definitions.render(TEMPLATE, passwords={}, agents=["n1"], vhost="v",
                                         user_prefix="p-")
    bindings = {(b["source"], b["destination"]) for b in rendered["bindings"]}
    assert (NODES_EXCHANGE, ALLOCATOR_NODES_QUEUE) in bindings
    assert (NODES_EXCHANGE, ALLOCATOR_QUEUE) not in bindings
    (queue,) = [q for q in rendered["queues"] if q["name"] == ALLOCATOR_NODES_QUEUE]
    assert queue["arguments"] == allocator_queue_spec(ALLOCATOR_NODES_QUEUE).arguments
    (policy,) = [p for p in rendered["policies"] if p["name"] == NODES_QUEUE_POLICY]
    assert policy["definition"] == nodes_queue_policy()
    matching = [q["name"] for q in rendered["queues"] if re.search(policy["pattern"], q["name"])]
    assert matching == [ALLOCATOR_NODES_QUEUE]
    (allocator,) = [p for p in rendered["permissions"] if p["user"] == "p-allocator"]
    for field in ("configure", "write", "read"):
        assert re.fullmatch(allocator[field], ALLOCATOR_NODES_QUEUE), field


@pytest.fixture
def bounded(rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    """The committed definitions with both inbound queues bounded at :data:`BOUND`."""
    template = copy.deepcopy(TEMPLATE)
    for policy in template["policies"]:
        if policy["name"] in (ALLOCATOR_QUEUE_POLICY, NODES_QUEUE_POLICY):
            policy["definition"]["max-length"] = BOUND
    with loaded_broker(rabbitmq, template, "flood") as loaded:
        yield loaded


def beat(host: str, gpu_count: int) -> Heartbeat:
    """A heartbeat that stays valid (its expiration: two intervals) for the test's length."""
    return heartbeat(host, gpus(host, GTX1070, gpu_count)).model_copy(
        update={"interval_s": 600.0})


def ready(broker: Broker, queue: str) -> int:
    """Messages ready in ``queue``, as the management API counts them now."""
    path = (f"/api/queues/{urllib.parse.quote(broker.vhost, safe='')}/"
            f"{urllib.parse.quote(queue, safe='')}")
    return int(broker.rabbitmq.api("GET", path).get("messages_ready", 0))


async def test_a_heartbeat_flood_fills_only_the_node_queue(
        bounded: Broker, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nodeagent.publisher")
    flooder = Publisher(bounded.url("agent-gpu-a"), "gpu-a", timeout_s=5)
    other = Publisher(bounded.url("agent-gpu-b"), "gpu-b", timeout_s=5)
    await flooder.start()
    await other.start()
    try:
        # No allocator reads: the flood stays in the broker until the node queue refuses it.
        sent = 0
        while await flooder.publish_heartbeat(beat("gpu-a", 1)) \
                or flooder.publishes_refused == 0:
            sent += 1
            assert sent <= BOUND * 3, "the node queue took more than its bound"
        assert flooder.publishes_refused == 1
        # Another host's heartbeat is refused too while the queue is full, and its agent told.
        assert not await other.publish_heartbeat(beat("gpu-b", 2))
        assert other.publishes_refused == 1
        refused_lines = [r.getMessage() for r in caplog.records
                         if r.name == "nodeagent.publisher" and "refused" in r.getMessage()]
        assert len(refused_lines) == 2, refused_lines  # one per agent
        assert all("queue is full" in line for line in refused_lines), refused_lines

        settings = bounded.settings(tmp_path / "ledger.sqlite").model_copy(
            update={"start_fence_s": 0})
        async with AllocatorClient(bounded.url("hub"), timeout_s=60) as hub:
            # The hub's request is taken while the node queue is full (today's shared queue
            # refused it: "queue is full")...
            call = asyncio.create_task(hub.inventory())
            await wait_until(lambda: _true(ready(bounded, ALLOCATOR_QUEUE) == 1), within=30)
            assert ready(bounded, ALLOCATOR_NODES_QUEUE) >= BOUND
            # ...and answered once an allocator runs.
            async with started(AllocatorService(settings)):
                inventory = await call
                assert inventory.ok
                # The backlog read, the other host's next heartbeat gets through.

                async def seen_again() -> bool:
                    await other.publish_heartbeat(beat("gpu-b", 2))
                    nodes = (await hub.inventory()).nodes
                    return any(n.host == "gpu-b" and n.up and n.gpus == 2 for n in nodes)
                await wait_until(seen_again, within=60, interval=0.5)
    finally:
        await flooder.stop()
        await other.stop()


async def test_an_allocator_on_old_definitions_still_gets_node_messages(
        rabbitmq: services.RabbitMQ, tmp_path: Path) -> None:
    """Definitions rendered by the release before (no node queue, no permission on it): the
    allocator keeps node messages on the request queue, as that release did."""
    old = copy.deepcopy(TEMPLATE)
    old["queues"] = [q for q in old["queues"] if q["name"] != ALLOCATOR_NODES_QUEUE]
    old["policies"] = [p for p in old["policies"] if p["name"] != NODES_QUEUE_POLICY]
    for binding in old["bindings"]:
        if binding["destination"] == ALLOCATOR_NODES_QUEUE:
            binding["destination"] = ALLOCATOR_QUEUE
    text = json.dumps(old).replace("|allocator\\\\.nodes", "")
    old = json.loads(text)
    assert ALLOCATOR_NODES_QUEUE.replace(".", "\\.") not in json.dumps(old["permissions"])
    with loaded_broker(rabbitmq, old, "old") as broker:
        agent = Publisher(broker.url("agent-gpu-a"), "gpu-a", timeout_s=5)
        await agent.start()
        settings = broker.settings(tmp_path / "ledger.sqlite").model_copy(
            update={"start_fence_s": 0})
        try:
            async with (started(AllocatorService(settings)),
                        AllocatorClient(broker.url("hub"), timeout_s=30) as hub):

                async def seen() -> bool:
                    await agent.publish_heartbeat(beat("gpu-a", 2))
                    nodes = (await hub.inventory()).nodes
                    return any(n.host == "gpu-a" and n.up for n in nodes)
                await wait_until(seen, within=60, interval=0.5)
        finally:
            await agent.stop()


async def _true(value: bool) -> bool:
    return value
