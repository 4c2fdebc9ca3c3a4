"""A real container's death frees its GPU: real allocator, real node agent, real Swarm engine.

The agent reads a simulated inventory (this machine has no GPU) and watches the real engine;
the services are real Swarm services carrying the lease label, as the hub plugin creates them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState, ReleaseReason
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, docker_cli, wait_until
from tests.support.lease_probes import container_of, granted_on, state_of

pytestmark = pytest.mark.docker


@contextlib.asynccontextmanager
async def node_agent(amqp_url: str, tmp_path: Path, **overrides: Any
                     ) -> AsyncIterator[str]:
    """A real node agent for a simulated host with one GTX 1070; yields the host name."""
    host = f"e2e-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / f"{host}.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070)]})
    settings = AgentSettings(host=host, amqp_url=amqp_url, inventory="simulated",
                             simulated_file=inventory, interval_s=0.5, publish_timeout_s=2.0,
                             docker=True, **overrides)
    agent = NodeAgent(settings)
    await agent.start()
    try:
        yield host
    finally:
        await agent.stop()


@contextlib.asynccontextmanager
async def lease_service(lease: Lease, image: str) -> AsyncIterator[str]:
    """A Swarm service holding the lease, as the spawner makes it; yields its name."""
    name = f"e2e-{lease.lease_id[:12]}"
    await docker_cli(
        "service", "create", "--detach", "--name", name, "--network", "host",
        "--no-resolve-image", "--restart-condition", "none", "--stop-grace-period", "1s",
        "--container-label", f"{LEASE_LABEL}={lease.lease_id}",
        "--env", f"NVIDIA_VISIBLE_DEVICES={','.join(lease.gpu_uuids)}",
        image, "sleep", "300")
    try:
        yield name
    finally:
        with contextlib.suppress(AssertionError):
            await docker_cli("service", "rm", name)


async def test_killed_container_frees_its_gpu_at_once(allocator, client, amqp_vhost, tmp_path,
                                                      busybox_image):
    async with node_agent(amqp_vhost.url, tmp_path) as host:
        lease = await granted_on(client, host, "alice")
        async with lease_service(lease, busybox_image):
            container = await container_of(lease)
            bound = await wait_until(lambda: state_of(client, lease.lease_id, LeaseState.BOUND),
                                     within=15)
            assert bound.container_id == container
            killed_at = time.monotonic()
            await docker_cli("kill", container)
            released = await wait_until(
                lambda: state_of(client, lease.lease_id, LeaseState.RELEASED), within=10)
            took = time.monotonic() - killed_at
            assert released.release_reason is ReleaseReason.CONTAINER_EXITED
            assert took < 5, f"released {took:.2f} s after the kill"
            # The next user gets that very GPU.
            nxt = await client.allocate(AllocateRequest(request_key="e2e/bob/", user="bob",
                                                        host=host))
            assert nxt.state is LeaseState.GRANTED and nxt.gpu_uuids == lease.gpu_uuids


async def test_hub_stop_releases_when_the_service_is_gone(allocator, client, amqp_vhost,
                                                          tmp_path, busybox_image):
    """Without stop commands (the agent's stop_commands off), the GPU waits for Swarm: the
    lease stays releasing while the container runs. tests/e2e/test_stop_on_release.py has the
    agent stop it at once."""
    async with node_agent(amqp_vhost.url, tmp_path, stop_commands=False) as host:
        lease = await granted_on(client, host, "carol")
        async with lease_service(lease, busybox_image) as service:
            await wait_until(lambda: state_of(client, lease.lease_id, LeaseState.BOUND),
                             within=15)
            stopping = await client.release(lease_id=lease.lease_id, reason="server stopped")
            assert stopping.state is LeaseState.RELEASING, "still running: not free yet"
            await asyncio.sleep(1.5)
            still = await client.status(lease_id=lease.lease_id)
            assert still.state is LeaseState.RELEASING, "the container still runs"
            await docker_cli("service", "rm", service)
            released = await wait_until(
                lambda: state_of(client, lease.lease_id, LeaseState.RELEASED), within=20)
            assert released.release_reason is ReleaseReason.CONTAINER_EXITED


async def test_missed_events_are_caught_by_the_heartbeat(allocator, client, amqp_vhost,
                                                         tmp_path, busybox_image):
    async with node_agent(amqp_vhost.url, tmp_path, docker_events=False) as host:
        lease = await granted_on(client, host, "dave")
        async with lease_service(lease, busybox_image):
            container = await container_of(lease)
            await wait_until(lambda: state_of(client, lease.lease_id, LeaseState.BOUND),
                             within=15)
            await docker_cli("kill", container)
            released = await wait_until(
                lambda: state_of(client, lease.lease_id, LeaseState.RELEASED), within=15)
            assert released.release_reason is ReleaseReason.CONTAINER_GONE
