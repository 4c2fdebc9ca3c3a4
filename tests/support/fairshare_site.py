"""A site for fair-share runs end to end, and a lease bound to a running container."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from allocator.amqp.client import AllocatorClient
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, wait_until


class Site:
    """One host of two GTX 1070s with a real agent, and the per-lease use it reports."""

    def __init__(self, tmp_path: Path) -> None:
        self.host = f"fair-{uuid.uuid4().hex[:8]}"
        self.inventory = tmp_path / f"{self.host}.json"
        self.gpus = [make_gpu(self.host, i, GTX1070) for i in range(2)]
        self.use: dict[str, dict[str, Any]] = {}
        self.write()

    def write(self) -> None:
        write_inventory(self.inventory, {self.host: self.gpus}, self.use)

    def set_use(self, lease_id: str, pct: float) -> None:
        self.use[lease_id] = {"utilization_pct": pct, "memory_used_mib": 600}
        self.write()

    @contextlib.asynccontextmanager
    async def agent(self, amqp_url: str) -> AsyncIterator[NodeAgent]:
        agent = NodeAgent(AgentSettings(
            host=self.host, amqp_url=amqp_url, inventory="simulated",
            simulated_file=self.inventory, interval_s=0.5, publish_timeout_s=2.0, docker=True,
            command_users=["guest"], amqp_reconnect_s=0.2))
        await agent.start()
        try:
            yield agent
        finally:
            await agent.stop()


async def bound_lease(client: AllocatorClient, docker: Any, site: Site, user: str,
                      server: str, pct: float) -> Lease:
    """A lease of ``user`` on the site, its container running, its processes at ``pct``."""
    async def up() -> bool:
        return any(n.host == site.host and n.up for n in (await client.inventory()).nodes)
    await wait_until(up, within=30)
    lease = await client.allocate(AllocateRequest(request_key=f"e2e/{user}/{server}", user=user,
                                                  host=site.host))
    assert lease.state is LeaseState.GRANTED
    site.set_use(lease.lease_id, pct)
    await docker.run_labelled(lease.lease_id)

    async def bound() -> bool:
        return (await client.status(lease_id=lease.lease_id)).state is LeaseState.BOUND
    await wait_until(bound, within=30)
    return lease
