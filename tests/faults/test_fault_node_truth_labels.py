"""Node truth that a forged report or label cannot bend, on the real broker and allocator.

- **A forged heartbeat.** Another host's agent credential (a broker user of its own, which may
  report only for its own host) names the GPU of a host that went down: the GPU does not move
  before ``gpu_move_after_s``; meanwhile it is a move conflict, shown on the GPU and placed on
  no host; it moves once the claim has stood that long.
- **A forged label.** A real container on the real Docker engine, started with the grant
  labels of someone's *queued* lease (as anyone with the node's Docker API could): a real node
  agent reports it, and the lease stays queued; the GPU it names is a conflict naming the
  container while it runs, and placeable again once it is gone.

The engine-level cases are in tests/engine/test_gpu_moves.py and
tests/engine/test_label_narrowing.py.

Only without the replicated log: a forged report or label is judged by the engine, the same
code whichever way its decisions are committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import AllocateRequest, GPUView, InventoryReply, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.broker_users import broker_user
from tests.support.common import GTX1070, NodeSimulator, gpus, heartbeat, wait_until
from tests.support.faults import assert_sound, audit_ledger, report, running_allocator

pytestmark = pytest.mark.slow

MOVE_AFTER_S = 3.0
DOWN_AFTER_S = 1.5


def gpu_row(inventory: InventoryReply, gpu_uuid: str) -> GPUView | None:
    return next((g for g in inventory.gpus if g.uuid == gpu_uuid), None)


async def test_a_forged_heartbeat_does_not_move_a_gpu_before_gpu_move_after_s(
        rabbitmq: services.RabbitMQ, amqp_vhost: services.AmqpVhost,
        ledger_path: Path) -> None:
    with broker_user(rabbitmq, amqp_vhost) as (owner_b, url_b):
        async with contextlib.AsyncExitStack() as stack:
            allocator = await stack.enter_async_context(running_allocator(
                amqp_vhost.url, ledger_path, allow_any_node_user=False,
                node_users={"gpu-old": "guest", "gpu-b": owner_b},
                node_down_after_s=DOWN_AFTER_S, gpu_move_after_s=MOVE_AFTER_S))
            client = await stack.enter_async_context(AllocatorClient(amqp_vhost.url,
                                                                     timeout_s=5))
            old_agent = await stack.enter_async_context(NodeSimulator(amqp_vhost.url))
            b_agent = await stack.enter_async_context(NodeSimulator(url_b))
            old_gpus, b_gpus = gpus("gpu-old", GTX1070, 1), gpus("gpu-b", GTX1070, 1)
            moving = old_gpus[0]
            await old_agent.publish(heartbeat("gpu-old", old_gpus, agent_id="old"))
            # gpu-b's agent reports every 0.25 s what ``reported`` holds, with its own
            # credential (the only host it may report for).
            reported = list(b_gpus)
            stop = asyncio.Event()

            async def keep_reporting() -> None:
                while not stop.is_set():
                    await b_agent.publish(heartbeat("gpu-b", list(reported), agent_id="b"),
                                          user_id=owner_b)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), 0.25)
            reporting = asyncio.create_task(keep_reporting())
            try:
                async def old_down_b_up() -> bool:
                    nodes = {n.host: n.up for n in (await client.inventory()).nodes}
                    return nodes == {"gpu-old": False, "gpu-b": True}
                await wait_until(old_down_b_up, within=20)
                # Now gpu-b's reports name gpu-old's GPU too.
                claimed_from = time.time()
                reported.append(moving.model_copy(update={"index": 1}))
                seen_conflict = refused_on_b = 0
                while True:
                    inventory = await client.inventory()
                    row = gpu_row(inventory, moving.uuid)
                    assert row is not None
                    if inventory.at < claimed_from + MOVE_AFTER_S:
                        # Before gpu_move_after_s (by the allocator's own clock): never moved.
                        assert row.host == "gpu-old", inventory.at - claimed_from
                    if row.host == "gpu-b":
                        break
                    if row.conflict is not None:
                        assert "reported by gpu-b" in row.conflict, row.conflict
                        seen_conflict += 1
                        if refused_on_b == 0:
                            # Placed on neither host: gpu-b's own GPU, then nothing.
                            held = await client.allocate(AllocateRequest(
                                request_key="hub/first/", user="first", host="gpu-b"))
                            assert held.gpu_uuids == [b_gpus[0].uuid]
                            with pytest.raises(AllocatorError) as refused:
                                await client.allocate(AllocateRequest(
                                    request_key="hub/second/", user="second", host="gpu-b"))
                            assert refused.value.code.value == "no_capacity"
                            refused_on_b += 1
                    assert time.time() < claimed_from + MOVE_AFTER_S + 30, "never moved"
                    await asyncio.sleep(0.1)
                moved_after_s = inventory.at - claimed_from
            finally:
                stop.set()
                await reporting
            assert seen_conflict > 0 and refused_on_b == 1
            assert moved_after_s >= MOVE_AFTER_S
            assert row.conflict is None
            assert allocator.engine.counters["gpu_move_conflict"] >= 1
            placed = await client.allocate(AllocateRequest(request_key="hub/third/",
                                                           user="third", host="gpu-b"))
            assert placed.gpu_uuids == [moving.uuid]
    assert_sound(audit_ledger(ledger_path))
    report("forged_heartbeat_move", gpu_move_after_s=MOVE_AFTER_S,
           moved_after_s=round(moved_after_s, 2), conflict_seen_in_polls=seen_conflict)


def agent_settings(host: str, url: str, inventory: Path, docker_url: str) -> AgentSettings:
    return AgentSettings(
        host=host, amqp_url=url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, publish_timeout_s=1.0, amqp_reconnect_s=0.2, docker=True,
        docker_url=docker_url, docker_backoff_s=0.1, docker_backoff_max_s=0.5,
        docker_replay_grace_s=0.5, docker_timeout_s=3.0, xid_poll_s=0.2, full_report_s=0.5)


@pytest.mark.docker
async def test_a_real_container_labelled_for_a_queued_lease_does_not_bind_it(
        amqp_vhost: services.AmqpVhost, ledger_path: Path, tmp_path: Path, docker_engine: str,
        busybox_image: str) -> None:
    url = amqp_vhost.url
    host = f"labels-{uuid.uuid4().hex[:8]}"
    inventory_file = tmp_path / "inventory.json"
    write_inventory(inventory_file, {host: [make_gpu(host, i, GTX1070) for i in range(2)]})
    docker = aiodocker.Docker(url=docker_engine)
    forged_id: str | None = None
    try:
        async with (running_allocator(url, ledger_path, container_gone_grace_s=0.5) as _,
                    AllocatorClient(url, timeout_s=5) as client):
            agent = NodeAgent(agent_settings(host, url, inventory_file, docker_engine))
            await agent.start()
            try:
                async def host_up() -> bool:
                    return any(n.host == host and n.up for n in (await client.inventory()).nodes)
                await wait_until(host_up, within=30)
                alice = await client.allocate(AllocateRequest(request_key="hub/alice/",
                                                              user="alice", host=host))
                bob = await client.allocate(AllocateRequest(request_key="hub/bob/", user="bob",
                                                            host=host, count=2, wait_s=120))
                assert bob.state is LeaseState.QUEUED
                [free] = [g.uuid for g in (await client.inventory()).gpus
                          if g.host == host and g.uuid not in alice.gpu_uuids]
                # Someone with the node's Docker API labels a container for bob's lease.
                labels = grant_labels(bob.model_copy(update={"host": host,
                                                             "gpu_uuids": [free]}))
                name = f"forged-{uuid.uuid4().hex[:8]}"
                container = await docker.containers.run(
                    config={"Image": busybox_image, "Cmd": ["sleep", "600"],
                            "StopSignal": "SIGKILL", "Labels": labels,
                            "HostConfig": {"NetworkMode": "host"}}, name=name)
                forged_id = container.id

                async def in_conflict() -> str | None:
                    # A start event names the container by id; the next listing by name too.
                    row = gpu_row(await client.inventory(), free)
                    shown = row.conflict if row is not None else None
                    return shown if shown is not None and name in shown else None
                shown = await wait_until(in_conflict, within=30)
                assert forged_id[:12] in shown and "queued" in shown, shown
                assert (await client.status(lease_id=bob.lease_id)).state is LeaseState.QUEUED
                with pytest.raises(AllocatorError) as refused:
                    await client.allocate(AllocateRequest(request_key="hub/carol/",
                                                          user="carol", host=host))
                assert refused.value.code.value == "no_capacity"
                # The container goes: so does the conflict; bob still waits for two GPUs.
                await docker.containers.container(forged_id).delete(force=True)
                forged_id = None

                async def placeable_again() -> bool:
                    row = gpu_row(await client.inventory(), free)
                    return row is not None and row.conflict is None
                await wait_until(placeable_again, within=30)
                assert (await client.status(lease_id=bob.lease_id)).state is LeaseState.QUEUED
            finally:
                await agent.stop()
    finally:
        if forged_id is not None:
            with contextlib.suppress(aiodocker.DockerError, OSError):
                await docker.containers.container(forged_id).delete(force=True)
        await docker.close()
    assert_sound(audit_ledger(ledger_path))
