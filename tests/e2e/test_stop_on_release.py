"""Stop on release: the allocator asks the node agent to stop a lease's container at once.

Real allocator, real node agent (simulated inventory, the real Docker engine in Swarm mode),
real Swarm services and plain containers carrying the lease label. Tasks run a shell that exits
on SIGTERM, as a notebook server does, so a stop takes milliseconds unless something waits.
The broker user of every part here is ``guest``, so the agents are told to take commands from
``guest`` (in a cluster: the ``allocator`` user, the default).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import (
    Lease,
    LeaseState,
    ReleaseReason,
    StopContainer,
    StopReason,
    encode,
)
from allocator.wire.topology import AGENTS_EXCHANGE, command_routing_key
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, docker_cli, wait_until
from tests.support.lease_probes import container_of, granted_on, state_of
from tests.support.plain_containers import TRAP_TERM, plain_containers

pytestmark = pytest.mark.docker


SWARM_STOP_DELAY_S = 2.0
"""Docker 20.10 waits this long (gossip convergence) before it stops a removed task that is
on a network other than the default bridge: whatever frees the GPU sooner was not Swarm."""


@contextlib.asynccontextmanager
async def agent_for(amqp_url: str, tmp_path: Path, *, expect_consuming: bool = True,
                    **overrides: Any) -> AsyncIterator[NodeAgent]:
    """A real node agent for a host of one GTX 1070, taking commands from ``guest``."""
    host = f"stop-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / f"{host}.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070)]})
    settings: dict[str, Any] = dict(
        host=host, amqp_url=amqp_url, inventory="simulated", simulated_file=inventory,
        interval_s=0.5, publish_timeout_s=2.0, docker=True, command_users=["guest"],
        amqp_reconnect_s=0.2)
    settings.update(overrides)
    agent = NodeAgent(AgentSettings(**settings))
    await agent.start()
    try:
        assert agent.commands is not None and agent.commands.consuming is expect_consuming
        yield agent
    finally:
        await agent.stop()


@contextlib.asynccontextmanager
async def trap_service(lease: Lease, image: str) -> AsyncIterator[str]:
    """A Swarm service holding the lease as the spawner makes it (host network, no restart),
    whose task exits on SIGTERM; yields its name."""
    name = f"stop-{lease.lease_id[:12]}"
    await docker_cli(
        "service", "create", "--detach", "--name", name, "--network", "host",
        "--no-resolve-image", "--restart-condition", "none",
        "--container-label", f"{LEASE_LABEL}={lease.lease_id}",
        "--env", f"NVIDIA_VISIBLE_DEVICES={','.join(lease.gpu_uuids)}",
        image, "sh", "-c", TRAP_TERM)
    try:
        yield name
    finally:
        with contextlib.suppress(AssertionError):
            await docker_cli("service", "rm", name)


async def send_command(amqp_url: str, command: StopContainer | bytes, *,
                       user_id: str | None = "guest", to: str | None = None) -> None:
    """Publish to the agents exchange as the allocator does (here as ``guest``), routed to
    the agent of ``to`` (default: the command's host)."""
    body = command if isinstance(command, bytes) else encode(command)
    host = to or (command.host if isinstance(command, StopContainer) else "nobody")
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(AGENTS_EXCHANGE, ensure=True)
        await exchange.publish(aio_pika.Message(body, user_id=user_id),
                               routing_key=command_routing_key(host), timeout=10)


# ------------------------------------------------------------------------------- tests


async def test_the_hubs_release_stops_the_container_long_before_swarm_would(
        allocator, client, amqp_vhost, tmp_path, busybox_image):
    async with agent_for(amqp_vhost.url, tmp_path) as agent:
        lease = await granted_on(client, agent.host, "alice")
        async with trap_service(lease, busybox_image) as service:
            container = await container_of(lease)
            await wait_until(lambda: state_of(client, lease.lease_id, LeaseState.BOUND),
                             within=15)
            asked_at = time.monotonic()
            stopping = await client.release(lease_id=lease.lease_id, reason="server stopped")
            assert stopping.state is LeaseState.RELEASING
            released = await wait_until(
                lambda: state_of(client, lease.lease_id, LeaseState.RELEASED),
                within=10, interval=0.02)
            took = time.monotonic() - asked_at
            assert released.release_reason is ReleaseReason.CONTAINER_EXITED
            print(f"released {took:.3f} s after the hub's release")
            assert took < SWARM_STOP_DELAY_S, f"released {took:.2f} s after the release"
            # The service still exists: it was the agent, not Swarm, that stopped the task,
            # and Swarm does not restart it (restart condition none).
            assert await docker_cli("service", "ls", "-q", "--filter", f"name={service}")
            assert not await docker_cli("ps", "-q", "--filter",
                                        f"label={LEASE_LABEL}={lease.lease_id}")
            assert agent.command_counters["outcome_stopped"] == 1, agent.command_counters
            assert container
            # The next user gets that very GPU at once.
            nxt = await granted_on(client, agent.host, "bob")
            assert nxt.gpu_uuids == lease.gpu_uuids
    assert allocator.stats.counters["commands_sent"] == 1


async def test_force_release_stops_the_container(allocator, client, amqp_vhost, tmp_path,
                                                 busybox_image, docker_engine):
    async with agent_for(amqp_vhost.url, tmp_path) as agent, \
            plain_containers(docker_engine, busybox_image) as docker:
        lease = await granted_on(client, agent.host, "carol")
        container = await docker.run_labelled(lease.lease_id)
        await wait_until(lambda: state_of(client, lease.lease_id, LeaseState.BOUND), within=15)
        forced = await client.release(lease_id=lease.lease_id, force=True, by="admin")
        assert forced.state is LeaseState.RELEASED
        assert forced.release_reason is ReleaseReason.ADMIN

        async def stopped() -> bool:
            return not await docker.is_running(container)
        await wait_until(stopped, within=30)
        await wait_until(lambda: _counter(agent, "outcome_stopped", 1), within=30)


async def test_a_zombie_start_is_stopped(amqp_vhost, ledger_path, tmp_path, busybox_image,
                                         docker_engine):
    """The lease was reclaimed at its bind deadline; its container starts after all."""
    service = AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, bind_timeout_s=1.0))
    await service.start()
    try:
        async with AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
                agent_for(amqp_vhost.url, tmp_path) as agent, \
                plain_containers(docker_engine, busybox_image) as docker:
            lease = await granted_on(client, agent.host, "dave")
            expired = await wait_until(
                lambda: state_of(client, lease.lease_id, LeaseState.RELEASED), within=30)
            assert expired.release_reason is ReleaseReason.BIND_TIMEOUT
            container = await docker.run_labelled(lease.lease_id)

            # Bounds, not speed: the start event crosses the agent, the broker and the
            # allocator and comes back as a stop command, which a loaded machine can delay.
            async def stopped() -> bool:
                return not await docker.is_running(container)
            await wait_until(stopped, within=30)
            await wait_until(lambda: _counter(agent, "outcome_stopped", 1), within=30)
            assert service.engine.counters["zombie_container"] >= 1
            assert service.engine.counters["stop_asked_lease_finished"] == 1
    finally:
        await service.stop()


