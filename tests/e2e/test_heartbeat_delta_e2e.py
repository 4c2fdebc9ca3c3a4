"""Heartbeat deltas end to end: two real node agents with the same simulated GPUs report to the
real allocator over the real broker, one in full every time and one in deltas only, and the
allocator holds the same GPUs for both through every change the test makes to the inventory.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from allocator.amqp.client import AllocatorClient
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.wire.protocol import GPUView, Health
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, update_gpu, write_inventory
from tests.support.common import GTX1070, RTX3090, wait_until

EXACT: dict[str, Any] = {"delta_utilization_pct": 0.0, "delta_memory_mib": 0,
                         "delta_temperature_c": 0.0, "delta_power_w": 0.0}
"""Thresholds that count every change, so that the two hosts must agree exactly."""


@contextlib.asynccontextmanager
async def agent(amqp_url: str, host: str, inventory: Path, **overrides: Any
                ) -> AsyncIterator[NodeAgent]:
    running = NodeAgent(AgentSettings(
        host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
        interval_s=0.3, publish_timeout_s=2.0, docker=False, xid_quiet_s=600.0,
        overheat_c=90.0, overheat_hysteresis_c=10.0, **EXACT, **overrides))
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def without_host(view: GPUView) -> dict[str, Any]:
    return view.model_dump(exclude={"uuid", "host"})


async def test_deltas_give_the_allocator_what_full_reports_give(
        allocator: AllocatorService, client: AllocatorClient, amqp_vhost: Any,
        tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:8]
    full_host, delta_host = f"full-{tag}", f"delta-{tag}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070), make_gpu(host, 1, RTX3090)]
                                for host in (full_host, delta_host)})
    steps: list[dict[int, dict[str, Any]]] = [
        {0: {"temperature_c": 97.0}, 1: {"memory_used_mib": 3000, "utilization_pct": 77.0}},
        {0: {"temperature_c": 70.0, "power_w": 140.0}, 1: {"utilization_pct": 12.5}},
        {1: {"xid": 79}},
        {0: {"memory_used_mib": 12, "utilization_pct": 0.5}},
    ]
    async with (agent(amqp_vhost.url, full_host, inventory, full_report_s=0) as full,
                agent(amqp_vhost.url, delta_host, inventory, full_report_s=3600) as deltas):
        async def both_agree(expect: dict[int, dict[str, Any]] | None = None
                             ) -> list[GPUView] | None:
            views = {(g.host, g.index): g for g in (await client.inventory()).gpus
                     if g.host in (full_host, delta_host)}
            if len(views) != 4:
                return None
            for index in (0, 1):
                a, b = views[(full_host, index)], views[(delta_host, index)]
                if without_host(a) != without_host(b):
                    return None
                for name, value in (expect or {}).get(index, {}).items():
                    if name == "xid":  # a fatal XID: unhealthy (for xid_quiet_s)
                        name, value = "health", Health.UNHEALTHY
                    if getattr(a, name, value) != value:
                        return None
            return list(views.values())

        await wait_until(both_agree, within=30)
        for step in steps:
            for host in (full_host, delta_host):
                for index, changes in step.items():
                    update_gpu(inventory, host, index, **changes)
            await wait_until(lambda step=step: both_agree(step), within=30)  # type: ignore[misc]
        assert full.deltas_sent == 0
        assert deltas.deltas_sent >= len(steps)  # each step is seen in a heartbeat of its own
        # Every delta published so far is applied (none lost, none out of order).
        published = deltas.deltas_sent
        counters = allocator.engine.counters

        async def all_applied() -> bool:
            return counters[Count.HEARTBEAT_DELTAS.value] >= published

        await wait_until(all_applied, within=30)
        assert counters[Count.HEARTBEAT_DELTA_GAPS.value] == 0
        assert counters[Count.HEARTBEAT_DELTAS_UNAPPLIED.value] == 0
