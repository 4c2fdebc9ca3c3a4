"""End to end: a real JupyterHub with GPUSwarmSpawner, the real allocator, the real Swarm engine.

Users act through the hub's REST API with their own tokens (and, in the browser test, through
the spawn form in headless Chromium). Real node agents report the simulated GPUs of this
machine's Swarm node and the lease-labelled containers that really run on the engine, so
leases bind and free as they do in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.wire.lease_container import LEASE_LABEL, grant_labels
from allocator.wire.protocol import Lease, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, RTX3090, wait_until
from tests.support.hub_e2e import (
    HubFactory,
    env_of,
    eventually,
    in_state,
    lease_of,
    node_agent,
    service_spec,
)
from tests.support.hub_harness import Hub

pytestmark = [pytest.mark.hub, pytest.mark.docker, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]
TEST_BUDGET_S = 150


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
async def agent(amqp_vhost: Any, swarm_host: str, tmp_path: Path, docker_engine: str,
                allocator: Any) -> AsyncIterator[NodeAgent]:
    """Real node agents: this engine's Swarm node (two GTX 1070, containers watched for real)
    and a remote host with four RTX 3090 whose engine is elsewhere (no container watching)."""
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {
        swarm_host: [make_gpu(swarm_host, i, GTX1070) for i in range(2)],
        "gpu-remote": [make_gpu("gpu-remote", i, RTX3090) for i in range(4)],
    })
    async with node_agent(swarm_host, amqp_vhost.url, inventory, docker=True) as local, \
            node_agent("gpu-remote", amqp_vhost.url, inventory, docker=False):
        async with AllocatorClient(amqp_vhost.url) as rpc:
            async def both_up() -> bool:
                return sum(n.up for n in (await rpc.inventory()).nodes) == 2
            await wait_until(both_up, within=20)
        yield local


@pytest.fixture
async def single_gpu_agent(amqp_vhost: Any, swarm_host: str, tmp_path: Path,
                           docker_engine: str, allocator: Any) -> AsyncIterator[NodeAgent]:
    """A real node agent for this engine's Swarm node with a single GTX 1070 (for queueing)."""
    inventory = tmp_path / "one-gpu.json"
    write_inventory(inventory, {swarm_host: [make_gpu(swarm_host, 0, GTX1070)]})
    async with node_agent(swarm_host, amqp_vhost.url, inventory, docker=True) as local:
        async with AllocatorClient(amqp_vhost.url) as rpc:
            async def up() -> bool:
                return any(n.up for n in (await rpc.inventory()).nodes)
            await wait_until(up, within=20)
        yield local


def spawner_state(hub: Hub, user: str) -> dict[str, Any]:
    """What the hub persisted for a user's default server (get_state)."""
    with contextlib.closing(sqlite3.connect(hub.dir / "hub.sqlite")) as db:
        row = db.execute(
            "SELECT spawners.state FROM spawners JOIN users ON users.id = spawners.user_id "
            "WHERE users.name = ? AND spawners.name = ''", (user,)).fetchone()
    return json.loads(row[0]) if row and row[0] else {}


# ------------------------------------------------------------------------------ tests


