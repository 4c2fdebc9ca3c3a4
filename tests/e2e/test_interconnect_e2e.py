"""How a host's GPUs are joined, end to end: a real node agent (simulated inventory that
describes the links, its command queue on the real Docker engine's agent) and a real
allocator over the real broker. The allocator's hello asks for the interconnect, the agent's
next full report carries it, the allocator keeps it on the node; a changed one replaces it,
and one the agent has not been asked for never leaves it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from allocator.wire.interconnect import HostInterconnect
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import (
    make_gpu,
    preset_interconnect,
    read_inventory,
    simulated_uuid,
    write_inventory,
)
from tests.support.common import wait_until

pytestmark = pytest.mark.docker

H100 = "NVIDIA H100 80GB HBM3"


@contextlib.asynccontextmanager
async def agent_of(amqp_url: str, inventory: Path, host: str, docker_engine: str
                   ) -> AsyncIterator[NodeAgent]:
    """A real node agent for ``host``, taking the allocator's commands (as ``guest``)."""
    agent = NodeAgent(AgentSettings(
        host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, full_report_s=1.0, publish_timeout_s=2.0, docker=True,
        docker_url=docker_engine, command_users=["guest"], amqp_reconnect_s=0.2))
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


async def test_the_allocator_asks_for_the_links_and_keeps_them_on_the_node(
        allocator: Any, amqp_vhost: Any, tmp_path: Path, docker_engine: str) -> None:
    host = f"links-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, i, H100) for i in range(8)]},
                    topology={host: "hgx"})
    uuids = [simulated_uuid(host, i) for i in range(8)]

    def held() -> HostInterconnect | None:
        node = allocator.engine.cluster.nodes.get(host)
        return None if node is None else node.interconnect

    async with agent_of(amqp_vhost.url, inventory, host, docker_engine) as agent:
        async def taken() -> HostInterconnect | None:
            return held()
        interconnect = await wait_until(taken, within=20)
        assert interconnect == preset_interconnect("hgx", uuids)
        assert agent.reports_interconnect and agent.interconnect_sent == interconnect
        assert len([link for link in interconnect.links if link.nvlinks == 18]) == 28

        write_inventory(inventory, read_inventory(inventory),
                        topology={host: "pcie-two-socket"})

        async def replaced() -> HostInterconnect | None:
            now = held()
            return now if now is not None and now != interconnect else None
        assert await wait_until(replaced, within=20) == preset_interconnect(
            "pcie-two-socket", uuids)
        assert allocator.engine.counters["interconnect_mismatch"] == 0
