"""MIG end to end through the hub: a real JupyterHub spawns a notebook on MIG instances of this
engine's Swarm node, the real agent binds it, and an admin re-partitions under it.

The agent reads a simulated inventory in which this node has an A100 in MIG mode (mixed
profiles) and a whole A100; its Docker watcher sees the real lease container.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.wire.protocol import Health, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.mig import REMOVED_REASON
from nodeagent.simulated import (
    make_gpu,
    make_mig_gpu,
    make_mig_instances,
    read_inventory,
    simulated_uuid,
    write_inventory,
)
from tests.support.common import A100_40GB as A100
from tests.support.common import MIG_1G, wait_until
from tests.support.hub_e2e import (
    HubFactory,
    env_of,
    eventually,
    in_state,
    lease_of,
    node_agent,
    service_spec,
)

pytestmark = [pytest.mark.hub, pytest.mark.docker, pytest.mark.slow]

TEST_BUDGET_S = 150


@pytest.fixture
async def mig_node(amqp_vhost: Any, swarm_host: str, tmp_path: Path, docker_engine: str,
                   allocator: Any) -> AsyncIterator[tuple[NodeAgent, Path]]:
    inventory = tmp_path / "mig.json"
    write_inventory(inventory, {swarm_host: [
        make_mig_gpu(swarm_host, 0, A100, ["3g.20gb", "1g.5gb", "1g.5gb"]),
        make_gpu(swarm_host, 1, A100),
    ]})
    async with node_agent(swarm_host, amqp_vhost.url, inventory, docker=True) as agent:
        async with AllocatorClient(amqp_vhost.url) as rpc:
            async def reported() -> bool:
                return len((await rpc.inventory()).gpus) == 5
            await wait_until(reported, within=20)
        yield agent, inventory


async def test_notebook_gets_the_instance_uuids_and_keeps_them_through_a_repartition(
    mig_node: tuple[NodeAgent, Path], client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str,
) -> None:
    agent, inventory = mig_node
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory()
        await hub.start_server("carol", {"mode": "exclusive", "model": MIG_1G, "count": 2})
        lease = await lease_of(client, hub.request_key("carol"))
        assert lease is not None and lease.model == MIG_1G and lease.host == swarm_host
        instances = read_inventory(inventory)[swarm_host][0]["mig_instances"]
        small = sorted(i["uuid"] for i in instances if i["profile"] == "1g.5gb")
        assert sorted(lease.gpu_uuids) == small
        env = env_of(await service_spec(docker, hub.service_name("carol")))
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(lease.gpu_uuids)
        assert all(u.startswith("MIG-") for u in env["NVIDIA_VISIBLE_DEVICES"].split(","))
        await eventually(lambda: in_state(client, lease.lease_id, LeaseState.BOUND),
                         what="bound lease")

        # The admin destroys every instance and creates one 7g.40gb while carol's runs.
        layout = read_inventory(inventory)
        layout[swarm_host][0]["mig_instances"] = make_mig_instances(
            swarm_host, 0, ["7g.40gb"], first=10)
        write_inventory(inventory, layout)
        new_uuid = layout[swarm_host][0]["mig_instances"][0]["uuid"]

        async def new_layout_seen() -> bool:
            return any(g.uuid == new_uuid for g in (await client.inventory()).gpus)
        await eventually(new_layout_seen, what="the new instance")

        # The container's grant labels name the removed instances: the agent still reports
        # them, unhealthy, so they stay held and nothing new is placed on them.
        async def removed_but_reported() -> bool:
            gpus = {g.uuid: g for g in (await client.inventory()).gpus}
            return all(u in gpus and gpus[u].health is Health.UNHEALTHY
                       and REMOVED_REASON in gpus[u].health_reasons for u in small)
        await eventually(removed_but_reported, what="held instances still reported")
        await asyncio.sleep(1.5)  # a few more heartbeats: the lease must stay as it is
        held = await client.status(lease_id=lease.lease_id)
        assert held.state is LeaseState.BOUND and sorted(held.gpu_uuids) == small
        view = await client.inventory(include_leases=True)
        assert simulated_uuid(swarm_host, 0) not in {
            u for other in view.leases or [] for u in other.gpu_uuids}

        # Stopping the notebook frees the lease; the removed instances go with it.
        await hub.stop_server("carol")
        await eventually(lambda: in_state(client, lease.lease_id, LeaseState.RELEASED),
                         what="released")

        async def removed_gone() -> bool:
            return not {g.uuid for g in (await client.inventory()).gpus} & set(small)
        await eventually(removed_gone, what="the removed instances no longer reported")
        assert agent.mig_layout.retained == frozenset()