async def test_a_container_without_the_lease_label_is_left_alone(
        amqp_vhost, tmp_path, busybox_image, docker_engine):
    async with agent_for(amqp_vhost.url, tmp_path) as agent, \
            plain_containers(docker_engine, busybox_image) as docker:
        other = await docker.run_labelled("some-other-lease")
        for container_id in (other, other[:12]):
            await send_command(amqp_vhost.url, StopContainer(
                host=agent.host, lease_id="the-lease-named", container_id=container_id,
                grace_s=0, reason=StopReason.RELEASED))
        # A container name resolves to a container in Docker's API; it is never used.
        info = await docker.containers.container(other).show()
        await send_command(amqp_vhost.url, StopContainer(
            host=agent.host, lease_id="some-other-lease", container_id=info["Name"][1:],
            grace_s=0, reason=StopReason.RELEASED))

        async def handled() -> int:
            return agent.command_counters["outcome_wrong_lease"] == 3
        await wait_until(handled, within=5)
        assert await docker.is_running(other)


async def test_commands_from_other_users_and_bad_bodies_are_ignored(
        amqp_vhost, tmp_path, busybox_image, docker_engine):
    async with agent_for(amqp_vhost.url, tmp_path, command_users=["allocator"]) as agent, \
            plain_containers(docker_engine, busybox_image) as docker:
        container = await docker.run_labelled("lease-1")
        command = StopContainer(host=agent.host, lease_id="lease-1", container_id=container,
                                grace_s=0, reason=StopReason.RELEASED)
        await send_command(amqp_vhost.url, command)  # from guest, not in command_users
        await send_command(amqp_vhost.url, command, user_id=None)
        await wait_until(lambda: _counter(agent, "refused_user", 2), within=5)
        assert await docker.is_running(container)
    async with agent_for(amqp_vhost.url, tmp_path) as agent, \
            plain_containers(docker_engine, busybox_image) as docker:
        container = await docker.run_labelled("lease-2")
        for body in (b"not json", b'{"v": 1, "kind": "stop_container"}', b"[" * 5000,
                     encode(command)[:-3]):
            await send_command(amqp_vhost.url, body, to=agent.host)
        # Routed to this agent but naming another host: not its business.
        await send_command(amqp_vhost.url, command.model_copy(update={"host": "elsewhere"}),
                           to=agent.host)
        await wait_until(lambda: _counter(agent, "invalid", 4), within=5)
        await wait_until(lambda: _counter(agent, "wrong_host", 1), within=5)
        assert agent.commands is not None and agent.commands.consuming
        # Still consuming: a good command is carried out, and a repeat is harmless.
        good = StopContainer(host=agent.host, lease_id="lease-2", container_id=container,
                             grace_s=0, reason=StopReason.LEASE_FINISHED)
        await send_command(amqp_vhost.url, good)
        await wait_until(lambda: _counter(agent, "outcome_stopped", 1), within=5)
        assert not await docker.is_running(container)
        await send_command(amqp_vhost.url, good)
        await wait_until(lambda: _counter(agent, "outcome_not_running", 1), within=5)


