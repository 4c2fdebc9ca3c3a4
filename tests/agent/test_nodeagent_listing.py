"""The node agent's listing mode (``docker_events=False``): no event stream, containers re-listed
before every heartbeat. Real broker, real Docker engine, simulated GPUs."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aiodocker
import pytest

from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import NODE_MESSAGE_ADAPTER, ContainerEvent, Heartbeat, HeartbeatDelta
from allocator.wire.topology import NODES_EXCHANGE
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory


@pytest.mark.docker
async def test_listing_mode_reports_containers_by_heartbeat_only(
        amqp_vhost: Any, docker_engine: str, busybox_image: str, tmp_path: Path) -> None:
    host = f"test-node-{uuid.uuid4().hex[:8]}"
    lease_id = f"lease-{uuid.uuid4().hex[:10]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070")]})
    # Deltas come too; the container's coming and going makes full heartbeats.
    received: list[Heartbeat | HeartbeatDelta | ContainerEvent] = []

    async def on_message(incoming: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with incoming.process():
            received.append(NODE_MESSAGE_ADAPTER.validate_json(incoming.body))

    async def heartbeat_where(predicate: Any, after: int) -> Heartbeat:
        async with asyncio.timeout(10):
            while True:
                for message in received[after:]:
                    if isinstance(message, Heartbeat) and message.host == host \
                            and predicate(message):
                        return message
                await asyncio.sleep(0.05)

    connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
    docker = aiodocker.Docker(url=docker_engine)
    container_id = None
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                                  durable=True)
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")
        await queue.consume(on_message)
        settings = AgentSettings(
            host=host, amqp_url=amqp_vhost.url, inventory="simulated", simulated_file=inventory,
            interval_s=0.25, publish_timeout_s=1.0, docker=True, docker_url=docker_engine,
            docker_events=False, xid_poll_s=0.2)
        agent = NodeAgent(settings)
        await agent.start()
        try:
            container = await docker.containers.run(
                config={"Image": busybox_image, "Cmd": ["sleep", "300"],
                        "Labels": {LEASE_LABEL: lease_id}, "HostConfig": {"NetworkMode": "host"}},
                name=f"nodeagent-test-{lease_id}")
            container_id = container.id
            listed = await heartbeat_where(
                lambda b: any(c.lease_id == lease_id for c in b.containers), 0)
            assert listed.containers_complete
            mark = len(received)
            await container.kill()
            gone = await heartbeat_where(
                lambda b: all(c.lease_id != lease_id for c in b.containers), mark)
            assert gone.containers_complete
            assert not any(isinstance(m, ContainerEvent) for m in received)
            assert agent.events_forwarded == 0
        finally:
            await agent.stop()
    finally:
        if container_id is not None:
            with contextlib.suppress(aiodocker.DockerError):
                await docker.containers.container(container_id).delete(force=True)
        await docker.close()
        await connection.close()
