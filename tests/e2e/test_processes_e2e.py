"""Processes on a GPU through a real allocator and the real broker, with the shipped
definitions: the allocator's hello reaches the agent's command queue (once per agent), and a
GPU a stray container uses is shown ``outside_use`` in the inventory and the GPU-state metric
and never granted; a lease's measured usage that a heartbeat carries (as a 0.3.0 agent sends
it) is folded onto the lease, written to the ledger file and counted by ``gpu-ledger usage``.
Heartbeats are published as the agent's broker user; the agent itself, with its simulated
processes and real containers, is tested elsewhere."""

from __future__ import annotations

import contextlib
import io
import sqlite3
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
from rich.console import Console

from allocator.admin.ledger_cli import render_status
from allocator.admin.status import live_status
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
    ContainerInfo,
    GPUProcess,
    GPUView,
    LeaseState,
    LeaseUsage,
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
from tests.support.ledger_cli import gpu_ledger

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
            render_status(live_status(await hub.inventory(include_leases=True),
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


# ------------------------------------------------------------------ measured usage


def stored_energy(path: Path, lease_id: str) -> float | None:
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        row = conn.execute("SELECT energy_j FROM leases WHERE lease_id = ?",
                           (lease_id,)).fetchone()
    return None if row is None else row[0]


async def test_usage_a_heartbeat_carries_reaches_the_ledger_and_the_showback(
        broker: Broker, running: AllocatorService, ledger_path: Path) -> None:
    agent_user = broker.prefix + "agent-gpu-a"
    listed = gpus(HOST, GTX1070, 2)

    async def beat(containers: list[ContainerInfo]) -> None:
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key(HOST),
                      encode(heartbeat(HOST, listed, containers, agent_id="agent-1")),
                      user_id=agent_user)

    await beat([])
    async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub:
        lease = await hub.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                   wait_s=30))
        if lease.state is not LeaseState.GRANTED:  # the node's report may still be on its way
            async def granted() -> bool:
                return (await hub.status(lease_id=lease.lease_id)).state is LeaseState.GRANTED
            await wait_until(granted)
        # 2 kWh and one GPU-hour of SM time, since the agent began measuring.
        measured = LeaseUsage(since=time.time() - 7200, energy_j=7_200_000.0, sm_s=3600.0,
                              memory_s=600.0, peak_memory_mib=5000)
        await beat([ContainerInfo(container_id="c-alice", lease_id=lease.lease_id,
                                  started_at=time.time() - 7200, usage=measured)])

        async def bound() -> bool:
            return (await hub.status(lease_id=lease.lease_id)).state is LeaseState.BOUND
        await wait_until(bound)

        async def written() -> float | None:
            return stored_energy(ledger_path, lease.lease_id)
        assert await wait_until(written, within=20) == 7_200_000.0
    run = await gpu_ledger("usage", "--ledger", ledger_path, "--json")
    assert run.rc == 0, run.err
    [row] = run.json()["rows"]
    assert (row["user"], row["model"], row["kwh"], row["used_gpu_hours"],
            row["peak_memory_mib"]) == ("alice", GTX1070, 2.0, 1.0, 5000)
