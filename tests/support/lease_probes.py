"""What a lease is now, read from the allocator, and its container on the Docker engine."""

from __future__ import annotations

from allocator.amqp.client import AllocatorClient
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState
from tests.support.common import GTX1070, docker_cli, wait_until


async def state_of(client: AllocatorClient, lease_id: str, state: LeaseState) -> Lease | None:
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None


async def granted_on(client: AllocatorClient, host: str, user: str) -> Lease:
    async def known() -> bool:
        return any(n.host == host and n.up for n in (await client.inventory()).nodes)
    await wait_until(known, within=15)
    lease = await client.allocate(AllocateRequest(request_key=f"e2e/{user}/", user=user,
                                                  host=host, model=GTX1070))
    assert lease.state is LeaseState.GRANTED and lease.host == host
    return lease


async def container_of(lease: Lease) -> str:
    async def running() -> str:
        return await docker_cli("ps", "-q", "--no-trunc", "--filter",
                                f"label={LEASE_LABEL}={lease.lease_id}")
    return await wait_until(running, within=30)
