"""Placement by links end to end: the real allocator over the real broker, simulated hosts that
report their interconnect (the simulated agent's presets) in their heartbeats, and the client
asking for a level of links."""

from __future__ import annotations

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.placement.gpu_sets import worst_link
from allocator.wire.interconnect import LinkLevel
from allocator.wire.protocol import AllocateRequest, ErrorCode, LeaseState
from nodeagent.simulated import preset_interconnect
from tests.support.common import A100, gpus, heartbeat, wait_until


@pytest.fixture
async def linked(client: AllocatorClient, nodes):
    """pcie: 8 A100, two sockets of two PCIe switches; ws: 4 A100, two NVLink pairs; old: 2
    A100 whose agent reports no links."""
    links = {}
    for host, count, preset in (("pcie", 8, "pcie-two-socket"), ("ws", 4, "nvlink-pairs"),
                                ("old", 2, None)):
        listed = gpus(host, A100, count)
        nodes.inventory[host] = listed
        links[host] = None if preset is None else preset_interconnect(
            preset, [g.uuid for g in listed])  # type: ignore[arg-type]
        await nodes.publish(heartbeat(host, listed).model_copy(
            update={"interconnect": links[host]}))

    async def ready() -> bool:
        inventory = await client.inventory()
        return sum(node.up for node in inventory.nodes) >= 3
    await wait_until(ready)
    return links


def ask(user: str, **fields: object) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{user}/", user=user, model=A100, **fields)


async def test_a_demanded_level_is_kept_waited_for_and_refused_clearly(client, linked):
    pairs = []
    for user in ("alice", "bob"):
        lease = await client.allocate(ask(user, count=2, topology="nvlink"))
        assert lease.host == "ws" and lease.state is LeaseState.GRANTED
        assert worst_link(linked["ws"], lease.gpu_uuids) is LinkLevel.NVLINK
        assert lease.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(lease.gpu_uuids)
        assert lease.env["SWARM_GPU_NUMA_NODES"] == "0"
        pairs.append(lease)
    assert {u for lease in pairs for u in lease.gpu_uuids} == set(linked["ws"].uuids)
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask("carol", count=2, topology="nvlink"))
    assert refused.value.code is ErrorCode.NO_CAPACITY
    assert "NVLink" in refused.value.message
    queued = await client.allocate(ask("dave", count=2, topology="nvlink", wait_s=30))
    assert queued.state is LeaseState.QUEUED
    await client.release(lease_id=pairs[0].lease_id, force=True)
    granted = await client.wait_for_grant("hub/dave/", wait_s=5)
    assert granted.host == "ws" and set(granted.gpu_uuids) == set(pairs[0].gpu_uuids)


async def test_the_better_connected_of_the_first_hosts(client, linked):
    # Both "ws" (joined by a host bridge, one NUMA node) and "pcie" (across its host bridges)
    # keep "socket" for 4 GPUs; "ws" is the better connected and the best fit.
    socket = await client.allocate(ask("alice", count=4, topology="socket"))
    assert socket.host == "ws"
    assert worst_link(linked["ws"], socket.gpu_uuids) is LinkLevel.HOSTBRIDGE
    # Without a level: "old" fits best (2 free) but has no links to promise; "pcie" has a
    # pair behind one switch.
    pair = await client.allocate(ask("bob", count=2))
    assert pair.host == "pcie"
    assert worst_link(linked["pcie"], pair.gpu_uuids) is LinkLevel.SINGLE
    assert pair.env["SWARM_GPU_NUMA_NODES"] in ("0", "1")
    one = await client.allocate(ask("carol", count=1))
    assert one.host == "old" and "SWARM_GPU_NUMA_NODES" not in one.env


async def test_a_level_no_host_can_keep_is_unsatisfiable(client, linked):
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask("alice", count=3, topology="nvlink"))
    assert refused.value.code is ErrorCode.UNSATISFIABLE
    assert "NVLink" in refused.value.message
