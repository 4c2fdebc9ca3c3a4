"""End to end, in Chromium: how GPUs are joined, as users and admins see it. A real hub (its
spawn form and the GPU page) asks the real allocator over the real broker, where a simulated
node reports how its GPUs are joined and another, as an agent before 0.3.0, does not."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.wire.interconnect import HostInterconnect, LinkLevel, build_interconnect
from allocator.wire.protocol import AllocateRequest, GPUInfo, LeaseState
from tests.support.common import (
    GTX1070,
    RTX3090,
    NodeSimulator,
    gpus,
    heartbeat,
    started,
    wait_until,
)
from tests.support.gpu_page import SEEN, TEST_BUDGET_S, USERS, open_page
from tests.support.hub_browser import Browser
from tests.support.hub_harness import Hub

pytestmark = [pytest.mark.hub, pytest.mark.browser, pytest.mark.slow]

TIMES = "\u00d7"


def two_nvlink_pairs(uuids: list[str]) -> HostInterconnect:
    """GPUs 0-1 and 2-3 joined by NVLink, the other pairs through a PCIe host bridge."""
    links = {(i, j): (LinkLevel.HOSTBRIDGE, 0) for i in range(4) for j in range(i + 1, 4)}
    links[(0, 1)] = links[(2, 3)] = (LinkLevel.NVLINK, 4)
    return build_interconnect(uuids, [0, 0, 0, 0], links)


class LinkedNodes:
    """gpu-a: two GTX 1070 of an agent that reports no links; gpu-b: four RTX 3090 in two
    NVLink pairs. Both keep reporting, with a running container for each lease started."""

    def __init__(self, nodes: NodeSimulator) -> None:
        self.nodes = nodes
        self.gpus: dict[str, list[GPUInfo]] = {"gpu-a": gpus("gpu-a", GTX1070, 2),
                                               "gpu-b": gpus("gpu-b", RTX3090, 4)}
        self.links = two_nvlink_pairs([gpu.uuid for gpu in self.gpus["gpu-b"]])

    async def beat_forever(self) -> None:
        while True:
            await self.nodes.beat("gpu-a", self.gpus["gpu-a"])
            await self.nodes.publish(heartbeat("gpu-b", self.gpus["gpu-b"]).model_copy(
                update={"interconnect": self.links}))
            await asyncio.sleep(0.5)


@pytest.fixture
async def allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    async with started(AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=0, node_down_after_s=3600,
        aliases={"1070": GTX1070, "3090": RTX3090}))) as service:
        yield service


@pytest.fixture
async def linked(nodes: NodeSimulator, allocator: Any) -> AsyncIterator[LinkedNodes]:
    cluster = LinkedNodes(nodes)
    task = asyncio.create_task(cluster.beat_forever())
    async with AllocatorClient(allocator.settings.amqp_url) as rpc:
        async def reported() -> bool:
            found = {n.host: n for n in (await rpc.inventory()).nodes}
            return len(found) == 2 and found["gpu-b"].interconnect is not None
        await wait_until(reported, within=30)
    try:
        yield cluster
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def hub(tmp_path: Path, chp_path: Path, amqp_vhost: Any) -> AsyncIterator[Hub]:
    """A real hub with the GPU page; it spawns no server (the lease is asked directly)."""
    hub = Hub(tmp_path / "hub", chp=chp_path, amqp_url=amqp_vhost.url,
              docker_host="unix:///nonexistent/docker.sock", image="unused:never-pulled",
              users=USERS, page={"SWARM_GPU_PAGE_SAMPLE_INTERVAL_S": "1"}, first_admin=True)
    try:
        await hub.start()
        yield hub
    finally:
        await hub.stop()


COUNTS = "[...document.querySelectorAll('#sg-count option')].map(o => o.textContent)"


async def test_the_form_and_the_page_say_how_gpus_are_joined(
    linked: LinkedNodes, client: AllocatorClient, hub: Hub, chromium_path: Path,
    tmp_path: Path,
) -> None:
    """dave (staff: up to 8 GPUs) sees each multi-GPU choice's connection follow the model
    he picks, and the topology choice only for several whole GPUs; alice's two GPUs are a
    free NVLink pair, and her card and the admin's table say so."""
    async with asyncio.timeout(TEST_BUDGET_S):
        for user in ("dave", "alice", "admin"):
            await hub.login_password(user)

        def form() -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / "chromium-dave") as browser:
                tab = browser.page()
                browser.log_in(tab, hub.url, "dave", hub.passwords["dave"])
                browser.navigate(tab, f"{hub.url}/hub/spawn")
                seen: dict[str, Any] = {}
                for model, count in (("any", "1"), (RTX3090, "2"), (GTX1070, "2"),
                                     (RTX3090, "1")):
                    browser.evaluate(tab, f"""
                        document.querySelector('input[name=profile][value=custom]')?.click();
                        document.querySelector('input[name=mode][value=exclusive]').click();
                        document.getElementById('sg-model').value = '{model}';
                        document.getElementById('sg-count').value = '{count}';
                        document.getElementById('sg-form').dispatchEvent(
                            new Event('change', {{bubbles: true}}));""")
                    seen[f"{model}/{count}"] = browser.evaluate(tab, f"""({{
                        counts: {COUNTS},
                        topology: document.getElementById('sg-topology').disabled,
                        choices: [...document.querySelectorAll('#sg-topology option')].map(
                            o => o.value)}})""")
                return seen

        seen = await asyncio.to_thread(form)
        three090 = seen[f"{RTX3090}/2"]
        assert three090["counts"][1:4] == [
            f"2 {TIMES} NVIDIA GeForce RTX 3090, NVLink",
            f"3 {TIMES} NVIDIA GeForce RTX 3090, a PCIe host bridge",
            f"4 {TIMES} NVIDIA GeForce RTX 3090, a PCIe host bridge"], three090
        assert three090["topology"] is False, "several whole GPUs: the choice is open"
        assert three090["choices"] == ["any", "nvlink", "pcie-switch", "socket"]
        assert seen[f"{GTX1070}/2"]["counts"][1] == "2 GPUs", "gpu-a reports no links"
        assert seen["any/1"]["counts"][1] == "2 GPUs, NVLink"
        assert seen["any/1"]["topology"] is True and seen[f"{RTX3090}/1"]["topology"] is True

        lease = await client.allocate(AllocateRequest(
            request_key=hub.request_key("alice", ""), user="alice",
            groups=USERS["alice"], model="3090", count=2, topology="nvlink"))
        assert lease.state is LeaseState.GRANTED and lease.link == "nvlink", lease
        assert sorted(lease.gpu_indices) in ([0, 1], [2, 3])

        def page(user: str) -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / f"chromium-{user}", width=1100) as browser:
                tab = open_page(browser, hub, user,
                                until="document.querySelectorAll('.sg-link').length > 0")
                seen: dict[str, Any] = browser.evaluate(tab, SEEN)
                seen["links"] = browser.evaluate(
                    tab, "[...document.querySelectorAll('.sg-link')].map(e => e.innerText)")
                seen["scripts"] = browser.evaluate(
                    tab, "document.querySelectorAll('script').length")
                return seen

        as_alice = await asyncio.to_thread(page, "alice")
        assert as_alice["links"] == ["2 GPUs, NVLink"], as_alice
        assert "2 GPUs, NVLink" in as_alice["cards"][lease.lease_id]
        assert as_alice["scripts"] == 0
        as_admin = await asyncio.to_thread(page, "admin")
        assert as_admin["links"] == ["2 GPUs, NVLink"] * 2, as_admin
        held = [row for row in as_admin["cluster"] if "alice" in row[6]]
        assert len(held) == 2 and all("2 GPUs, NVLink" in row[6] for row in held), held
