"""Only a delivery the broker still stands behind makes a standby claim the ledger log.

Two real allocators (in this process) share the replicated log on the real broker, each with
its own ledger. The active one writes (epoch 1). The standby is handed what an allocator that
lost the active place may still hold when it applies its next batch: a timer tick queued just
before it learnt of another claim, or a delivery whose channel the broker no longer answers on
(the process was paused past its connection's heartbeat timeout: the broker gave the delivery
to the other allocator meanwhile). Claiming on either would depose the active allocator for a
request that is not this one's to decide.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aio_pika

from allocator.amqp.client import AllocatorClient
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.service.intake import TICK as _TICK
from allocator.wire.protocol import AllocateRequest
from tests.support.common import GTX1070, NodeSimulator, gpus, wait_until
from tests.support.faults import Proxy, running_allocator


@contextlib.asynccontextmanager
async def active_and_standby(url: str, tmp_path: Path
                             ) -> AsyncIterator[tuple[AllocatorService, AllocatorService]]:
    """The active allocator (writer of epoch 1) and a standby that has read its claim."""
    options = {"ledger_log": "stream", "request_timeout_s": 2, "start_fence_s": 0}
    async with (running_allocator(url, tmp_path / "a" / "ledger.sqlite", **options) as active,
                running_allocator(url, tmp_path / "b" / "ledger.sqlite", **options) as standby,
                NodeSimulator(url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))  # the active one claims

        async def standby_read_the_claim() -> bool:
            return standby.log is not None and standby.log.position is not None
        await wait_until(standby_read_the_claim, within=20)
        assert active.log is not None and active.log.is_writer
        yield active, standby


async def assert_active_still_writes(url: str, active: AllocatorService,
                                     standby: AllocatorService) -> None:
    """A request is answered by the active allocator, still at epoch 1, on both ledgers."""
    async with AllocatorClient(url, timeout_s=10) as client:
        lease = await client.allocate(AllocateRequest(request_key="hub/after/", user="u"))
        await client.release(lease_id=lease.lease_id, force=True, by="test")
    assert active.log is not None and active.log.is_writer
    assert standby.log is not None and not standby.log.is_writer
    assert standby.log.position is not None and standby.log.position.epoch == 1
    assert standby.stats.counters[Count.TAKEOVERS] == 0


async def test_a_standby_timer_tick_does_not_claim_the_log(amqp_vhost, tmp_path: Path) -> None:
    async with active_and_standby(amqp_vhost.url, tmp_path) as (active, standby):
        await standby._apply_batch([_TICK])
        await assert_active_still_writes(amqp_vhost.url, active, standby)


async def test_a_delivery_whose_channel_no_longer_answers_does_not_claim_the_log(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    proxy = Proxy(lambda: asyncio.open_connection(amqp_vhost.broker.host,
                                                  amqp_vhost.broker.port))
    port = await proxy.serve_tcp()
    through_proxy = url.replace(f":{amqp_vhost.broker.port}/", f":{port}/", 1)
    assert through_proxy != url
    async with active_and_standby(url, tmp_path) as (active, standby):
        connection = await aio_pika.connect(through_proxy, timeout=10)
        try:
            channel = await connection.channel()
            queue = await channel.declare_queue(exclusive=True)
            await channel.default_exchange.publish(
                aio_pika.Message(b'{"kind": "inventory"}'), routing_key=queue.name)

            async def delivered() -> aio_pika.abc.AbstractIncomingMessage | None:
                return await queue.get(no_ack=False, fail=False)
            message = await wait_until(delivered, within=10)
            # The link goes silent: to this process the channel still looks open.
            proxy.freeze()
            await standby._apply_batch([message])
            assert standby.stats.counters[Count.STALE_DELIVERIES] == 1
            await assert_active_still_writes(url, active, standby)
        finally:
            await proxy.cut()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await connection.close()
