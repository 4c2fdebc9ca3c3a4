"""GPU health from the node agent excludes a GPU from placement and re-admits it when it recovers.

A real agent reads a simulated inventory file and the test changes it as a failing GPU would
look through NVML (overheating, a fatal XID, falling off the bus); the real allocator must
stop placing on that GPU at once and place on it again when the agent judges it healthy.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.protocol import AllocateRequest, ErrorCode, Health, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, simulated_uuid, update_gpu, write_inventory
from tests.support.common import GTX1070, wait_until


@contextlib.asynccontextmanager
async def one_gpu_host(amqp_url: str, tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    host = f"health-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070)]})
    agent = NodeAgent(AgentSettings(
        host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
        interval_s=0.3, publish_timeout_s=2.0, docker=False, xid_quiet_s=1.0,
        overheat_c=90.0, overheat_hysteresis_c=10.0))
    await agent.start()
    try:
        yield host, inventory
    finally:
        await agent.stop()


async def gpu_health(client: AllocatorClient, uuid_: str, health: Health) -> bool:
    gpus = (await client.inventory()).gpus
    return any(g.uuid == uuid_ and g.health is health for g in gpus)


@pytest.mark.parametrize(
    ("fault", "recovery"),
    [
        ({"temperature_c": 97.0}, {"temperature_c": 70.0}),
        ({"xid": 79}, {}),  # fell off the bus: fatal, transient once it stays quiet
        ({"lost": True}, {"lost": False}),
    ],
    ids=["overheat", "fatal-xid", "lost"],
)
async def test_unhealthy_gpu_is_excluded_then_readmitted(allocator, client, amqp_vhost, tmp_path,
                                                         fault, recovery):
    async with one_gpu_host(amqp_vhost.url, tmp_path) as (host, inventory):
        gpu = simulated_uuid(host, 0)
        await wait_until(lambda: gpu_health(client, gpu, Health.HEALTHY), within=15)

        update_gpu(inventory, host, 0, **fault)
        await wait_until(lambda: gpu_health(client, gpu, Health.UNHEALTHY), within=15)
        with pytest.raises(AllocatorError) as refused:
            await client.allocate(AllocateRequest(request_key="h/ann/", user="ann", host=host))
        assert refused.value.code is ErrorCode.NO_CAPACITY

        if recovery:
            update_gpu(inventory, host, 0, **recovery)
        await wait_until(lambda: gpu_health(client, gpu, Health.HEALTHY), within=15)
        lease = await client.allocate(AllocateRequest(request_key="h/ann/", user="ann",
                                                      host=host))
        assert lease.state is LeaseState.GRANTED and lease.gpu_uuids == [gpu]
