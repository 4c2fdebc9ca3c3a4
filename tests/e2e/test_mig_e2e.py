"""MIG instances and compute capability end to end: real node agents, real broker, real allocator.

Three simulated hosts, each with its own real agent reading one inventory file: ``mig`` has an
A100 in MIG mode carved into mixed profiles, ``whole`` a whole A100 and ``pascal`` a GTX 1070.
Requests pick by profile, by count of instances and by compute capability; the GPU in MIG mode
is never granted whole; its health reaches its instances; a re-partition keeps a held
instance held and offers the new ones.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.protocol import AllocateRequest, ErrorCode, Health, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import (
    make_gpu,
    make_mig_gpu,
    make_mig_instances,
    read_inventory,
    simulated_uuid,
    update_gpu,
    write_inventory,
)
from tests.support.common import A100_40GB as A100
from tests.support.common import GTX1070 as GTX
from tests.support.common import MIG_1G, MIG_3G, wait_until

PROFILES = ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]


@dataclass
class Hosts:
    mig: str
    whole: str
    pascal: str
    inventory: Path

    def instances(self) -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = read_inventory(self.inventory)[self.mig][0][
            "mig_instances"]
        return entries

    def uuids_of(self, profile: str) -> list[str]:
        return [i["uuid"] for i in self.instances() if i["profile"] == profile]


@contextlib.asynccontextmanager
async def three_hosts(amqp_url: str, tmp_path: Path,
                      client: AllocatorClient) -> AsyncIterator[Hosts]:
    tag = uuid.uuid4().hex[:6]
    hosts = Hosts(f"mig-{tag}", f"whole-{tag}", f"pascal-{tag}", tmp_path / "inventory.json")
    write_inventory(hosts.inventory, {
        hosts.mig: [make_mig_gpu(hosts.mig, 0, A100, PROFILES)],
        hosts.whole: [make_gpu(hosts.whole, 0, A100)],
        hosts.pascal: [make_gpu(hosts.pascal, 0, GTX)],
    })
    agents = [
        NodeAgent(AgentSettings(
            host=host, amqp_url=amqp_url, inventory="simulated",
            simulated_file=hosts.inventory, interval_s=0.3, publish_timeout_s=2.0,
            docker=False, overheat_c=90.0, overheat_hysteresis_c=10.0, xid_quiet_s=1.0))
        for host in (hosts.mig, hosts.whole, hosts.pascal)
    ]
    async with contextlib.AsyncExitStack() as stack:
        for agent in agents:
            await agent.start()
            stack.push_async_callback(agent.stop)

        async def all_reported() -> bool:
            inventory = await client.inventory()
            return len([g for g in inventory.gpus if g.host.endswith(tag)]) == 3 + len(PROFILES)
        await wait_until(all_reported, within=20)
        yield hosts


def ask(key: str, **fields: Any) -> AllocateRequest:
    return AllocateRequest(request_key=f"mig/{key}/", user=key, **fields)


async def refused(client: AllocatorClient, request: AllocateRequest) -> ErrorCode:
    with pytest.raises(AllocatorError) as error:
        await client.allocate(request)
    return error.value.code


async def test_pick_by_profile_count_and_capability_never_the_mig_gpu_whole(
        allocator: Any, client: AllocatorClient, amqp_vhost: Any, tmp_path: Path) -> None:
    async with three_hosts(amqp_vhost.url, tmp_path, client) as hosts:
        inventory = await client.inventory()
        models = {m.model: m for m in inventory.models}
        assert models[MIG_1G].free == 2 and models[MIG_1G].mig_profile == "1g.5gb"
        assert models[MIG_1G].mig_parent_model == A100
        assert models[A100].total == 1  # the GPU in MIG mode is no unit of its own
        parent = next(g for g in inventory.gpus if g.uuid == simulated_uuid(hosts.mig, 0))
        assert parent.mig_enabled and parent.compute_capability == "8.0"

        # By profile and count: both 1g.5gb instances of the MIG host, in one lease.
        pair = await client.allocate(ask("ann", model=MIG_1G, count=2))
        assert pair.host == hosts.mig
        assert sorted(pair.gpu_uuids) == sorted(hosts.uuids_of("1g.5gb"))
        assert pair.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(pair.gpu_uuids)
        assert all(u.startswith("MIG-") for u in pair.gpu_uuids)
        assert await refused(client, ask("bob", model=MIG_1G)) is ErrorCode.NO_CAPACITY
        assert await refused(client, ask("bob", model=MIG_1G, count=3)) \
            is ErrorCode.UNSATISFIABLE

        # The A100 model: only the whole one; the GPU in MIG mode is never handed out.
        whole = await client.allocate(ask("cid", model=A100))
        assert whole.host == hosts.whole and whole.gpu_uuids == [simulated_uuid(hosts.whole, 0)]
        assert await refused(client, ask("dan", model=A100)) is ErrorCode.NO_CAPACITY

        # By compute capability: 8.0 or better leaves the GTX 1070 (6.1) alone.
        big = await client.allocate(ask("eve", min_compute_capability="8.0"))
        assert big.host == hosts.mig and big.model in (MIG_3G, f"{A100} MIG 2g.10gb")
        assert await refused(client, ask("fay", min_compute_capability="9.0")) \
            is ErrorCode.UNSATISFIABLE
        pascal = await client.allocate(ask("gus", architecture="pascal"))
        assert pascal.host == hosts.pascal
        # Everything else is taken or a MIG parent: nothing is left for any request.
        last = await client.allocate(ask("hal"))
        assert last.host == hosts.mig
        assert await refused(client, ask("ivy")) is ErrorCode.NO_CAPACITY
        every = await client.inventory(include_leases=True)
        granted = {u for lease in every.leases or [] for u in lease.gpu_uuids}
        assert simulated_uuid(hosts.mig, 0) not in granted


@pytest.mark.parametrize(("fault", "recovery"), [
    ({"temperature_c": 97.0}, {"temperature_c": 60.0}),
    ({"xid": 79}, {}),
    ({"lost": True}, {"lost": False}),
], ids=["overheat", "fatal-xid", "lost"])
async def test_parent_health_excludes_its_instances_and_recovery_readmits_them(
        allocator: Any, client: AllocatorClient, amqp_vhost: Any, tmp_path: Path,
        fault: dict[str, Any], recovery: dict[str, Any]) -> None:
    async with three_hosts(amqp_vhost.url, tmp_path, client) as hosts:
        instance_uuids = {i["uuid"] for i in hosts.instances()}

        async def instances_are(health: Health) -> bool:
            gpus = (await client.inventory()).gpus
            return {g.uuid for g in gpus if g.health is health} >= instance_uuids

        update_gpu(hosts.inventory, hosts.mig, 0, **fault)
        await wait_until(lambda: instances_are(Health.UNHEALTHY), within=15)
        assert await refused(client, ask("ann", model=MIG_1G)) is ErrorCode.NO_CAPACITY
        assert await refused(client, ask("ann", host=hosts.mig)) is ErrorCode.NO_CAPACITY

        if recovery:  # a fatal XID recovers by itself once quiet for xid_quiet_s
            update_gpu(hosts.inventory, hosts.mig, 0, **recovery)
        await wait_until(lambda: instances_are(Health.HEALTHY), within=15)
        lease = await client.allocate(ask("ann", model=MIG_1G))
        assert lease.state is LeaseState.GRANTED and lease.gpu_uuids[0] in instance_uuids


async def test_repartition_under_a_held_instance_keeps_it_held(
        allocator: Any, client: AllocatorClient, amqp_vhost: Any, tmp_path: Path) -> None:
    async with three_hosts(amqp_vhost.url, tmp_path, client) as hosts:
        held = await client.allocate(ask("ann", model=MIG_3G))
        (held_uuid,) = held.gpu_uuids
        # The admin re-partitions: the 3g.20gb instance is destroyed, four 1g.5gb instead.
        layout = read_inventory(hosts.inventory)
        layout[hosts.mig][0]["mig_instances"] = make_mig_instances(
            hosts.mig, 0, ["1g.5gb"] * 4, first=10)
        write_inventory(hosts.inventory, layout)

        async def four_free() -> bool:
            models = {m.model: m for m in (await client.inventory()).models}
            return MIG_1G in models and models[MIG_1G].free == 4
        await wait_until(four_free, within=15)

        # The lease still holds its instance; nothing else can get it.
        status = await client.status(lease_id=held.lease_id)
        assert status.state is LeaseState.GRANTED and status.gpu_uuids == [held_uuid]
        four = await client.allocate(ask("bob", model=MIG_1G, count=4))
        assert held_uuid not in four.gpu_uuids
        assert await refused(client, ask("cid", model=MIG_3G)) is ErrorCode.UNSATISFIABLE
