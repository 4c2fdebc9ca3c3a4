"""Heartbeat batches linger: a quiet cluster's heartbeats share ledger commits, and nothing
else waits for them (a real allocator, broker and ledger)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerInfo,
    GPUProcess,
    LeaseState,
)
from tests.support.common import GTX1070, NodeSimulator, gpus, started, wait_until


def _allocator(url: str, ledger_path: Path, linger_s: float) -> AllocatorService:
    # No timer ticks during the test: a tick is a batch of its own, which would blur the count.
    return AllocatorService(AllocatorSettings(
        amqp_url=url, ledger_path=ledger_path, allow_any_node_user=True, admin_users=["guest"],
        start_fence_s=0, tick_s=3600, heartbeat_linger_s=linger_s))


def _hosts_in_ledger(path: Path) -> int:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
        return int(conn.execute("SELECT count(*) FROM nodes").fetchone()[0])


async def _batches_for_spaced_heartbeats(url: str, ledger_path: Path, linger_s: float) -> int:
    """Batches the allocator commits for ten hosts' heartbeats published 50 ms apart."""
    hosts = [f"gpu-{i}" for i in range(10)]
    async with started(_allocator(url, ledger_path, linger_s)) as allocator, \
            NodeSimulator(url) as nodes:
        before = allocator.stats.counters[Count.BATCHES.value]
        for host in hosts:
            await nodes.beat(host, gpus(host, GTX1070, 1))
            await asyncio.sleep(0.05)

        async def all_committed() -> bool:
            return await asyncio.to_thread(_hosts_in_ledger, ledger_path) == len(hosts)
        await wait_until(all_committed, within=20)
        return allocator.stats.counters[Count.BATCHES.value] - before


async def test_a_quiet_clusters_heartbeats_share_commits(amqp_vhost, ledger_path: Path) -> None:
    # The ten heartbeats take about 0.5 s to publish: one linger of 1 s holds them all (a
    # second batch at most, if the first heartbeat's window closes just before the last).
    assert await _batches_for_spaced_heartbeats(amqp_vhost.url, ledger_path, 1.0) <= 2


async def test_without_a_linger_each_heartbeat_is_a_batch(amqp_vhost, ledger_path: Path) -> None:
    # The same heartbeats, each applied as it comes: what the linger saves. (Only a commit
    # slower than the 50 ms between two heartbeats merges two of them.)
    assert await _batches_for_spaced_heartbeats(amqp_vhost.url, ledger_path, 0.0) >= 5


LONG_LINGER_S = 5.0


@pytest.fixture
async def lingering(amqp_vhost, ledger_path: Path):
    """An allocator whose heartbeat batches would wait 5 s for company."""
    async with started(_allocator(amqp_vhost.url, ledger_path, LONG_LINGER_S)) as allocator:
        yield allocator


async def test_a_request_ends_the_linger_of_a_heartbeat_batch(lingering, amqp_vhost, nodes
                                                              ) -> None:
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        asked = time.monotonic()
        inventory = await client.inventory()
        waited = time.monotonic() - asked
    # Applied in arrival order in one batch: the heartbeat before the request, which saw it.
    assert [node.host for node in inventory.nodes if node.up] == ["gpu-a"]
    assert waited < LONG_LINGER_S / 2, f"the request waited {waited:.2f} s for the linger"


async def test_a_container_event_ends_the_linger_of_a_heartbeat_batch(lingering, amqp_vhost,
                                                                       nodes) -> None:
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        lease = await client.allocate(AllocateRequest(request_key="h/u/", user="u",
                                                      model=GTX1070))
        await nodes.beat("gpu-a")  # a heartbeat batch begins to linger...
        sent = time.monotonic()
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.START)  # ...and this ends it

        async def bound() -> bool:
            record = lingering.engine.leases.get(lease.lease_id)
            return record is not None and record.state is LeaseState.BOUND
        await wait_until(bound, within=LONG_LINGER_S * 2, interval=0.01)
        waited = time.monotonic() - sent
    assert waited < LONG_LINGER_S / 2, f"the start event waited {waited:.2f} s for the linger"


async def test_a_report_a_hand_over_waits_for_does_not_linger(lingering, amqp_vhost, nodes
                                                               ) -> None:
    """A GPU whose lease just ended drains until its node's next report shows that lease's
    processes gone: that report is applied at once, not after the heartbeat linger, which
    would otherwise add itself to every hand-over."""
    [gpu] = gpus("gpu-a", GTX1070, 1)
    container = "0123abcd" * 8
    process = GPUProcess(pid=4242, memory_used_mib=900, name="python", container_id=container)
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.beat("gpu-a", [gpu.model_copy(update={"processes": []})])
        lease = await client.allocate(AllocateRequest(request_key="h/u/", user="u"))
        running = ContainerInfo(container_id=container, lease_id=lease.lease_id)
        await nodes.beat("gpu-a", [gpu.model_copy(update={"processes": [process]})], [running])

        async def bound() -> bool:
            record = lingering.engine.leases.get(lease.lease_id)
            return record is not None and record.state is LeaseState.BOUND
        await wait_until(bound, within=LONG_LINGER_S * 2, interval=0.01)
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.DIE, container)

        async def draining() -> bool:
            return lingering.engine.processes.draining_on("gpu-a")
        await wait_until(draining, within=LONG_LINGER_S * 2, interval=0.01)
        await nodes.beat("gpu-a", [gpu.model_copy(update={"processes": []})])
        sent = time.monotonic()

        async def verified() -> bool:
            return not lingering.engine.processes.draining_on("gpu-a")
        await wait_until(verified, within=LONG_LINGER_S * 2, interval=0.01)
        waited = time.monotonic() - sent
    assert waited < LONG_LINGER_S / 2, f"the awaited report waited {waited:.2f} s"
