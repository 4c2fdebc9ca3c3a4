"""End to end: the GPU page (``/services/gpu/``) as a real JupyterHub runs it, in Chromium.

A real hub starts the page from ``compose/jupyterhub_config.py`` as its managed service; the
page asks the real allocator over the real broker, where simulated nodes report GPUs and the
lease containers running on them (with their processes' GPU use). Users log in through the
hub's login form in headless Chromium and open the page as they would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hub_browser import Browser
from hub_harness import Hub
from support import GTX1070, RTX3090, NodeSimulator, gpus, wait_until

from allocator.client import AllocatorClient
from allocator.protocol import (
    AllocateRequest,
    ContainerInfo,
    GPUInfo,
    Lease,
    LeaseState,
    ProcessUse,
)

pytestmark = [pytest.mark.hub, pytest.mark.browser, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_BUDGET_S = 240
USERS = {"alice": ["students"], "bob": ["students"], "admin": ["staff"]}
"""``admin`` is the example configuration's hub admin."""


class Cluster:
    """Simulated nodes that keep reporting: GPUs with their utilization, and a running
    container (with its processes' GPU use) for each lease that has been started."""

    def __init__(self, nodes: NodeSimulator) -> None:
        self.nodes = nodes
        self.gpus: dict[str, list[GPUInfo]] = {
            "gpu-a": gpus("gpu-a", GTX1070, 2),
            "gpu-b": gpus("gpu-b", RTX3090, 2),
        }
        self.containers: dict[str, list[ContainerInfo]] = {"gpu-a": [], "gpu-b": []}

    def busy(self, host: str, index: int, utilization: float, memory_mib: int) -> None:
        """Set what one GPU reports."""
        gpu = self.gpus[host][index]
        self.gpus[host][index] = gpu.model_copy(
            update={"utilization_pct": utilization, "memory_used_mib": memory_mib})

    def run(self, lease: Lease) -> None:
        """A container of ``lease`` runs on its host, its processes using its GPUs as the
        GPUs report."""
        assert lease.host is not None
        by_uuid = {gpu.uuid: gpu for gpu in self.gpus[lease.host]}
        self.containers[lease.host].append(ContainerInfo(
            container_id=f"c-{lease.lease_id[:12]}", lease_id=lease.lease_id,
            started_at=time.time(),
            gpu_use=[ProcessUse(gpu_uuid=uuid, memory_used_mib=by_uuid[uuid].memory_used_mib,
                                utilization_pct=by_uuid[uuid].utilization_pct)
                     for uuid in lease.gpu_uuids]))

    async def beat_forever(self) -> None:
        while True:
            for host, gpu_list in self.gpus.items():
                await self.nodes.beat(host, gpu_list, self.containers[host])
            await asyncio.sleep(0.5)


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
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url=amqp_vhost.url,
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users=USERS, page={"SWARM_GPU_PAGE_SAMPLE_INTERVAL_S": "1"})
    await hub.start()
    try:
        yield hub
    finally:
        await hub.stop()


async def lease_for(client: AllocatorClient, hub: Hub, user: str, model: str) -> Lease:
    lease = await client.allocate(AllocateRequest(
        request_key=hub.request_key(user), user=user, groups=USERS[user], model=model))
    assert lease.state is LeaseState.GRANTED, lease
    return lease


async def page_answers(hub: Hub) -> str:
    """Wait until the hub routes the page to a running service; the URL an anonymous
    visitor ends up at."""
    async with aiohttp.ClientSession() as session:
        async def routed() -> str | None:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(hub.page_url) as response:
                    await response.read()
                    if response.status == 200:
                        return str(response.url)
            return None
        return await wait_until(routed, within=60, interval=0.5)


