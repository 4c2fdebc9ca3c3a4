"""Requests go ahead of a backlog of heartbeats, and every delivery is still settled exactly
once (a real allocator, broker and ledger)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aio_pika

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.topology import ALLOCATOR_QUEUE
from tests.support.common import GTX1070, NodeSimulator, gpus, started, wait_until

BACKLOG = 1000


def _allocator(url: str, ledger_path: Path) -> AllocatorService:
    # Small batches make applying the backlog take many commits, while the whole backlog is
    # delivered at once (prefetch): the request is read long before the last heartbeat.
    return AllocatorService(AllocatorSettings(
        amqp_url=url, ledger_path=ledger_path, allow_any_node_user=True, start_fence_s=0,
        tick_s=3600, batch_max=8, prefetch=4096))


async def test_a_request_passes_a_backlog_of_heartbeats_left_by_a_restart(amqp_vhost,
                                                                         ledger_path: Path
                                                                         ) -> None:
    async with started(_allocator(amqp_vhost.url, ledger_path)):
        pass  # the queue and exchanges exist; the allocator is down, as during a restart
    async with NodeSimulator(amqp_vhost.url) as nodes:
        for index in range(BACKLOG):
            host = f"gpu-{index:04d}"
            await nodes.beat(host, gpus(host, GTX1070, 1))
    async with AllocatorClient(amqp_vhost.url, timeout_s=60) as client:
        # Published behind the whole backlog, before the allocator is back.
        asked = asyncio.create_task(client.inventory())
        await asyncio.sleep(0.2)
        async with started(_allocator(amqp_vhost.url, ledger_path)):
            async with asyncio.timeout(60):
                inventory = await asked
            # Answered in arrival order it would have seen every host (they came first).
            assert len(inventory.nodes) < BACKLOG, "the request waited for the whole backlog"

            async def all_applied() -> bool:
                return len((await client.inventory()).nodes) == BACKLOG
            await wait_until(all_applied, within=60, interval=0.2)
    # Every delivery was acknowledged (none settled before it was applied: every host
    # arrived): the allocator's channel closed with none unsettled, which the broker would
    # have put back into the queue.
    connection = await aio_pika.connect(amqp_vhost.url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(ALLOCATOR_QUEUE, passive=True)
        assert declared.declaration_result.message_count == 0
