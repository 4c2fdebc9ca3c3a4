"""A real hub spawning on the real Swarm: node agents, the hub factory's type, and what a
spawned service and its lease look like."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiodocker
from aiodocker.containers import DockerContainer
from aiodocker.volumes import DockerVolume

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.protocol import ErrorCode, Lease, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from tests.support.common import started
from tests.support.hub_harness import Hub


@contextlib.asynccontextmanager
async def node_agent(host: str, amqp_url: str, inventory: Path, *, docker: bool
                     ) -> AsyncIterator[NodeAgent]:
    """A real node agent reading a simulated inventory (this machine has no GPU). It takes
    stop commands from ``guest``, the allocator's broker user here (in a cluster: allocator)."""
    agent = NodeAgent(AgentSettings(
        host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
        interval_s=0.5, publish_timeout_s=2.0, docker=docker, command_users=["guest"]))
    async with started(agent):
        yield agent


HubFactory = Callable[..., Awaitable[Hub]]


async def containers_gone(docker: aiodocker.Docker, prefix: str, within: float = 60.0) -> None:
    """Wait until no container of the hub's services is left on the engine (removed with
    force when it outstays a service's removal). The next test's allocator starts on an empty
    ledger and would adopt a lease container that is still there, by its grant labels, as it
    does on a real node: the servers of one test must not become another test's leases."""
    deadline = time.monotonic() + within
    while True:
        left = [c for c in await docker.containers.list(all=True)
                if c["Labels"].get("com.docker.swarm.service.name", "").startswith(prefix)]
        if not left:
            return
        if time.monotonic() > deadline:
            for container in left:
                with contextlib.suppress(aiodocker.DockerError):
                    await container.delete(force=True)
            return
        await asyncio.sleep(0.3)


async def volumes_gone(docker: aiodocker.Docker, prefix: str) -> None:
    """Remove the hub's users' volumes (named after its prefix, hub_harness), once its
    containers are gone: the engine is shared, and a volume is never removed by Swarm."""
    listed = await docker.volumes.list()
    for volume in listed.get("Volumes") or []:
        if volume["Name"].startswith(prefix):
            with contextlib.suppress(aiodocker.DockerError):
                await DockerVolume(docker, volume["Name"]).delete()


async def service_container(docker: aiodocker.Docker, service: str
                            ) -> DockerContainer:
    """The running container of a service's task (the one the hub just saw answer)."""
    found = await docker.containers.list(filters={
        "label": [f"com.docker.swarm.service.name={service}"], "status": ["running"]})
    assert len(found) == 1, f"{service}: {len(found)} running containers"
    return found[0]


async def run_in(container: DockerContainer, *command: str
                 ) -> tuple[int, str]:
    """Run ``command`` in the container (``docker exec``); its exit code and output."""
    execution = await container.exec(list(command))
    output = b""
    async with execution.start(detach=False) as stream:
        while (message := await stream.read_out()) is not None:
            output += message.data
    inspected = await execution.inspect()
    return int(inspected["ExitCode"]), output.decode(errors="replace")


async def eventually(check: Callable[[], Awaitable[Any]], *, within: float = 30.0,
                     what: str = "condition") -> Any:
    timeout = within
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout} s (last: {last!r})")


async def lease_of(client: AllocatorClient, key: str) -> Lease | None:
    try:
        return await client.status(request_key=key)
    except AllocatorError as exc:
        if exc.code is ErrorCode.NOT_FOUND:
            return None
        raise


async def service_spec(docker: aiodocker.Docker, name: str) -> dict[str, Any]:
    service = await docker.services.inspect(name)
    return dict(service["Spec"])


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in spec["TaskTemplate"]["ContainerSpec"]["Env"])


async def in_state(client: AllocatorClient, lease_id: str, state: LeaseState) -> Lease | None:
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None
