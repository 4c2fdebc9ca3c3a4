"""End to end: the GPU page (``/services/gpu/``) as a real JupyterHub runs it, in Chromium.

A real hub starts the page from ``compose/jupyterhub_config.py`` as its managed service; the
page asks the real allocator over the real broker, where simulated nodes report GPUs and the
lease containers running on them (with their processes' GPU use). Users log in through the
hub's login form in headless Chromium and open the page as they would.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
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
from hubplugin.page.history import UsageHistory
from hubplugin.page.usage import UsagePoint

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
async def allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    """The real allocator, with guarantees: each user is guaranteed one GPU and may borrow
    one more; a reclaim warning stays pending for ten minutes."""
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    service = AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=0,
        aliases={"1070": GTX1070, "3090": RTX3090},
        default_user_quota=1, default_user_borrow_limit=2, reclaim_grace_s=600))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


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


async def lease_for(client: AllocatorClient, hub: Hub, user: str, model: str,
                    server: str = "") -> Lease:
    lease = await client.allocate(AllocateRequest(
        request_key=hub.request_key(user, server), user=user, groups=USERS[user], model=model))
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


async def seed_history(hub: Hub, leases: list[tuple[Lease, int]]) -> None:
    """Three hours of plausible samples per lease, written into the page's own history file
    (for the README's picture only: the assertions never see them)."""
    history = UsageHistory(Path(hub.env["SWARM_GPU_PAGE_HISTORY_PATH"]), keep_s=4 * 3600)
    await history.open()
    try:
        now = time.time()
        rows = []
        for n, (lease, memory_mib) in enumerate(leases):
            total = 8192 if lease.model == GTX1070 else 24576
            for i in range(360):
                at = now - 3 * 3600 + i * 30
                busy = 0.0 if n == 2 and i > 150 else \
                    max(0.0, 60 + 30 * math.sin(i / (9 + 4 * n)) + 8 * math.sin(i / 2.3))
                memory = memory_mib if i > 40 else memory_mib * i // 40
                rows.append((lease.lease_id, lease.user,
                             UsagePoint(at, min(busy, 100.0), memory, total)))
        await history.record(rows)
    finally:
        await history.close()


SEEN = """({
    url: location.href,
    leases: [...document.querySelectorAll('.sg-lease')].map(e => e.dataset.lease),
    cards: Object.fromEntries([...document.querySelectorAll('.sg-lease')].map(
        e => [e.dataset.lease, e.innerText])),
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
        # alice: one GTX 1070 within her guarantee, busy; a second one borrowed, busy too.
        # bob: an RTX 3090 whose processes do nothing.
        alice = await lease_for(client, page_hub, "alice", "1070")
        borrowed = await lease_for(client, page_hub, "alice", "1070", server="extra")
        bob = await lease_for(client, page_hub, "bob", "3090")
        own = await lease_for(client, page_hub, "admin", "3090")
        assert (alice.borrowed, borrowed.borrowed, bob.borrowed) == (False, True, False)
        cluster.busy("gpu-a", alice.gpu_indices[0], 73.0, 3072)
        cluster.busy("gpu-a", borrowed.gpu_indices[0], 41.0, 1024)
        cluster.busy("gpu-b", bob.gpu_indices[0], 0.0, 512)
        cluster.busy("gpu-b", own.gpu_indices[0], 88.0, 18432)
        for lease in (alice, borrowed, bob, own):
            cluster.run(lease)

        # Nobody logged in: the hub's login, not the page.
        landed = await page_answers(page_hub)
        assert "/hub/login" in landed, landed

        shot = tmp_path / "gpu-page.png"
        docs = os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1"

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
                if docs:  # the README's picture: hours of made-up history behind the charts
                    asyncio.run(seed_history(page_hub, [(alice, 3072), (borrowed, 1024),
                                                         (bob, 512), (own, 18432)]))
                    browser.navigate(tab, page_hub.page_url)
                browser.screenshot(tab, shot, full_page=True)
            return as_alice, as_admin

        as_alice, as_admin = await asyncio.to_thread(drive)

        # alice: her own two leases (never bob's), each with its host, model, utilization
        # and memory now, guaranteed or borrowed, and a chart of samples.
        assert as_alice["url"] == page_hub.page_url
        assert sorted(as_alice["leases"]) == sorted([alice.lease_id, borrowed.lease_id])
        mine, extra = as_alice["cards"][alice.lease_id], as_alice["cards"][borrowed.lease_id]
        assert "default server" in mine and "gpu-a" in mine and GTX1070 in mine
        assert "73 %" in mine and "3 GiB of 8 GiB" in mine and "within your guarantee" in mine
        assert "server “extra”" in extra and "41 %" in extra and "borrowed" in extra
        assert as_alice["lines"] == 2
        assert bob.lease_id not in as_alice["text"] and "bob" not in as_alice["text"]
        assert as_alice["cluster"] == [], "only admins see every GPU"

        # admin: their own lease, and all four GPUs, who holds them, idle and borrowing.
        assert as_admin["leases"] == [own.lease_id]
        rows = {(row[0], row[1]): row for row in as_admin["cluster"]}
        assert set(rows) == {("gpu-a", "0"), ("gpu-a", "1"), ("gpu-b", "0"), ("gpu-b", "1")}
        held = {row[6].split(" ")[0] + ":" + row[8]: row for row in rows.values()
                if row[3] == "held"}
        assert sorted(held) == ["admin:guaranteed", "alice:borrowed", "alice:guaranteed",
                                "bob:guaranteed"]
        assert held["bob:guaranteed"][7] != "—", "bob's processes do nothing: idle"
        assert held["alice:guaranteed"][7] == "—"

        assert shot.stat().st_size > 10_000
        if docs:
            shutil.copyfile(shot, REPO_ROOT / "docs" / "gpu-page.png")

