"""Node messages on a queue of their own, consumed only by the replica that serves requests.

Single-active-consumer elects one consumer per queue, so with two inbound queues two replicas
could each be active on one. Two real allocators (in this process) share the replicated
ledger log on the real broker, each with its own ledger: only the one that the request queue
elected consumes the node queue, a replica that finds itself given node messages while it is
no writer gives them back and stops consuming them (it never claims the log on them), and
when the active one goes, the other takes both queues.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from tests.support import services
from tests.support.common import GTX1070, NodeSimulator, gpus, wait_until
from tests.support.faults import running_allocator

OPTIONS = {"ledger_log": "stream", "request_timeout_s": 2, "start_fence_s": 0}


async def host_seen(url: str, host: str, gpu_count: int) -> bool:
    """Whether the allocator that answers requests reports ``host`` up with its GPUs."""
    async with AllocatorClient(url, timeout_s=10) as client:
        inventory = await client.inventory()
    return any(node.host == host and node.up and node.gpus == gpu_count
               for node in inventory.nodes)


async def serving(service: AllocatorService) -> bool:
    return service.consuming_nodes and service.log is not None and service.log.is_writer


@pytest.mark.slow
async def test_only_the_replica_serving_requests_consumes_node_messages(
        amqp_vhost: services.AmqpVhost, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="allocator.service.standby")
    url = amqp_vhost.url
    async with running_allocator(url, tmp_path / "a" / "ledger.sqlite", **OPTIONS) as first:
        # Alone and with no hub calling: its own activity probe elects it.
        await wait_until(lambda: serving(first), within=30)
        async with (running_allocator(url, tmp_path / "b" / "ledger.sqlite",
                                      **OPTIONS) as second,
                    NodeSimulator(url) as nodes):
            await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))
            assert await wait_until(lambda: host_seen(url, "gpu-a", 2), within=30)

            async def second_read_the_claim() -> bool:
                return second.log is not None and second.log.position is not None
            await wait_until(second_read_the_claim, within=30)
            # A heartbeat after the second started goes to the first (the second's own
            # probes too): the second consumes requests only.
            await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
            assert await wait_until(lambda: host_seen(url, "gpu-a", 4), within=30)
            assert not second.consuming_nodes
            assert first.consuming_nodes

            # The race the rule is for: the second is handed the node queue while the first
            # serves requests (as just after it was deposed). It gives the messages back,
            # stops consuming them and claims nothing; the first consumes them again.
            await first._link.cancel_nodes()
            await second._link.consume_nodes(second._intake.on_message)
            await first._link.consume_nodes(first._intake.on_message)  # behind the second
            await nodes.beat("gpu-b", gpus("gpu-b", GTX1070, 3))
            assert await wait_until(lambda: host_seen(url, "gpu-b", 3), within=30)
            await wait_until(lambda: _true(not second.consuming_nodes), within=30)
            assert first.log is not None and first.log.is_writer
            assert second.log is not None and not second.log.is_writer
            assert second.stats.counters[Count.TAKEOVERS] == 0
            assert any("go back to the node queue" in r.getMessage() for r in caplog.records)
            await wait_until(lambda: serving(first), within=30)

            # The first goes: the second takes the request queue, claims, takes the nodes.
            await first.stop()
            await wait_until(lambda: serving(second), within=60)
            await nodes.beat("gpu-c", gpus("gpu-c", GTX1070, 1))
            assert await wait_until(lambda: host_seen(url, "gpu-c", 1), within=30)


async def _true(value: bool) -> bool:
    return value
