"""Stop commands through broker restarts: the allocator sends, the agent's consumer comes back.

A private RabbitMQ node (fixture ``private_rabbitmq``) is stopped for real and started again,
then only its application is stopped and started, and then the agent's command queue is
deleted under its consumer (the broker cancels the consumer). Each time, a lease bound on a
simulated node is released by the hub, and the stop command the allocator sends must reach
the agent's :class:`~nodeagent.commands.CommandConsumer` within the recovery bound. The
consumer's stopper records the commands instead of calling Docker (the Docker side is tested
in ``tests/e2e/test_stop_on_release.py``).

Only without the replicated log: the fault is in the agent's command consumer, and a stop
command goes out after its batch is committed, whichever way; the allocator's side of a
broker restart with the log is in test_fault_broker_restart.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, ContainerAction, LeaseState, StopReason
from allocator.wire.topology import agent_queue_name
from nodeagent.commands import CommandConsumer
from nodeagent.containers import StopOutcome
from tests.support.common import GTX1070, NodeSimulator, gpus, wait_until
from tests.support.faults import report

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

HOST = "gpu-commands"
RECOVERY_BOUND_S = 20.0
"""The consumer (and the allocator) must work again within this of the broker coming back."""


class Recorder:
    """Stands in for Docker: remembers what it was asked to stop."""

    def __init__(self) -> None:
        self.stopped: list[tuple[str, str, float]] = []

    async def __call__(self, container_id: str, lease_id: str, grace_s: float) -> StopOutcome:
        self.stopped.append((container_id, lease_id, grace_s))
        return StopOutcome.STOPPED

    def containers(self) -> list[str]:
        return [container_id for container_id, _, _ in self.stopped]


async def release_a_bound_lease(url: str, client: AllocatorClient, user: str) -> str:
    """Allocate on HOST, bind it with a start event, release it as the hub; the container."""
    container = f"c-{user}"
    async with NodeSimulator(url) as nodes:
        await nodes.beat(HOST, gpus(HOST, GTX1070, 4))
        lease = await client.allocate(AllocateRequest(request_key=f"hub/{user}/", user=user,
                                                      host=HOST))
        await nodes.event(HOST, lease.lease_id, ContainerAction.START, container_id=container)

        async def bound() -> bool:
            status = await client.status(lease_id=lease.lease_id)
            return status.state is LeaseState.BOUND
        await wait_until(bound, within=RECOVERY_BOUND_S)
    released = await client.release(lease_id=lease.lease_id, reason="server stopped")
    assert released.state is LeaseState.RELEASING
    return container


async def answered(client: AllocatorClient) -> bool:
    try:
        await client.inventory()
    except Exception:
        return False
    return True


@pytest.mark.slow
async def test_stop_commands_survive_broker_restarts(private_rabbitmq, ledger_path: Path
                                                    ) -> None:
    broker = private_rabbitmq
    url = broker.url
    allocator = AllocatorService(AllocatorSettings(
        amqp_url=url + "?reconnect_interval=0.5", ledger_path=ledger_path,
        allow_any_node_user=True, admin_users=["guest"], tick_s=0.1, node_down_after_s=120,
        stop_grace_s=120, container_stop_grace_s=3.0))
    recorder = Recorder()
    consumer = CommandConsumer(url, HOST, recorder, command_users=["guest"], timeout_s=2.0,
                               reconnect_s=0.2, check_s=1.0)
    client = AllocatorClient(url, timeout_s=3.0, connect_timeout_s=2.0)
    figures: dict[str, Any] = {}
    try:
        await allocator.start()
        assert await consumer.start(wait_s=10)
        await client.connect()

        first = await release_a_bound_lease(url, client, "alice")
        await wait_until(lambda: _has(recorder, first), within=5)
        assert recorder.stopped == [(first, recorder.stopped[0][1], 3.0)]

        async def recovers(label: str) -> None:
            up_at = time.monotonic()
            await wait_until(lambda: consumer.wait_consuming(0.1), within=RECOVERY_BOUND_S)
            figures[f"{label}_consumer_back_after_s"] = round(time.monotonic() - up_at, 2)
            await wait_until(lambda: answered(client), within=RECOVERY_BOUND_S, interval=0.2)

        # 1. The broker stops for real (the VM exits) and starts again on its database.
        sessions = consumer.counters["sessions"]
        await asyncio.to_thread(broker.stop)
        await wait_until(lambda: _not_consuming(consumer), within=10)
        await asyncio.to_thread(broker.start)
        await recovers("restart")
        assert consumer.counters["sessions"] > sessions
        second = await release_a_bound_lease(url, client, "bob")
        await wait_until(lambda: _has(recorder, second), within=RECOVERY_BOUND_S)

        # 2. Only the RabbitMQ application stops and starts (the Erlang VM stays).
        await asyncio.to_thread(broker.stop_app)
        await wait_until(lambda: _not_consuming(consumer), within=10)
        await asyncio.to_thread(broker.start_app)
        await recovers("app_restart")
        third = await release_a_bound_lease(url, client, "carol")
        await wait_until(lambda: _has(recorder, third), within=RECOVERY_BOUND_S)

        # 3. The queue is deleted under the consumer: the broker cancels it, the consumer
        # notices and declares the queue again.
        sessions = consumer.counters["sessions"]
        deleted = await asyncio.to_thread(broker.ctl, "delete_queue", agent_queue_name(HOST))
        assert deleted.returncode == 0, deleted.stderr
        started = time.monotonic()
        await wait_until(lambda: _more_sessions(consumer, sessions), within=RECOVERY_BOUND_S)
        figures["queue_deleted_consumer_back_after_s"] = round(time.monotonic() - started, 2)
        fourth = await release_a_bound_lease(url, client, "dave")
        await wait_until(lambda: _has(recorder, fourth), within=RECOVERY_BOUND_S)
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await consumer.stop()
        await allocator.stop()

    assert recorder.containers() == [first, second, third, fourth], recorder.stopped
    assert consumer.counters["failed"] == consumer.counters["invalid"] == 0
    assert allocator.engine.counters["stop_asked_" + StopReason.RELEASED.value] == 4
    figures["commands_sent"] = allocator.stats.counters["commands_sent"]
    figures["command_failures"] = allocator.stats.counters["command_failures"]
    figures["consumer_sessions"] = consumer.counters["sessions"]
    report("agent_commands_broker_restart", **figures)


async def _has(recorder: Recorder, container: str) -> bool:
    return container in recorder.containers()


async def _not_consuming(consumer: CommandConsumer) -> bool:
    return not consumer.consuming


async def _more_sessions(consumer: CommandConsumer, than: int) -> bool:
    return consumer.counters["sessions"] > than
