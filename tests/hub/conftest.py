"""Fixtures the hub tests share: the GPU page's hub and cluster, the Docker engine and its
Swarm host, hubs made to order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient
from tests.support.common import NodeSimulator, wait_until
from tests.support.gpu_page import (
    UPDATE_DOCS,
    USERS,
    Cluster,
)
from tests.support.hub_e2e import HubFactory, containers_gone, volumes_gone
from tests.support.hub_harness import Hub


@pytest.fixture
async def cluster(nodes: NodeSimulator, allocator: Any) -> AsyncIterator[Cluster]:
    cluster = Cluster(nodes)
    task = asyncio.create_task(cluster.beat_forever())
    async with AllocatorClient(allocator.settings.amqp_url) as rpc:
        async def both_up() -> bool:
            return sum(n.up for n in (await rpc.inventory()).nodes) == 2
        await wait_until(both_up, within=30)
    try:
        yield cluster
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def page_hub(tmp_path: Path, chp_path: Path, amqp_vhost: Any) -> AsyncIterator[Hub]:
    """A real hub with the GPU page (sampling every second). It spawns no server: the leases
    are asked of the allocator directly, under the keys the hub's spawner would use."""
    page = {"SWARM_GPU_PAGE_SAMPLE_INTERVAL_S": "1"}
    if UPDATE_DOCS:  # the README's picture: charts of three minutes, not three hours
        page["SWARM_GPU_PAGE_HISTORY_HOURS"] = "0.05"
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url=amqp_vhost.url,
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users=USERS, page=page, first_admin=True)
    try:
        await hub.start()
        yield hub
    finally:
        await hub.stop()


@pytest.fixture
async def docker(docker_engine: str) -> AsyncIterator[aiodocker.Docker]:
    async with aiodocker.Docker(url=docker_engine) as client:
        yield client


@pytest.fixture
async def swarm_host(docker: aiodocker.Docker) -> str:
    """The hostname of this engine's Swarm node (what ``node.hostname ==`` matches)."""
    info = await docker.system.info()
    node = await docker.nodes.inspect(node_id=info["Swarm"]["NodeID"])
    return str(node["Description"]["Hostname"])


@pytest.fixture
async def hub_factory(
    tmp_path: Path, chp_path: Path, amqp_vhost: Any, docker_engine: str, busybox_image: str,
    docker: aiodocker.Docker,
) -> AsyncIterator[HubFactory]:
    hubs: list[Hub] = []

    async def make(users: dict[str, list[str]] | None = None, **kwargs: Any) -> Hub:
        hub = Hub(
            tmp_path / f"hub{len(hubs)}", chp=chp_path,
            amqp_url=kwargs.pop("amqp_url", amqp_vhost.url), docker_host=docker_engine,
            image=busybox_image,
            users=users or {"alice": ["students"], "bob": ["students"], "carol": ["staff"]},
            **kwargs,
        )
        hubs.append(hub)
        await hub.start()
        return hub

    yield make
    for hub in hubs:
        await hub.stop()
        for service in await docker.services.list():
            if service["Spec"]["Name"].startswith(hub.prefix):
                with contextlib.suppress(aiodocker.DockerError):
                    await docker.services.delete(service["ID"])
        await containers_gone(docker, hub.prefix)
        await volumes_gone(docker, hub.prefix)