async def _counter(agent: NodeAgent, name: str, value: int) -> bool:
    return agent.command_counters[name] >= value


async def test_grace_then_sigkill(amqp_vhost, tmp_path, busybox_image, docker_engine):
    """A container that ignores SIGTERM is killed once the grace ran out."""
    async with agent_for(amqp_vhost.url, tmp_path) as agent, \
            plain_containers(docker_engine, busybox_image) as docker:
        container = await docker.containers.run(
            config={"Image": busybox_image, "Cmd": ["sleep", "300"],  # PID 1: SIGTERM ignored
                    "Labels": {LEASE_LABEL: "stubborn"}, "HostConfig": {"NetworkMode": "host"}},
            name=f"stop-stubborn-{uuid.uuid4().hex[:6]}")
        try:
            started = time.monotonic()
            await send_command(amqp_vhost.url, StopContainer(
                host=agent.host, lease_id="stubborn", container_id=container.id, grace_s=1,
                reason=StopReason.RELEASED))
            await wait_until(lambda: _counter(agent, "outcome_stopped", 1), within=10)
            took = time.monotonic() - started
            assert 1.0 <= took < 5.0, took
            info = await container.show()
            assert info["State"]["ExitCode"] == 137, "killed"
        finally:
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)


async def test_an_unreachable_broker_does_not_hold_up_the_agent(tmp_path, docker_engine):
    """Nothing listens on the port: the agent starts promptly, the consumer keeps trying."""
    started = time.monotonic()
    async with agent_for("amqp://guest:guest@127.0.0.1:1/", tmp_path, publish_timeout_s=1.0,
                         expect_consuming=False) as agent:
        assert time.monotonic() - started < 3.0
        assert agent.commands is not None and not agent.commands.consuming
        assert agent.commands.last_error
    assert time.monotonic() - started < 6.0
