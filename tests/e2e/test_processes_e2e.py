"""Processes on a GPU through a real allocator and the real broker, with the shipped
definitions: the allocator's hello reaches the agent's command queue (once per agent), and a
GPU a stray container uses is shown ``outside_use`` in the inventory and the GPU-state metric
and never granted. Heartbeats are published as the agent's broker user; the agent itself, with
its simulated processes and real containers, is tested elsewhere."""

from __future__ import annotations

import io
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
from rich.console import Console

from allocator.admin import reports
from allocator.admin.ledger_cli import render_status
from allocator.amqp.client import AllocatorClient
from allocator.metrics import exporter as allocator_metrics
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AGENT_COMMAND_ADAPTER,
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    AllocateRequest,
    AllocatorHello,
    GPUProcess,
    GPUView,
    LeaseState,
    ProcessState,
    encode,
)
from allocator.wire.topology import (
    AGENTS_EXCHANGE,
    NODES_EXCHANGE,
    agent_queue_spec,
    command_routing_key,
    heartbeat_routing_key,
)
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, Broker, loaded_broker, publish
from tests.support.common import GTX1070, gpus, heartbeat, wait_until

HOST = "gpu-a"


@pytest.fixture
def broker(rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    """The committed definitions, under a vhost and user names of this test's own."""
    with loaded_broker(rabbitmq, TEMPLATE, "processes") as loaded:
        yield loaded


@pytest.fixture
async def running(broker: Broker, ledger_path: Path) -> AsyncIterator[AllocatorService]:
    """A real allocator consuming as the ``allocator`` user."""
    service = AllocatorService(broker.settings(ledger_path))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def report(*, stray: bool, agent_id: str = "agent-1") -> bytes:
    """A heartbeat of two GPUs; with ``stray``, a container without a lease uses GPU 1."""
    listed = gpus(HOST, GTX1070, 2)
    listed[0] = listed[0].model_copy(update={"processes": []})
    listed[1] = listed[1].model_copy(update={"processes": [GPUProcess(
        pid=4242, memory_used_mib=900, name="python", container_id="f00dcafe",
        container_name="stray", image="lab/miner:1")] if stray else []})
    return encode(heartbeat(HOST, listed, agent_id=agent_id))


async def test_the_hello_reaches_the_agent_and_outside_use_is_shown(
        broker: Broker, running: AllocatorService) -> None:
    agent_user = broker.prefix + "agent-gpu-a"
    spec = agent_queue_spec(HOST)
    connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(spec.name, durable=spec.durable,
                                            arguments=spec.arguments)
        await queue.bind(AGENTS_EXCHANGE, command_routing_key(HOST))
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key(HOST),
                      report(stray=True), user_id=agent_user)

        async def delivered() -> aio_pika.abc.AbstractIncomingMessage | None:
            return await queue.get(fail=False, no_ack=True)
        message = await wait_until(delivered)
        assert message.user_id == broker.prefix + "allocator"
        assert AGENT_COMMAND_ADAPTER.validate_json(message.body) == AllocatorHello(
            host=HOST, reads=[GPU_PROCESSES, INTERCONNECT, LEASE_USAGE])

        async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub:
            async def stray_gpu() -> GPUView | None:
                views = (await hub.inventory()).gpus
                return next((g for g in views if g.index == 1 and g.process_state), None)
            view = await wait_until(stray_gpu)
            assert view.process_state is ProcessState.OUTSIDE_USE
            assert view.processes is not None
            assert [(p.pid, p.container_name, p.image) for p in view.processes] == [
                (4242, "stray", "lab/miner:1")]
            # gpu-ledger status, as it prints the live allocator's answer.
            out = io.StringIO()
            render_status(reports.live_status(await hub.inventory(include_leases=True),
                                              await hub.queue()),
                          Console(file=out, width=200, soft_wrap=False))
            assert "pid 4242 in container stray (lab/miner:1)" in out.getvalue()
            snap = allocator_metrics.read_scrape(running, time.time())
            assert snap.gpus[GTX1070, "outside_use"] == 1 and snap.gpus[GTX1070, "free"] == 1
            # Two GPUs asked: the one in outside use is not granted, so it waits.
            both = await hub.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                      count=2, wait_s=60))
            assert both.state is LeaseState.QUEUED
            # The same agent reports again, the stray gone: the request gets both GPUs, and
            # the agent was told only once.
            await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE,
                          heartbeat_routing_key(HOST), report(stray=False),
                          user_id=agent_user)

            async def granted() -> bool:
                lease = await hub.status(lease_id=both.lease_id)
                return lease.state is LeaseState.GRANTED
            await wait_until(granted)
            # A batch's commands go out after its commit and before its replies: a second
            # hello, decided with the report that freed the GPU, would be counted by now.
            assert running.stats.counters["hellos_sent"] == 1