async def test_gpu_server_through_rest(
    agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory()
        key = hub.request_key("alice")
        await hub.start_server("alice", {"mode": "exclusive", "model": "1070"})

        lease = await lease_of(client, key)
        assert lease is not None and lease.user == "alice"
        assert lease.host == swarm_host and lease.model == GTX1070 and len(lease.gpu_uuids) == 1

        spec = await service_spec(docker, hub.service_name("alice"))
        env = env_of(spec)
        assert env["NVIDIA_VISIBLE_DEVICES"] == lease.gpu_uuids[0]
        assert env["SWARM_GPU_LEASE"] == lease.lease_id
        assert env["SWARM_GPU_HOST"] == swarm_host
        assert {k: env[k] for k in lease.env} == lease.env, "the allocator's env, unchanged"
        assert "SWARM_GPU_LEASE_ID" not in env, "one name for the lease id"
        assert env["JUPYTER_ENABLE_LAB"] == "1"  # the example config's environment is kept
        container = spec["TaskTemplate"]["ContainerSpec"]
        # The whole grant travels with the container (an allocator that lost the ledger
        # adopts the lease from these labels).
        # alice is in "students" (the hub's groups above): an adopted lease shows them.
        assert container["Labels"] == {**grant_labels(lease, server_name="",
                                                      groups=["students"]),
                                       "swarm-gpu.test": "e2e"}
        assert spec["Labels"][LEASE_LABEL] == lease.lease_id
        constraints = spec["TaskTemplate"]["Placement"]["Constraints"]
        assert constraints == ["node.role == manager", f"node.hostname == {swarm_host}"]
        # Swarm must not restart a dead GPU task behind the ledger's back
        assert spec["TaskTemplate"]["RestartPolicy"]["Condition"] == "none"

        # the hub persisted the lease, so a restarted hub can release it
        assert spawner_state(hub, "alice")["gpu_lease_id"] == lease.lease_id

        # the container runs: the node (agent) binds the lease
        bound = await eventually(
            lambda: in_state(client, lease.lease_id, LeaseState.BOUND), what="bound lease")
        assert bound.container_id

        inventory = await client.inventory(include_leases=True)
        assert lease.lease_id in {held.lease_id for held in inventory.leases or []}
        one070 = next(m for m in inventory.models if m.model == GTX1070)
        assert one070.free == 1

        # a named profile over REST: a shared slice of the other GTX 1070
        await hub.start_server("bob", {"profile": "gtx1070-share"})
        share = await lease_of(client, hub.request_key("bob"))
        assert share is not None and share.shared and share.memory_mib == 2048
        assert share.gpu_uuids != lease.gpu_uuids
        share_env = env_of(await service_spec(docker, hub.service_name("bob")))
        assert share_env["NVIDIA_VISIBLE_DEVICES"] == share.gpu_uuids[0]
        assert share_env["SWARM_GPU_SHARED"] == "1"
        assert share_env["SWARM_GPU_MEMORY_LIMIT_MIB"] == "2048"
        assert share_env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
        assert float(share_env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.25, abs=0.01)
        await hub.stop_server("bob")

        # stop: the hub marks it releasing, the GPU frees when the container is gone
        await hub.stop_server("alice")
        after = await client.status(lease_id=lease.lease_id)
        assert after.state in (LeaseState.RELEASING, LeaseState.RELEASED)
        released = await eventually(
            lambda: in_state(client, lease.lease_id, LeaseState.RELEASED), what="released")
        assert released.release_reason is not None
        # The agent stopped both servers' containers when the hub released their leases,
        # without waiting for Swarm to stop the removed services' tasks.
        async def both_stopped() -> bool:
            return agent.command_counters["outcome_stopped"] == 2
        await eventually(both_stopped, within=5, what="the agent's stops")
        with pytest.raises(aiodocker.DockerError):
            await docker.services.inspect(hub.service_name("alice"))
        assert "gpu_lease_id" not in spawner_state(hub, "alice")
        assert hub.alive()


FORGED: list[tuple[dict[str, Any], int, str]] = [
    ({"mode": "exclusive", "model": "3090"}, 400, "may not use GPU model '3090'"),
    ({"mode": "exclusive", "count": 0}, 400, "between 1 and 64"),
    ({"mode": "exclusive", "count": 10**6}, 400, "between 1 and 64"),
    ({"mode": "exclusive", "count": 2}, 400, "at most 1 GPU per server"),
    ({"mode": "exclusive", "host": "nowhere"}, 400, "Unknown host 'nowhere'"),
    ({"mode": "shared", "model": "1070", "share_memory_mib": 10**6}, 400,
     "at most 8192 MiB; you asked for 1000000"),
    ({"mode": "exclusive", "profile": "two-3090"}, 400, "Unknown profile 'two-3090'"),
    ({"mode": "root"}, 400, "GPU mode"),
    ({"gpus": "all"}, 400, "unknown option 'gpus'"),
    ({"mode": "exclusive", "topology": "fast"}, 400,
     "GPU connection: must be one of: any, nvlink, pcie-switch, socket"),
]


async def test_forged_options_are_refused_without_a_lease(
    agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory()
        for options, want, needle in FORGED:
            status, body = await hub.spawn("alice", options)
            assert status == want, (options, status, body)
            assert needle in body["message"], (options, body)
            assert await lease_of(client, hub.request_key("alice")) is None
            assert await hub.server_model("alice") is None or not (
                await hub.server_model("alice") or {}).get("ready")
        services = [s["Spec"]["Name"] for s in await docker.services.list()]
        assert hub.service_name("alice") not in services
        status, _ = await hub.api("GET", "/")
        assert status == 200 and hub.alive()


async def test_allocator_unreachable_fails_clearly_and_cpu_servers_still_start(
    hub_factory: HubFactory, docker: aiodocker.Docker,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        # nothing listens on port 1: the broker is unreachable
        hub = await hub_factory(amqp_url="amqp://guest:guest@127.0.0.1:1/", first_admin=True)
        started = time.monotonic()
        status, body = await hub.spawn("alice", {"mode": "exclusive", "model": "1070"})
        assert status == 503, body
        assert "GPU allocator cannot be reached" in body["message"]
        assert "start a server without a GPU" in body["message"]
        assert time.monotonic() - started < 15
        assert hub.alive()

        # the spawn form still renders, with a note, and "no GPU" works
        cookies = await hub.login_cookies("alice")
        assert hub.session is not None
        async with hub.session.get(f"{hub.url}/hub/spawn", cookies=cookies) as response:
            page = await response.text()
        assert response.status == 200
        assert "GPU allocator is not reachable" in page
        assert 'name="mode" value="none" checked' in page

        await hub.start_server("alice", {"mode": "none"})
        spec = await service_spec(docker, hub.service_name("alice"))
        assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert LEASE_LABEL not in spec["TaskTemplate"]["ContainerSpec"].get("Labels", {})
        assert spec["TaskTemplate"]["Placement"]["Constraints"] == ["node.role == manager"]
        await hub.stop_server("alice")
        assert hub.alive()


async def test_silent_allocator_times_out_with_a_clear_message(
    amqp_vhost: Any, hub_factory: HubFactory,
) -> None:
    import aio_pika

    from allocator.service import declare_topology
    from allocator.wire.topology import ALLOCATOR_QUEUE

    async with asyncio.timeout(TEST_BUDGET_S):
        # the broker and the queue are there, but no allocator consumes it
        connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
        async with connection:
            await declare_topology(connection, ALLOCATOR_QUEUE)
        hub = await hub_factory(allocator_timeout=2.0)
        started = time.monotonic()
        status, body = await hub.spawn("alice", {"mode": "exclusive", "model": "1070"})
        assert status == 503, body
        assert "GPU allocator cannot be reached" in body["message"]
        assert "did not answer within 2 s" in body["message"]
        assert time.monotonic() - started < 10
        status, _ = await hub.api("GET", "/")
        assert status == 200 and hub.alive()


async def _queue_bob_behind_alice(
    hub: Hub, client: AllocatorClient,
) -> tuple[Lease, asyncio.Task[tuple[int, Any]], list[dict[str, Any]]]:
    """alice holds the only GPU and bob's spawn waits for it: his queued lease, the spawn
    (still running) and the spawn page's events up to his queue position."""
    await hub.start_server("alice", {"mode": "exclusive", "model": "1070"})
    spawn = asyncio.create_task(hub.spawn("bob", {"mode": "exclusive", "model": "1070"}))
    events = await hub.progress_events("bob", until="queued (position 1)")
    bob = await lease_of(client, hub.request_key("bob"))
    assert bob is not None and bob.state is LeaseState.QUEUED
    return bob, spawn, events


async def test_queued_request_reports_its_position_and_gets_the_freed_gpu(
    single_gpu_agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(wait_s=60.0)
        # bob asks for alice's GPU: queued, and the spawn page says where he stands
        bob, spawn, events = await _queue_bob_behind_alice(hub, client)
        assert any("Asking the GPU allocator" in e["message"] for e in events), events
        assert bob.queue_position == 1
        alice = await lease_of(client, hub.request_key("alice"))
        assert alice is not None

        await hub.stop_server("alice")
        status, body = await spawn
        assert status in (201, 202), body
        await hub.wait_ready("bob", within=60)
        granted = await lease_of(client, hub.request_key("bob"))
        assert granted is not None and granted.state in (LeaseState.GRANTED, LeaseState.BOUND)
        assert granted.gpu_uuids == alice.gpu_uuids
        spec = await service_spec(docker, hub.service_name("bob"))
        assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == alice.gpu_uuids[0]
        await hub.stop_server("bob")


async def test_cancelling_a_queued_spawn_withdraws_the_request(
    single_gpu_agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(wait_s=60.0)
        bob, spawn, _ = await _queue_bob_behind_alice(hub, client)

        status, body = await hub.api("DELETE", "/users/bob/server", user="bob")
        assert status in (202, 204), body
        with contextlib.suppress(Exception):
            await spawn
        withdrawn = await eventually(
            lambda: _final(client, bob.lease_id), what="withdrawn queued request")
        assert withdrawn.state is LeaseState.RELEASED
        assert withdrawn.release_reason is not None
        assert withdrawn.release_reason.value == "cancelled"
        assert hub.alive()
        # alice's GPU was never touched, and the queue is empty
        inventory_now = await client.inventory()
        assert inventory_now.queued == 0
        alice = await lease_of(client, hub.request_key("alice"))
        assert alice is not None and alice.state.holds_gpus
        await hub.stop_server("alice")


async def _final(client: AllocatorClient, lease_id: str) -> Lease | None:
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state.final else None


async def test_queue_wait_runs_out_with_a_clear_message(
    single_gpu_agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(wait_s=2.0)
        await hub.start_server("alice", {"mode": "exclusive", "model": "1070"})
        status, body = await hub.spawn("bob", {"mode": "exclusive", "model": "1070"})
        assert status == 409, body
        assert "No GPU is free" in body["message"]
        bob = await lease_of(client, hub.request_key("bob"))
        assert bob is None or bob.state.final
        await hub.stop_server("alice")


async def test_hub_restart_keeps_the_lease_and_releases_it_later(
    agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(cleanup_servers=False)
        await hub.start_server("carol", {"mode": "exclusive", "model": "1070", "count": 2})
        lease = await lease_of(client, hub.request_key("carol"))
        assert lease is not None and len(lease.gpu_uuids) == 2

        await hub.stop()  # the server keeps running while the hub is away
        await eventually(lambda: in_state(client, lease.lease_id, LeaseState.BOUND),
                         what="bound lease")
        await hub.start()
        model = await hub.server_model("carol")
        assert model is not None and model["ready"]
        again = await client.status(lease_id=lease.lease_id)
        assert again.state is LeaseState.BOUND  # nothing double-booked, nothing leaked

        await hub.stop_server("carol")
        await eventually(lambda: in_state(client, lease.lease_id, LeaseState.RELEASED),
                         what="released after restart")


async def test_spawn_form_in_chromium(
    agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker, swarm_host: str, chromium_path: Path, tmp_path: Path,
) -> None:
    from tests.support.hub_browser import Browser

    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory(first_admin=True)  # it authorizes carol's signup
        shot = tmp_path / "spawn-form.png"
        password = await hub.login_password("carol")

        def drive() -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / "chromium") as browser:
                page = browser.page()
                browser.log_in(page, hub.url, "carol", password)
                browser.navigate(page, f"{hub.url}/hub/spawn")
                seen = browser.evaluate(page, """({
                    profiles: [...document.querySelectorAll('input[name=profile]')]
                        .map(e => e.value),
                    checked: document.querySelector('input[name=profile]:checked').value,
                    customDisabled: document.getElementById('sg-custom').disabled,
                    models: [...document.querySelectorAll('#sg-model option')]
                        .map(o => o.value),
                    text: document.body.innerText,
                })""")
                # choose the GPU ourselves: one whole GTX 1070 on this host
                browser.evaluate(page, f"""
                    document.querySelector('input[name=profile][value=custom]').click();
                    document.querySelector('input[name=mode][value=exclusive]').click();
                    document.getElementById('sg-model').value = {json.dumps(GTX1070)};
                    document.getElementById('sg-count').value = '1';
                    document.getElementById('sg-host').value = {json.dumps(swarm_host)};
                    document.getElementById('sg-form').dispatchEvent(
                        new Event('change', {{bubbles: true}}));
                """)
                seen["after"] = browser.evaluate(page, """({
                    customDisabled: document.getElementById('sg-custom').disabled,
                    countDisabled: document.getElementById('sg-count').disabled,
                    memoryDisabled: document.getElementById('sg-memory').disabled,
                    host: document.getElementById('sg-host').selectedOptions[0].textContent,
                })""")
                browser.screenshot(page, shot, full_page=True)
                browser.submit(page, "document.querySelector('#spawn_form').requestSubmit()")
                seen["url"] = browser.url(page)
                return seen

        seen = await asyncio.to_thread(drive)
        assert seen["profiles"] == ["cpu", "gtx1070", "gtx1070-share", "two-3090", "a100-node",
                                    "custom"]
        assert seen["checked"] == "cpu" and seen["customDisabled"] is True
        assert seen["models"] == ["any", GTX1070, RTX3090]
        assert "Available now" in seen["text"] and "gpu-remote" in seen["text"]
        assert seen["after"]["customDisabled"] is False
        assert seen["after"]["countDisabled"] is False and seen["after"]["memoryDisabled"] is True
        assert seen["after"]["host"] == f"{swarm_host} — 2 free GPUs"
        assert "/spawn-pending/carol" in seen["url"] or "/user/carol" in seen["url"], seen["url"]
        assert shot.stat().st_size > 10_000
        if os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1":
            # refresh the committed picture of the form: SWARM_GPU_UPDATE_DOCS=1 scripts/test
            shutil.copyfile(shot, REPO_ROOT / "docs" / "spawn-form.png")

        await hub.wait_ready("carol")
        lease = await lease_of(client, hub.request_key("carol"))
        assert lease is not None and lease.host == swarm_host and lease.model == GTX1070
        spec = await service_spec(docker, hub.service_name("carol"))
        assert env_of(spec)["NVIDIA_VISIBLE_DEVICES"] == lease.gpu_uuids[0]
        await hub.stop_server("carol")


async def test_killed_notebook_frees_its_gpu_and_is_not_restarted(
    agent: NodeAgent, client: AllocatorClient, hub_factory: HubFactory,
    docker: aiodocker.Docker,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        hub = await hub_factory()
        await hub.start_server("alice", {"mode": "exclusive", "model": "1070"})
        lease = await lease_of(client, hub.request_key("alice"))
        assert lease is not None
        bound = await eventually(
            lambda: in_state(client, lease.lease_id, LeaseState.BOUND), what="bound lease")
        assert bound.container_id is not None

        await docker.containers.container(bound.container_id).kill()
        released = await eventually(
            lambda: in_state(client, lease.lease_id, LeaseState.RELEASED), what="released")
        assert released.release_reason is not None
        assert released.release_reason.value == "container_exited"
        one070 = next(m for m in (await client.inventory()).models if m.model == GTX1070)
        assert one070.free == 2, "the GPU is free again"

        # Swarm must not start a new task with the released GPUs (restart policy none).
        await asyncio.sleep(3)
        running = await docker.containers.list(
            filters=json.dumps({"label": [f"{LEASE_LABEL}={lease.lease_id}"],
                                "status": ["running"]}))
        assert running == []
        assert hub.alive()