def open_page(browser: Browser, hub: Hub, user: str, *, until: str) -> str:
    """Log in as ``user`` in a fresh tab and open the page until ``until`` (a script) is true;
    returns the tab's session."""
    page = browser.page()
    browser.navigate(page, f"{hub.url}/hub/login")
    browser.submit(page, f"""
        document.querySelector('#username_input').value = '{user}';
        document.querySelector('#password_input').value = 'x';
        document.querySelector('form').submit();
    """)
    deadline = time.monotonic() + 60
    while True:
        browser.navigate(page, hub.page_url)
        if browser.evaluate(page, until):
            return page
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {until!r} to {user}:\n"
                                 + str(browser.evaluate(page, "document.body.innerText")))
        time.sleep(1.0)


SEEN = """({
    url: location.href,
    leases: [...document.querySelectorAll('.sg-lease')].map(e => e.dataset.lease),
    text: document.getElementById('sg-page').innerText,
    lines: [...document.querySelectorAll('.sg-lease svg polyline.sg-util')].length,
    cluster: [...document.querySelectorAll('#sg-cluster tr.sg-gpu')].map(
        r => [...r.cells].map(c => c.innerText)),
})"""


async def test_users_see_their_own_gpus_and_admins_every_gpu(
    cluster: Cluster, client: AllocatorClient, page_hub: Hub, chromium_path: Path,
    tmp_path: Path,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        alice = await lease_for(client, page_hub, "alice", "1070")
        bob = await lease_for(client, page_hub, "bob", "3090")
        cluster.busy("gpu-a", alice.gpu_indices[0], 73.0, 3072)
        cluster.busy("gpu-b", bob.gpu_indices[0], 12.0, 1024)
        cluster.run(alice)
        cluster.run(bob)

        # Nobody logged in: the hub's login, not the page.
        landed = await page_answers(page_hub)
        assert "/hub/login" in landed, landed

        shot = tmp_path / "gpu-page.png"

        def drive() -> tuple[dict[str, Any], dict[str, Any]]:
            # one browser (its own cookies) per user, as two people would have
            with Browser(chromium_path, tmp_path / "chromium-alice") as browser:
                tab = open_page(browser, page_hub, "alice",
                                until="document.querySelectorAll("
                                      "'.sg-lease svg polyline.sg-util').length > 0")
                as_alice = browser.evaluate(tab, SEEN)
            with Browser(chromium_path, tmp_path / "chromium-admin", width=1100) as browser:
                tab = open_page(browser, page_hub, "admin",
                                until="!!document.getElementById('sg-cluster')")
                as_admin = browser.evaluate(tab, SEEN)
                browser.screenshot(tab, shot, full_page=True)
            return as_alice, as_admin

        as_alice, as_admin = await asyncio.to_thread(drive)

        # alice: her own lease, its host, model and utilization now, a chart of samples.
        assert as_alice["url"] == page_hub.page_url
        assert as_alice["leases"] == [alice.lease_id]
        assert "gpu-a" in as_alice["text"] and GTX1070 in as_alice["text"]
        assert "73 %" in as_alice["text"] and "3 GiB of 8 GiB" in as_alice["text"]
        assert as_alice["lines"] == 1
        assert bob.lease_id not in as_alice["text"] and "bob" not in as_alice["text"]
        assert as_alice["cluster"] == [], "only admins see every GPU"

        # admin: holds nothing, sees all four GPUs and who holds them.
        assert as_admin["leases"] == []
        rows = {(row[0], row[1]): row for row in as_admin["cluster"]}
        assert set(rows) == {("gpu-a", "0"), ("gpu-a", "1"), ("gpu-b", "0"), ("gpu-b", "1")}
        holders = sorted(row[6].split(" ")[0] for row in rows.values() if row[3] == "held")
        assert holders == ["alice", "bob"]
        assert sum(row[3] == "free" for row in rows.values()) == 2

        assert shot.stat().st_size > 10_000
        if os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1":
            shutil.copyfile(shot, REPO_ROOT / "docs" / "gpu-page.png")
