"""The GPU page behind a real hub: its users, what they hold, and the page opened as one of them."""

from __future__ import annotations

import asyncio
import os
import time

from allocator.amqp.client import AllocatorClient
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerInfo,
    GPUInfo,
    GPUProcess,
    Lease,
    LeaseState,
    ProcessUse,
)
from tests.support.common import GTX1070, RTX3090, NodeSimulator, gpus
from tests.support.hub_browser import Browser
from tests.support.hub_harness import Hub

TEST_BUDGET_S = 240


UPDATE_DOCS = os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1"
"""Refresh docs/gpu-page.png from a demo state: ``SWARM_GPU_UPDATE_DOCS=1 scripts/test ...``."""


USERS = {"alice": ["students"], "bob": ["students"], "admin": ["staff"], "dave": ["staff"]}
"""``admin`` is the example configuration's first admin (its password from the secret)."""


class Cluster:
    """Simulated nodes that keep reporting: GPUs with their utilization, and a running
    container (with its processes' GPU use) for each lease that has been started."""

    def __init__(self, nodes: NodeSimulator) -> None:
        self.nodes = nodes
        self.gpus: dict[str, list[GPUInfo]] = {
            "gpu-a": gpus("gpu-a", GTX1070, 2),
            "gpu-b": gpus("gpu-b", RTX3090, 2),
        }
        self.running: dict[str, list[tuple[Lease, float]]] = {"gpu-a": [], "gpu-b": []}

    def busy(self, host: str, index: int, utilization: float, memory_mib: int) -> None:
        """Set what one GPU reports."""
        gpu = self.gpus[host][index]
        self.gpus[host][index] = gpu.model_copy(
            update={"utilization_pct": utilization, "memory_used_mib": memory_mib})

    def use(self, host: str, index: int, processes: list[GPUProcess]) -> None:
        """Set the processes one GPU lists."""
        gpu = self.gpus[host][index]
        self.gpus[host][index] = gpu.model_copy(update={"processes": processes})

    def run(self, lease: Lease) -> None:
        """A container of ``lease`` runs on its host from now on."""
        assert lease.host is not None
        self.running[lease.host].append((lease, time.time()))

    def containers(self, host: str) -> list[ContainerInfo]:
        """The host's lease containers, their processes using their GPUs as the GPUs report."""
        by_uuid = {gpu.uuid: gpu for gpu in self.gpus[host]}
        return [ContainerInfo(
            container_id=f"c-{lease.lease_id[:12]}", lease_id=lease.lease_id, started_at=started,
            gpu_use=[ProcessUse(gpu_uuid=uuid, memory_used_mib=by_uuid[uuid].memory_used_mib,
                                utilization_pct=by_uuid[uuid].utilization_pct)
                     for uuid in lease.gpu_uuids])
            for lease, started in self.running[host]]

    async def beat_forever(self) -> None:
        while True:
            for host, gpu_list in self.gpus.items():
                await self.nodes.beat(host, gpu_list, self.containers(host))
            await asyncio.sleep(0.5)


async def lease_for(client: AllocatorClient, hub: Hub, user: str, model: str,
                    server: str = "") -> Lease:
    lease = await client.allocate(AllocateRequest(
        request_key=hub.request_key(user, server), user=user, groups=USERS[user], model=model))
    assert lease.state is LeaseState.GRANTED, lease
    return lease


def open_page(browser: Browser, hub: Hub, user: str, *, until: str) -> str:
    """Log in as ``user`` (its account made first: ``await hub.login_password(user)``) in a
    fresh tab and open the page until ``until`` (a script) is true; returns the tab's session."""
    page = browser.page()
    browser.log_in(page, hub.url, user, hub.passwords[user])
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
    cards: Object.fromEntries([...document.querySelectorAll('.sg-lease')].map(
        e => [e.dataset.lease, e.innerText])),
    text: document.getElementById('sg-page').innerText,
    charted: [...document.querySelectorAll('.sg-lease')].filter(
        e => e.querySelector('svg polyline.sg-util')).map(e => e.dataset.lease),
    cluster: [...document.querySelectorAll('#sg-cluster tr.sg-gpu')].map(
        r => [...r.cells].map(c => c.innerText)),
})"""


RECLAIMS = """({
    reclaims: [...document.querySelectorAll('.sg-reclaim')].map(
        e => [e.dataset.lease, e.dataset.deadline]),
    notes: [...document.querySelectorAll('.sg-reclaim')].map(e => e.innerText),
    queued: [...document.querySelectorAll('.sg-queued')].map(
        e => [e.dataset.lease, e.querySelector('.sg-position').innerText]),
})"""
