"""What an admin sees of leases without reading the ledger: the gauge of each group's GPUs
held within its guarantee against borrowed beyond it, in a real scrape; and the allocator's
JSON log lines of a lease's life, each carrying the lease's id, host and user.

A real allocator (in this process for the scrape, a child process for its log), the real
broker and a real node agent on a simulated inventory of two GPUs (no Docker engine: the
leases are never bound, which is all a grant, a release and fair share's standing need).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from allocator.amqp.client import AllocatorClient
from allocator.metrics import exporter as allocator_metrics
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, started, wait_until
from tests.support.faults import AllocatorProcess, running_allocator

HELD = "swarm_gpu_group_gpus_held"


@asynccontextmanager
async def gpu_node(amqp_url: str, tmp_path: Path) -> AsyncIterator[str]:
    """A node agent reporting two GTX 1070s of a host of its own; the host's name."""
    host = f"obs-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, index, GTX1070) for index in range(2)]})
    async with started(NodeAgent(AgentSettings(
            host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
            interval_s=0.25, publish_timeout_s=2.0, amqp_reconnect_s=0.2, docker=False))):
        yield host


async def node_up(client: AllocatorClient, host: str) -> None:
    async def up() -> bool:
        return any(n.host == host and n.up for n in (await client.inventory()).nodes)
    await wait_until(up, within=30, interval=0.1)


async def granted(client: AllocatorClient, user: str, groups: list[str]) -> Lease:
    lease = await client.allocate(AllocateRequest(
        request_key=f"obs/{user}/", user=user, groups=groups, model=GTX1070))
    assert lease.state is LeaseState.GRANTED, lease
    return lease


def scrape(port: int) -> dict[tuple[str, str], float]:
    """(group, share) -> GPUs of the held gauge, from a real scrape of ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.labels["group"], sample.labels["share"]): sample.value
            for family in text_string_to_metric_families(text) if family.name == HELD
            for sample in family.samples}


async def test_the_gauge_splits_each_groups_gpus_into_guaranteed_and_borrowed(
        amqp_vhost: Any, ledger_path: Path, tmp_path: Path) -> None:
    # lab is guaranteed one GPU and may borrow a second; quiet is guaranteed one and holds
    # none; extra has no guarantee, so it is no label value.
    async with running_allocator(amqp_vhost.url, ledger_path, start_fence_s=0,
                                 group_quota={"lab": 1, "quiet": 1},
                                 group_borrow_limit={"lab": 2}) as service, \
            gpu_node(amqp_vhost.url, tmp_path) as host, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        server = allocator_metrics.serve(service, port=0, addr="127.0.0.1")
        try:
            async def figures() -> dict[tuple[str, str], float]:
                return await asyncio.to_thread(scrape, server.port)

            assert await figures() == {("lab", "guaranteed"): 0, ("lab", "borrowed"): 0,
                                       ("quiet", "guaranteed"): 0, ("quiet", "borrowed"): 0}
            await node_up(client, host)

            older = await granted(client, "alice", ["lab", "extra"])
            assert not older.borrowed
            assert await figures() == {("lab", "guaranteed"): 1, ("lab", "borrowed"): 0,
                                       ("quiet", "guaranteed"): 0, ("quiet", "borrowed"): 0}

            younger = await granted(client, "bob", ["lab"])
            assert younger.borrowed  # beyond lab's guarantee of one
            held = await figures()
            assert (held["lab", "guaranteed"], held["lab", "borrowed"]) == (1, 1)

            # The older lease ends: the younger one moves within the guarantee (fair share
            # restands the leases on its tick), and the gauge follows the standing reclaim
            # acts on, which the lease's status shows too.
            await client.release(lease_id=older.lease_id, force=True)

            async def moved() -> dict[tuple[str, str], float] | None:
                now = await figures()
                return now if now["lab", "borrowed"] == 0 else None
            held = await wait_until(moved, within=20, interval=0.1)
            assert held["lab", "guaranteed"] == 1
            assert not (await client.status(lease_id=younger.lease_id)).borrowed
        finally:
            server.close()


def lease_lines(written: str, lease_id: str) -> list[dict[str, Any]]:
    """The JSON lines of the allocator's log that carry ``lease_id`` as their field."""
    lines = [json.loads(line) for line in written.splitlines() if line.strip()]
    return [line for line in lines if line.get("lease_id") == lease_id]


async def test_json_log_lines_of_a_grant_and_a_release_carry_lease_host_and_user(
        amqp_vhost: Any, tmp_path: Path) -> None:
    process = AllocatorProcess("lease-logs", amqp_vhost.url, tmp_path / "ledger.sqlite",
                               tmp_path, log_format="json", start_fence_s=0, tick_s=0.1)
    await process.start()
    try:
        await process.wait_consuming(within=60)
        async with gpu_node(amqp_vhost.url, tmp_path) as host, \
                AllocatorClient(amqp_vhost.url, timeout_s=20) as client:
            await node_up(client, host)
            lease = await granted(client, "alice", ["lab"])
            await client.release(lease_id=lease.lease_id, by="hub")

            async def release_logged() -> list[dict[str, Any]] | None:
                lines = lease_lines(process.log(), lease.lease_id)
                return lines if any("-> releasing" in line["message"] for line in lines) \
                    else None
            lines = await wait_until(release_logged, within=20, interval=0.1)
    finally:
        code = await process.stop()
    assert code == 0, process.log()[-3000:]
    grant = [line for line in lines if "-> granted" in line["message"]]
    release = [line for line in lines if "-> releasing" in line["message"]]
    assert len(grant) == 1 and len(release) == 1, lines
    for line in (*grant, *release):
        assert (line["host"], line["user"], line["level"]) == (host, "alice", "INFO"), line
        assert line["logger"] == "allocator.service.batch", line
        # The text a person reads names the lease too, for the text format.
        assert lease.lease_id in line["message"] and host in line["message"], line
    assert "by hub" in release[0]["message"], release[0]
